// SPDX-License-Identifier: Apache-2.0
//! @file decoder.hpp
//! The decoding loop: prefill, then Medusa steps (heads → candidates → one tree forward →
//! acceptance → KV commit) over an engine's model, plus plain decoding through the same model so
//! that vanilla and Medusa runs share one code path and one binary.
//!
//! An engine implements `decoder_model`: a batched forward that appends K/V at given slots and
//! honours a mask (causal, or a packed tree mask), and a `kv_cache()` view the library commits
//! accepted paths in. Heads are anything with `num_heads()` and `forward(hidden, logits)`
//! (`head_stack_runner` adapts a `head_stack` and a GEMM policy).
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
#include <medusa/candidates.hpp>
#include <medusa/error.hpp>
#include <medusa/kv_cache.hpp>
#include <medusa/tree.hpp>

#include <algorithm>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

MEDUSA_NAMESPACE_BEGIN

// ------------------------------------------------------------------------------------------------
// What the decoder asks of an engine
// ------------------------------------------------------------------------------------------------

//! One forward call: `T = tokens.size()` new tokens whose K/V the model appends at cache slots
//! `[cache_length, cache_length + T)`.
struct forward_batch {
  std::span<const std::int32_t> tokens;     //!< `[T]` token ids
  std::span<const std::int32_t> positions;  //!< `[T]` absolute positions (RoPE): `L + depth` in a tree step
  int cache_length = 0;                     //!< `L`: committed slots `[0, L)` are visible to every token
  //! Visibility among the new tokens: empty = causal (token i sees new tokens 0..i); otherwise the
  //! tree's packed mask (`T` rows; token i sees token j iff `tree_mask.visible(i, j)`), e.g.
  //! `medusa::tree::mask_view()`.
  tree_mask_view tree_mask = {};
  int first_output_row = 0;                 //!< logits/hidden are wanted for rows `[first_output_row, T)`
  std::span<float> logits;                  //!< `[T - first_output_row][vocab]`
  std::span<float> hidden;                  //!< `[T - first_output_row][hidden]`: final-normed states (lm_head input)
};

//! An engine's model as the decoder drives it.
//!
//! - `forward(batch)` runs `batch.tokens` at `batch.positions`, writes their K/V at slots
//!   `[L, L+T)` of `kv_cache()`, and fills logits and hidden states of the requested rows.
//! - `kv_cache()` returns a writable `kv_cache_view` over all layers, or a range of writable views
//!   (one per layer, `kv_layer_views`); the decoder commits accepted paths in it (any layout whose
//!   mapping satisfies `kv_layout_mapping`); its capacity bounds the context.
//! - `vocab_size()`, `hidden_size()`.
template <class M>
concept decoder_model = requires(M& m, const forward_batch& batch) {
  { m.vocab_size() } -> std::convertible_to<int>;
  { m.hidden_size() } -> std::convertible_to<int>;
  m.forward(batch);
  { m.kv_cache() } -> writable_kv_cache;
};

//! Draft heads as the decoder drives them: `forward(hidden [d], logits [num_heads][vocab])`.
template <class H>
concept draft_heads = requires(H& h, std::span<const float> hidden, std::span<float> logits) {
  { h.num_heads() } -> std::convertible_to<int>;
  h.forward(hidden, logits);
};

//! Adapts a `head_stack` (heads.hpp) and a GEMM policy to `draft_heads`: one hidden state in,
//! `[H][V]` logits out. Owns the stack's forward workspace, sized once.
template <class Stack, class Gemm>
class head_stack_runner {
 public:
  //! Neither `stack` nor `gemm` is owned; both must outlive the runner.
  head_stack_runner(const Stack& stack, Gemm& gemm)
      : stack_(&stack), gemm_(&gemm), workspace_(stack.workspace_size(1)) {}
  //! The same from pointers (neither may be null).
  head_stack_runner(const Stack* stack, Gemm* gemm) : head_stack_runner(*stack, *gemm) {}

  //! Number of heads of the stack.
  [[nodiscard]] int num_heads() const { return static_cast<int>(stack_->num_heads()); }
  //! Head logits of one hidden state.
  void forward(std::span<const float> hidden, std::span<float> logits) {
    stack_->forward(*gemm_, hidden, 1, logits, workspace_);
  }

 private:
  const Stack* stack_;
  Gemm* gemm_;
  std::vector<float> workspace_;
};

// ------------------------------------------------------------------------------------------------
// Options, statistics, results
// ------------------------------------------------------------------------------------------------

//! Limits and sampling settings of one `generate` call.
struct decode_options {
  int max_new_tokens = 256;     //!< stop after this many generated tokens (≥ 0)
  std::int32_t eos_token = -1;  //!< stop when this token is generated (not emitted); -1 = never
  int prefill_chunk = 512;      //!< prompt tokens per prefill forward (bounds activation memory); ≥ 1
  std::uint64_t seed = 0;       //!< Philox key of the sampling policies
};

//! Why a `generate` call ended.
enum class stop_reason : std::uint8_t {
  max_tokens,    //!< `max_new_tokens` reached
  eos,           //!< the EOS token was generated
  callback,      //!< the token callback returned false (e.g. a stop string matched)
  context_full,  //!< the KV cache has no slot left
};

//! Name of a stop reason ("max_tokens", "eos", "callback", "context_full").
constexpr std::string_view to_string(stop_reason r) noexcept {
  switch (r) {
    case stop_reason::max_tokens: return "max_tokens";
    case stop_reason::eos: return "eos";
    case stop_reason::callback: return "callback";
    case stop_reason::context_full: return "context_full";
  }
  return "?";
}

//! Where the time of a `generate` call went (seconds, wall clock).
struct phase_times {
  double prefill = 0;     //!< prompt forward passes
  double heads = 0;       //!< draft heads on the accepted hidden state
  double candidates = 0;  //!< top-k per head and gather into tree tokens
  double forward = 0;     //!< model forward passes after the prefill (tree or single-token)
  double accept = 0;      //!< acceptance policy
  double commit = 0;      //!< KV commit of the accepted path
  double total = 0;       //!< the whole call
};

//! Counters of a `generate` call.
struct decode_stats {
  int prompt_tokens = 0;  //!< tokens prefilled
  int new_tokens = 0;     //!< tokens emitted
  int steps = 0;          //!< forward passes after the prefill (tree steps + single-token steps)
  int tree_steps = 0;     //!< steps that ran the whole tree
  //! `accepted_histogram[a]`: tree steps that accepted `a` drafts (size depth + 1).
  std::vector<int> accepted_histogram;
  //! `accepted_at_depth[d-1]`: tree steps whose accepted path reached depth `d` (size depth).
  std::vector<int> accepted_at_depth;
  phase_times seconds;  //!< time split by phase

  //! Tokens emitted per forward pass after the prefill (1 for plain decoding).
  [[nodiscard]] double mean_accepted() const noexcept {
    return steps > 0 ? static_cast<double>(new_tokens) / steps : 0.0;
  }
  //! Generated tokens per second over the whole call.
  [[nodiscard]] double tokens_per_second() const noexcept {
    return seconds.total > 0 ? new_tokens / seconds.total : 0.0;
  }
};

//! Output of a `generate` call.
struct decode_result {
  std::vector<std::int32_t> tokens;  //!< generated tokens (prompt excluded, EOS excluded)
  stop_reason reason = stop_reason::max_tokens;
  decode_stats stats;
};

//! Invalid arguments of a decoding call (over-long prompt, bad token ids, size mismatches).
class decode_error : public invalid_input {
 public:
  using invalid_input::invalid_input;
};

namespace detail {

using decode_clock = std::chrono::steady_clock;

inline double seconds_since(decode_clock::time_point t0) {
  return std::chrono::duration<double>(decode_clock::now() - t0).count();
}

// Token callbacks may return bool (false = stop) or nothing (never stops).
template <class F>
bool call_on_token(F& f, std::int32_t token) {
  if constexpr (std::is_void_v<std::invoke_result_t<F&, std::int32_t>>) {
    f(token);
    return true;
  } else {
    return static_cast<bool>(f(token));
  }
}

struct no_callback {
  void operator()(std::int32_t) const noexcept {}
};

// Root choice from a logit row: argmax for the deterministic policies, a warped draw for the
// sampling ones (a lossless sampler must take its first root from the target distribution too).
template <class Policy>
std::int32_t choose_token(const Policy& policy, std::span<const float> z, std::uint64_t seed,
                          std::uint64_t step, acceptance_workspace& ws) {
  if constexpr (std::is_base_of_v<sampling_warp, Policy>)
    return sample_token(z, static_cast<const sampling_warp&>(policy), seed, step, ws);
  else {
    detail::check_logit_row(z, -1, "logit row");
    return argmax(z);
  }
}

// State shared by vanilla and Medusa loops: emission with the stop rules, prefill, single steps.
template <decoder_model Model>
class decode_session {
 public:
  decode_session(Model& model, const decode_options& opt) : model_(model), opt_(opt) {
    vocab_ = static_cast<int>(model.vocab_size());
    hidden_ = static_cast<int>(model.hidden_size());
    if (vocab_ <= 0 || hidden_ <= 0)
      throw decode_error("model reports vocab " + std::to_string(vocab_) + " and hidden size " +
                         std::to_string(hidden_));
    if (opt.max_new_tokens < 0)
      throw decode_error("max_new_tokens must be >= 0, got " + std::to_string(opt.max_new_tokens));
    if (opt.prefill_chunk < 1)
      throw decode_error("prefill_chunk must be >= 1, got " + std::to_string(opt.prefill_chunk));
    z_.resize(static_cast<std::size_t>(vocab_));
    h_.resize(static_cast<std::size_t>(hidden_));
  }

  [[nodiscard]] int capacity() const { return kv_capacity(model_.kv_cache()); }
  [[nodiscard]] int length() const noexcept { return length_; }
  [[nodiscard]] int vocab() const noexcept { return vocab_; }
  [[nodiscard]] std::span<const float> logits() const noexcept { return z_; }
  [[nodiscard]] std::span<const float> hidden() const noexcept { return h_; }
  std::span<float> logits_buffer() noexcept { return z_; }
  std::span<float> hidden_buffer() noexcept { return h_; }
  decode_result& result() noexcept { return result_; }
  [[nodiscard]] bool done() const noexcept { return done_; }
  void stop(stop_reason r) noexcept {
    done_ = true;
    result_.reason = r;
  }

  // Runs the prompt through the model in chunks; leaves the last position's logits and hidden
  // state in logits()/hidden(). An empty prompt is an error: there is no state to continue from.
  void prefill(std::span<const std::int32_t> prompt) {
    const auto t0 = decode_clock::now();
    if (prompt.empty()) throw decode_error("the prompt is empty: give at least one token (e.g. BOS)");
    if (prompt.size() > static_cast<std::size_t>(capacity()))
      throw decode_error("prompt of " + std::to_string(prompt.size()) + " tokens does not fit the context of " +
                         std::to_string(capacity()) + " tokens");
    const int n = static_cast<int>(prompt.size());
    for (std::size_t i = 0; i < prompt.size(); ++i)
      if (prompt[i] < 0 || prompt[i] >= vocab_)
        throw decode_error("prompt token #" + std::to_string(i) + " = " + std::to_string(prompt[i]) +
                           " is outside the vocabulary [0, " + std::to_string(vocab_) + ")");
    std::vector<std::int32_t> positions(static_cast<std::size_t>(std::min(n, opt_.prefill_chunk)));
    for (int begin = 0; begin < n; begin += opt_.prefill_chunk) {
      const int count = std::min(opt_.prefill_chunk, n - begin);
      for (int i = 0; i < count; ++i) positions[static_cast<std::size_t>(i)] = begin + i;
      forward_batch b;
      b.tokens = prompt.subspan(static_cast<std::size_t>(begin), static_cast<std::size_t>(count));
      b.positions = std::span<const std::int32_t>(positions.data(), static_cast<std::size_t>(count));
      b.cache_length = begin;
      b.first_output_row = count - 1;
      b.logits = z_;
      b.hidden = h_;
      model_.forward(b);
    }
    length_ = n;
    result_.stats.prompt_tokens = n;
    result_.stats.seconds.prefill += seconds_since(t0);
  }

  // Emits one generated token under the stop rules; returns false once generation is over.
  template <class OnToken>
  bool emit(std::int32_t token, OnToken& on_token) {
    if (done_) return false;
    if (token == opt_.eos_token) {
      stop(stop_reason::eos);
      return false;
    }
    result_.tokens.push_back(token);
    ++result_.stats.new_tokens;
    if (!call_on_token(on_token, token)) {
      stop(stop_reason::callback);
      return false;
    }
    if (result_.stats.new_tokens >= opt_.max_new_tokens) {
      stop(stop_reason::max_tokens);
      return false;
    }
    return true;
  }

  // Plain step: runs `token` at slot length() and leaves its logits/hidden state. The caller has
  // emitted `token` already.
  void single_step(std::int32_t token) {
    const auto t0 = decode_clock::now();
    const std::int32_t pos = length_;
    forward_batch b;
    b.tokens = std::span<const std::int32_t>(&token, 1);
    b.positions = std::span<const std::int32_t>(&pos, 1);
    b.cache_length = length_;
    b.logits = z_;
    b.hidden = h_;
    model_.forward(b);
    ++length_;
    ++result_.stats.steps;
    result_.stats.seconds.forward += seconds_since(t0);
  }

  void set_length(int l) noexcept { length_ = l; }
  Model& model() noexcept { return model_; }
  const decode_options& options() const noexcept { return opt_; }

 private:
  Model& model_;
  decode_options opt_;
  int vocab_ = 0;
  int hidden_ = 0;
  int length_ = 0;
  bool done_ = false;
  std::vector<float> z_, h_;
  decode_result result_;
};

// The common ending of both loops: a pending token (known, not yet emitted) is emitted, then
// advanced with one plain forward pass if generation continues and a slot is left.
template <decoder_model Model, class Policy, class OnToken>
void plain_step(decode_session<Model>& s, const Policy& policy, std::int32_t& pending,
                std::uint64_t& step, acceptance_workspace& ws, OnToken& on_token) {
  if (!s.emit(pending, on_token)) return;
  if (s.length() >= s.capacity()) {
    s.stop(stop_reason::context_full);
    return;
  }
  s.single_step(pending);
  const auto t0 = decode_clock::now();
  pending = choose_token(policy, s.logits(), s.options().seed, ++step, ws);
  s.result().stats.seconds.accept += seconds_since(t0);
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
//!         options; whatever the model throws.
template <decoder_model Model, acceptance_policy Policy, class OnToken = detail::no_callback>
decode_result generate_vanilla(Model& model, std::span<const std::int32_t> prompt, const Policy& policy,
                               const decode_options& opt = {}, OnToken&& on_token = {}) {
  const auto t0 = detail::decode_clock::now();
  detail::decode_session<Model> s(model, opt);
  acceptance_workspace ws(1, s.vocab());
  if (opt.max_new_tokens == 0) return std::move(s.result());
  s.prefill(prompt);
  std::uint64_t step = 0;
  std::int32_t pending = detail::choose_token(policy, s.logits(), opt.seed, step, ws);
  while (!s.done()) detail::plain_step(s, policy, pending, step, ws, on_token);
  s.result().stats.seconds.total = detail::seconds_since(t0);
  return std::move(s.result());
}

// ------------------------------------------------------------------------------------------------
// Medusa decoding
// ------------------------------------------------------------------------------------------------

//! Medusa decoding of one request over an engine's model, draft heads, a tree and an acceptance
//! policy. Construction sizes every buffer once; `generate` allocates nothing per step beyond
//! the output token vector.
//!
//! @tparam Model  satisfies `decoder_model`
//! @tparam Heads  satisfies `draft_heads` (at least `tree.depth()` heads)
//! @tparam Tree   satisfies `tree_like` (e.g. `medusa::tree`, a compile-time preset)
//! @tparam Policy satisfies `acceptance_policy` (greedy, typical, rejection, user policies)
template <decoder_model Model, draft_heads Heads, tree_like Tree, acceptance_policy Policy>
class decoder {
 public:
  //! @throws decode_error if the heads are fewer than the tree's depth or the tree does not fit
  //!         the KV cache at all.
  decoder(Model& model, Heads& heads, const Tree& tree, Policy policy = {})
      : model_(model), heads_(heads), tree_(tree), policy_(std::move(policy)) {
    const int n = tree_.num_nodes();
    const int depth = tree_.depth();
    num_heads_ = static_cast<int>(heads_.num_heads());
    vocab_ = static_cast<int>(model_.vocab_size());
    hidden_ = static_cast<int>(model_.hidden_size());
    if (num_heads_ < depth)
      throw decode_error("the tree is " + std::to_string(depth) + " deep but only " + std::to_string(num_heads_) +
                         " draft heads are loaded");
    if (vocab_ <= 0 || hidden_ <= 0)
      throw decode_error("model reports vocab " + std::to_string(vocab_) + " and hidden size " +
                         std::to_string(hidden_));
    const auto v = static_cast<std::size_t>(vocab_);
    head_logits_.resize(static_cast<std::size_t>(num_heads_) * v);
    flat_.resize(flat_candidates_size(tree_, num_heads_));
    node_tokens_.resize(static_cast<std::size_t>(n));
    positions_.resize(static_cast<std::size_t>(n));
    tree_logits_.resize(static_cast<std::size_t>(n) * v);
    tree_hidden_.resize(static_cast<std::size_t>(n) * static_cast<std::size_t>(hidden_));
    if constexpr (!has_mask_view) {
      mask_.resize(static_cast<std::size_t>(n) * static_cast<std::size_t>(tree_.words_per_row()));
      copy_packed_mask(tree_, std::span<std::uint32_t>(mask_));
    }
    ws_.reserve(n, vocab_);
  }

  //! Generates up to `opt.max_new_tokens` tokens after `prompt` (which must not be empty: start
  //! from BOS). Resets the model's context: the prompt is prefilled from slot 0.
  //! @throws decode_error / acceptance_error / kv_cache_error on bad input; whatever the model throws.
  template <class OnToken = detail::no_callback>
  decode_result generate(std::span<const std::int32_t> prompt, const decode_options& opt = {},
                         OnToken&& on_token = {}) {
    using detail::decode_clock;
    using detail::seconds_since;
    const auto t_start = decode_clock::now();
    detail::decode_session<Model> s(model_, opt);
    auto& stats = s.result().stats;
    const int depth = tree_.depth();
    stats.accepted_histogram.assign(static_cast<std::size_t>(depth + 1), 0);
    stats.accepted_at_depth.assign(static_cast<std::size_t>(depth), 0);
    if (opt.max_new_tokens == 0) return std::move(s.result());
    s.prefill(prompt);

    const int n = tree_.num_nodes();
    const auto d = static_cast<std::size_t>(hidden_);
    std::uint64_t step = 0;
    std::int32_t pending = detail::choose_token(policy_, s.logits(), opt.seed, step, ws_);
    // h: the hidden state the heads read (prefill's last position, then the accepted node's).
    std::span<const float> h = s.hidden();
    while (!s.done()) {
      // Near the end of the context (or with nothing left to draft for), take plain steps: the
      // output is identical, only slower.
      const int remaining = opt.max_new_tokens - stats.new_tokens;
      if (s.length() + n > s.capacity() || remaining <= 1 || pending == opt.eos_token) {
        detail::plain_step(s, policy_, pending, step, ws_, on_token);
        h = s.hidden();
        continue;
      }
      const int L = s.length();
      auto t0 = decode_clock::now();
      heads_.forward(h, head_logits_);
      stats.seconds.heads += seconds_since(t0);

      t0 = decode_clock::now();
      generate_candidates(tree_, pending, head_logits_, vocab_, flat_, node_tokens_);
      write_node_positions(tree_, L, positions_.data());
      stats.seconds.candidates += seconds_since(t0);

      t0 = decode_clock::now();
      kv_check_append(model_.kv_cache(), L, n);
      forward_batch b;
      b.tokens = node_tokens_;
      b.positions = positions_;
      b.cache_length = L;
      b.tree_mask = mask_view();
      b.logits = tree_logits_;
      b.hidden = tree_hidden_;
      model_.forward(b);
      stats.seconds.forward += seconds_since(t0);

      t0 = decode_clock::now();
      verify_request req;
      req.node_tokens = node_tokens_;
      req.logits = tree_logits_;
      req.vocab = vocab_;
      req.seed = opt.seed;
      req.step = ++step;
      req.eos_token = opt.eos_token;
      const verify_result res = verify(tree_, req, policy_, ws_);
      stats.seconds.accept += seconds_since(t0);

      t0 = decode_clock::now();
      s.set_length(kv_commit(model_.kv_cache(), L, tree_, res.nodes()));
      stats.seconds.commit += seconds_since(t0);

      ++stats.steps;
      ++stats.tree_steps;
      ++stats.accepted_histogram[static_cast<std::size_t>(res.accept_length)];
      for (int a = 1; a <= res.accept_length; ++a) ++stats.accepted_at_depth[static_cast<std::size_t>(a - 1)];
      for (std::int32_t tok : res.tokens())
        if (!s.emit(tok, on_token)) break;
      if (s.done()) break;
      // An accepted EOS draft ends the request in emit(); otherwise continue from the bonus.
      pending = res.bonus;
      h = std::span<const float>(tree_hidden_.data() + static_cast<std::size_t>(res.next_node) * d, d);
    }
    stats.seconds.total = seconds_since(t_start);
    return std::move(s.result());
  }

  //! The tree in use.
  [[nodiscard]] const Tree& tree() const noexcept { return tree_; }
  //! The policy in use.
  [[nodiscard]] const Policy& policy() const noexcept { return policy_; }

 private:
  static constexpr bool has_mask_view = requires(const Tree& t) {
    { t.mask_view() } -> std::convertible_to<tree_mask_view>;
  };
  [[nodiscard]] tree_mask_view mask_view() const noexcept {
    if constexpr (has_mask_view) return tree_.mask_view();
    else return {mask_, tree_.words_per_row()};
  }

  Model& model_;
  Heads& heads_;
  Tree tree_;
  Policy policy_;
  int num_heads_ = 0, vocab_ = 0, hidden_ = 0;
  std::vector<float> head_logits_, tree_logits_, tree_hidden_;
  std::vector<std::int32_t> flat_, node_tokens_, positions_;
  std::vector<std::uint32_t> mask_;  // the packed mask of a tree without mask_view()
  acceptance_workspace ws_;
};

MEDUSA_NAMESPACE_END
