// SPDX-License-Identifier: Apache-2.0
//! @file acceptance/request.hpp
//! One verify call's data: `verify_request` (the caller's tokens, logits, drafts, seed and step),
//! `verify_result` (the accepted path, the tokens to commit, the bonus) and the reusable scratch
//! memory `acceptance_workspace`; with the request checks that every policy shares.
//!
//! @code
//! #include <medusa/acceptance/request.hpp>
//! medusa::acceptance_workspace ws(/*nodes=*/64, /*vocab=*/32000);  // once; reused every step
//! @endcode
#pragma once

#include <medusa/config.hpp>
#include <medusa/acceptance/policies.hpp>
#include <medusa/acceptance_error.hpp>
#include <medusa/candidates.hpp>
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

//! One request of a verify call. All spans are caller memory and only read.
struct verify_request {
  std::span<const std::int32_t> node_tokens;  //!< [num_nodes], node 0 = the root token
  std::span<const float> logits;              //!< [num_nodes][vocab] row-major
  int vocab = 0;                              //!< vocabulary size
  std::span<const float> draft_probs = {};    //!< [num_nodes][vocab]; speculative_policy only (row 0 unused)
  std::uint64_t seed = 0;                     //!< per-request Philox key (sampling policies)
  std::uint64_t step = 0;                     //!< step counter of the request (Philox counter)
  std::int32_t eos_token = -1;                //!< stop after an accepted EOS draft (-1 = off)
  //! [depth][vocab]; `draft_sampling_policy` only: row d-1 = the distribution the depth-d node
  //! tokens were drawn from without replacement (`sample_candidates` writes it).
  std::span<const float> draft_rows = {};
};

//! Result of verifying one request.
struct verify_result {
  //! Longest root-to-node path a result can hold (depth + 1).
  static constexpr int max_path = 64;

  int best_row = 0;       //!< row of retrieve_indices (rejection: first row through next_node)
  int accept_length = 0;  //!< A: accepted drafts, root not counted
  int next_node = 0;      //!< nodes[A]: the row of the next state (z, h)
  std::int32_t bonus = -1;  //!< next step's root; -1 when the step ended on EOS
  bool eos = false;         //!< an accepted draft was the EOS token (the path ends there)
  std::array<int, max_path> node_ids{};          //!< nodes[0..A], root first
  std::array<std::int32_t, max_path> token_ids{};  //!< tokens to commit: root + drafts

  //! Accepted node ids, root first (A + 1 entries).
  [[nodiscard]] std::span<const int> nodes() const noexcept {
    return {node_ids.data(), static_cast<std::size_t>(accept_length + 1)};
  }
  //! Tokens to commit, root first (A + 1 entries).
  [[nodiscard]] std::span<const std::int32_t> tokens() const noexcept {
    return {token_ids.data(), static_cast<std::size_t>(accept_length + 1)};
  }
};

namespace detail {
struct workspace_access;
}  // namespace detail

//! Scratch memory of `verify`, sized once for a tree size and vocabulary; a call with larger
//! sizes grows it (once), equal or smaller ones never allocate.
class acceptance_workspace {
 public:
  //! Tokens per block of the block masses that speed up draft draws.
  static constexpr std::size_t draw_block = 256;

  acceptance_workspace() = default;
  //! Sizes the scratch for trees of up to `num_nodes` nodes and vocabularies up to `vocab`.
  acceptance_workspace(int num_nodes, int vocab) { reserve(num_nodes, vocab); }

  //! Grows the scratch if needed (never shrinks).
  void reserve(int num_nodes, int vocab) {
    const auto n = static_cast<std::size_t>(std::max(num_nodes, 0));
    const auto v = static_cast<std::size_t>(std::max(vocab, 0));
    if (accepted_.size() < n) {
      accepted_.resize(n);
      score_.resize(n);
      drawn_.assign(n, 0);  // scratch: old contents need not move
      drawn_r_.assign(n, 0.0);
    }
    if (residual_.size() < v) {
      residual_.resize(v);
      ids_.resize(v);
      keys_.resize(v);
      blocks_.assign((v + draw_block - 1) / draw_block, 0.0);
    }
  }

  //! Nodes the scratch holds now.
  [[nodiscard]] std::size_t node_capacity() const noexcept { return accepted_.size(); }
  //! Vocabulary size the scratch holds now.
  [[nodiscard]] std::size_t vocab_capacity() const noexcept { return residual_.size(); }

 private:
  friend struct detail::workspace_access;
  std::vector<std::uint8_t> accepted_;  // per node: the node and its ancestry passed
  std::vector<double> score_;           // per node: summed log-score of the path
  std::vector<double> residual_;        // [vocab]: residual of rejection sampling
  std::vector<std::int32_t> ids_;       // [vocab]: ranking for top-k / top-p
  std::vector<std::uint64_t> keys_;     // [vocab]: sort keys for top-p selection
  std::vector<std::int32_t> drawn_;     // per node: draws of one depth (draft sampling)
  std::vector<double> drawn_r_;         // per node: residual saved at those draws
  std::vector<double> blocks_;          // [vocab / draw_block]: block masses of a draft row
};

namespace detail {
// The implementation's way into the workspace's scratch (the members are not an API).
struct workspace_access {
  static std::uint8_t* accepted(acceptance_workspace& w) noexcept { return w.accepted_.data(); }
  static double* score(acceptance_workspace& w) noexcept { return w.score_.data(); }
  static double* residual(acceptance_workspace& w) noexcept { return w.residual_.data(); }
  static std::int32_t* ids(acceptance_workspace& w) noexcept { return w.ids_.data(); }
  static std::uint64_t* keys(acceptance_workspace& w) noexcept { return w.keys_.data(); }
  static std::int32_t* drawn(acceptance_workspace& w) noexcept { return w.drawn_.data(); }
  static double* drawn_r(acceptance_workspace& w) noexcept { return w.drawn_r_.data(); }
  static double* blocks(acceptance_workspace& w) noexcept { return w.blocks_.data(); }
};
}  // namespace detail

// ------------------------------------------------------------------------------------------------
// Checks and path helpers shared by the policies' algorithms
// ------------------------------------------------------------------------------------------------


namespace detail {

template <tree_like Tree, class Policy>
void validate_request(const Tree& t, const verify_request& req, const Policy& policy) {
  if constexpr (requires { policy.validate(); }) policy.validate();
  check_vocab(req.vocab);
  const int n = t.num_nodes();
  if (t.depth() + 1 > verify_result::max_path)
    throw acceptance_error(acceptance_errc::too_deep,
                           "tree depth " + std::to_string(t.depth()) + " exceeds the verify limit " +
                               std::to_string(verify_result::max_path - 1));
  if (req.node_tokens.size() != static_cast<std::size_t>(n))
    throw acceptance_error(acceptance_errc::size_mismatch,
                           "node_tokens has " + std::to_string(req.node_tokens.size()) +
                               " entries, the tree has " + std::to_string(n) + " nodes");
  const std::size_t cells = static_cast<std::size_t>(n) * static_cast<std::size_t>(req.vocab);
  if (req.logits.size() != cells)
    throw acceptance_error(
        req.logits.size() % static_cast<std::size_t>(n) == 0 ? acceptance_errc::vocab_mismatch
                                                              : acceptance_errc::size_mismatch,
        "logits have " + std::to_string(req.logits.size()) + " values, expected " +
            std::to_string(n) + " nodes x vocab " + std::to_string(req.vocab) + " = " +
            std::to_string(cells));
  for (int u = 0; u < n; ++u) {
    const std::int32_t tok = req.node_tokens[static_cast<std::size_t>(u)];
    if (tok < 0 || tok >= req.vocab)
      throw acceptance_error(acceptance_errc::token_out_of_range,
                             "node " + std::to_string(u) + ": token " + std::to_string(tok) +
                                 " is outside [0, " + std::to_string(req.vocab) + ")",
                             u);
  }
  if constexpr (depth_draft_policy<Policy>) {
    const std::size_t rows = static_cast<std::size_t>(t.depth()) * static_cast<std::size_t>(req.vocab);
    if (req.draft_rows.size() != rows)
      throw acceptance_error(acceptance_errc::size_mismatch,
                             "draft_rows have " + std::to_string(req.draft_rows.size()) +
                                 " values, expected depth " + std::to_string(t.depth()) +
                                 " x vocab " + std::to_string(req.vocab) + " = " +
                                 std::to_string(rows));
  } else if constexpr (sampling_policy<Policy>) {
    if constexpr (Policy::draft_distributions) {
      if (req.draft_probs.size() != cells)
        throw acceptance_error(acceptance_errc::size_mismatch,
                               "draft_probs have " + std::to_string(req.draft_probs.size()) +
                                   " values, expected " + std::to_string(cells));
    }
  }
}

inline std::span<const float> node_row(const verify_request& req, int u) {
  const auto v = static_cast<std::size_t>(req.vocab);
  return req.logits.subspan(static_cast<std::size_t>(u) * v, v);
}

inline std::span<const float> checked_row(const verify_request& req, int u) {
  const auto row = node_row(req, u);
  check_logit_row(row, u, "node");
  return row;
}

//! Fills nodes/tokens of `res` by walking up from `last` (depth `a`).
template <tree_like Tree>
void fill_path(const Tree& t, const verify_request& req, int last, verify_result& res) {
  const int a = t.node_depth(last);
  res.accept_length = a;
  res.next_node = last;
  for (int j = a, u = last; j >= 0; --j, u = t.parent(u)) {
    res.node_ids[static_cast<std::size_t>(j)] = u;
    res.token_ids[static_cast<std::size_t>(j)] = req.node_tokens[static_cast<std::size_t>(u)];
  }
}

//! Reference-compatible row of a sampled path: the first leaf row through its final node.
template <tree_like Tree>
void set_first_row_through(const Tree& t, verify_result& res) {
  for (int p = 0; p < t.num_leaves(); ++p) {
    if (t.retrieve(p, res.accept_length) == res.next_node) {
      res.best_row = p;
      return;
    }
  }
}

//! Shortens an accepted path at its first EOS draft; true if it did.
inline bool truncate_at_eos(const verify_request& req, verify_result& res) {
  if (req.eos_token < 0) return false;
  for (int j = 1; j <= res.accept_length; ++j) {
    if (res.token_ids[static_cast<std::size_t>(j)] == req.eos_token) {
      res.accept_length = j;
      res.next_node = res.node_ids[static_cast<std::size_t>(j)];
      res.eos = true;
      res.bonus = -1;
      return true;
    }
  }
  return false;
}

}  // namespace detail

MEDUSA_NAMESPACE_END
