// SPDX-License-Identifier: Apache-2.0
//! @file decoder/batch.hpp
//! `batch_decoder`: Medusa steps for a batch of requests over one engine (continuous batching).
//! Requests join and leave between steps; each `step()` prefills the requests that joined, then
//! runs one step for every request in one ragged forward pass, and returns each request's new
//! tokens and, when it ended, why.
//!
//! @code
//! medusa::batch_decoder dec(model, heads, medusa::tree::preset("mc_sim_7b_63"), medusa::greedy_policy{},
//!                           /*max_batch=*/8);
//! dec.join(/*request=*/0, prompt_a, {.max_new_tokens = 256, .eos_token = 2});
//! dec.join(/*request=*/1, prompt_b, {.max_new_tokens = 64});
//! while (!dec.empty()) {
//!   for (const medusa::request_update& u : dec.step()) {
//!     stream(u.request, u.tokens);                 // the tokens this step generated
//!     if (u.finished) done(u.request, u.reason);   // u.result holds the whole output
//!   }
//!   // join new requests here
//! }
//! @endcode
//!
//! A request's tokens are exactly those it would get decoded alone (`decoder::generate`, and with
//! greedy acceptance plain greedy decoding): requests share the forward pass and the tree, never
//! state. Errors specific to one request (non-finite logits or hidden states from the model, a
//! `model_output_error` naming the request and the step; a cache that cannot take the step; a
//! throwing token callback; pages the engine cannot map; a model's own commit that throws or
//! reports a wrong length) end that request with `stop_reason::failed` and the exception in its
//! update; the others go on. A failed step commits nothing: `decode_result::cache_length` counts
//! the request's valid cache slots, so the engine may drop the request (free its slots) or resume
//! it by joining again with `prompt + tokens` and `decode_options::cached_prompt_tokens`. Errors of
//! the whole batch (the model's forward throws) propagate from `step()`.
#pragma once

#include <medusa/config.hpp>
#include <medusa/acceptance.hpp>
#include <medusa/candidates.hpp>
#include <medusa/drafts.hpp>
#include <medusa/decoder/model.hpp>
#include <medusa/decoder/options.hpp>
#include <medusa/kv_cache.hpp>
#include <medusa/tree.hpp>
#include <medusa/tree/prefix.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

MEDUSA_NAMESPACE_BEGIN

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

inline std::size_t to_size(int v) noexcept { return static_cast<std::size_t>(v); }

inline const char* describe_non_finite(float v) noexcept { return v != v ? "NaN" : v > 0 ? "+Inf" : "-Inf"; }

// A hidden state the heads will read (or the next step starts from) must be finite.
inline void check_hidden_row(int request, std::uint64_t step, std::span<const float> row, const std::string& where) {
  for (std::size_t j = 0; j < row.size(); ++j)
    if (!std::isfinite(row[j]))
      throw model_output_error(request, step, model_output::hidden,
                               where + ": element " + std::to_string(j) + " is " + describe_non_finite(row[j]));
}

// A logit row the next token is chosen from: no NaN or +Inf, not every token masked.
inline void check_logits_row(int request, std::uint64_t step, std::span<const float> row, const std::string& where) {
  const logit_row_scan scan = scan_logit_row(row.data(), row.size());
  if (scan.first_invalid >= 0)
    throw model_output_error(request, step, model_output::logits,
                             where + ": logit " + std::to_string(scan.first_invalid) + " is " +
                                 describe_non_finite(row[static_cast<std::size_t>(scan.first_invalid)]));
  if (!scan.any_allowed)
    throw model_output_error(request, step, model_output::logits, where + ": every logit is -Inf");
}

}  // namespace detail

//! The one-node tree of plain decoding: with it (and `no_heads`) every step of a `batch_decoder`
//! is a single-token step, so plain and Medusa decoding share one loop.
struct plain_tree {
  [[nodiscard]] static constexpr int num_nodes() noexcept { return 1; }
  [[nodiscard]] static constexpr int parent(int) noexcept { return -1; }
  [[nodiscard]] static constexpr int words_per_row() noexcept { return 1; }
  [[nodiscard]] static constexpr std::uint32_t packed_mask_word(int, int) noexcept { return 1u; }
  [[nodiscard]] static constexpr bool mask(int, int) noexcept { return true; }
  [[nodiscard]] static constexpr int depth() noexcept { return 0; }
  [[nodiscard]] static constexpr int topk() noexcept { return 1; }
  [[nodiscard]] static constexpr int num_leaves() noexcept { return 1; }
  [[nodiscard]] static constexpr int node_depth(int) noexcept { return 0; }
  [[nodiscard]] static constexpr int rank(int) noexcept { return 0; }
  [[nodiscard]] static constexpr int tree_index(int) noexcept { return 0; }
  [[nodiscard]] static constexpr int child_begin(int) noexcept { return 1; }
  [[nodiscard]] static constexpr int child_count(int) noexcept { return 0; }
  [[nodiscard]] static constexpr int depth_begin(int d) noexcept { return d == 0 ? 0 : 1; }
  [[nodiscard]] static constexpr int max_rank(int) noexcept { return 0; }
  [[nodiscard]] static constexpr int leaf(int) noexcept { return 0; }
  [[nodiscard]] static constexpr int retrieve(int, int) noexcept { return 0; }
  [[nodiscard]] tree_mask_view mask_view() const noexcept { return {std::span<const std::uint32_t>(&word_, 1), 1}; }

 private:
  static constexpr std::uint32_t word_ = 1u;
};

//! What one `step()` did for one request.
struct request_update {
  int request = -1;                      //!< the id given to `join`
  std::span<const std::int32_t> tokens;  //!< tokens generated this step (valid until the next step/join/leave)
  bool finished = false;                 //!< the request ended in this step and left the batch
  stop_reason reason = stop_reason::max_tokens;  //!< why it ended (when `finished`)
  std::exception_ptr error;              //!< the request's error (when `reason == stop_reason::failed`)
  decode_result result;                  //!< when `finished`: the request's whole output and statistics

  //! The error's message ("" without one).
  [[nodiscard]] std::string error_message() const {
    if (!error) return {};
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      return e.what();
    } catch (...) {
      return "unknown exception";
    }
  }
};

//! Medusa decoding of a batch of requests over an engine's model, draft heads, one tree shared by
//! the batch and an acceptance policy. Construction sizes every buffer for `max_batch` requests;
//! `step()` allocates nothing beyond the requests' output token vectors.
//!
//! A step, for each request in the batch:
//! - decoding far enough from its limits: heads on its hidden state → candidates → its tree rows
//!   in the shared ragged forward → acceptance (`verify_batch`) → `kv_commit` in its
//!   `kv_cache(request)`, or the model's own `commit` (`kv_committing_model`) → emit root + drafts;
//!   candidates are the heads' top-K, or, with a `depth_draft_policy` (`draft_sampling_policy`),
//!   drawn without replacement from the heads' warped softmax (`sample_candidates`, at the step
//!   of the verify call), whose draft rows go to that request's `verify_request`;
//! - otherwise (near the end of its context or of `max_new_tokens`, pending EOS, a one-node tree):
//!   a plain step, emitting the pending token and running it as one row of the same forward;
//! - with a KV pool that grants fewer slots than asked (`kv_granting_model`): the first nodes of
//!   the tree that fit, or a plain step; a request of which no slot fits fails with
//!   `kv_cache_error` (`kv_errc::pool_exhausted`).
//!
//! With a root-only tree (`tree::from_text("[]")`) and `no_heads` this is plain batched decoding.
//!
//! @tparam Model  satisfies `batch_decoder_model` (optionally the paging hooks of decoder/model.hpp);
//!                a `kv_committing_model` is committed through its `commit`, even when it also has
//!                `kv_cache(request)`: the decoder then checks appends and paths against
//!                `max_context()` and the length `commit` returns (`kv_cache_error`)
//! @tparam Heads  satisfies `draft_heads` (at least `tree.depth()` heads); `request_draft_heads`
//!                (told each row's request id, rows in slot order) is used when available, else
//!                `batched_draft_heads`; `release(request)` when present hears of each request
//!                that leaves (`request_releasing`)
//! @tparam Tree   satisfies `tree_like` (one tree for every step), or `step_drafts` (each tree
//!                step builds its own tree: `step_drafter`, drafts.hpp; `draft(request, ...)` gets
//!                the request id when it has that form, `release(request)` when present hears of
//!                each request that leaves)
//! @tparam Policy satisfies `acceptance_policy`
template <batch_decoder_model Model, draft_heads Heads, class Tree, acceptance_policy Policy>
  requires tree_like<Tree> || step_drafts<Tree>
class batch_decoder {
  // A commit member without max_context() would be passed over for kv_cache(): say so instead.
  static_assert(!detail::has_request_kv_commit<Model> || context_bounded_model<Model>,
                "a model with commit(request, L, N, path) commits its own cache and must report max_context()");

 public:
  //! Per-request token callback: return false to stop the request (`stop_reason::callback`).
  using token_callback = std::function<bool(std::int32_t)>;

  //! @throws decode_error if the heads are fewer than the tree's depth, `max_batch < 1`, or the
  //!         model reports a non-positive vocabulary or hidden size.
  batch_decoder(Model& model, Heads& heads, const Tree& tree, Policy policy = {}, int max_batch = 8)
      : model_(model), heads_(heads), tree_(tree), policy_(std::move(policy)), max_batch_(max_batch) {
    const int n = max_nodes();
    num_heads_ = static_cast<int>(heads_.num_heads());
    vocab_ = static_cast<int>(model_.vocab_size());
    hidden_ = static_cast<int>(model_.hidden_size());
    if (num_heads_ < heads_depth())
      throw decode_error("the tree is " + std::to_string(heads_depth()) + " deep but only " +
                         std::to_string(num_heads_) + " draft heads are loaded");
    if (vocab_ <= 0 || hidden_ <= 0)
      throw decode_error("model reports vocab " + std::to_string(vocab_) + " and hidden size " +
                         std::to_string(hidden_));
    if (max_batch_ < 1) throw decode_error("max_batch must be >= 1, got " + std::to_string(max_batch_));
    using detail::to_size;
    const std::size_t B = to_size(max_batch_), V = to_size(vocab_), d = to_size(hidden_), N = to_size(n);
    slots_.resize(B);
    for (slot& s : slots_) s.h.resize(d);
    head_in_.resize(B * d);
    head_ids_.resize(B);
    head_logits_.resize(B * to_size(num_heads_) * V);
    if constexpr (!per_step) flat_.resize(flat_candidates_size(tree_, num_heads_));
    masks_.resize(B);
    tokens_.resize(B * N);
    positions_.resize(B * N);
    ids_.resize(B);
    qo_indptr_.resize(B + 1);
    cache_lengths_.resize(B);
    members_.resize(B);
    verify_rows_.resize(B);
    logits_.resize(B * N * V);
    hidden_out_.resize(B * N * d);
    requests_.resize(B);
    results_.resize(B);
    if constexpr (samples_drafts) draft_rows_.resize(B * to_size(tree_.depth()) * V);
    step_tokens_.reserve(B * (to_size(max_depth()) + 1));
    updates_.reserve(B);
    if constexpr (!per_step && !has_mask_view) {
      mask_.resize(N * to_size(tree_.words_per_row()));
      copy_packed_mask(tree_, std::span<std::uint32_t>(mask_));
    }
    ws_.reserve(n, vocab_);
  }

  //! Adds a request; its prompt is prefilled at the next `step()`, which also runs its first step.
  //! `request` is the engine's id for it (passed to `kv_cache`, `forward`, the hooks); the prompt
  //! is copied, and prefilled from slot 0 of the request's cache.
  //! @throws decode_error (nothing changes) on a duplicate id, a full batch, an empty or over-long
  //!         prompt, tokens outside the vocabulary, or bad options.
  void join(int request, std::span<const std::int32_t> prompt, const decode_options& opt = {},
            token_callback on_token = {}) {
    if (contains(request)) throw decode_error("request " + std::to_string(request) + " is already in the batch");
    auto free_slot = std::find_if(slots_.begin(), slots_.end(), [](const slot& s) { return !s.active; });
    if (free_slot == slots_.end())
      throw decode_error("the batch is full (" + std::to_string(max_batch_) + " requests): request " +
                         std::to_string(request) + " cannot join");
    const std::string who = "request " + std::to_string(request) + ": ";
    if (opt.max_new_tokens < 0)
      throw decode_error(who + "max_new_tokens must be >= 0, got " + std::to_string(opt.max_new_tokens));
    if (opt.prefill_chunk < 1)
      throw decode_error(who + "prefill_chunk must be >= 1, got " + std::to_string(opt.prefill_chunk));
    if (prompt.empty()) throw decode_error(who + "the prompt is empty: give at least one token (e.g. BOS)");
    if (opt.cached_prompt_tokens < 0 || detail::to_size(opt.cached_prompt_tokens) >= prompt.size())
      throw decode_error(who + "cached_prompt_tokens must be in [0, " + std::to_string(prompt.size() - 1) +
                         "] for a prompt of " + std::to_string(prompt.size()) + " tokens (the last one always runs), got " +
                         std::to_string(opt.cached_prompt_tokens));
    const int context = context_of(request);
    if (prompt.size() > detail::to_size(context)) {
      std::string hint;
      if constexpr (kv_reserving_model<Model> && !context_bounded_model<Model>)
        hint = " (a model that maps pages on demand should report max_context())";
      throw decode_error(who + "prompt of " + std::to_string(prompt.size()) + " tokens does not fit the context of " +
                         std::to_string(context) + " tokens" + hint);
    }
    for (std::size_t i = 0; i < prompt.size(); ++i)
      if (prompt[i] < 0 || prompt[i] >= vocab_)
        throw decode_error(who + "prompt token #" + std::to_string(i) + " = " + std::to_string(prompt[i]) +
                           " is outside the vocabulary [0, " + std::to_string(vocab_) + ")");
    slot& s = *free_slot;
    s.prompt.assign(prompt.begin(), prompt.end());
    s.id = request;
    s.opt = opt;
    s.on_token = std::move(on_token);
    s.context = context;
    s.prefilled = opt.cached_prompt_tokens;
    s.ready = false;
    s.length = opt.cached_prompt_tokens;
    s.pending = -1;
    s.step = 0;
    s.done = false;
    s.error = nullptr;
    s.result = decode_result{};
    s.result.stats.accepted_histogram.assign(detail::to_size(max_depth() + 1), 0);
    s.result.stats.accepted_at_depth.assign(detail::to_size(max_depth()), 0);
    if constexpr (per_step) s.history.assign(prompt.begin(), prompt.end());
    s.joined = detail::decode_clock::now();
    s.active = true;
    ++size_;
  }

  //! Removes a request now (e.g. its client went away); it gets no further update. Its cache
  //! slots are the engine's to free or keep; heads and a drafter with `release(request)` are told.
  //! @throws decode_error if `request` is not in the batch.
  void leave(int request) {
    slot* s = find(request);
    if (s == nullptr) throw decode_error("request " + std::to_string(request) + " is not in the batch");
    retire(*s);
  }

  //! Runs one step for every request in the batch (prefilling those that joined since the last
  //! step first) and returns one update per request, in slot order. Finished requests have left
  //! the batch when this returns. The returned span and the updates' token spans stay valid until
  //! the next `step`, `join` or `leave`.
  //! @throws whatever the model's `forward` or the heads throw (errors of the whole batch).
  std::span<request_update> step() {
    using detail::decode_clock;
    using detail::seconds_since;
    updates_.clear();
    step_tokens_.clear();
    for (slot& s : slots_) {
      s.out_begin = 0;
      s.out_count = 0;
      s.in_step = s.active;
    }
    // A request that wants no tokens ends before any work (as plain decoding does).
    for (slot& s : slots_)
      if (s.active && !s.ready && s.opt.max_new_tokens == 0) finish(s, stop_reason::max_tokens);
    prefill();
    decode();
    for (slot& s : slots_) {
      if (!s.in_step) continue;
      request_update u;
      u.request = s.id;
      u.tokens = std::span<const std::int32_t>(step_tokens_.data() + s.out_begin, detail::to_size(s.out_count));
      if (s.done) {
        u.finished = true;
        u.reason = s.result.reason;
        u.error = s.error;
        s.result.stats.seconds.total = seconds_since(s.joined);
        s.result.cache_length = s.length;
        u.result = std::move(s.result);
        retire(s);
      }
      updates_.push_back(std::move(u));
    }
    return updates_;
  }

  //! Requests in the batch.
  [[nodiscard]] int size() const noexcept { return size_; }
  //! True when no request is in the batch.
  [[nodiscard]] bool empty() const noexcept { return size_ == 0; }
  //! Most requests at once.
  [[nodiscard]] int max_batch() const noexcept { return max_batch_; }
  //! True when `request` is in the batch.
  [[nodiscard]] bool contains(int request) const noexcept {
    return std::any_of(slots_.begin(), slots_.end(), [&](const slot& s) { return s.active && s.id == request; });
  }
  //! Committed cache slots of `request` (prompt + accepted tokens so far).
  //! @throws decode_error if `request` is not in the batch.
  [[nodiscard]] int length(int request) const {
    for (const slot& s : slots_)
      if (s.active && s.id == request) return s.length;
    throw decode_error("request " + std::to_string(request) + " is not in the batch");
  }
  //! The tree in use.
  [[nodiscard]] const Tree& tree() const noexcept { return tree_; }
  //! The policy in use.
  [[nodiscard]] const Policy& policy() const noexcept { return policy_; }

 private:
  struct slot {
    bool active = false;
    bool ready = false;  // prefilled: `pending` and `h` are valid
    bool done = false;
    bool in_step = false;
    int id = -1;
    decode_options opt;
    token_callback on_token;
    std::vector<std::int32_t> prompt;
    int prefilled = 0;
    int context = 0;
    int length = 0;
    std::int32_t pending = -1;
    std::uint64_t step = 0;  // Philox counter: 0 for the prefill root, then one per step
    std::vector<float> h;    // the hidden state the heads read next
    std::optional<::medusa::tree> step_tree;  // per-step drafts: this step's tree; else the part of
                                              // the shared tree a short KV pool left room for
    std::vector<std::int32_t> history;  // per-step drafts: prompt and generated tokens (for lookups)
    std::vector<std::int32_t> drafted;  // per-step drafts drafted together: this step's node tokens
    bool predrafted = false;            // `step_tree` and `drafted` hold this step's drafts
    decode_result result;
    std::exception_ptr error;
    detail::decode_clock::time_point joined;
    std::size_t out_begin = 0;
    int out_count = 0;
    int rows = 0;  // rows in the pass being run: a prefill chunk, or 0 = none, 1 = plain step, N > 1 = tree step
  };

  // Sampled drafts: candidates come from `sample_candidates`, one draft row per depth per member.
  static constexpr bool samples_drafts = depth_draft_policy<Policy>;
  // Drafts drawn per node by the drafter (speculative_policy with a `node_distribution_drafts` one).
  static constexpr bool node_drafts = [] {
    if constexpr (sampling_policy<Policy>) return Policy::draft_distributions && !samples_drafts && node_distribution_drafts<Tree>;
    else return false;
  }();
  // Per-step drafts: each tree step of each request builds its own tree (`step_drafts`).
  static constexpr bool per_step = !tree_like<Tree>;
  static_assert(!per_step || !samples_drafts, "per-step drafts take top-K candidates: use another policy");
  // A drafter reading the target's features (`feature_observing`): the prefill keeps every row's
  // hidden state, and each step hands over the committed rows'.
  [[nodiscard]] bool observing() const {
    if constexpr (per_step && feature_observing<Tree>) return tree_.observes_features();
    else return false;
  }
  // Hands the drafter request `request`'s features from `position` on (only when `observing()`).
  void observe(int request, int position, std::span<const float> rows) {
    if constexpr (per_step && feature_observing<Tree>) tree_.observe(request, position, rows);
  }
  // Prompt rows per request and prefill pass when every row's outputs are kept (bounds the logits).
  static constexpr int observed_prefill_rows = 64;
  [[nodiscard]] int max_nodes() const {
    if constexpr (per_step) return tree_.max_nodes();
    else return tree_.num_nodes();
  }
  [[nodiscard]] int max_depth() const {
    if constexpr (per_step) return tree_.max_depth();
    else return tree_.depth();
  }
  [[nodiscard]] int heads_depth() const {
    if constexpr (per_step) return tree_.heads_depth();
    else return tree_.depth();
  }
  [[nodiscard]] std::span<float> member_draft_rows(int member) noexcept {
    const std::size_t size = detail::to_size(tree_.depth()) * detail::to_size(vocab_);
    return std::span<float>(draft_rows_.data() + detail::to_size(member) * size, size);
  }

  static constexpr bool has_mask_view = requires(const Tree& t) {
    { t.mask_view() } -> std::convertible_to<tree_mask_view>;
  };
  [[nodiscard]] tree_mask_view mask_view() const noexcept {
    if constexpr (per_step) return {};
    else if constexpr (has_mask_view) return tree_.mask_view();
    else return {mask_, tree_.words_per_row()};
  }
  // Calls `f` with the tree of request `s`'s tree step: its own (per-step drafts, or the part of
  // the shared tree that fitted its KV pool), else the shared one.
  template <class F>
  decltype(auto) with_step_tree(const slot& s, F&& f) {
    if constexpr (per_step) return f(*s.step_tree);
    else return s.step_tree ? f(*s.step_tree) : f(tree_);
  }

  slot* find(int request) {
    for (slot& s : slots_)
      if (s.active && s.id == request) return &s;
    return nullptr;
  }

  int context_of(int request) { return detail::request_context(model_, request); }

  // The request leaves: its slot is freed, then heads and a drafter that keep per-request state
  // hear of it (`release(request)`, which should not throw).
  void retire(slot& s) {
    s.active = false;
    s.on_token = nullptr;
    s.prompt.clear();
    --size_;
    if constexpr (request_releasing<Heads>) heads_.release(s.id);
    if constexpr (per_step && request_releasing<Tree>) tree_.release(s.id);
  }

  void finish(slot& s, stop_reason r) {
    s.done = true;
    s.result.reason = r;
  }
  void fail(slot& s, std::exception_ptr e) {
    s.error = std::move(e);
    finish(s, stop_reason::failed);
  }
  // Runs `f` for request `s`, ending the request (not the batch) if it throws. False on failure.
  template <class F>
  bool guarded(slot& s, F&& f) {
    try {
      f();
      return true;
    } catch (...) {
      fail(s, std::current_exception());
      return false;
    }
  }

  // Request `s` (committed length L, `s.rows` new tokens already at tokens_[T..]) becomes
  // member B of the pass being gathered.
  void add_member(slot& s, int L, int& B, int& T) {
    using detail::to_size;
    members_[to_size(B)] = &s;
    ids_[to_size(B)] = s.id;
    cache_lengths_[to_size(B)] = L;
    qo_indptr_[to_size(B)] = T;
    T += s.rows;
    ++B;
  }
  // The ragged batch of the B members gathered (T tokens); outputs and mask are the caller's.
  ragged_batch gathered_batch(int B, int T) {
    using detail::to_size;
    qo_indptr_[to_size(B)] = T;
    ragged_batch b;
    b.requests = std::span<const int>(ids_.data(), to_size(B));
    b.qo_indptr = std::span<const int>(qo_indptr_.data(), to_size(B + 1));
    b.tokens = std::span<const std::int32_t>(tokens_.data(), to_size(T));
    b.positions = std::span<const std::int32_t>(positions_.data(), to_size(T));
    b.cache_lengths = std::span<const int>(cache_lengths_.data(), to_size(B));
    return b;
  }

  // The per-step drafts of every tree request, drafted together (`batch_step_drafts`, e.g. one
  // draft pass per depth for all of them): their trees and tokens wait in the slots. When the
  // drafter throws, each request drafts alone in the step's loop, so that only the one at fault
  // fails.
  void draft_together(int n, std::size_t HV) {
    step_calls_.clear();
    int r = 0;
    for (slot& s : slots_) {
      s.predrafted = false;
      if (s.rows <= 1) continue;
      s.history.push_back(s.pending);
      s.drafted.resize(detail::to_size(n));
      step_calls_.push_back({s.id, s.history, std::span<const float>(head_logits_.data() + detail::to_size(r) * HV, HV), s.drafted,
                             s.opt.seed, static_cast<std::uint64_t>(s.step + 1), std::nullopt});
      ++r;
    }
    if (step_calls_.empty()) return;
    bool ok = true;
    try {
      tree_.draft_batch(std::span<step_draft_call>(step_calls_), vocab_);
    } catch (...) {
      ok = false;
    }
    std::size_t i = 0;
    for (slot& s : slots_) {
      if (s.rows <= 1) continue;
      s.history.pop_back();
      if (ok) {
        s.step_tree = std::move(step_calls_[i].result);
        s.predrafted = true;
      }
      ++i;
    }
  }

  // Maps (hook) and checks slots [L, L + count) of a request before a forward writes them, and
  // returns how many of the `count` the engine could map (all, unless its `reserve` grants fewer).
  // A model that commits itself is checked against its context before it maps anything.
  int prepare_append(slot& s, int L, int count) {
    if constexpr (kv_committing_model<Model>) detail::kv_check_append_within(context_of(s.id), L, count);
    int fit = count;
    if constexpr (kv_granting_model<Model>) {
      fit = std::min(count, static_cast<int>(model_.reserve(s.id, L + count)) - L);
      if (fit < 1)
        throw kv_cache_error(kv_errc::pool_exhausted,
                             "request " + std::to_string(s.id) + ": the KV pool is exhausted: not one more slot past " +
                                 std::to_string(L) + " can be mapped (asked for " + std::to_string(L + count) + ")");
    } else if constexpr (kv_reserving_model<Model>) {
      model_.reserve(s.id, L + count);
    }
    if constexpr (!kv_committing_model<Model>) kv_check_append(model_.kv_cache(s.id), L, fit);
    return fit;
  }

  // Commits request `s`'s accepted `path` of a tree pass of `tree`; returns the new length. A
  // model that commits itself gets only paths `kv_commit` would take, and must report L + A + 1.
  template <class StepTree>
  int commit_path(const slot& s, const StepTree& tree, std::span<const int> path) {
    if constexpr (kv_committing_model<Model>) {
      detail::kv_validate_commit_within(context_of(s.id), s.length, tree, path, -1);
      const int want = s.length + static_cast<int>(path.size());
      const int got = static_cast<int>(model_.commit(s.id, s.length, static_cast<int>(tree.num_nodes()), path));
      if (got != want)
        throw kv_cache_error(kv_errc::invalid_length,
                             "request " + std::to_string(s.id) + ": the model's commit returned length " +
                                 std::to_string(got) + ", expected " + std::to_string(want) + " (L " +
                                 std::to_string(s.length) + " + " + std::to_string(path.size()) + " accepted slots)");
      return got;
    } else {
      return kv_commit(model_.kv_cache(s.id), s.length, tree, path);
    }
  }

  // Emits one generated token under the request's stop rules; false once the request is over.
  bool emit(slot& s, std::int32_t token) {
    if (s.done) return false;
    if (token == s.opt.eos_token) {
      finish(s, stop_reason::eos);
      return false;
    }
    if (s.out_count == 0) s.out_begin = step_tokens_.size();
    step_tokens_.push_back(token);
    if constexpr (per_step) s.history.push_back(token);
    ++s.out_count;
    s.result.tokens.push_back(token);
    ++s.result.stats.new_tokens;
    if (s.on_token) {
      bool go = true;
      if (!guarded(s, [&] { go = s.on_token(token); })) return false;
      if (!go) {
        finish(s, stop_reason::callback);
        return false;
      }
    }
    if (s.result.stats.new_tokens >= s.opt.max_new_tokens) {
      finish(s, stop_reason::max_tokens);
      return false;
    }
    return true;
  }

  // Prefill of the requests that joined: ragged causal passes of up to `prefill_chunk` tokens per
  // request until every prompt is in the cache; then each takes its first root from the last
  // position's logits.
  void prefill() {
    using detail::to_size;
    const std::size_t V = to_size(vocab_), d = to_size(hidden_);
    for (;;) {
      const auto t0 = detail::decode_clock::now();
      int B = 0, T = 0;
      for (slot& s : slots_) {
        if (!s.active || s.done || s.ready) continue;
        int count = std::min(observing() ? std::min(s.opt.prefill_chunk, observed_prefill_rows) : s.opt.prefill_chunk,
                             static_cast<int>(s.prompt.size()) - s.prefilled);
        if (!guarded(s, [&] { count = prepare_append(s, s.prefilled, count); })) continue;
        if (positions_.size() < to_size(T + count)) {  // prompt chunks may exceed the tree rows
          positions_.resize(to_size(T + count));
          tokens_.resize(to_size(T + count));
        }
        for (int i = 0; i < count; ++i) {
          tokens_[to_size(T + i)] = s.prompt[to_size(s.prefilled + i)];
          positions_[to_size(T + i)] = s.prefilled + i;
        }
        s.rows = count;
        add_member(s, s.prefilled, B, T);
      }
      if (B == 0) return;
      // A drafter reading features gets every prompt row's hidden state (and so every row's logits).
      const bool all_rows = observing();
      const int out_rows = all_rows ? T : B;
      if (logits_.size() < to_size(out_rows) * V) logits_.resize(to_size(out_rows) * V);
      if (hidden_out_.size() < to_size(out_rows) * d) hidden_out_.resize(to_size(out_rows) * d);
      ragged_batch b = gathered_batch(B, T);
      b.last_row_only = !all_rows;
      b.logits = std::span<float>(logits_.data(), to_size(out_rows) * V);
      b.hidden = std::span<float>(hidden_out_.data(), to_size(out_rows) * d);
      model_.forward(b);
      const double dt = detail::seconds_since(t0);
      for (int i = 0; i < B; ++i) {
        slot& s = *members_[to_size(i)];
        s.result.stats.seconds.prefill += dt;
        // Each chunk's last row is checked: a non-finite one fails the request with the chunk's
        // slots left out of its valid length.
        const std::size_t last = all_rows ? to_size(qo_indptr_[to_size(i) + 1] - 1) : to_size(i);
        const auto z = std::span<const float>(logits_.data() + last * V, V);
        const auto h = std::span<const float>(hidden_out_.data() + last * d, d);
        const std::string where = "prompt token #" + std::to_string(s.prefilled + s.rows - 1);
        if (!guarded(s, [&] {
              detail::check_logits_row(s.id, 0, z, where);
              detail::check_hidden_row(s.id, 0, h, where);
              if (all_rows)
                observe(s.id, s.prefilled,
                        std::span<const float>(hidden_out_.data() + to_size(qo_indptr_[to_size(i)]) * d, to_size(s.rows) * d));
            }))
          continue;
        s.prefilled += s.rows;
        s.length = s.prefilled;
        if (s.prefilled < static_cast<int>(s.prompt.size())) continue;
        s.result.stats.prompt_tokens = static_cast<int>(s.prompt.size());
        std::copy(h.begin(), h.end(), s.h.begin());
        if (guarded(s, [&] { s.pending = detail::choose_token(policy_, z, s.opt.seed, s.step, ws_); })) s.ready = true;
      }
    }
  }

  // One step for every prefilled request: one ragged forward of tree rows (or a single row).
  void decode() {
    using detail::decode_clock;
    using detail::seconds_since;
    using detail::to_size;
    const int n = max_nodes();
    const std::size_t V = to_size(vocab_), d = to_size(hidden_), HV = to_size(num_heads_) * V;

    // Which requests take a tree step, which a plain one; plain ones emit their pending token now.
    int R = 0;  // tree requests, in order: their hidden states go to the heads together
    for (slot& s : slots_) {
      s.rows = 0;
      if (!s.active || s.done || !s.ready) continue;
      const int remaining = s.opt.max_new_tokens - s.result.stats.new_tokens;
      // A pool that grants part of a reserve: first one slot for every request that runs a token,
      // so that one request's tree cannot take the last pages another needs for a plain step.
      if constexpr (kv_granting_model<Model>)
        if (s.length < s.context && remaining > 1 && s.pending != s.opt.eos_token &&
            !guarded(s, [&] { prepare_append(s, s.length, 1); }))
          continue;
      if (n > 1 && s.length + n <= s.context && remaining > 1 && s.pending != s.opt.eos_token) {
        std::copy_n(s.h.data(), d, head_in_.data() + to_size(R) * d);
        head_ids_[to_size(R)] = s.id;
        s.rows = n;
        ++R;
        continue;
      }
      if (!emit(s, s.pending)) continue;
      if (s.length >= s.context) {
        finish(s, stop_reason::context_full);
        continue;
      }
      s.rows = 1;
    }

    // Draft heads over the tree requests' hidden states, then each request's candidates. A
    // drafter whose trees read no head (a lookup or a draft model alone) skips them.
    auto t0 = decode_clock::now();
    if (R > 0 && heads_depth() > 0) {
      if constexpr (request_draft_heads<Heads>) {  // rows in slot order, with their requests' ids
        heads_.forward(std::span<const float>(head_in_.data(), to_size(R) * d), R,
                       std::span<const int>(head_ids_.data(), to_size(R)),
                       std::span<float>(head_logits_.data(), to_size(R) * HV));
      } else if constexpr (batched_draft_heads<Heads>) {
        heads_.forward(std::span<const float>(head_in_.data(), to_size(R) * d), R,
                       std::span<float>(head_logits_.data(), to_size(R) * HV));
      } else {
        for (int r = 0; r < R; ++r)
          heads_.forward(std::span<const float>(head_in_.data() + to_size(r) * d, d),
                         std::span<float>(head_logits_.data() + to_size(r) * HV, HV));
      }
    }
    if constexpr (per_step && batch_step_drafts<Tree>) draft_together(n, HV);
    const double heads_time = seconds_since(t0);

    t0 = decode_clock::now();
    int B = 0, T = 0, r = 0;
    for (slot& s : slots_) {
      if (s.rows == 0) continue;
      const int L = s.length;
      std::int32_t* toks = tokens_.data() + T;
      std::int32_t* pos = positions_.data() + T;
      bool ok = true;
      if constexpr (!per_step) s.step_tree.reset();
      if constexpr (per_step) {
        if (s.rows > 1) {  // this step's own tree; nothing to draft = a plain step
          const auto hl = std::span<const float>(head_logits_.data() + to_size(r) * HV, HV);
          ++r;
          s.history.push_back(s.pending);
          ok = s.predrafted || guarded(s, [&] {
            const auto node_tokens = std::span<std::int32_t>(toks, to_size(n));
            if constexpr (seeded_step_drafts<Tree>)  // the verification's seed and step (its draws: their own range)
              s.step_tree = tree_.draft(s.id, s.history, hl, vocab_, node_tokens, s.opt.seed, static_cast<std::uint64_t>(s.step + 1));
            else if constexpr (request_step_drafts<Tree>) s.step_tree = tree_.draft(s.id, s.history, hl, vocab_, node_tokens);
            else s.step_tree = tree_.draft(s.history, hl, vocab_, node_tokens);
          });
          s.history.pop_back();
          if (s.predrafted) std::copy(s.drafted.begin(), s.drafted.end(), toks);
          if (ok && s.step_tree) {
            s.rows = s.step_tree->num_nodes();
            write_node_positions(*s.step_tree, L, pos);
          } else if (ok) {
            s.rows = 0;
            if (!emit(s, s.pending)) continue;
            if (s.length >= s.context) {
              finish(s, stop_reason::context_full);
              continue;
            }
            s.rows = 1;
          }
        }
      }
      const int count = s.rows;
      if (!per_step && count > 1) {  // a tree step (a plain step is one row)
        const auto hl = std::span<const float>(head_logits_.data() + to_size(r) * HV, HV);
        ++r;
        ok = guarded(s, [&] {
          const auto node_tokens = std::span<std::int32_t>(toks, to_size(n));
          if constexpr (samples_drafts) {  // drafts drawn from the heads' warped softmax (member B's rows)
            const sampling_warp warp{static_cast<float>(policy_.temperature), static_cast<int>(policy_.top_k),
                                     static_cast<float>(policy_.top_p)};
            sample_candidates(tree_, s.pending, hl, vocab_, warp, s.opt.seed, s.step + 1, node_tokens,
                              member_draft_rows(B), ws_);
          } else if constexpr (!per_step) {
            generate_candidates(tree_, s.pending, hl, vocab_, flat_, node_tokens);
          }
          if constexpr (!per_step) write_node_positions(tree_, L, pos);
        });
      } else if (count == 1) {
        toks[0] = s.pending;
        pos[0] = L;
      }
      int fit = count;
      if (ok) ok = guarded(s, [&] { fit = prepare_append(s, L, count); });
      if constexpr (node_drafts)  // a sampled tree's first nodes are not an unbiased part of its draws
        if (ok && fit < count && s.step_tree && s.step_tree->num_leaves() > 1) fit = 1;  // (a chain's are)
      if (ok && fit < count && fit > 1)  // a short KV pool: the first `fit` nodes of the tree
        ok = guarded(s, [&] { s.step_tree = with_step_tree(s, [&](const auto& t) { return detail::first_nodes(t, fit); }); });
      if (!ok) {
        s.rows = 0;
        continue;
      }
      s.rows = fit;
      if (fit == 1 && count > 1) {  // room for the root only: a plain step, as near the context's end
        s.step_tree.reset();
        s.rows = 0;
        if (!emit(s, s.pending)) continue;
        toks[0] = s.pending;
        pos[0] = L;
        s.rows = 1;
      }
      masks_[to_size(B)] = s.rows == 1 ? plain_tree{}.mask_view() : s.step_tree ? s.step_tree->mask_view() : mask_view();
      add_member(s, L, B, T);
    }
    const double candidates_time = seconds_since(t0);
    if (B == 0) return;

    t0 = decode_clock::now();
    ragged_batch b = gathered_batch(B, T);
    b.request_masks = std::span<const tree_mask_view>(masks_.data(), to_size(B));
    b.logits = std::span<float>(logits_.data(), to_size(T) * V);
    b.hidden = std::span<float>(hidden_out_.data(), to_size(T) * d);
    model_.forward(b);
    const double forward_time = seconds_since(t0);

    // Acceptance: the tree requests through verify_batch; if any request's logits are bad, each
    // is verified alone so that only the bad ones fail (verification has no side effects).
    t0 = decode_clock::now();
    int verify_count = 0;
    bool shrunk = false;  // a request runs part of the shared tree: each is verified alone
    for (int i = 0; i < B; ++i) {
      slot& s = *members_[to_size(i)];
      if (s.rows == 1) continue;  // plain steps need no verification
      shrunk = shrunk || s.step_tree.has_value();
      verify_request q;
      q.node_tokens = std::span<const std::int32_t>(tokens_.data() + qo_indptr_[to_size(i)], to_size(s.rows));
      q.logits = std::span<const float>(logits_.data() + to_size(qo_indptr_[to_size(i)]) * V, to_size(s.rows) * V);
      q.vocab = vocab_;
      q.seed = s.opt.seed;
      q.step = s.step + 1;
      q.eos_token = s.opt.eos_token;
      if constexpr (samples_drafts) {  // a part of the tree that fitted is shallower: its rows only
        const int depth = s.step_tree ? s.step_tree->depth() : static_cast<int>(tree_.depth());
        q.draft_rows = member_draft_rows(i).first(to_size(depth) * V);
      }
      if constexpr (node_drafts) q.draft_probs = std::span<const float>(tree_.draft_probs(s.id)).first(to_size(s.rows) * V);
      requests_[to_size(verify_count)] = q;
      verify_rows_[to_size(verify_count)] = i;
      ++verify_count;
    }
    bool verified_all = !per_step && !shrunk;  // per-step trees differ: each request is verified alone
    if constexpr (!per_step) {
      if (verify_count > 0 && verified_all) {
        try {
          verify_batch(tree_, std::span<const verify_request>(requests_.data(), to_size(verify_count)), policy_, ws_,
                       std::span<verify_result>(results_.data(), to_size(verify_count)));
        } catch (...) {
          verified_all = false;
        }
      }
    }
    std::vector<bool>& ok = verified_ok_;
    ok.assign(to_size(verify_count), true);
    if (!verified_all)
      for (int j = 0; j < verify_count; ++j) {
        slot& s = *members_[to_size(verify_rows_[to_size(j)])];
        ok[to_size(j)] = guarded(s, [&] {
          try {
            results_[to_size(j)] =
                with_step_tree(s, [&](const auto& t) { return verify(t, requests_[to_size(j)], policy_, ws_); });
          } catch (const acceptance_error& e) {  // the model's logits of this step: say whose and when
            if (e.code() != acceptance_errc::non_finite_logit) throw;
            const std::string what = e.what();
            throw model_output_error(s.id, s.step + 1, model_output::logits, what.substr(what.find(' ') + 1));
          }
        });
      }
    const double accept_time = seconds_since(t0);

    // Commit, emit and move on, request by request.
    int j = 0;
    for (int i = 0; i < B; ++i) {
      slot& s = *members_[to_size(i)];
      const std::size_t row0 = to_size(qo_indptr_[to_size(i)]);
      auto& st = s.result.stats;
      st.seconds.heads += heads_time;
      st.seconds.candidates += candidates_time;
      st.seconds.forward += forward_time;
      st.seconds.accept += accept_time;
      ++st.steps;
      ++s.step;
      if (s.rows == 1) {  // plain step: its token was emitted; choose the next one
        const auto z = std::span<const float>(logits_.data() + row0 * V, V);
        const auto h = std::span<const float>(hidden_out_.data() + row0 * d, d);
        const auto tc = decode_clock::now();
        const bool chosen = guarded(s, [&] {
          detail::check_logits_row(s.id, s.step, z, "row 0");
          detail::check_hidden_row(s.id, s.step, h, "row 0");
          s.pending = detail::choose_token(policy_, z, s.opt.seed, s.step, ws_);
          if (observing()) observe(s.id, s.length, h);
        });
        st.seconds.accept += seconds_since(tc);
        if (!chosen) continue;  // the slot this step wrote is not counted valid
        s.length += 1;
        std::copy(h.begin(), h.end(), s.h.begin());
        if constexpr (kv_releasing_model<Model>)
          if (!s.done) guarded(s, [&] { model_.release(s.id, s.length); });
        continue;
      }
      const int jj = j++;
      if (!ok[to_size(jj)]) continue;
      const verify_result& res = results_[to_size(jj)];
      const auto h = std::span<const float>(hidden_out_.data() + (row0 + to_size(res.next_node)) * d, d);
      if (!guarded(s, [&] { detail::check_hidden_row(s.id, s.step, h, "node " + std::to_string(res.next_node)); }))
        continue;  // nothing committed: the cache is as before the step
      const auto tc = decode_clock::now();
      const int L = s.length;
      const bool committed = guarded(s, [&] {
        s.length = with_step_tree(s, [&](const auto& t) { return commit_path(s, t, res.nodes()); });
        if constexpr (kv_releasing_model<Model>) model_.release(s.id, s.length);
        if (observing()) {  // the committed rows' features, in path order
          const auto nodes = res.nodes();
          observed_.resize(nodes.size() * d);
          for (std::size_t k = 0; k < nodes.size(); ++k)
            std::copy_n(hidden_out_.data() + (row0 + to_size(nodes[k])) * d, d, observed_.data() + k * d);
          observe(s.id, L, observed_);
        }
      });
      st.seconds.commit += seconds_since(tc);
      if (!committed) continue;
      ++st.tree_steps;
      ++st.accepted_histogram[to_size(res.accept_length)];
      for (int a = 1; a <= res.accept_length; ++a) ++st.accepted_at_depth[to_size(a - 1)];
      for (std::int32_t tok : res.tokens())
        if (!emit(s, tok)) break;
      if (s.done) continue;
      // An accepted EOS draft ends the request in emit(); otherwise continue from the bonus.
      s.pending = res.bonus;
      std::copy(h.begin(), h.end(), s.h.begin());
    }
  }

  Model& model_;
  Heads& heads_;
  Tree tree_;
  Policy policy_;
  int max_batch_ = 0;
  int num_heads_ = 0, vocab_ = 0, hidden_ = 0;
  int size_ = 0;
  std::vector<slot> slots_;
  std::vector<float> head_in_, head_logits_, logits_, hidden_out_;
  std::vector<float> draft_rows_;  // [max_batch][depth][vocab]: sampled drafts' rows, per member
  std::vector<float> observed_;    // a committed path's features, for a drafter that reads them
  std::vector<std::int32_t> flat_, tokens_, positions_;
  std::vector<int> ids_, head_ids_, qo_indptr_, cache_lengths_, verify_rows_;
  std::vector<slot*> members_;
  std::vector<verify_request> requests_;
  std::vector<step_draft_call> step_calls_;  // per-step drafts drafted together
  std::vector<verify_result> results_;
  std::vector<bool> verified_ok_;
  std::vector<std::int32_t> step_tokens_;
  std::vector<request_update> updates_;
  std::vector<std::uint32_t> mask_;  // the packed mask of a tree without mask_view()
  std::vector<tree_mask_view> masks_;  // per-step drafts: each member's mask in the pass
  acceptance_workspace ws_;
};

MEDUSA_NAMESPACE_END
