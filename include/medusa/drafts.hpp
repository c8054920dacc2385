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
//! The branch comes from a `branch_source`: `ngram_lookup` by default (`step_drafter`), or any
//! type proposing a continuation of a request's tokens (`basic_step_drafter<Source>`), e.g. a
//! draft model keeping per-request state: it gets the request id of every call, and
//! `release(request)` when the request leaves the batch.
//!
//! `step_drafter` puts them together for the decoders: pass one where a tree goes
//! (`medusa::decoder dec(model, heads, drafter, policy)`), and every tree step gets its own tree.
//!
//! @code
//! medusa::step_drafter drafter({.paths = plan.paths,                      // the heads' tree, or
//!                               .dynamic_nodes = 0,                       // > 0: this step's best paths
//!                               .lookup = medusa::ngram_lookup{.max_tokens = 8}}, /*heads=*/4);
//! medusa::decoder dec(engine, heads, drafter, medusa::greedy_policy{});
//! @endcode
#pragma once

#include <medusa/config.hpp>
#include <medusa/acceptance_error.hpp>
#include <medusa/candidates.hpp>
#include <medusa/detail/row_math.hpp>
#include <medusa/error.hpp>
#include <medusa/tree.hpp>
#include <medusa/tree/search.hpp>

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

MEDUSA_NAMESPACE_BEGIN

//! Prompt lookup: the continuation of the most recent earlier occurrence of the longest suffix
//! (`max_ngram` down to `min_ngram` tokens) of a request's tokens. The default `branch_source` of
//! `step_drafter`; it keeps no state, so the request id does not matter to it.
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
  //! The same for request `request` (a stateless lookup ignores it).
  int find(int /*request*/, std::span<const std::int32_t> history, std::span<std::int32_t> out) const {
    return find(history, out);
  }
};

//! A source of the branch `step_drafter` adds under the root (`ngram_lookup`, or a user type):
//! - `max_tokens`, a data member or a member function: the longest continuation it proposes;
//! - `find(request, history, out)` or `find(history, out)`: writes a continuation of `history` (the
//!   request's prompt and generated tokens, ending with this step's root) to `out` (up to
//!   `min(max_tokens, out.size())` tokens, the first one following the root) and returns its
//!   length, 0 for none. `request` is the engine's id of the request (0 in the single-request
//!   `decoder`); a source keeping per-request state reads it, and may have `release(request)`,
//!   called when the request leaves the batch (through `step_drafter::release`).
//! - optionally `validate() const`, called by `step_drafter`'s constructor (throw `invalid_input`).
//! Drafts stay lossless whatever it proposes: verification decides which tokens are kept.
template <class S>
concept branch_source =
    std::copy_constructible<S> &&
    (requires(const S& s) {
      { s.max_tokens() } -> std::convertible_to<int>;
    } || requires(const S& s) {
      { s.max_tokens } -> std::convertible_to<int>;
    }) &&
    (requires(S& s, int request, std::span<const std::int32_t> history, std::span<std::int32_t> out) {
      { s.find(request, history, out) } -> std::convertible_to<int>;
    } || requires(S& s, std::span<const std::int32_t> history, std::span<std::int32_t> out) {
      { s.find(history, out) } -> std::convertible_to<int>;
    });

namespace detail {
template <branch_source S>
int branch_max_tokens(const S& s) {
  if constexpr (requires { { s.max_tokens() } -> std::convertible_to<int>; }) return static_cast<int>(s.max_tokens());
  else return static_cast<int>(s.max_tokens);
}
template <branch_source S>
int branch_find(S& s, int request, std::span<const std::int32_t> history, std::span<std::int32_t> out) {
  if constexpr (requires { { s.find(request, history, out) } -> std::convertible_to<int>; })
    return static_cast<int>(s.find(request, history, out));
  else return static_cast<int>(s.find(history, out));
}
}  // namespace detail

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

//! What a `basic_step_drafter` drafts each step; `step_drafter_options` for `ngram_lookup`.
template <branch_source Branch = ngram_lookup>
struct basic_step_drafter_options {
  std::vector<std::vector<int>> paths = {};  //!< the heads' tree (ranks < topk) when `dynamic_nodes == 0`
  int dynamic_nodes = 0;                //!< > 0: this step's `dynamic_nodes − 1` most probable paths instead
  std::optional<Branch> lookup = {};    //!< a branch under the root when the source proposes one
  int topk = default_topk;              //!< candidates per head
};
//! The options of `step_drafter` (prompt lookup, `ngram_lookup`).
using step_drafter_options = basic_step_drafter_options<ngram_lookup>;

//! Builds each tree step's tree and node tokens (see the file comment), its branch from a
//! `branch_source` (`step_drafter`: prompt lookup, `ngram_lookup`). A `step_drafts` source: the
//! decoders call `draft(request, ...)` once per tree step of a request. Not thread-safe (scratch
//! buffers). `batch_decoder` keeps its own copy of the drafter (and so of the branch source).
//!
//! @code
//! struct my_source {                       // e.g. a per-request draft model
//!   int max_tokens = 4;
//!   int find(int request, std::span<const std::int32_t> history, std::span<std::int32_t> out);
//!   void release(int request);             // optional: the request left
//! };
//! medusa::basic_step_drafter<my_source> drafter({.paths = plan.paths, .lookup = my_source{}}, 4);
//! @endcode
template <branch_source Branch = ngram_lookup>
class basic_step_drafter {
 public:
  //! The branch source.
  using branch_type = Branch;
  //! The options.
  using options_type = basic_step_drafter_options<Branch>;

  //! `heads`: draft heads available (the heads' tree must not be deeper). Throws `invalid_input`
  //! (or `tree_error` for bad paths) naming the problem.
  basic_step_drafter(options_type opt, int heads) : opt_(std::move(opt)), heads_(heads) {
    if (heads_ < 1) throw invalid_input("step drafter: needs at least one head, got " + std::to_string(heads_));
    if (opt_.topk < 1 || opt_.topk > max_tree_topk - 1)
      throw invalid_input("step drafter: topk must be in [1, " + std::to_string(max_tree_topk - 1) + "), got " +
                          std::to_string(opt_.topk));
    if (opt_.dynamic_nodes < 0) throw invalid_input("step drafter: dynamic_nodes must be >= 0");
    if constexpr (requires(const Branch& b) { b.validate(); })
      if (opt_.lookup) opt_.lookup->validate();
    if (opt_.lookup && detail::branch_max_tokens(*opt_.lookup) < 1)
      throw invalid_input("step drafter: the branch source's max_tokens must be >= 1, got " +
                          std::to_string(detail::branch_max_tokens(*opt_.lookup)));
    if (opt_.dynamic_nodes == 0) {
      if (opt_.paths.empty() && !opt_.lookup)
        throw invalid_input("step drafter: give paths, dynamic_nodes or a lookup");
      if (!opt_.paths.empty()) {
        // Set field by field: nvcc's front end rejects designated initializers in a class template.
        tree_options topt;
        topt.topk = opt_.topk;
        topt.max_depth = heads_;
        const tree t = tree::from_paths(opt_.paths, topt);
        heads_depth_ = t.depth();
        heads_nodes_ = t.num_nodes();
        paths_ = t.sorted_paths();
      } else {
        heads_nodes_ = 1;
      }
    } else {
      heads_nodes_ = opt_.dynamic_nodes;
      heads_depth_ = std::min(heads_, std::max(0, opt_.dynamic_nodes - 1));
    }
    const int lookup_len = opt_.lookup ? detail::branch_max_tokens(*opt_.lookup) : 0;
    max_nodes_ = heads_nodes_ + lookup_len;
    max_depth_ = std::max(heads_depth_, lookup_len);
    const auto k = static_cast<std::size_t>(opt_.topk), h = static_cast<std::size_t>(heads_depth_);
    top_tokens_.resize(h * k);
    top_probs_.resize(opt_.dynamic_nodes > 0 ? h * k : 0);
    continuation_.resize(static_cast<std::size_t>(lookup_len));
  }

  //! Most nodes a step's tree can have (root included): sizes the decoder's buffers.
  [[nodiscard]] int max_nodes() const noexcept { return max_nodes_; }
  //! Deepest path a step's tree can have (lookup branches may go deeper than the heads).
  [[nodiscard]] int max_depth() const noexcept { return max_depth_; }
  //! Heads read: the depth of the heads' part of the tree.
  [[nodiscard]] int heads_depth() const noexcept { return heads_depth_; }
  //! The options.
  [[nodiscard]] const options_type& options() const noexcept { return opt_; }

  //! This step's tree and node tokens for request 0 (one request alone): `draft(0, ...)`.
  std::optional<tree> draft(std::span<const std::int32_t> history, std::span<const float> head_logits, int vocab,
                            std::span<std::int32_t> node_tokens) {
    return draft(0, history, head_logits, vocab, node_tokens);
  }

  //! This step's tree and node tokens (`node_tokens`, at least `max_nodes()` entries; the first
  //! `num_nodes()` of the tree are written) for request `request` (the engine's id; the branch
  //! source gets it). `history` = the request's tokens so far, ending with the root;
  //! `head_logits` = `[heads][vocab]` (at least `heads_depth()` rows).
  //! Returns nothing when there is nothing to draft (a lookup alone without a match): a plain step.
  //! Throws `acceptance_error` for non-finite head logits or a vocabulary smaller than topk.
  std::optional<tree> draft(int request, std::span<const std::int32_t> history, std::span<const float> head_logits,
                            int vocab, std::span<std::int32_t> node_tokens) {
    const auto v = static_cast<std::size_t>(vocab), k = static_cast<std::size_t>(opt_.topk);
    if (heads_depth_ > 0 && (vocab < opt_.topk || head_logits.size() < static_cast<std::size_t>(heads_depth_) * v))
      throw acceptance_error(acceptance_errc::size_mismatch,
                             "step drafter: need " + std::to_string(heads_depth_) + " head rows of a vocab >= topk " +
                                 std::to_string(opt_.topk) + ", got " + std::to_string(head_logits.size()) +
                                 " logits for vocab " + std::to_string(vocab));
    for (int d = 0; d < heads_depth_; ++d) {
      const auto row = head_logits.subspan(static_cast<std::size_t>(d) * v, v);
      detail::check_logit_row(row, d, "head");
      detail::top_k_ids(row.data(), v, opt_.topk, top_tokens_.data() + static_cast<std::size_t>(d) * k);
      if (opt_.dynamic_nodes > 0) {  // softmax probabilities of the top-k: exp(z − max) / Σ exp(z − max)
        scratch_.resize(v);
        const float m = detail::row_max(row.data(), v).max;
        const double sum = detail::softmax_fill(row.data(), v, m, 1.0f, scratch_.data());
        for (std::size_t r = 0; r < k; ++r)
          top_probs_[static_cast<std::size_t>(d) * k + r] =
              static_cast<float>(scratch_[static_cast<std::size_t>(top_tokens_[static_cast<std::size_t>(d) * k + r])] / sum);
      }
    }
    std::vector<std::vector<int>> paths =
        opt_.dynamic_nodes > 0 ? dynamic_paths(top_probs_, opt_.topk, opt_.dynamic_nodes - 1, heads_depth_) : paths_;
    int found = 0;
    if (opt_.lookup) {
      found = std::clamp(detail::branch_find(*opt_.lookup, request, history, continuation_), 0,
                         static_cast<int>(continuation_.size()));
      if (found > 0)
        paths = with_lookup_branch(paths, top_tokens_, opt_.topk, std::span<const std::int32_t>(continuation_.data(), static_cast<std::size_t>(found)));
    }
    if (paths.empty()) return std::nullopt;  // lookup alone and no match: a plain step
    tree_options topt;  // field by field: see the constructor
    topt.topk = opt_.topk + 1;
    topt.max_depth = std::max(max_depth_, 1);
    tree out = tree::from_paths(paths, topt);
    if (node_tokens.size() < static_cast<std::size_t>(out.num_nodes()))
      throw acceptance_error(acceptance_errc::size_mismatch, "step drafter: node_tokens too short");
    node_tokens[0] = history.empty() ? 0 : history.back();
    for (int u = 1; u < out.num_nodes(); ++u) {
      const auto& p = out.sorted_paths()[static_cast<std::size_t>(u) - 1];
      const std::size_t d = p.size() - 1;
      const int r = p.back();
      node_tokens[static_cast<std::size_t>(u)] =
          r == opt_.topk ? continuation_[d] : top_tokens_[d * k + static_cast<std::size_t>(r)];
    }
    return out;
  }

  //! Whether the decoders should pass the target's features (`feature_observing`): the branch
  //! source reads them (e.g. `feature_draft_branch`).
  [[nodiscard]] bool observes_features() const {
    if constexpr (requires(const Branch& b) {
                    { b.observes_features() } -> std::convertible_to<bool>;
                  })
      return opt_.lookup && opt_.lookup->observes_features();
    else return false;
  }
  //! The target's features of request `request`'s positions from `position` on (`rows`:
  //! `[count][hidden]`), for a branch source that reads them.
  void observe(int request, int position, std::span<const float> rows) {
    if constexpr (requires(Branch& b) { b.observe(request, position, rows); })
      if (opt_.lookup) opt_.lookup->observe(request, position, rows);
  }

  //! Request `request` left the batch: the branch source hears of it when it has
  //! `release(request)` (`batch_decoder` calls this).
  void release(int request) {
    if constexpr (requires(Branch& b) { b.release(request); })
      if (opt_.lookup) opt_.lookup->release(request);
  }

 private:
  options_type opt_;
  int heads_ = 0, heads_depth_ = 0, heads_nodes_ = 1, max_nodes_ = 1, max_depth_ = 0;
  std::vector<std::vector<int>> paths_;
  std::vector<std::int32_t> top_tokens_, continuation_;
  std::vector<float> top_probs_;
  std::vector<double> scratch_;
};

//! `step_drafter`: per-step drafts with prompt lookup (`ngram_lookup`) as the branch source.
using step_drafter = basic_step_drafter<ngram_lookup>;

//! A per-step drafter whose `draft` takes the request id first:
//! `draft(request, history, head_logits, vocab, node_tokens)`.
template <class D>
concept request_step_drafts = requires(D& d, int request, std::span<const std::int32_t> history,
                                       std::span<const float> logits, int vocab, std::span<std::int32_t> tokens) {
  { d.draft(request, history, logits, vocab, tokens) } -> std::same_as<std::optional<tree>>;
};

//! A per-step drafter that draws its tokens at random: the decoders call `draft(request, history,
//! head_logits, vocab, node_tokens, seed, step)` with the request's seed and the step number its
//! verification uses, so that its draws come from Philox(seed, step) in a counter range of their
//! own (`sample_candidates` does the same), independent of the verification's and different for
//! every seed.
template <class D>
concept seeded_step_drafts = requires(D& d, int request, std::span<const std::int32_t> history, std::span<const float> logits,
                                      int vocab, std::span<std::int32_t> tokens, std::uint64_t seed, std::uint64_t step) {
  { d.draft(request, history, logits, vocab, tokens, seed, step) } -> std::same_as<std::optional<tree>>;
};

//! One request's drafting in a batched drafter call (`batch_step_drafts`): the arguments of
//! `draft(request, history, head_logits, vocab, node_tokens, seed, step)`, and its result.
struct step_draft_call {
  int request = 0;                          //!< the engine's id of the request
  std::span<const std::int32_t> history;    //!< its tokens, ending with the step's root
  std::span<const float> head_logits;       //!< its rows of the heads' logits (may be empty)
  std::span<std::int32_t> node_tokens;      //!< receives its tree's tokens (`max_nodes()` entries)
  std::uint64_t seed = 0;                   //!< its Philox key (drafters that sample)
  std::uint64_t step = 0;                   //!< the step number its verification uses
  std::optional<tree> result;               //!< written by the drafter: the tree, or nothing (a plain step)
};

//! A per-step drafter that drafts every request of a step in one call, `draft_batch(calls,
//! vocab)`, e.g. running one ragged draft pass per depth for all of them (`tree_drafter` over a
//! `tree_draft_batch_source`). `batch_decoder` prefers it; each call's result must be what
//! `draft` gives for that request alone. A call that throws is retried request by request, so
//! that only the request at fault fails.
template <class D>
concept batch_step_drafts = requires(D& d, std::span<step_draft_call> calls, int vocab) { d.draft_batch(calls, vocab); };

//! A per-step tree source for the decoders (`step_drafter`, `basic_step_drafter`, or a user type
//! with the same members): `max_nodes()`, `max_depth()`, `heads_depth()` and `draft(history,
//! head_logits, vocab, node_tokens)`, or `draft(request, history, ...)` (`request_step_drafts`),
//! which the decoders prefer when both are there: `request` is the engine's id of the request the
//! step serves (0 in the single-request `decoder`). Optionally `release(request)`: the request left
//! the batch (finished, failed or `leave`), once per request that left; it should not throw.
template <class D>
concept step_drafts = requires(D& d) {
  { d.max_nodes() } -> std::convertible_to<int>;
  { d.max_depth() } -> std::convertible_to<int>;
  { d.heads_depth() } -> std::convertible_to<int>;
} && (request_step_drafts<D> || seeded_step_drafts<D> || requires(D& d, std::span<const std::int32_t> history, std::span<const float> logits,
                                         int vocab, std::span<std::int32_t> tokens) {
  { d.draft(history, logits, vocab, tokens) } -> std::same_as<std::optional<tree>>;
});

//! A per-step drafter that reads the target's features (its final-normed hidden states, the LM
//! head's input), e.g. over a `feature_draft_branch`: when `observes_features()` is true, the
//! decoders call `observe(request, position, rows)` with the features of every prompt position
//! after the prefill, then of every token a step commits (the root and the accepted drafts), in
//! order; `rows` = `[count][hidden]` for positions `[position, position + count)`.
template <class D>
concept feature_observing = requires(D& d, const D& cd, int request, int position, std::span<const float> rows) {
  { cd.observes_features() } -> std::convertible_to<bool>;
  d.observe(request, position, rows);
};

//! A per-step drafter whose tokens were drawn at random, that also gives the distribution each
//! node's token was drawn from, for `speculative_policy`: `draft_probs(request)` = `[nodes][vocab]`
//! of the request's last tree (row 0, the root's, unused). The decoders pass those rows to the
//! verification (`verify_request::draft_probs`); e.g. `draft_model_sampler`.
template <class D>
concept node_distribution_drafts = step_drafts<D> && seeded_step_drafts<D> && requires(const D& d, int request) {
  { d.draft_probs(request) } -> std::convertible_to<std::span<const float>>;
};

MEDUSA_NAMESPACE_END
