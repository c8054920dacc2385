// SPDX-License-Identifier: Apache-2.0
// Candidates (docs/acceptance.md): top-k with the tie rule, the flat layout, the gather and the
// per-path rows.
#include <medusa/candidates.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

namespace {

std::vector<std::int32_t> reference_top_k(const std::vector<float>& x, int k) {
  std::vector<std::int32_t> ids(x.size());
  std::iota(ids.begin(), ids.end(), 0);
  std::stable_sort(ids.begin(), ids.end(), [&](int a, int b) { return x[a] > x[b]; });
  ids.resize(static_cast<std::size_t>(k));
  return ids;
}

// The reference notebook's tree (the worked example of docs/tree.md).
medusa::tree notebook_tree() {
  return medusa::tree::from_paths({{0}, {0, 0}, {0, 1}, {0, 2}, {1}, {1, 0}, {1, 1}, {1, 2}});
}

}  // namespace

TEST_CASE("top_k matches a stable sort, ties by lower id, for small and large k") {
  std::mt19937 rng(1234);
  for (int n : {1, 7, 16, 17, 100, 1000, 5003}) {
    for (int k : {1, 2, 3, 10, 64, 65, 200, 5003}) {
      if (k > n) continue;
      for (int quant : {0, 4}) {  // quant 4: few distinct values, many ties
        std::vector<float> x(static_cast<std::size_t>(n));
        std::uniform_real_distribution<float> u(-5.0f, 5.0f);
        for (auto& v : x) v = quant ? std::floor(u(rng) / 5.0f * quant) : u(rng);
        std::vector<std::int32_t> ids(static_cast<std::size_t>(k));
        medusa::top_k(x, ids);
        CHECK_MESSAGE(ids == reference_top_k(x, k), "n=" << n << " k=" << k << " quant=" << quant);
      }
    }
  }
}

TEST_CASE("top_k on ascending and descending rows (worst cases of the insertion path)") {
  std::vector<float> up(4096), down(4096);
  for (int i = 0; i < 4096; ++i) {
    up[static_cast<std::size_t>(i)] = static_cast<float>(i);
    down[static_cast<std::size_t>(i)] = static_cast<float>(-i);
  }
  std::vector<std::int32_t> ids(10);
  medusa::top_k(up, ids);
  CHECK(ids == reference_top_k(up, 10));
  medusa::top_k(down, ids);
  CHECK(ids == reference_top_k(down, 10));
}

TEST_CASE("top_k and argmax reject NaN, +Inf, all-masked rows and bad k; -Inf is a masked token") {
  std::vector<float> x(40, 1.0f);
  std::vector<std::int32_t> ids(3);
  x[33] = std::numeric_limits<float>::quiet_NaN();
  CHECK_THROWS_AS(medusa::top_k(x, ids), medusa::acceptance_error);
  x[33] = std::numeric_limits<float>::infinity();
  try {
    medusa::top_k(x, ids);
    FAIL("no throw");
  } catch (const medusa::acceptance_error& e) {
    CHECK(e.code() == medusa::acceptance_errc::non_finite_logit);
    CHECK(std::string(e.what()).find("logit 33 is +Inf") != std::string::npos);
  }
  x[33] = 0.0f;
  std::vector<std::int32_t> too_many(41);
  CHECK_THROWS_AS(medusa::top_k(x, too_many), medusa::acceptance_error);
  CHECK_THROWS_AS(medusa::top_k(x, std::span<std::int32_t>{}), medusa::acceptance_error);
  x[5] = 3.0f;
  x[9] = 3.0f;
  CHECK(medusa::argmax(x) == 5);
  x[2] = -std::numeric_limits<float>::infinity();  // a masked token is legal
  CHECK(medusa::argmax(x) == 5);
  CHECK_NOTHROW(medusa::top_k(x, ids));
  CHECK(std::find(ids.begin(), ids.end(), 2) == ids.end());
  std::fill(x.begin(), x.end(), -std::numeric_limits<float>::infinity());
  CHECK_THROWS_WITH_AS(medusa::argmax(x), doctest::Contains("all tokens masked"), medusa::acceptance_error);
  CHECK_THROWS_AS(medusa::argmax(std::span<const float>{}), medusa::acceptance_error);
}

TEST_CASE("generate_candidates: flat layout with stride K, k_d per depth, gather via tree_index") {
  const auto t = notebook_tree();
  const int vocab = 50;
  const int heads = 3;  // one more head than the tree needs
  std::vector<float> head_logits(static_cast<std::size_t>(heads * vocab));
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (auto& v : head_logits) v = u(rng);
  // Head 0: tokens 40 > 30 (best two); head 1: 11 > 12 = 13 (tie → 12 before 13).
  head_logits[40] = 9.0f;
  head_logits[30] = 8.0f;
  head_logits[vocab + 11] = 9.0f;
  head_logits[vocab + 12] = 8.0f;
  head_logits[vocab + 13] = 8.0f;
  std::vector<std::int32_t> flat(medusa::flat_candidates_size(t, heads));
  REQUIRE(flat.size() == 31);
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(t.num_nodes()));
  medusa::generate_candidates(t, 7, head_logits, vocab, flat, tokens);
  CHECK(medusa::candidates_per_depth(t, 1) == 2);
  CHECK(medusa::candidates_per_depth(t, 2) == 3);
  CHECK(flat[0] == 7);
  CHECK(flat[1] == 40);
  CHECK(flat[2] == 30);
  CHECK(flat[3] == -1);  // rank 2 of head 0 is never read
  CHECK(flat[11] == 11);
  CHECK(flat[12] == 12);
  CHECK(flat[13] == 13);
  CHECK(flat[21] == -1);  // head 2 is deeper than the tree
  // Worked example of docs/tree.md: tree_indices = [0, 1, 2, 11, 12, 13, 11, 12, 13].
  CHECK(tokens == std::vector<std::int32_t>{7, 40, 30, 11, 12, 13, 11, 12, 13});

  medusa::candidate_workspace ws(t, heads);
  std::vector<std::int32_t> tokens2(tokens.size());
  const auto f = ws.generate(t, 7, head_logits, vocab, tokens2);
  CHECK(std::vector<std::int32_t>(f.begin(), f.end()) == flat);
  CHECK(tokens2 == tokens);

  // Reference per-path view; the notebook tree has no padding, so use a mixed-depth tree too.
  std::vector<std::int32_t> rows(static_cast<std::size_t>(t.num_leaves() * (t.depth() + 1)));
  medusa::candidate_rows(t, tokens, rows);
  CHECK(std::vector<std::int32_t>(rows.begin(), rows.begin() + 3) == std::vector<std::int32_t>{7, 30, 13});
  const auto m = medusa::tree::from_paths({{0}, {1}, {0, 0}});
  std::vector<std::int32_t> mt{5, 6, 7, 8};
  std::vector<std::int32_t> mrows(static_cast<std::size_t>(m.num_leaves() * (m.depth() + 1)));
  medusa::candidate_rows(m, mt, mrows);
  // Rows: leaf [0,0] (node 3) first, then leaf [1] (node 2) padded with token 0.
  CHECK(mrows == std::vector<std::int32_t>{5, 6, 8, 5, 7, 0});
}

TEST_CASE("generate_candidates validates before writing") {
  const auto t = notebook_tree();
  const int vocab = 20;
  std::vector<float> head_logits(static_cast<std::size_t>(2 * vocab), 0.0f);
  std::vector<std::int32_t> flat(medusa::flat_candidates_size(t, 2), 99);
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(t.num_nodes()), 99);
  auto code_of = [&](auto&& f) {
    try {
      f();
    } catch (const medusa::acceptance_error& e) {
      return static_cast<int>(e.code());
    }
    return -1;
  };
  CHECK(code_of([&] { medusa::generate_candidates(t, 20, head_logits, vocab, flat, tokens); }) ==
        static_cast<int>(medusa::acceptance_errc::token_out_of_range));
  CHECK(code_of([&] { medusa::generate_candidates(t, 0, head_logits, 0, flat, tokens); }) ==
        static_cast<int>(medusa::acceptance_errc::vocab_mismatch));
  CHECK(code_of([&] {
          medusa::generate_candidates(t, 0, std::span<const float>(head_logits).first(20), vocab,
                                      flat, tokens);
        }) == static_cast<int>(medusa::acceptance_errc::size_mismatch));
  head_logits[static_cast<std::size_t>(vocab + 3)] = std::numeric_limits<float>::quiet_NaN();
  try {
    medusa::generate_candidates(t, 0, head_logits, vocab, flat, tokens);
    FAIL("no throw");
  } catch (const medusa::acceptance_error& e) {
    CHECK(e.code() == medusa::acceptance_errc::non_finite_logit);
    CHECK(e.node() == 1);  // the head
  }
  CHECK(std::all_of(flat.begin(), flat.end(), [](int v) { return v == 99; }));
  CHECK(std::all_of(tokens.begin(), tokens.end(), [](int v) { return v == 99; }));
  CHECK_THROWS_AS(medusa::candidate_workspace(t, 1), medusa::acceptance_error);
}

TEST_CASE("candidates on a preset: siblings carry distinct tokens, cousins share them") {
  const auto t = medusa::tree::preset("mc_sim_7b_63");
  const int vocab = 1000;
  std::vector<float> head_logits(static_cast<std::size_t>(4 * vocab));
  std::mt19937 rng(99);
  std::normal_distribution<float> nd;
  for (auto& v : head_logits) v = nd(rng);
  medusa::candidate_workspace ws(t, 4);
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(t.num_nodes()));
  ws.generate(t, 3, head_logits, vocab, tokens);
  for (int u = 1; u < t.num_nodes(); ++u) {
    const auto top = reference_top_k(
        std::vector<float>(head_logits.begin() + (t.node_depth(u) - 1) * vocab,
                           head_logits.begin() + t.node_depth(u) * vocab),
        t.rank(u) + 1);
    CHECK(tokens[static_cast<std::size_t>(u)] == top.back());
  }
  for (int v = 0; v < t.num_nodes(); ++v) {
    std::vector<std::int32_t> kids;
    for (int c = t.child_begin(v); c < t.child_begin(v) + t.child_count(v); ++c)
      kids.push_back(tokens[static_cast<std::size_t>(c)]);
    std::sort(kids.begin(), kids.end());
    CHECK(std::adjacent_find(kids.begin(), kids.end()) == kids.end());
  }
}
