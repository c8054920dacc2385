// SPDX-License-Identifier: Apache-2.0
//! @file decoder/row_invariance.hpp
//! `check_row_invariance`: does an engine give a token the same bits whatever pass it runs in?
//!
//! Greedy Medusa equals plain greedy decoding only if a row's logits do not depend on how many
//! rows share its forward pass (a tree step runs many, a plain step one) nor on masked-out tree
//! nodes beside it. A GEMM or attention kernel that picks its blocking by the row count breaks
//! this by one ULP, and one ULP flips an argmax now and then: Medusa output then drifts from plain
//! decoding. This check runs `tokens` through the model:
//! - one token a pass (the reference, as plain decoding runs them);
//! - in causal passes of each size in `pass_sizes`;
//! - in tree passes where every accepted token has a masked-out sibling beside it;
//! - for a batch model, with a second request in every pass (`companion_request`),
//! and compares logits and hidden states bit for bit.
//!
//! @code
//! #include <medusa/decoder/row_invariance.hpp>
//! const auto report = medusa::check_row_invariance(model, tokens);   // tokens: a real prompt
//! if (!report.invariant) std::fprintf(stderr, "%s\n", report.message().c_str());
//! @endcode
//!
//! The check writes the model's cache from slot 0 (a batch model: the cache of `request`, and of
//! `companion_request`): run it before serving, or on a request id no one uses.
#pragma once

#include <medusa/config.hpp>
#include <medusa/decoder/model.hpp>
#include <medusa/error.hpp>
#include <medusa/tree/runtime_tree.hpp>

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

MEDUSA_NAMESPACE_BEGIN

//! What `check_row_invariance` runs.
struct row_invariance_options {
  std::vector<int> pass_sizes = {2, 3, 4, 5, 8, 16, 31, 64};  //!< causal pass sizes (tokens a forward)
  bool tree_passes = true;    //!< also tree passes with a masked-out sibling beside each token
  int request = 0;            //!< batch models: the request id whose cache the check writes
  int companion_request = 1;  //!< batch models: a second request in every pass (-1: none)
};

//! The outcome: `invariant`, or the first row that differs from its one-token-a-pass value.
struct row_invariance_report {
  bool invariant = true;
  int rows_checked = 0;      //!< rows compared, over all passes
  std::string pass;          //!< the pass that differs, e.g. "causal, 8 tokens a pass"
  int row = -1;              //!< position in `tokens` of the differing row
  bool in_hidden = false;    //!< the difference is in the hidden state, not the logits
  int index = -1;            //!< the logit (token id) or hidden channel that differs
  float alone = 0.0f;        //!< its value one token a pass
  float in_pass = 0.0f;      //!< its value in `pass`

  //! One line: "rows are invariant (N rows compared)" or what differs, where.
  [[nodiscard]] std::string message() const {
    if (invariant) return "rows are invariant (" + std::to_string(rows_checked) + " rows compared)";
    return std::string("row ") + std::to_string(row) + " differs in " + pass + ": " +
           (in_hidden ? "hidden[" : "logit[") + std::to_string(index) + "] is " + std::to_string(in_pass) +
           " there and " + std::to_string(alone) + " one token a pass (" +
           std::to_string(ulps()) + " in the bit pattern): greedy Medusa will not always equal plain decoding";
  }
  //! How far apart the two values' bit patterns are (1 = one ULP, for values of one sign).
  [[nodiscard]] std::int64_t ulps() const noexcept {
    const auto d = static_cast<std::int64_t>(std::bit_cast<std::uint32_t>(in_pass)) -
                   static_cast<std::int64_t>(std::bit_cast<std::uint32_t>(alone));
    return d < 0 ? -d : d;
  }
};

namespace detail {

// One pass of `tokens` at `positions` after `cache_length` committed slots, with `mask` (empty =
// causal). Fills every row's logits and hidden states in `logits`/`hidden` ([copies][rows][...]):
// one copy, or for a batch model with a companion request two, the companion's rows second.
// Returns the number of copies.
template <class Model>
int invariance_pass(Model& model, const row_invariance_options& o, std::span<const std::int32_t> tokens,
                    std::span<const std::int32_t> positions, int cache_length, tree_mask_view mask,
                    std::vector<float>& logits, std::vector<float>& hidden) {
  const auto rows = tokens.size();
  const auto vocab = static_cast<std::size_t>(model.vocab_size());
  const auto width = static_cast<std::size_t>(model.hidden_size());
  if constexpr (batch_decoder_model<Model>) {
    const bool two = o.companion_request >= 0;
    const int copies = two ? 2 : 1;
    std::vector<std::int32_t> all_tokens, all_positions;
    for (int c = 0; c < copies; ++c) {
      all_tokens.insert(all_tokens.end(), tokens.begin(), tokens.end());
      all_positions.insert(all_positions.end(), positions.begin(), positions.end());
    }
    const auto n = static_cast<int>(rows);
    const int requests[2] = {o.request, o.companion_request};
    const int indptr[3] = {0, n, 2 * n};
    const int lengths[2] = {cache_length, cache_length};
    const tree_mask_view masks[2] = {mask, mask};
    const auto count = static_cast<std::size_t>(copies);
    logits.assign(count * rows * vocab, 0.0f);
    hidden.assign(count * rows * width, 0.0f);
    ragged_batch b;
    b.requests = std::span<const int>(requests, count);
    b.qo_indptr = std::span<const int>(indptr, count + 1);
    b.tokens = all_tokens;
    b.positions = all_positions;
    b.cache_lengths = std::span<const int>(lengths, count);
    if (!mask.empty()) b.request_masks = std::span<const tree_mask_view>(masks, count);
    b.logits = logits;
    b.hidden = hidden;
    model.forward(b);
    return copies;
  } else {
    logits.assign(rows * vocab, 0.0f);
    hidden.assign(rows * width, 0.0f);
    forward_batch b;
    b.tokens = tokens;
    b.positions = positions;
    b.cache_length = cache_length;
    b.tree_mask = mask;
    b.logits = logits;
    b.hidden = hidden;
    model.forward(b);
    return 1;
  }
}

}  // namespace detail

//! Runs `tokens` through `model` one token a pass, then in passes of other sizes and shapes (see
//! the file comment), and reports the first row whose logits or hidden state differ in any bit.
//! @throws invalid_input if `tokens` has fewer than 2 tokens, a pass size is below 1, or the
//!         tokens do not fit the model's context.
template <class Model>
  requires decoder_model<Model> || batch_decoder_model<Model>
row_invariance_report check_row_invariance(Model& model, std::span<const std::int32_t> tokens,
                                           const row_invariance_options& options = {}) {
  const auto n = static_cast<int>(tokens.size());
  if (n < 2) throw invalid_input("check_row_invariance: give at least 2 tokens, got " + std::to_string(n));
  for (int s : options.pass_sizes)
    if (s < 1) throw invalid_input("check_row_invariance: a pass size must be at least 1, got " + std::to_string(s));
  int context = 0;
  if constexpr (batch_decoder_model<Model>) context = detail::request_context(model, options.request);
  else if constexpr (context_bounded_model<Model>) context = static_cast<int>(model.max_context());
  else context = kv_capacity(model.kv_cache());
  // A tree pass writes its decoys past the chain: up to 4 slots past the last token.
  const int need = n + (options.tree_passes ? 4 : 0);
  if (need > context)
    throw invalid_input("check_row_invariance: " + std::to_string(n) + " tokens need " + std::to_string(need) +
                        " slots, more than the context of " + std::to_string(context));
  const auto vocab = static_cast<std::size_t>(model.vocab_size());
  const auto width = static_cast<std::size_t>(model.hidden_size());
  const auto rows = static_cast<std::size_t>(n);
  std::vector<std::int32_t> positions(rows);
  for (int i = 0; i < n; ++i) positions[static_cast<std::size_t>(i)] = i;

  // The reference: one token a pass, as plain decoding runs them.
  std::vector<float> ref_logits(rows * vocab), ref_hidden(rows * width), logits, hidden;
  for (int i = 0; i < n; ++i) {
    const auto r = static_cast<std::size_t>(i);
    detail::invariance_pass(model, options, tokens.subspan(r, 1), std::span<const std::int32_t>(positions).subspan(r, 1), i,
                            {}, logits, hidden);
    std::copy_n(logits.begin(), vocab, ref_logits.begin() + static_cast<std::ptrdiff_t>(r * vocab));
    std::copy_n(hidden.begin(), width, ref_hidden.begin() + static_cast<std::ptrdiff_t>(r * width));
  }

  row_invariance_report report;
  // Compares the rows `out_rows[k]` of each copy the last pass made (`copies`, of `pass_rows`
  // rows) against the reference rows `rows_at[k]`.
  auto compare = [&](const std::string& pass, int copies, std::size_t pass_rows, std::span<const int> rows_at,
                     std::span<const int> out_rows) {
    for (int copy = 0; copy < copies; ++copy)
      for (std::size_t k = 0; k < rows_at.size() && report.invariant; ++k) {
        const auto want = static_cast<std::size_t>(rows_at[k]);
        const auto got = static_cast<std::size_t>(copy) * pass_rows + static_cast<std::size_t>(out_rows[k]);
        ++report.rows_checked;
        for (int part = 0; part < 2 && report.invariant; ++part) {
          const std::size_t w = part == 0 ? vocab : width;
          const float* a = (part == 0 ? ref_logits : ref_hidden).data() + want * w;
          const float* c = (part == 0 ? logits : hidden).data() + got * w;
          for (std::size_t j = 0; j < w; ++j) {
            if (std::bit_cast<std::uint32_t>(a[j]) == std::bit_cast<std::uint32_t>(c[j])) continue;
            report = {false, report.rows_checked, copy == 0 ? pass : pass + ", beside another request",
                      rows_at[k], part == 1, static_cast<int>(j), a[j], c[j]};
            break;
          }
        }
      }
  };

  for (int size : options.pass_sizes) {
    const std::string pass = "causal, " + std::to_string(size) + " tokens a pass";
    for (int first = 0; first < n && report.invariant; first += size) {
      const int count = std::min(size, n - first);
      const auto f = static_cast<std::size_t>(first), c = static_cast<std::size_t>(count);
      const int copies = detail::invariance_pass(model, options, tokens.subspan(f, c),
                                                 std::span<const std::int32_t>(positions).subspan(f, c), first, {}, logits, hidden);
      std::vector<int> at(c), out(c);
      for (int k = 0; k < count; ++k) at[static_cast<std::size_t>(k)] = first + k, out[static_cast<std::size_t>(k)] = k;
      compare(pass, copies, c, at, out);
    }
    if (!report.invariant) return report;
  }

  if (options.tree_passes) {
    // A chain of the next tokens with a decoy sibling beside each: nodes [root, a1, d1, a2, d2, ...]
    // in the tree's node order (depth, then rank); the decoys are masked out of the chain's rows.
    const int depth = std::min(n - 1, 4);
    std::vector<std::vector<int>> paths;
    std::vector<int> chain;
    for (int d = 0; d < depth; ++d) {
      std::vector<int> decoy = chain;
      decoy.push_back(1);
      chain.push_back(0);
      paths.push_back(chain);
      paths.push_back(decoy);
    }
    const tree t = tree::from_paths(paths);
    const std::string pass = "a tree pass with a masked-out sibling beside each token";
    for (int root = 0; root + depth < n && report.invariant; root += depth) {
      const auto nodes = static_cast<std::size_t>(t.num_nodes());
      std::vector<std::int32_t> node_tokens(nodes), node_positions(nodes);
      std::vector<int> at, out;
      for (int u = 0; u < t.num_nodes(); ++u) {
        const int d = t.node_depth(u);
        const bool on_chain = u == 0 || t.rank(u) == 0;  // the root has no rank
        node_tokens[static_cast<std::size_t>(u)] =
            on_chain ? tokens[static_cast<std::size_t>(root + d)] : tokens[static_cast<std::size_t>((root + d + 1) % n)];
        node_positions[static_cast<std::size_t>(u)] = root + d;
        if (on_chain) at.push_back(root + d), out.push_back(u);
      }
      const int copies = detail::invariance_pass(model, options, node_tokens, node_positions, root, t.mask_view(), logits, hidden);
      compare(pass, copies, nodes, at, out);
      // The pass left decoys in slots the next pass reads: write the chain there again.
      const auto next = static_cast<std::size_t>(root + 1), len = static_cast<std::size_t>(depth);
      detail::invariance_pass(model, options, tokens.subspan(next, len), std::span<const std::int32_t>(positions).subspan(next, len),
                              root + 1, {}, logits, hidden);
    }
  }
  return report;
}

MEDUSA_NAMESPACE_END
