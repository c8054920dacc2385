// SPDX-License-Identifier: Apache-2.0
//! @file dispatch.hpp
//! The one place where run-time values become template arguments.
//!
//! | dispatcher | run-time value | what `f` receives |
//! |---|---|---|
//! | `dispatch_value<Vs...>(v, what, f)` | any value in the list `Vs` | `f.template operator()<V>()` |
//! | `dispatch_dtype(d, f)` | `dtype` | `f.template operator()<D>()`, `D` an `dtype` constant |
//! | `dispatch_head_count(n, f)` | head count | `f.template operator()<H>()`: `H` = n for 1..8, else `std::dynamic_extent` |
//! | `dispatch_policy(name, options, f)` | policy name + options | `f(policy)`: a `greedy_policy`, `typical_policy`, ... |
//! | `dispatch_tree(t, f)` | a run-time `medusa::tree` | `f(tree)`: the preset's `static_tree` when `t` has a preset's shape, else `t` |
//!
//! A value outside the supported list throws `dispatch_error` naming the value and the list.
//! Every instantiation `f` is called with must return the same type.
//!
//! @code
//! #include <medusa/dispatch.hpp>
//! auto t = medusa::tree::from_text(tree_text);
//! medusa::dispatch_policy("typical", {.temperature = 0.7f}, [&](auto policy) {
//!   medusa::dispatch_tree(t, [&](const auto& tree) {
//!     medusa::decoder dec(model, heads, tree, policy);   // instantiated per preset and policy
//!     return dec.generate(prompt);
//!   });
//! });
//! @endcode
#pragma once

#include <medusa/config.hpp>
#include <medusa/acceptance.hpp>
#include <medusa/dtype.hpp>
#include <medusa/error.hpp>
#include <medusa/tree/presets.hpp>
#include <medusa/tree/runtime_tree.hpp>

#include <cstddef>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>

MEDUSA_NAMESPACE_BEGIN

//! A run-time value that no instantiation exists for (an unknown policy name, a head count of 0).
class dispatch_error : public invalid_input {
 public:
  //! @param what the message; @param kind what was dispatched ("policy", "dtype", ...).
  dispatch_error(const std::string& what, std::string_view kind) : invalid_input(what), kind_(kind) {}
  //! What was dispatched.
  [[nodiscard]] std::string_view kind() const noexcept { return kind_; }

 private:
  std::string_view kind_;
};

namespace detail {

template <class V>
std::string dispatch_name(const V& v) {
  if constexpr (std::is_integral_v<V>) return std::to_string(v);
  else if constexpr (std::is_convertible_v<V, std::string_view>) return "'" + std::string(std::string_view(v)) + "'";
  else return std::string(to_string(v));
}

template <auto... Values, class V>
[[noreturn]] void dispatch_unsupported(const V& v, std::string_view what) {
  std::string msg = "unsupported " + std::string(what) + " " + dispatch_name(v) + "; supported:";
  const char* sep = " ";
  ((msg += sep + dispatch_name(Values), sep = ", "), ...);
  throw dispatch_error(msg, what);
}

// `v` is one of the values (checked by the caller).
template <auto First, auto... Rest, class V, class F>
decltype(auto) dispatch_known(const V& v, F& f) {
  if constexpr (sizeof...(Rest) == 0) {
    return f.template operator()<First>();
  } else {
    if (v == First) return f.template operator()<First>();
    return dispatch_known<Rest...>(v, f);
  }
}

}  // namespace detail

//! Calls `f.template operator()<V>()` for the `V` among `Values` that equals `v`; throws
//! `dispatch_error` ("unsupported <what> <v>; supported: ...") when there is none.
template <auto... Values, class V, class F>
decltype(auto) dispatch_value(const V& v, std::string_view what, F&& f) {
  static_assert(sizeof...(Values) > 0, "medusa: dispatch_value needs at least one supported value");
  bool hit = false;
  ((hit = hit || v == Values), ...);
  if (!hit) detail::dispatch_unsupported<Values...>(v, what);
  return detail::dispatch_known<Values...>(v, f);
}

//! Calls `f.template operator()<D>()` with the `dtype` constant `D == d` (use `dtype_type<D>` for
//! the element type).
template <class F>
decltype(auto) dispatch_dtype(dtype d, F&& f) {
  return dispatch_value<dtype::f32, dtype::f16, dtype::bf16>(d, "dtype", f);
}

//! Head counts with their own instantiation; larger counts run as `std::dynamic_extent`.
inline constexpr int max_static_heads = 8;

//! Calls `f.template operator()<H>()` with `H = num_heads` (a `std::size_t`) for 1..8, and
//! `H = std::dynamic_extent` above; throws `dispatch_error` for a count below 1.
template <class F>
decltype(auto) dispatch_head_count(int num_heads, F&& f) {
  if (num_heads < 1) throw dispatch_error("unsupported head count " + std::to_string(num_heads) + " (at least 1)", "head count");
  if (num_heads > max_static_heads) return f.template operator()<std::dynamic_extent>();
  return [&]<std::size_t... H>(std::index_sequence<H...>) -> decltype(auto) {
    return dispatch_value<static_cast<int>(H + 1)...>(num_heads, "head count", [&]<int N>() -> decltype(auto) {
      return f.template operator()<static_cast<std::size_t>(N)>();
    });
  }(std::make_index_sequence<max_static_heads>{});
}

//! Parameters of the built-in policies by name; an unset field takes the policy's default.
struct policy_options {
  //! T; unset: 0.7 for `typical` (the reference's command-line default), 1.0 for the sampling
  //! policies (the model's own distribution). `greedy` ignores it.
  std::optional<float> temperature;
  std::optional<float> posterior_threshold;  //!< typical: ε (default 0.09)
  std::optional<float> posterior_alpha;      //!< typical: δ (default 0.3)
  std::optional<int> top_k;                  //!< sampling: top-k filter (default 0 = off)
  std::optional<float> top_p;                //!< sampling: nucleus mass (default 1 = off)
};

//! A list of policy types for `dispatch_policy`; each has a `static constexpr std::string_view name`.
template <class... Policies>
struct policy_list {};

//! The built-in policies.
using builtin_policies =
    policy_list<greedy_policy, typical_policy, rejection_policy, speculative_policy, draft_sampling_policy>;

//! The policy `P` with `options` applied (fields a policy does not have are ignored) and validated
//! (`acceptance_error`, `bad_parameter`). Policies other than the built-in ones are default-constructed.
template <class P>
P make_policy(const policy_options& o) {
  P p{};
  if constexpr (std::is_same_v<P, typical_policy>) {
    p.temperature = o.temperature.value_or(0.7f);
    p.posterior_threshold = o.posterior_threshold.value_or(p.posterior_threshold);
    p.posterior_alpha = o.posterior_alpha.value_or(p.posterior_alpha);
  } else if constexpr (std::is_base_of_v<sampling_warp, P>) {
    p.temperature = o.temperature.value_or(1.0f);
    p.top_k = o.top_k.value_or(p.top_k);
    p.top_p = o.top_p.value_or(p.top_p);
  }
  if constexpr (requires { p.validate(); }) p.validate();
  return p;
}

//! Calls `f(policy)` with the policy of `List` named `name`, built by `make_policy`; throws
//! `dispatch_error` for a name outside the list.
template <class List = builtin_policies, class F>
decltype(auto) dispatch_policy(std::string_view name, const policy_options& options, F&& f, List = {}) {
  return [&]<class... P>(policy_list<P...>) -> decltype(auto) {
    static_assert(sizeof...(P) > 0, "medusa: dispatch_policy needs at least one policy");
    constexpr std::string_view names[] = {P::name...};
    std::size_t index = sizeof...(P);
    for (std::size_t i = 0; i < sizeof...(P); ++i)
      if (names[i] == name) index = i;
    if (index == sizeof...(P)) {
      std::string msg = "unsupported policy '" + detail::printable(name, 64) + "'; supported:";
      for (std::size_t i = 0; i < sizeof...(P); ++i) msg += (i ? ", " : " ") + std::string(names[i]);
      throw dispatch_error(msg, "policy");
    }
    return [&]<std::size_t... I>(std::index_sequence<I...>) -> decltype(auto) {
      return dispatch_value<I...>(index, "policy", [&]<std::size_t J>() -> decltype(auto) {
        using Policy = std::tuple_element_t<J, std::tuple<P...>>;
        return f(make_policy<Policy>(options));
      });
    }(std::index_sequence_for<P...>{});
  }(List{});
}

//! Calls `f(Tag::tree)` with the compile-time tree of the first tag in `Tags` whose tree has the
//! shape of `t` (`same_shape`), else `f(t)`. By default the tags are the presets, so a preset
//! given at run time runs on its `static_tree` instantiation.
template <class Tags = presets::all_tags, class F>
decltype(auto) dispatch_tree(const tree& t, F&& f, Tags = {}) {
  return [&]<class... Tag>(presets::tag_list<Tag...>) -> decltype(auto) {
    constexpr std::size_t count = sizeof...(Tag);
    std::size_t index = count;
    std::size_t i = 0;
    ((index = index == count && same_shape(t, Tag::tree) ? i : index, ++i), ...);
    if constexpr (count == 0) {
      return f(t);
    } else {
      if (index == count) return f(t);
      return [&]<std::size_t... I>(std::index_sequence<I...>) -> decltype(auto) {
        return dispatch_value<I...>(index, "tree", [&]<std::size_t J>() -> decltype(auto) {
          return f(std::tuple_element_t<J, std::tuple<Tag...>>::tree);
        });
      }(std::make_index_sequence<count>{});
    }
  }(Tags{});
}

MEDUSA_NAMESPACE_END
