// SPDX-License-Identifier: Apache-2.0
//! @file draft_sampler.hpp
//! Classic speculative sampling with a draft model: each step, a draft model with the target's
//! vocabulary *samples* a chain of `max_tokens` tokens from its own warped distribution, and
//! `speculative_policy` verifies each token x against the distribution q it was drawn from:
//! accepted with probability min(1, p(x)/q(x)), else the next token is drawn from
//! norm(max(p − q, 0)). The emitted tokens follow the target's warped distribution exactly
//! (docs/acceptance.md), and a draft whose q is close to the target's p gets most chains accepted,
//! which greedy chains verified by rejection (a point mass as q) do not at T > 0.
//!
//! `draft_model_sampler` is a per-step drafter (`step_drafts`, drafts.hpp) that also gives each
//! node's row q (`node_distribution_drafts`); the decoders pass those rows to the verification.
//! It keeps the draft's cache in step as `draft_model_branch` does. `feature_draft_sampler` does
//! the same with a feature drafter's chains (feature_draft.hpp), fed the target's features.
//!
//! @code
//! medusa::draft_model_sampler<DraftEngine> drafts(draft_engine, target.vocab_size(),
//!                                                  {.max_tokens = 4, .warp = {.temperature = 0.7f}});
//! medusa::decoder dec(target, heads, drafts, medusa::speculative_policy{{.temperature = 0.7f}});
//! @endcode
#pragma once

#include <medusa/config.hpp>
#include <medusa/acceptance/policies.hpp>
#include <medusa/acceptance/sampling.hpp>
#include <medusa/detail/philox.hpp>
#include <medusa/draft_model.hpp>
#include <medusa/drafts.hpp>
#include <medusa/feature_draft.hpp>
#include <medusa/error.hpp>
#include <medusa/tree.hpp>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

MEDUSA_NAMESPACE_BEGIN

//! What a `draft_model_sampler` drafts, and from what.
struct draft_sampler_options {
  int max_tokens = 4;   //!< tokens drafted after each root (≥ 1): the chain's length
  sampling_warp warp;   //!< applied to the draft's logits (the target's warp is the usual choice)
};

//! A per-step drafter that samples the chain of a branch source with `find_with(request,
//! history, out, choose)` (`draft_model_branch`, `feature_draft_branch`) and gives each node's
//! draft distribution (see the file comment). A branch that reads the target's features
//! (`observe`) gets them through the sampler. Copies share the branch's state and counts; each
//! keeps its own rows, so read `draft_probs` from the copy that drafted (the decoder's own, which
//! it holds by value). `draft_model_sampler` and `feature_draft_sampler` name the two kinds.
template <class Branch>
class chain_sampler {
 public:
  //! Samples `branch`'s chains of `opt.max_tokens` (the branch's own length is not used). Throws
  //! `invalid_input` for `max_tokens < 1` and `acceptance_error` (`bad_parameter`) for a bad warp.
  chain_sampler(Branch branch, int target_vocab, draft_sampler_options opt) : branch_(std::move(branch)), opt_(opt) {
    if (opt_.max_tokens < 1)
      throw invalid_input("draft sampler: max_tokens must be >= 1, got " + std::to_string(opt_.max_tokens));
    opt_.warp.validate();
    const auto v = static_cast<std::size_t>(target_vocab);
    r_.resize(v);
    ids_.resize(v);
    keys_.resize(v);
    for (int k = 1; k <= opt_.max_tokens; ++k) {
      std::vector<std::vector<int>> paths;
      for (int d = 1; d <= k; ++d) paths.emplace_back(static_cast<std::size_t>(d), 0);
      chains_.push_back(tree::from_paths(paths));
    }
  }

  //! Nodes of the largest tree: the root and the chain.
  [[nodiscard]] int max_nodes() const noexcept { return opt_.max_tokens + 1; }
  //! Depth of the largest tree.
  [[nodiscard]] int max_depth() const noexcept { return opt_.max_tokens; }
  //! No heads are read.
  [[nodiscard]] int heads_depth() const noexcept { return 0; }

  //! Whether the branch reads the target's features (`feature_observing`).
  [[nodiscard]] bool observes_features() const {
    if constexpr (requires(const Branch& b) {
                    { b.observes_features() } -> std::convertible_to<bool>;
                  })
      return branch_.observes_features();
    else return false;
  }
  //! The target's features, for a branch that reads them.
  void observe(int request, int position, std::span<const float> rows) {
    if constexpr (requires(Branch& b) { b.observe(request, position, rows); }) branch_.observe(request, position, rows);
  }

  //! This step's chain for `request`: `node_tokens[0]` = the root (`history.back()`), then the
  //! drafts sampled with Philox(`seed`, `step`) draws from 2^63 up (the decoders pass the request's
  //! seed and the step of the verification, whose draws count from 0); their rows q go to
  //! `draft_probs(request)`. Nothing (a plain step) where the draft's context has no room. Throws
  //! what the branch's `find` throws, and `acceptance_error` for a non-finite draft logit.
  std::optional<tree> draft(int request, std::span<const std::int32_t> history, std::span<const float> /*head_logits*/,
                            int vocab, std::span<std::int32_t> node_tokens, std::uint64_t seed, std::uint64_t step) {
    const auto v = static_cast<std::size_t>(vocab);
    if (v != r_.size())
      throw invalid_input("draft sampler: vocabulary " + std::to_string(vocab) + ", the draft's is " + std::to_string(r_.size()));
    if (node_tokens.size() < static_cast<std::size_t>(max_nodes()))
      throw acceptance_error(acceptance_errc::size_mismatch, "draft sampler: node_tokens too short");
    std::vector<float>& rows = probs_[request];
    rows.assign(static_cast<std::size_t>(max_nodes()) * v, 0.0f);
    auto sample = [&](std::span<const float> logits, int i) {
      detail::check_logit_row(logits, -1, "drafter");
      const double mass = detail::warp_into(logits, opt_.warp, r_.data(), ids_.data(), keys_.data());
      float* q = rows.data() + static_cast<std::size_t>(i + 1) * v;
      for (std::size_t t = 0; t < v; ++t) q[t] = static_cast<float>(r_[t] / mass);
      const double u = detail::philox_uniform(seed, step, detail::draft_draw_offset + static_cast<std::uint64_t>(i));
      return detail::draw_from(r_.data(), v, mass, u);
    };
    const int count = branch_.find_with(request, history, node_tokens.subspan(1, static_cast<std::size_t>(opt_.max_tokens)), sample);
    if (count < 1) return std::nullopt;
    node_tokens[0] = history.back();
    return chains_[static_cast<std::size_t>(count - 1)];
  }

  //! `[max_nodes][vocab]` draft distributions of `request`'s last chain: row u is the
  //! distribution node u's token was drawn from (row 0 unused). Empty before its first draft.
  [[nodiscard]] std::span<const float> draft_probs(int request) const {
    const auto it = probs_.find(request);
    return it == probs_.end() ? std::span<const float>{} : std::span<const float>(it->second);
  }

  //! The request left: its draft cache and rows are dropped.
  void release(int request) {
    branch_.release(request);
    probs_.erase(request);
  }

  //! The draft's work so far (the branch's counts).
  [[nodiscard]] std::int64_t tokens_run() const noexcept { return branch_.tokens_run(); }
  //! Forward passes of the draft so far.
  [[nodiscard]] std::int64_t passes() const noexcept { return branch_.passes(); }
  //! Wall-clock seconds of the draft's passes so far.
  [[nodiscard]] double seconds() const noexcept { return branch_.seconds(); }

 private:
  Branch branch_;
  draft_sampler_options opt_;
  std::vector<tree> chains_;                    // chains_[k − 1]: the chain of k drafts
  std::map<int, std::vector<float>> probs_;     // per request: its last chain's rows
  std::vector<double> r_;                       // the warped row, unnormalised
  std::vector<std::int32_t> ids_;
  std::vector<std::uint64_t> keys_;
};

//! Speculative sampling with a draft model's chains (`draft_model_branch`).
template <draft_model Draft>
class draft_model_sampler : public chain_sampler<draft_model_branch<Draft>> {
 public:
  //! `draft` must outlive the sampler and serve it alone. Throws `invalid_input` when the draft's
  //! vocabulary size differs from `target_vocab` (naming both) or `max_tokens < 1`, and
  //! `acceptance_error` (`bad_parameter`) for a bad warp.
  draft_model_sampler(Draft& draft, int target_vocab, draft_sampler_options opt)
      : chain_sampler<draft_model_branch<Draft>>(draft_model_branch<Draft>(draft, target_vocab, {.max_tokens = opt.max_tokens}),
                                                 target_vocab, opt) {}
};

//! Speculative sampling with a feature drafter's chains (`feature_draft_branch`, feature_draft.hpp).
template <feature_draft_model Model>
class feature_draft_sampler : public chain_sampler<feature_draft_branch<Model>> {
 public:
  //! `model` must outlive the sampler and serve it alone. Throws `invalid_input` when its
  //! vocabulary or width differs from the target's (naming both) or `max_tokens < 1`, and
  //! `acceptance_error` (`bad_parameter`) for a bad warp.
  feature_draft_sampler(Model& model, int target_vocab, int target_hidden, draft_sampler_options opt)
      : chain_sampler<feature_draft_branch<Model>>(
            feature_draft_branch<Model>(model, target_vocab, target_hidden, {.max_tokens = opt.max_tokens}), target_vocab, opt) {}
};

MEDUSA_NAMESPACE_END
