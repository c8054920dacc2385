// SPDX-License-Identifier: Apache-2.0
//! @file acceptance/verify.hpp
//! `verify`: which drafted tree nodes to commit and the next step's bonus token, for one request
//! or a batch sharing a tree; the node-test algorithm here, the sampling ones in
//! acceptance/sampling.hpp.
//!
//! @code
//! #include <medusa/acceptance/verify.hpp>
//! auto t = medusa::tree::preset("mc_sim_7b_63");
//! medusa::acceptance_workspace ws(t.num_nodes(), vocab);  // once
//! medusa::verify_request req{.node_tokens = node_tokens, .logits = logits, .vocab = vocab};
//! auto r = medusa::verify(t, req, medusa::greedy_policy{}, ws);  // r.tokens(), r.bonus
//! @endcode
#pragma once

#include <medusa/config.hpp>
#include <medusa/acceptance/policies.hpp>
#include <medusa/acceptance/request.hpp>
#include <medusa/acceptance/sampling.hpp>
#include <medusa/acceptance_error.hpp>
#include <medusa/detail/row_math.hpp>
#include <medusa/tree.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <vector>

MEDUSA_NAMESPACE_BEGIN

namespace detail {

template <tree_like Tree, node_test_policy Policy>
verify_result verify_node_test(const Tree& t, const verify_request& req, const Policy& policy,
                               acceptance_workspace& ws) {
  constexpr bool scored = requires(const Policy& p, const typename Policy::parent_state& s,
                                   std::span<const float> z, std::int32_t x) {
    { p.log_score(s, z, x) } -> std::convertible_to<double>;
  };
  const int n = t.num_nodes();
  std::uint8_t* acc = workspace_access::accepted(ws);
  double* score = workspace_access::score(ws);
  std::fill(acc, acc + n, std::uint8_t{0});
  acc[0] = 1;
  score[0] = 0.0;
  int a = 0;
  // Node order puts ancestors first, so a node's flag is final before its children are tested;
  // only parents that are themselves accepted are ever prepared (usually a handful of rows).
  for (int v = 0; v < n; ++v) {
    const int cc = t.child_count(v);
    if (!acc[v] || cc == 0) continue;
    const auto z = checked_row(req, v);
    const typename Policy::parent_state s = policy.prepare(z);
    const int cb = t.child_begin(v);
    for (int c = cb; c < cb + cc; ++c) {
      const std::int32_t x = req.node_tokens[static_cast<std::size_t>(c)];
      if (!policy.accepts(s, z, x)) continue;
      acc[c] = 1;
      if constexpr (scored) score[c] = score[v] + static_cast<double>(policy.log_score(s, z, x));
      a = std::max(a, t.node_depth(c));
    }
  }
  verify_result res;
  int best_row = 0;
  int last = 0;
  if (a > 0) {
    best_row = -1;
    double best = 0.0;
    for (int p = 0; p < t.num_leaves(); ++p) {
      const int u = t.retrieve(p, a);
      if (u < 0 || !acc[u]) continue;
      if constexpr (scored) {
        if (best_row < 0 || score[u] > best) {
          best_row = p;
          best = score[u];
          last = u;
        }
      } else {
        best_row = p;
        last = u;
        break;
      }
    }
  }
  res.best_row = best_row;
  fill_path(t, req, last, res);
  if (truncate_at_eos(req, res)) return res;
  const auto z = checked_row(req, res.next_node);
  if constexpr (requires { { policy.bonus(z) } -> std::convertible_to<std::int32_t>; })
    res.bonus = policy.bonus(z);
  else
    res.bonus = argmax_finite(z.data(), z.size());
  return res;
}

// One validated request through the policy's algorithm.
template <tree_like Tree, acceptance_policy Policy>
verify_result verify_validated(const Tree& t, const verify_request& req, const Policy& policy,
                               acceptance_workspace& ws) {
  if constexpr (node_test_policy<Policy>)
    return verify_node_test(t, req, policy, ws);
  else if constexpr (depth_draft_policy<Policy>)
    return verify_depth_drafts(t, req, policy, ws);
  else
    return verify_sampling(t, req, policy, ws);
}

}  // namespace detail


//! Verifies one request: runs the policy over the tree and returns the accepted path, the tokens
//! to commit and the bonus token.
//! @throws acceptance_error on shape/vocab mismatches, token ids outside [0, vocab), NaN or +Inf
//!         (or every token masked) in a row that is read (node() names it), bad policy parameters
//!         or draft rows.
template <tree_like Tree, acceptance_policy Policy>
verify_result verify(const Tree& t, const verify_request& req, const Policy& policy,
                     acceptance_workspace& ws) {
  detail::validate_request(t, req, policy);
  ws.reserve(t.num_nodes(), req.vocab);
  return detail::verify_validated(t, req, policy, ws);
}

//! Convenience overload that allocates its own workspace (use the workspace form per step).
template <tree_like Tree, acceptance_policy Policy>
verify_result verify(const Tree& t, const verify_request& req, const Policy& policy) {
  acceptance_workspace ws(t.num_nodes(), req.vocab);
  return verify(t, req, policy, ws);
}

//! Verifies a batch of requests sharing one tree and policy, each with its own logits, seed and
//! step. `results[b]` receives request b. If `commit_offsets` is non-empty it must have
//! `requests.size() + 1` entries and receives the exclusive prefix sum of `A + 1` (where each
//! request's committed tokens start in a packed output) with the total last.
//! Every request is validated before any result is written.
template <tree_like Tree, acceptance_policy Policy>
void verify_batch(const Tree& t, std::span<const verify_request> requests, const Policy& policy,
                  acceptance_workspace& ws, std::span<verify_result> results,
                  std::span<int> commit_offsets = {}) {
  if (results.size() != requests.size())
    throw acceptance_error(acceptance_errc::size_mismatch,
                           "batch: " + std::to_string(requests.size()) + " requests but " +
                               std::to_string(results.size()) + " result slots");
  if (!commit_offsets.empty() && commit_offsets.size() != requests.size() + 1)
    throw acceptance_error(acceptance_errc::size_mismatch,
                           "batch: commit_offsets needs " + std::to_string(requests.size() + 1) +
                               " entries, got " + std::to_string(commit_offsets.size()));
  for (const verify_request& req : requests) detail::validate_request(t, req, policy);
  for (std::size_t b = 0; b < requests.size(); ++b) {
    ws.reserve(t.num_nodes(), requests[b].vocab);
    results[b] = detail::verify_validated(t, requests[b], policy, ws);
  }
  if (!commit_offsets.empty()) {
    commit_offsets[0] = 0;
    for (std::size_t b = 0; b < requests.size(); ++b)
      commit_offsets[b + 1] = commit_offsets[b] + results[b].accept_length + 1;
  }
}

MEDUSA_NAMESPACE_END
