// SPDX-License-Identifier: Apache-2.0
//! @file candidates.hpp
//! Candidates (docs/acceptance.md): per-head top-k over the vocabulary, the gather of the flat
//! candidate vector into tree-node tokens, and the reference's per-path candidate rows.
//!
//! Conventions: head `h` (0-based) feeds tree depth `h + 1`; it needs only its best
//! `k_d = max_rank(d) + 1` tokens, but the flat vector keeps stride `K = tree.topk()` so that
//! `tree_index` stays reference-compatible: `F = [root, top_0[0..K), ..., top_{H-1}[0..K)]`.
//! Ties in top-k go to the lower token id. Slots that are never read (ranks ≥ k_d, heads deeper
//! than the tree) are set to -1. Nothing here allocates: all outputs are caller-owned spans, or
//! live in a `candidate_workspace` sized once.
//!
//! Candidates *sampled* from the heads' warped softmax (without replacement, for
//! `draft_sampling_policy`) are `sample_candidates` in acceptance.hpp: they share the target's warp.
//!
//! @code
//! auto t = medusa::tree::preset("mc_sim_7b_63");
//! medusa::candidate_workspace ws(t, /*num_heads=*/4);
//! std::vector<std::int32_t> node_tokens(t.num_nodes());
//! // head_logits: [4][vocab] row-major raw head logits; root: the token chosen from the base logits
//! ws.generate(t, root, head_logits, vocab, node_tokens);
//! @endcode
#pragma once

#include <medusa/config.hpp>
#include <medusa/acceptance_error.hpp>
#include <medusa/detail/row_math.hpp>
#include <medusa/tree.hpp>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

MEDUSA_NAMESPACE_BEGIN

namespace detail {

// A logit row must hold no NaN and no +Inf; -Inf marks a masked token (banned words, grammar
// constraints, top-k masks), but not every token may be masked. `what` names the row ("node",
// "head"), followed by `node` unless it is -1 (a lone row).
inline void check_logit_row(std::span<const float> row, int node, const char* what) {
  const logit_row_scan scan = scan_logit_row(row.data(), row.size());
  const std::string name = node >= 0 ? std::string(what) + " " + std::to_string(node) : std::string(what);
  if (scan.first_invalid >= 0) {
    const float v = row[static_cast<std::size_t>(scan.first_invalid)];
    throw acceptance_error(acceptance_errc::non_finite_logit,
                           name + ": logit " + std::to_string(scan.first_invalid) + " is " + (v != v ? "NaN" : "+Inf"),
                           node);
  }
  if (!scan.any_allowed && !row.empty())
    throw acceptance_error(acceptance_errc::non_finite_logit, name + ": every logit is -Inf (all tokens masked)", node);
}

inline void check_vocab(int vocab) {
  if (vocab <= 0)
    throw acceptance_error(acceptance_errc::vocab_mismatch,
                           "vocab size must be positive, got " + std::to_string(vocab));
}

}  // namespace detail

//! Writes the `ids.size()` best token ids of `logits` to `ids`, best first, equal logits by
//! ascending id. Raw logits: no temperature, no filter.
//! Masked tokens (-Inf) rank last.
//! @throws acceptance_error `size_mismatch` if `ids` is empty or longer than the row,
//!         `non_finite_logit` (node() = -1) on NaN, +Inf, or a row with every token masked.
inline void top_k(std::span<const float> logits, std::span<std::int32_t> ids) {
  if (ids.empty() || ids.size() > logits.size())
    throw acceptance_error(acceptance_errc::size_mismatch,
                           "top-k: k = " + std::to_string(ids.size()) + " must be in [1, " +
                               std::to_string(logits.size()) + "] (the row length)");
  detail::check_logit_row(logits, -1, "top-k row");
  detail::top_k_ids(logits.data(), logits.size(), static_cast<int>(ids.size()), ids.data());
}

//! The id of the largest logit, lowest id on ties (the greedy root).
//! @throws acceptance_error `vocab_mismatch` on an empty row, `non_finite_logit` on NaN, +Inf, or
//!         every token masked (-Inf).
inline std::int32_t argmax(std::span<const float> logits) {
  if (logits.empty())
    throw acceptance_error(acceptance_errc::vocab_mismatch, "argmax of an empty logit row");
  detail::check_logit_row(logits, -1, "argmax row");
  return detail::argmax_finite(logits.data(), logits.size());
}

//! `k_d` = how many top tokens head `depth - 1` must provide (`max_rank(depth) + 1`), for
//! `depth` in [1, tree.depth()].
template <tree_like Tree>
int candidates_per_depth(const Tree& t, int depth) {
  return t.max_rank(depth) + 1;
}

//! Length of the flat candidate vector `F` for `num_heads` heads: `1 + topk · num_heads`.
template <tree_like Tree>
std::size_t flat_candidates_size(const Tree& t, int num_heads) {
  return 1 + static_cast<std::size_t>(t.topk()) * static_cast<std::size_t>(num_heads);
}

//! `node_tokens[u] = flat[tree_index(u)]` for every node (the gather).
//! @throws acceptance_error `size_mismatch` if `node_tokens.size() != num_nodes()` or `flat` is
//!         too short for the tree's deepest head.
template <tree_like Tree>
void gather_tree_tokens(const Tree& t, std::span<const std::int32_t> flat,
                        std::span<std::int32_t> node_tokens) {
  const int n = t.num_nodes();
  if (node_tokens.size() != static_cast<std::size_t>(n))
    throw acceptance_error(acceptance_errc::size_mismatch,
                           "node_tokens has " + std::to_string(node_tokens.size()) +
                               " entries, the tree has " + std::to_string(n) + " nodes");
  if (flat.size() < flat_candidates_size(t, t.depth()))
    throw acceptance_error(acceptance_errc::size_mismatch,
                           "flat candidates have " + std::to_string(flat.size()) +
                               " entries, a depth-" + std::to_string(t.depth()) +
                               " tree needs at least " +
                               std::to_string(flat_candidates_size(t, t.depth())));
  for (int u = 0; u < n; ++u) node_tokens[static_cast<std::size_t>(u)] = flat[static_cast<std::size_t>(t.tree_index(u))];
}

//! Fills `flat` (`1 + topk·H` entries, H = head_logits.size() / vocab ≥ tree depth) with the root
//! and the top-k_d ids of each head used by the tree (unused slots -1), then gathers
//! `node_tokens`. `head_logits` is row-major `[H][vocab]`.
//! @throws acceptance_error `vocab_mismatch`, `size_mismatch` (H not integral or < depth, spans of
//!         the wrong length), `token_out_of_range` (root), `non_finite_logit` (node() = head).
template <tree_like Tree>
void generate_candidates(const Tree& t, std::int32_t root, std::span<const float> head_logits,
                         int vocab, std::span<std::int32_t> flat,
                         std::span<std::int32_t> node_tokens) {
  detail::check_vocab(vocab);
  const auto v = static_cast<std::size_t>(vocab);
  if (head_logits.size() % v != 0 || head_logits.size() / v < static_cast<std::size_t>(t.depth()))
    throw acceptance_error(acceptance_errc::size_mismatch,
                           "head logits have " + std::to_string(head_logits.size()) +
                               " values: need a whole number of vocab-" + std::to_string(vocab) +
                               " rows, at least " + std::to_string(t.depth()) +
                               " (one per tree depth)");
  const int heads = static_cast<int>(head_logits.size() / v);
  if (flat.size() != flat_candidates_size(t, heads))
    throw acceptance_error(acceptance_errc::size_mismatch,
                           "flat candidates have " + std::to_string(flat.size()) +
                               " entries, expected 1 + topk*heads = " +
                               std::to_string(flat_candidates_size(t, heads)));
  if (node_tokens.size() != static_cast<std::size_t>(t.num_nodes()))
    throw acceptance_error(acceptance_errc::size_mismatch,
                           "node_tokens has " + std::to_string(node_tokens.size()) +
                               " entries, the tree has " + std::to_string(t.num_nodes()) +
                               " nodes");
  if (root < 0 || root >= vocab)
    throw acceptance_error(acceptance_errc::token_out_of_range,
                           "root token " + std::to_string(root) + " is outside [0, " +
                               std::to_string(vocab) + ")",
                           0);
  for (int d = 1; d <= t.depth(); ++d) {
    const auto row = head_logits.subspan(static_cast<std::size_t>(d - 1) * v, v);
    detail::check_logit_row(row, d - 1, "head");
    const int k = candidates_per_depth(t, d);
    if (k > vocab)
      throw acceptance_error(acceptance_errc::vocab_mismatch,
                             "depth " + std::to_string(d) + " needs the top " + std::to_string(k) +
                                 " tokens but the vocab has only " + std::to_string(vocab),
                             d - 1);
  }
  // Validated: now write.
  const auto stride = static_cast<std::size_t>(t.topk());
  flat[0] = root;
  for (std::size_t i = 1; i < flat.size(); ++i) flat[i] = -1;
  for (int d = 1; d <= t.depth(); ++d) {
    const auto row = head_logits.subspan(static_cast<std::size_t>(d - 1) * v, v);
    detail::top_k_ids(row.data(), row.size(), candidates_per_depth(t, d),
                      flat.data() + 1 + static_cast<std::size_t>(d - 1) * stride);
  }
  gather_tree_tokens(t, flat, node_tokens);
}

//! The reference's per-path view: `rows[p][j] = node_tokens[retrieve(p, j)]`, padded cells token
//! 0 (reference behaviour; acceptance never reads them). `rows` is row-major
//! `[num_leaves][depth + 1]`.
//! @throws acceptance_error `size_mismatch` on wrong span lengths.
template <tree_like Tree>
void candidate_rows(const Tree& t, std::span<const std::int32_t> node_tokens,
                    std::span<std::int32_t> rows) {
  const auto cols = static_cast<std::size_t>(t.depth() + 1);
  if (node_tokens.size() != static_cast<std::size_t>(t.num_nodes()) ||
      rows.size() != static_cast<std::size_t>(t.num_leaves()) * cols)
    throw acceptance_error(acceptance_errc::size_mismatch,
                           "candidate rows: need " + std::to_string(t.num_nodes()) +
                               " node tokens and " + std::to_string(t.num_leaves()) + "x" +
                               std::to_string(cols) + " cells, got " +
                               std::to_string(node_tokens.size()) + " and " +
                               std::to_string(rows.size()));
  for (int p = 0; p < t.num_leaves(); ++p) {
    for (std::size_t j = 0; j < cols; ++j) {
      const int u = t.retrieve(p, static_cast<int>(j));
      rows[static_cast<std::size_t>(p) * cols + j] =
          u < 0 ? 0 : node_tokens[static_cast<std::size_t>(u)];
    }
  }
}

//! One-time workspace of candidate generation: owns the flat vector `F` for a given head count,
//! so a step is one call with no allocation.
class candidate_workspace {
 public:
  //! Sizes `F` for `num_heads` heads of tree `t` (num_heads ≥ t.depth()).
  //! @throws acceptance_error `size_mismatch` if num_heads < t.depth().
  template <tree_like Tree>
  candidate_workspace(const Tree& t, int num_heads) : num_heads_(num_heads) {
    if (num_heads < t.depth())
      throw acceptance_error(acceptance_errc::size_mismatch,
                             "a depth-" + std::to_string(t.depth()) + " tree needs at least " +
                                 std::to_string(t.depth()) + " heads, got " +
                                 std::to_string(num_heads));
    flat_.assign(flat_candidates_size(t, num_heads), -1);
  }

  //! `generate_candidates` into the owned `F`; `head_logits` must hold `num_heads()` rows.
  //! Returns `F`.
  template <tree_like Tree>
  std::span<const std::int32_t> generate(const Tree& t, std::int32_t root,
                                         std::span<const float> head_logits, int vocab,
                                         std::span<std::int32_t> node_tokens) {
    if (flat_.size() != flat_candidates_size(t, num_heads_))
      throw acceptance_error(acceptance_errc::size_mismatch,
                             "candidate workspace was sized for another tree (topk " +
                                 std::to_string((flat_.size() - 1) / static_cast<std::size_t>(num_heads_)) +
                                 ", tree topk " + std::to_string(t.topk()) + ")");
    detail::check_vocab(vocab);
    if (head_logits.size() != static_cast<std::size_t>(num_heads_) * static_cast<std::size_t>(vocab))
      throw acceptance_error(acceptance_errc::size_mismatch,
                             "head logits have " + std::to_string(head_logits.size()) +
                                 " values, expected " + std::to_string(num_heads_) + " x " +
                                 std::to_string(vocab));
    generate_candidates(t, root, head_logits, vocab, flat_, node_tokens);
    return flat_;
  }

  //! The flat candidate vector of the last `generate` call.
  [[nodiscard]] std::span<const std::int32_t> flat() const noexcept { return flat_; }
  //! Head count the workspace was sized for.
  [[nodiscard]] int num_heads() const noexcept { return num_heads_; }

 private:
  int num_heads_;
  std::vector<std::int32_t> flat_;
};

MEDUSA_NAMESPACE_END
