// SPDX-License-Identifier: Apache-2.0
//! @file decoder.hpp
//! The decoding loop: prefill, then Medusa steps (heads → candidates → one tree forward →
//! acceptance → KV commit) over an engine's model, plus plain decoding through the same model so
//! that vanilla and Medusa runs share one code path and one binary.
//!
//! An engine implements `decoder_model` (decoder/model.hpp): a forward pass that appends K/V at
//! given slots and honours a mask (causal, or a packed tree mask), and a `kv_cache()` view the
//! library commits accepted paths in, or, for a cache the host cannot write, a `commit(L, N, path)`
//! of its own and `max_context()`. Heads are anything with `num_heads()` and
//! `forward(hidden, logits)` (`head_stack_runner` adapts a `head_stack` and a GEMM policy).
//! Serving engines drive several requests at once with `batch_decoder` (decoder/batch.hpp), on
//! which both loops here are built: a request decoded alone is a batch of one.
//!
//! @code
//! medusa::tree tree = medusa::tree::preset("mc_sim_7b_63");
//! medusa::decoder dec(model, heads, tree, medusa::greedy_policy{});
//! medusa::decode_options opt;
//! opt.max_new_tokens = 128;
//! opt.eos_token = 2;
//! auto out = dec.generate(prompt, opt, [](std::int32_t tok) { print(tok); return true; });
//! // out.tokens == medusa::generate_vanilla(model, prompt, opt, ...).tokens with greedy_policy
//! @endcode
//!
//! Step semantics: the root of a step is the previous step's bonus token (or the token
//! chosen from the prefill logits); a step commits `root + A` accepted drafts, then continues
//! from the accepted node's logits and hidden state with no extra forward pass. Near the end of
//! the context, where a whole tree no longer fits, the loop falls back to single-token steps, so
//! the output stays identical to plain decoding up to the last slot.
#pragma once

#include <medusa/config.hpp>
#include <medusa/acceptance.hpp>
#include <medusa/decoder/batch.hpp>
#include <medusa/decoder/model.hpp>
#include <medusa/decoder/options.hpp>
#include <medusa/tree.hpp>

#include <cstdint>
#include <memory>
#include <span>
#include <utility>

MEDUSA_NAMESPACE_BEGIN

namespace detail {

// A single-request model seen as a batch model of one request (id 0): the hooks pass through, and
// so does the cache: `kv_cache` when the model has one, `commit` when it commits itself.
template <decoder_model Model>
class single_request_model {
  // A commit member without max_context() would be passed over for kv_cache(): say so instead.
  static_assert(!has_single_kv_commit<Model> || context_bounded_model<Model>,
                "a model with commit(L, N, path) commits its own cache and must report max_context()");

 public:
  explicit single_request_model(Model& m) : m_(m) {}
  [[nodiscard]] int vocab_size() { return static_cast<int>(m_.vocab_size()); }
  [[nodiscard]] int hidden_size() { return static_cast<int>(m_.hidden_size()); }
  decltype(auto) kv_cache(int)
    requires writable_kv_cache_model<Model>
  {
    return m_.kv_cache();
  }
  int commit(int, int committed_length, int num_tree_nodes, std::span<const int> path)
    requires kv_committing_single_model<Model>
  {
    return static_cast<int>(m_.commit(committed_length, num_tree_nodes, path));
  }
  void forward(const ragged_batch& b) {
    const int T = static_cast<int>(b.tokens.size());
    forward_batch f;
    f.tokens = b.tokens;
    f.positions = b.positions;
    f.cache_length = b.cache_lengths[0];
    f.tree_mask = T > 1 ? b.mask_of(0) : tree_mask_view{};  // one token: causal and tree agree
    f.first_output_row = b.last_row_only ? T - 1 : 0;
    f.logits = b.logits;
    f.hidden = b.hidden;
    m_.forward(f);
  }
  decltype(auto) reserve(int request, int slots)  // the slots granted, when the model says
    requires kv_reserving_model<Model>
  {
    return m_.reserve(request, slots);
  }
  void release(int request, int length)
    requires kv_releasing_model<Model>
  {
    m_.release(request, length);
  }
  [[nodiscard]] int max_context() const
    requires context_bounded_model<Model>
  {
    return static_cast<int>(m_.max_context());
  }

 private:
  Model& m_;
};

// One request through a batch of one: join, step until it ends, rethrow its error if it failed.
template <class Batch, class OnToken>
decode_result run_alone(Batch& batch, std::span<const std::int32_t> prompt, const decode_options& opt,
                        OnToken& on_token) {
  typename Batch::token_callback cb;
  if constexpr (!std::is_same_v<std::remove_cvref_t<OnToken>, no_callback>)
    cb = [&on_token](std::int32_t t) { return call_on_token(on_token, t); };
  batch.join(0, prompt, opt, std::move(cb));
  try {
    for (;;)
      for (request_update& u : batch.step())
        if (u.finished) {
          if (u.error) std::rethrow_exception(u.error);
          return std::move(u.result);
        }
  } catch (...) {
    if (batch.contains(0)) batch.leave(0);
    throw;
  }
}

}  // namespace detail

// ------------------------------------------------------------------------------------------------
// Plain decoding
// ------------------------------------------------------------------------------------------------

//! Plain autoregressive decoding through the same model: one forward pass per token. With
//! `greedy_policy` (or `typical_policy`) tokens are argmaxes; with `rejection_policy` /
//! `speculative_policy` they are drawn from the same warped target distribution Medusa preserves.
//! `on_token(token)` is called for each generated token; returning `false` stops.
//! @throws decode_error on an empty or over-long prompt, token ids outside the vocabulary, or bad
//!         options; acceptance_error on non-finite logits; whatever the model throws.
template <decoder_model Model, acceptance_policy Policy, class OnToken = detail::no_callback>
decode_result generate_vanilla(Model& model, std::span<const std::int32_t> prompt, const Policy& policy,
                               const decode_options& opt = {}, OnToken&& on_token = {}) {
  detail::single_request_model<Model> one(model);
  no_heads heads;
  batch_decoder batch(one, heads, plain_tree{}, policy, 1);
  return detail::run_alone(batch, prompt, opt, on_token);
}

// ------------------------------------------------------------------------------------------------
// Medusa decoding
// ------------------------------------------------------------------------------------------------

//! Medusa decoding of one request over an engine's model, draft heads, a tree and an acceptance
//! policy: a `batch_decoder` of one request. Construction sizes every buffer once; `generate`
//! allocates nothing per step beyond the output token vector.
//!
//! @tparam Model  satisfies `decoder_model`
//! @tparam Heads  satisfies `draft_heads` (at least `tree.depth()` heads); heads and drafters
//!                that take request ids (`request_draft_heads`, `request_step_drafts`) get 0
//! @tparam Tree   satisfies `tree_like` (e.g. `medusa::tree`, a compile-time preset), or
//!                `step_drafts` (`step_drafter`: each tree step builds its own tree, drafts.hpp)
//! @tparam Policy satisfies `acceptance_policy` (greedy, typical, rejection, user policies)
template <decoder_model Model, draft_heads Heads, class Tree, acceptance_policy Policy>
  requires tree_like<Tree> || step_drafts<Tree>
class decoder {
  using model_adapter = detail::single_request_model<Model>;

 public:
  //! @throws decode_error if the heads are fewer than the tree's depth.
  decoder(Model& model, Heads& heads, const Tree& tree, Policy policy = {})
      : one_(std::make_unique<model_adapter>(model)), batch_(*one_, heads, tree, std::move(policy), 1) {}

  //! Generates up to `opt.max_new_tokens` tokens after `prompt` (which must not be empty: start
  //! from BOS). Resets the model's context: the prompt is prefilled from slot 0.
  //! @throws decode_error / acceptance_error / kv_cache_error on bad input; whatever the model throws.
  template <class OnToken = detail::no_callback>
  decode_result generate(std::span<const std::int32_t> prompt, const decode_options& opt = {},
                         OnToken&& on_token = {}) {
    return detail::run_alone(batch_, prompt, opt, on_token);
  }

  //! The tree in use.
  [[nodiscard]] const Tree& tree() const noexcept { return batch_.tree(); }
  //! The policy in use.
  [[nodiscard]] const Policy& policy() const noexcept { return batch_.policy(); }

 private:
  std::unique_ptr<model_adapter> one_;  // a stable address for batch_'s reference across moves
  batch_decoder<model_adapter, Heads, Tree, Policy> batch_;
};

MEDUSA_NAMESPACE_END
