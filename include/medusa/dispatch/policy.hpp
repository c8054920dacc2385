// SPDX-License-Identifier: Apache-2.0
//! @file dispatch/policy.hpp
//! A policy named at run time to its type: `dispatch_policy(name, options, f)` calls `f` with a
//! `greedy_policy`, `typical_policy`, ... built by `make_policy` from `policy_options`.
//!
//! @code
//! #include <medusa/dispatch/policy.hpp>
//! medusa::policy_options options;
//! options.temperature = 0.7f;
//! std::string_view picked = medusa::dispatch_policy("typical", options, [](auto policy) {
//!   return decltype(policy)::name;
//! });  // "typical"
//! @endcode
#pragma once

#include <medusa/config.hpp>
#include <medusa/acceptance.hpp>
#include <medusa/dispatch/value.hpp>
#include <medusa/tree/errors.hpp>

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>

MEDUSA_NAMESPACE_BEGIN

//! Parameters of the built-in policies by name; an unset field takes the policy's default. Every
//! field has a default member initializer, so `{.temperature = 0.7f}` compiles under `-Wextra`.
struct policy_options {
  //! T; unset: the policy's own default, 0.7 for `typical` (the reference's), 1.0 for the
  //! sampling policies (the model's own distribution). `greedy` ignores it.
  std::optional<float> temperature = {};
  std::optional<float> posterior_threshold = {};  //!< typical: ε (default 0.09)
  std::optional<float> posterior_alpha = {};      //!< typical: δ (default 0.3)
  std::optional<int> top_k = {};                  //!< sampling: top-k filter (default 0 = off)
  std::optional<float> top_p = {};                //!< sampling: nucleus mass (default 1 = off)
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
    p.temperature = o.temperature.value_or(p.temperature);
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

MEDUSA_NAMESPACE_END
