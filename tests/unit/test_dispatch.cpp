// SPDX-License-Identifier: Apache-2.0
// The dispatch point: run-time values become template arguments, and values without an
// instantiation are typed errors that name the value and the supported list.
#include <medusa/dispatch.hpp>

#include <doctest/doctest.h>

#include <cstddef>
#include <span>
#include <string>
#include <type_traits>

namespace {

template <class F>
std::string dispatch_message(F&& f) {
  try {
    f();
  } catch (const medusa::dispatch_error& e) {
    return e.what();
  }
  return "no exception";
}

}  // namespace

TEST_CASE("dispatch_value calls the instantiation of the matching value") {
  for (int v : {2, 4, 8}) CHECK(medusa::dispatch_value<2, 4, 8>(v, "width", []<int W>() { return W * 10; }) == v * 10);
  const auto msg = dispatch_message([] { medusa::dispatch_value<2, 4, 8>(3, "width", []<int>() {}); });
  CHECK(msg == "medusa: unsupported width 3; supported: 2, 4, 8");
  try {
    medusa::dispatch_value<1>(0, "width", []<int>() {});
  } catch (const medusa::dispatch_error& e) {
    CHECK(e.kind() == "width");
    CHECK(dynamic_cast<const medusa::invalid_input*>(&e) != nullptr);
  }
}

TEST_CASE("dispatch_dtype maps each dtype to its element type") {
  for (auto d : {medusa::dtype::f32, medusa::dtype::f16, medusa::dtype::bf16}) {
    const std::size_t size = medusa::dispatch_dtype(d, []<medusa::dtype D>() { return sizeof(medusa::dtype_type<D>); });
    CHECK(size == medusa::dtype_size(d));
    const bool round_trip = medusa::dispatch_dtype(d, [d]<medusa::dtype D>() { return medusa::dtype_of<medusa::dtype_type<D>> == d; });
    CHECK(round_trip);
  }
  const auto bad = static_cast<medusa::dtype>(7);
  CHECK(dispatch_message([&] { medusa::dispatch_dtype(bad, []<medusa::dtype>() {}); }).find("unsupported dtype") !=
        std::string::npos);
}

TEST_CASE("dispatch_head_count: 1..8 static, more dynamic, fewer than 1 an error") {
  for (int n = 1; n <= medusa::max_static_heads; ++n)
    CHECK(medusa::dispatch_head_count(n, []<std::size_t H>() { return H; }) == static_cast<std::size_t>(n));
  for (int n : {9, 64})
    CHECK(medusa::dispatch_head_count(n, []<std::size_t H>() { return H; }) == std::dynamic_extent);
  CHECK(dispatch_message([] { medusa::dispatch_head_count(0, []<std::size_t>() {}); }) ==
        "medusa: unsupported head count 0 (at least 1)");
}

TEST_CASE("dispatch_policy builds the named policy with its options") {
  medusa::policy_options o;
  std::string seen;
  medusa::dispatch_policy("greedy", o, [&](const auto& p) { seen = p.name; });
  CHECK(seen == "greedy");
  // typical: an unset temperature is 0.7, set fields are applied
  const auto t = medusa::dispatch_policy("typical", o, [](const auto& p) -> medusa::typical_policy {
    if constexpr (std::is_same_v<std::remove_cvref_t<decltype(p)>, medusa::typical_policy>) return p;
    else return {};
  });
  CHECK(t.temperature == doctest::Approx(0.7f));
  o.temperature = 0.5f;
  o.posterior_alpha = 0.2f;
  o.top_p = 0.9f;
  const auto t2 = medusa::make_policy<medusa::typical_policy>(o);
  CHECK(t2.temperature == 0.5f);
  CHECK(t2.posterior_alpha == 0.2f);
  CHECK(t2.posterior_threshold == doctest::Approx(0.09f));
  const auto r = medusa::make_policy<medusa::rejection_policy>(o);
  CHECK(r.temperature == 0.5f);
  CHECK(r.top_p == 0.9f);
  CHECK(medusa::make_policy<medusa::speculative_policy>({}).temperature == 1.0f);
  // validation of the options is the policy's own
  o.temperature = -1.0f;
  try {
    medusa::dispatch_policy("rejection", o, [](const auto&) {});
    FAIL("no exception");
  } catch (const medusa::acceptance_error& e) {
    CHECK(e.code() == medusa::acceptance_errc::bad_parameter);
  }
  // names outside the list
  CHECK(dispatch_message([] { medusa::dispatch_policy("beam", {}, [](const auto&) {}); }) ==
        "medusa: unsupported policy 'beam'; supported: greedy, typical, rejection, speculative, sampled");
  using deterministic = medusa::policy_list<medusa::greedy_policy, medusa::typical_policy>;
  CHECK(dispatch_message([] { medusa::dispatch_policy("rejection", {}, [](const auto&) {}, deterministic{}); }) ==
        "medusa: unsupported policy 'rejection'; supported: greedy, typical");
}

TEST_CASE("dispatch_tree runs a preset on its compile-time tree and anything else at run time") {
  for (std::size_t i = 0; i < medusa::preset_table.size(); ++i) {
    const auto name = medusa::preset_table[i].name;
    CAPTURE(name);
    const auto t = medusa::tree::preset(name);
    const bool ok = medusa::dispatch_tree(t, [&](const auto& tr) {
      using T = std::remove_cvref_t<decltype(tr)>;
      if constexpr (std::is_same_v<T, medusa::tree>) return false;
      else return tr == medusa::presets::all[i] && medusa::same_shape(tr, t);
    });
    CHECK(ok);
  }
  for (const char* text : {"[[0],[1],[0,0]]", "[[0],[0,0],[1],[0,1],[2]]"}) {
    const auto t = medusa::tree::from_text(text);
    CHECK(medusa::dispatch_tree(t, [](const auto& tr) { return std::is_same_v<std::remove_cvref_t<decltype(tr)>, medusa::tree>; }));
  }
  // Same paths, other topk: tree indices differ, so no preset instantiation applies.
  const auto k11 = medusa::tree::from_text(medusa::preset_text("mc_sim_7b_63"), {.topk = 11});
  CHECK(medusa::dispatch_tree(k11, [](const auto& tr) { return std::is_same_v<std::remove_cvref_t<decltype(tr)>, medusa::tree>; }));
  // A narrower list of tags.
  using only_zephyr = medusa::presets::tag_list<medusa::presets::tag_of<"zephyr_stage2">>;
  const auto mc = medusa::tree::preset("mc_sim_7b_63");
  CHECK(medusa::dispatch_tree(mc, [](const auto& tr) { return std::is_same_v<std::remove_cvref_t<decltype(tr)>, medusa::tree>; },
                              only_zephyr{}));
}
