// SPDX-License-Identifier: Apache-2.0
//! @file drafts.hpp
//! Per-step drafts (docs/decoder.md, "Dynamic and hybrid drafts"): instead of one tree for every
//! step, each step's tree is built from what the step knows.
//! - *Dynamic*: the paths with the highest probability under this step's head distributions
//!   (the product of each head's softmax at the path's ranks), best first, up to a budget.
//! - *Hybrid*: a prompt-lookup branch joins the heads' tree when the request's own tokens end with
//!   an n-gram seen earlier: the tokens that followed it are drafted as a chain under the root
//!   (merged into the heads' nodes where they propose the same tokens). Lookup nodes carry the
//!   reserved rank `topk` (the tree is compiled with `topk + 1`), and may go deeper than the heads.
//!
//! Verification is unchanged, so every draft is lossless: drafts only decide which tokens the
//! model checks.
//!
//! @code
//! medusa::ngram_lookup lookup{.min_ngram = 2, .max_ngram = 4, .max_tokens = 8};
//! std::int32_t cont[8];
//! int m = lookup.find(history, cont);           // 0 = no match
//! auto paths = medusa::with_lookup_branch(heads_paths, top_tokens, 10, std::span(cont, m));
//! @endcode
#pragma once

#include <medusa/config.hpp>
#include <medusa/error.hpp>
#include <medusa/tree/search.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

MEDUSA_NAMESPACE_BEGIN

//! Prompt lookup: the continuation of the most recent earlier occurrence of the longest suffix
//! (`max_ngram` down to `min_ngram` tokens) of a request's tokens.
struct ngram_lookup {
  int min_ngram = 2;   //!< shortest suffix matched (≥ 1)
  int max_ngram = 4;   //!< longest suffix tried first
  int max_tokens = 8;  //!< longest continuation drafted (≥ 1)

  //! Throws `invalid_input` unless 1 ≤ min_ngram ≤ max_ngram and max_tokens ≥ 1.
  void validate() const {
    if (min_ngram < 1 || max_ngram < min_ngram || max_tokens < 1)
      throw invalid_input("lookup: need 1 <= min_ngram <= max_ngram and max_tokens >= 1, got " + std::to_string(min_ngram) +
                          ", " + std::to_string(max_ngram) + ", " + std::to_string(max_tokens));
  }

  //! Writes the continuation (up to `min(max_tokens, out.size())` tokens) and returns its length;
  //! 0 when no suffix of `history` occurred earlier with a token after it.
  int find(std::span<const std::int32_t> history, std::span<std::int32_t> out) const {
    const auto n = static_cast<std::ptrdiff_t>(history.size());
    const auto cap = static_cast<std::ptrdiff_t>(std::min<std::size_t>(static_cast<std::size_t>(max_tokens), out.size()));
    if (cap == 0) return 0;
    for (std::ptrdiff_t m = std::min<std::ptrdiff_t>(max_ngram, n - 1); m >= min_ngram; --m) {
      const auto suffix = history.subspan(static_cast<std::size_t>(n - m));
      // Most recent first: the nearest context is the best predictor of a loop.
      for (std::ptrdiff_t i = n - m - 1; i >= 0; --i) {
        if (!std::equal(suffix.begin(), suffix.end(), history.begin() + i)) continue;
        const std::ptrdiff_t count = std::min(cap, n - (i + m));
        std::copy_n(history.begin() + i + m, count, out.begin());
        return static_cast<int>(count);
      }
    }
    return 0;
  }
};

//! This step's dynamic tree: the `count` most probable paths (best first, none deeper than
//! `max_depth` or the heads given) when head k's rank-r token has probability `top_probs[k *
//! topk + r]` and the heads are taken as independent. `top_probs` holds `heads × topk` values
//! (each head's top-k softmax probabilities, descending).
[[nodiscard]] inline std::vector<std::vector<int>> dynamic_paths(std::span<const float> top_probs, int topk, int count,
                                                                 int max_depth) {
  if (topk < 1 || top_probs.size() % static_cast<std::size_t>(topk) != 0)
    throw invalid_input("dynamic tree: " + std::to_string(top_probs.size()) + " probabilities are not whole rows of topk " +
                        std::to_string(topk));
  const int heads = static_cast<int>(top_probs.size() / static_cast<std::size_t>(topk));
  auto prob = [&](std::span<const int> path) {
    double p = 1.0;
    for (std::size_t k = 0; k < path.size(); ++k) p *= top_probs[k * static_cast<std::size_t>(topk) + static_cast<std::size_t>(path[k])];
    return p;
  };
  return detail::ranked_by(prob, topk, count, std::min(max_depth <= 0 ? heads : max_depth, heads));
}

//! `paths` (ranks < topk address the heads' candidates: `top_tokens[(depth − 1) * topk + rank]`)
//! plus a lookup branch for `continuation` (token at depth d = continuation[d − 1]): from the
//! root, the branch follows existing nodes whose token is the continuation's, then adds nodes of
//! rank `topk` for the rest. Returns the new path list (compile it with topk + 1 ranks).
[[nodiscard]] inline std::vector<std::vector<int>> with_lookup_branch(const std::vector<std::vector<int>>& paths,
                                                                      std::span<const std::int32_t> top_tokens, int topk,
                                                                      std::span<const std::int32_t> continuation) {
  std::vector<std::vector<int>> out = paths;
  std::vector<int> at;  // the branch's current node
  bool own = false;     // past the shared part: every further node is a lookup node
  for (std::size_t d = 0; d < continuation.size(); ++d) {
    int next = -1;
    if (!own) {
      for (const auto& p : paths) {
        if (p.size() != d + 1 || !std::equal(at.begin(), at.end(), p.begin())) continue;
        const std::size_t slot = d * static_cast<std::size_t>(topk) + static_cast<std::size_t>(p.back());
        if (slot < top_tokens.size() && top_tokens[slot] == continuation[d]) {
          next = p.back();
          break;
        }
      }
    }
    if (next < 0) {
      own = true;
      next = topk;
    }
    at.push_back(next);
    if (own) out.push_back(at);
  }
  return out;
}

MEDUSA_NAMESPACE_END
