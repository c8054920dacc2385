// SPDX-License-Identifier: Apache-2.0
//! @file decoder/calibrate.hpp
//! Path-conditional calibration from real decoding (`path_counter`, tree/search.hpp): given a
//! request's tokens (prompt and the model's own continuation), one causal forward gives the hidden
//! state at every position, the heads run on each, and every position adds the ranks its heads
//! gave the tokens that followed. `optimize_tree` then picks trees for the text the user decodes.
//!
//! @code
//! medusa::path_counter counts(heads.num_heads(), 10);
//! for (const auto& seq : sequences) medusa::count_paths(engine, heads, seq, counts);
//! std::ofstream("calibration.json") << medusa::calibration_json(counts);
//! @endcode
#pragma once

#include <medusa/config.hpp>
#include <medusa/decoder.hpp>
#include <medusa/decoder/model.hpp>
#include <medusa/detail/row_math.hpp>
#include <medusa/error.hpp>
#include <medusa/tree/search.hpp>

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

MEDUSA_NAMESPACE_BEGIN

//! Rank of `token` in a logit row under the candidates' order (larger first, ties by ascending id).
[[nodiscard]] inline int token_rank(std::span<const float> z, std::int32_t token) {
  const float x = z[static_cast<std::size_t>(token)];
  int above = 0;
  for (std::size_t i = 0; i < z.size(); ++i)
    above += z[i] > x || (z[i] == x && static_cast<std::int32_t>(i) < token);
  return above;
}

//! Adds the positions `first`, `first + 1`, ... of `tokens` (a request's prompt and its greedy
//! continuation) to `counts`: a causal forward over all of them in request `request`'s cache
//! (overwritten; reserved and released when the model has those hooks), then the heads on each
//! counted position. Decoding runs the heads from the last prompt position on, so pass
//! `first = prompt length − 1` to count what decoding sees (the prompt's own tokens are the
//! user's, not the model's). Throws
//! `invalid_input` for fewer than 2 tokens, more than the cache holds, or more heads counted than
//! the heads give; whatever the model or heads throw.
template <batch_decoder_model Model, draft_heads Heads>
void count_paths(Model& model, Heads& heads, std::span<const std::int32_t> tokens, path_counter& counts, int first = 0,
                 int request = 0) {
  const int T = static_cast<int>(tokens.size());
  if (T < 2) throw invalid_input("count_paths: need at least 2 tokens, got " + std::to_string(T));
  if (counts.heads() > heads.num_heads())
    throw invalid_input("count_paths: counting " + std::to_string(counts.heads()) + " heads but the heads give " +
                        std::to_string(heads.num_heads()));
  const int capacity = detail::request_context(model, request);
  if (T > capacity) throw invalid_input("count_paths: " + std::to_string(T) + " tokens do not fit the context of " + std::to_string(capacity));
  if constexpr (kv_reserving_model<Model>) model.reserve(request, T);
  const auto V = static_cast<std::size_t>(model.vocab_size()), d = static_cast<std::size_t>(model.hidden_size());
  const auto n = static_cast<std::size_t>(T);
  std::vector<std::int32_t> positions(n);
  for (int i = 0; i < T; ++i) positions[static_cast<std::size_t>(i)] = i;
  std::vector<float> logits(n * V), hidden(n * d);
  detail::forward_request(model, request, tokens, positions, 0, false, logits, hidden);
  const int H = heads.num_heads();
  const auto HV = static_cast<std::size_t>(H) * V;
  constexpr int chunk = 32;  // positions per heads call (batched heads read their weights once)
  std::vector<float> head_logits(static_cast<std::size_t>(chunk) * HV);
  std::vector<int> ranks(static_cast<std::size_t>(counts.heads()));
  // Position t's heads predict tokens t+2+k; positions without a head-0 target are skipped.
  counts.next_sequence();
  for (int t0 = std::max(first, 0); t0 + 2 < T; t0 += chunk) {
    const int rows = std::min(chunk, T - 2 - t0);
    const auto* h = hidden.data() + static_cast<std::size_t>(t0) * d;
    if constexpr (batched_draft_heads<Heads>) {
      heads.forward(std::span<const float>(h, static_cast<std::size_t>(rows) * d), rows,
                    std::span<float>(head_logits.data(), static_cast<std::size_t>(rows) * HV));
    } else {
      for (int i = 0; i < rows; ++i)
        heads.forward(std::span<const float>(h + static_cast<std::size_t>(i) * d, d),
                      std::span<float>(head_logits.data() + static_cast<std::size_t>(i) * HV, HV));
    }
    for (int i = 0; i < rows; ++i) {
      const int t = t0 + i;
      for (int k = 0; k < counts.heads(); ++k) {
        const int target = t + 2 + k;
        const auto row = std::span<const float>(head_logits.data() + static_cast<std::size_t>(i) * HV + static_cast<std::size_t>(k) * V, V);
        ranks[static_cast<std::size_t>(k)] = target < T ? token_rank(row, tokens[static_cast<std::size_t>(target)]) : -1;
      }
      counts.add(ranks);
    }
  }
  if constexpr (kv_releasing_model<Model>) model.release(request, 0);
}

//! The same for a single-request model (`decoder_model`); its cache is overwritten.
template <decoder_model Model, draft_heads Heads>
  requires(!batch_decoder_model<Model>)
void count_paths(Model& model, Heads& heads, std::span<const std::int32_t> tokens, path_counter& counts, int first = 0) {
  detail::single_request_model<Model> one(model);
  count_paths(one, heads, tokens, counts, first, 0);
}

MEDUSA_NAMESPACE_END
