// SPDX-License-Identifier: Apache-2.0
//! @file draft_model.hpp
//! A draft model as the branch source of a `basic_step_drafter` (drafts.hpp): a small model with
//! the target's vocabulary proposes, after each step's root, the greedy chain of its next
//! `max_tokens` tokens, and the target verifies the chain in its tree step. Verification decides
//! what is kept, so decoding stays lossless whatever the draft proposes.
//!
//! The draft keeps its own KV cache in step with the request: the branch remembers which tokens
//! the draft's cache holds, and each call runs only the tokens of the history past their longest
//! common prefix. Drafts the target accepted are reused as they are; the step's bonus token (and
//! any draft the target rejected) is caught up in one causal pass.
//!
//! The draft is a single-request `decoder_model` (e.g. the example engine over a small model), for
//! the single-request `decoder`, or a `batch_decoder_model` (e.g. the example's serving engine),
//! whose request ids are the target's: then each request of a `batch_decoder` has its own draft
//! cache, freed (`release(request, 0)`) when the request leaves.
//!
//! The branch is also a `tree_draft_source` (draft_tree.hpp): `tree_drafter` grows each step's
//! tree from it, best first, instead of one chain.
//!
//! @code
//! medusa::draft_model_branch<DraftEngine> draft(draft_engine, target.vocab_size(), {.max_tokens = 4});
//! medusa::basic_step_drafter<medusa::draft_model_branch<DraftEngine>> drafter({.lookup = draft}, heads.num_heads());
//! medusa::decoder dec(target, heads, drafter, medusa::greedy_policy{});  // heads: add .paths to use them too
//! @endcode
#pragma once

#include <medusa/config.hpp>
#include <medusa/candidates.hpp>
#include <medusa/decoder.hpp>
#include <medusa/decoder/model.hpp>
#include <medusa/draft_tree.hpp>
#include <medusa/error.hpp>
#include <medusa/kv_cache.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

MEDUSA_NAMESPACE_BEGIN

//! What a `draft_model_branch` drafts.
struct draft_model_options {
  int max_tokens = 4;  //!< tokens drafted after each root (≥ 1): the chain's length
};

//! A model a `draft_model_branch` can run: one request at a time, or a batch model.
template <class M>
concept draft_model = decoder_model<M> || batch_decoder_model<M>;

//! The branch source of a `basic_step_drafter` that runs a draft model (see the file comment).
//! Copies share the draft's cache state, as they share the model.
template <draft_model Draft>
class draft_model_branch {
 public:
  //! Whether the draft serves many requests (a `batch_decoder_model`), each with its own cache.
  static constexpr bool batched = batch_decoder_model<Draft>;

  //! `draft` must outlive the branch and serve it alone. `target_vocab`: the target's vocabulary
  //! size. Throws `invalid_input` when the draft's vocabulary size differs (naming both) or
  //! `max_tokens < 1`.
  draft_model_branch(Draft& draft, int target_vocab, draft_model_options opt = {})
      : state_(std::make_shared<state>(state{&draft, opt, {}, {}, {}, {}, {}, {}, 0, 0, 0.0})) {
    const int v = static_cast<int>(draft.vocab_size());
    if (v != target_vocab)
      throw invalid_input("draft model: its vocabulary has " + std::to_string(v) + " tokens, the target's " +
                          std::to_string(target_vocab));
    validate();
  }

  //! Throws `invalid_input` unless `max_tokens ≥ 1`.
  void validate() const {
    if (state_->opt.max_tokens < 1)
      throw invalid_input("draft model: max_tokens must be >= 1, got " + std::to_string(state_->opt.max_tokens));
  }

  //! The longest chain drafted.
  [[nodiscard]] int max_tokens() const noexcept { return state_->opt.max_tokens; }

  //! Writes the draft's greedy continuation of `history` (request `request`'s tokens, ending with
  //! the step's root) to `out`: `min(max_tokens, out.size())` tokens, fewer where the draft's
  //! context ends; returns how many. Throws `invalid_input` for a history token outside the
  //! vocabulary (or a request other than 0 for a single-request draft), `acceptance_error` for a
  //! non-finite draft logit row, and what the draft's forward throws.
  int find(int request, std::span<const std::int32_t> history, std::span<std::int32_t> out) {
    return find_with(request, history, out, [](std::span<const float> logits, int) { return argmax(logits); });
  }
  //! The same for request 0.
  int find(std::span<const std::int32_t> history, std::span<std::int32_t> out) { return find(0, history, out); }

  //! `find` with `choose(logits, i)` picking draft i (0-based) from the draft's logit row after the
  //! history and drafts 0…i−1 (`find` takes the argmax): what a drafter that samples its chain
  //! builds on (`draft_model_sampler`). The chosen tokens must lie in the vocabulary.
  template <class Choose>
  int find_with(int request, std::span<const std::int32_t> history, std::span<std::int32_t> out, Choose&& choose) {
    state& s = *state_;
    const int n = static_cast<int>(history.size());
    // Drafting K tokens writes the history's K/V and the first K − 1 drafts': slots [0, n + K − 1).
    const int count = std::min({s.opt.max_tokens, static_cast<int>(out.size()), context(request) - n + 1});
    if (n == 0 || count < 1 || !catch_up(request, history)) return 0;
    std::vector<std::int32_t>& cached = s.cached[request];
    std::int32_t next = choose(std::span<const float>(s.logits), 0);
    out[0] = next;
    for (int i = 1; i < count; ++i) {
      const std::int32_t token[1] = {next};
      run(request, token, n + i - 1);
      cached.push_back(token[0]);
      next = choose(std::span<const float>(s.logits), i);
      out[static_cast<std::size_t>(i)] = next;
    }
    return count;
  }

  //! The draft's vocabulary size (`tree_draft_source`).
  [[nodiscard]] int vocab_size() const { return static_cast<int>(state_->model->vocab_size()); }

  //! `tree_draft_source` (draft_tree.hpp): catches the draft's cache up on `history` and returns
  //! its logit row after the root; empty when the history fills the draft's context. Throws as
  //! `find` does.
  std::span<const float> draft_root(int request, std::span<const std::int32_t> history) {
    if (history.empty() || !catch_up(request, history)) return {};
    return state_->logits;
  }

  //! `tree_draft_source`: runs a draft tree's pass (the root again, at slot `n − 1` of a history
  //! of n tokens, and the pass's nodes after it, with the tree's mask; or a chain's rows past
  //! `pass.cached`) and returns the logit rows of its last `pass.outputs` nodes; empty when the
  //! pass does not fit the draft's context or its pool. The cache keeps the history only: the
  //! nodes' slots are overwritten by the next call.
  std::span<const float> draft_pass(int request, std::span<const std::int32_t> history, const draft_tree_pass& pass) {
    const draft_pass_call call{request, history, &pass};
    std::span<const float> rows;
    run_passes(std::span<const draft_pass_call>(&call, 1), std::span<std::span<const float>>(&rows, 1));
    return rows;
  }

  //! `tree_draft_batch_source` (a draft that serves many requests): every request's catch-up in
  //! one ragged pass; `rows[i]` = what `draft_root` gives for call i alone (empty where its history
  //! fills the draft's context). Throws as `find` does, and `invalid_input` for a request that
  //! appears twice.
  void draft_roots(std::span<const draft_root_call> calls, std::span<std::span<const float>> rows)
    requires batched
  {
    state& s = *state_;
    detail::check_distinct_requests(calls, "draft model");
    batch_.clear();
    for (std::size_t i = 0; i < calls.size(); ++i) {
      rows[i] = {};
      const int request = calls[i].request;
      const auto history = calls[i].history;
      const int n = static_cast<int>(history.size());
      check_history(history);
      if (n == 0 || n > context(request)) continue;
      const int keep = keep_cached(request, history);
      map_slots(request, n);
      batch_.add(request, history.subspan(static_cast<std::size_t>(keep)), keep, i, {}, [&](int j) { return keep + j; });
    }
    if (batch_.empty()) return;
    run_batch(/*last_row_only=*/true);
    const auto V = static_cast<std::size_t>(s.model->vocab_size());
    for (std::size_t b = 0; b < batch_.calls.size(); ++b) {
      const std::size_t i = batch_.calls[b];
      const auto history = calls[i].history;
      std::vector<std::int32_t>& cached = s.cached[calls[i].request];
      cached.insert(cached.end(), history.begin() + static_cast<std::ptrdiff_t>(cached.size()), history.end());
      rows[i] = std::span<const float>(s.tree_logits).subspan(b * V, V);
    }
  }

  //! `tree_draft_batch_source`: every request's tree pass in one ragged pass, each with its own
  //! mask (or causal past a chain's cached rows); `rows[i]` = what `draft_pass` gives for call i
  //! alone (empty where it does not fit the draft's context or pool). Throws `invalid_input` for a
  //! request that appears twice, and what the draft's forward throws.
  void draft_passes(std::span<const draft_pass_call> calls, std::span<std::span<const float>> rows)
    requires batched
  {
    detail::check_distinct_requests(calls, "draft model");
    run_passes(calls, rows);
  }

  //! The request left: its draft cache holds nothing of use any more (a batch draft that frees
  //! pages gets `release(request, 0)`).
  void release(int request) {
    state& s = *state_;
    s.cached.erase(request);
    if constexpr (batched && kv_releasing_model<Draft>) s.model->release(request, 0);
  }

  //! Tokens the draft has run so far (the catch-up passes and the chains), for its cost.
  [[nodiscard]] std::int64_t tokens_run() const noexcept { return state_->tokens_run; }
  //! Forward passes of the draft so far.
  [[nodiscard]] std::int64_t passes() const noexcept { return state_->passes; }
  //! Wall-clock seconds of the draft's forward passes so far: the drafter's own cost, for its share
  //! of a step.
  [[nodiscard]] double seconds() const noexcept { return state_->seconds; }

 private:
  struct state {
    Draft* model;
    draft_model_options opt;
    std::map<int, std::vector<std::int32_t>> cached;  // per request: the tokens its draft cache holds, slot by slot
    std::vector<std::int32_t> positions;
    std::vector<float> logits, hidden;  // hidden: not read, but models may write it unasked
    std::vector<float> tree_logits, tree_hidden;  // a tree pass's or a batched pass's rows
    std::int64_t tokens_run, passes;
    double seconds;
  };

  // Calls `f` with the draft as a batch model: itself, or a single-request draft seen as a batch of
  // one (`detail::single_request_model`, request 0), so that both take one path.
  template <class F>
  decltype(auto) as_batch(F&& f) const {
    if constexpr (batched) {
      return f(*state_->model);
    } else {
      detail::single_request_model<Draft> one(*state_->model);
      return f(one);
    }
  }

  // The draft's context for `request`: `max_context()` where it has one, else its cache's capacity.
  [[nodiscard]] int context(int request) const {
    return as_batch([&](auto& m) { return detail::request_context(m, request); });
  }

  // One ragged pass of several requests' rows (`draft_roots`, `draft_passes`).
  struct batch_rows {
    std::vector<int> requests, indptr{0}, lengths;
    std::vector<std::int32_t> tokens, positions;
    std::vector<tree_mask_view> masks;
    std::vector<std::size_t> calls;  // per request of the pass: its call

    void clear() {
      requests.clear();
      indptr.assign(1, 0);
      lengths.clear();
      tokens.clear();
      positions.clear();
      masks.clear();
      calls.clear();
    }
    [[nodiscard]] bool empty() const noexcept { return requests.empty(); }
    // `rows` of `request` at slots from `length` on, row i at `position(i)`, for call `call`.
    template <class Position>
    void add(int request, std::span<const std::int32_t> rows, int length, std::size_t call, tree_mask_view mask,
             Position&& position) {
      requests.push_back(request);
      lengths.push_back(length);
      tokens.insert(tokens.end(), rows.begin(), rows.end());
      for (int i = 0; i < static_cast<int>(rows.size()); ++i) positions.push_back(position(i));
      indptr.push_back(static_cast<int>(tokens.size()));
      masks.push_back(mask);
      calls.push_back(call);
    }
  };

  // The tree passes of `calls` as one ragged pass (`draft_pass`, `draft_passes`).
  void run_passes(std::span<const draft_pass_call> calls, std::span<std::span<const float>> rows) {
    const state& s = *state_;
    batch_.clear();
    for (std::size_t i = 0; i < calls.size(); ++i) {
      rows[i] = {};
      const draft_tree_pass& pass = *calls[i].pass;
      const int request = calls[i].request;
      const int n = static_cast<int>(calls[i].history.size());
      const int T = pass.shape.num_nodes();
      if (n == 0 || n - 1 + T > context(request) || !reserve(request, n - 1 + T)) continue;
      const int c = pass.cached;
      // Rows [c, T) run after slot n − 1 + c, each at the root's position plus its depth: all of
      // them with the tree's mask, or a chain's last (causal).
      batch_.add(request, pass.tokens.subspan(static_cast<std::size_t>(c), static_cast<std::size_t>(T - c)), n - 1 + c, i,
                 c == 0 ? pass.shape.mask_view() : tree_mask_view{}, [&](int j) { return n - 1 + pass.shape.node_depth(c + j); });
    }
    if (batch_.empty()) return;
    run_batch(/*last_row_only=*/false);
    const auto V = static_cast<std::size_t>(s.model->vocab_size());
    for (std::size_t b = 0; b < batch_.calls.size(); ++b) {
      const std::size_t i = batch_.calls[b];
      const auto end = static_cast<std::size_t>(batch_.indptr[b + 1]);
      const auto outputs = static_cast<std::size_t>(calls[i].pass->outputs);
      rows[i] = std::span<const float>(s.tree_logits).subspan((end - outputs) * V, outputs * V);
    }
  }

  // Runs `batch_` as one forward pass; its logits go to `state_->tree_logits` (`[rows][vocab]`, or
  // `[requests][vocab]` for the last rows only).
  void run_batch(bool last_row_only) {
    state& s = *state_;
    const std::size_t out = last_row_only ? batch_.requests.size() : batch_.tokens.size();
    s.tree_logits.resize(out * static_cast<std::size_t>(s.model->vocab_size()));
    s.tree_hidden.resize(out * static_cast<std::size_t>(s.model->hidden_size()));
    timed([&] {
      ragged_batch b;
      b.requests = batch_.requests;
      b.qo_indptr = batch_.indptr;
      b.tokens = batch_.tokens;
      b.positions = batch_.positions;
      b.cache_lengths = batch_.lengths;
      if (std::any_of(batch_.masks.begin(), batch_.masks.end(), [](const tree_mask_view& m) { return !m.empty(); }))
        b.request_masks = batch_.masks;
      b.last_row_only = last_row_only;
      b.logits = s.tree_logits;
      b.hidden = s.tree_hidden;
      as_batch([&](auto& m) { m.forward(b); });
    }, static_cast<int>(batch_.tokens.size()));
  }

  // Throws `invalid_input` for a history token outside the draft's vocabulary.
  void check_history(std::span<const std::int32_t> history) const {
    const int vocab = static_cast<int>(state_->model->vocab_size());
    for (const std::int32_t t : history)
      if (t < 0 || t >= vocab)
        throw invalid_input("draft model: history token " + std::to_string(t) + " is outside its vocabulary of " +
                            std::to_string(vocab));
  }

  // Runs the history past what the draft's cache holds (the root always, for its logits, left in
  // `state_->logits`). False when the history does not fit the draft's context.
  bool catch_up(int request, std::span<const std::int32_t> history) {
    state& s = *state_;
    if (!batched && request != 0)
      throw invalid_input("draft model: a single-request draft serves request 0, not request " + std::to_string(request));
    const int n = static_cast<int>(history.size());
    check_history(history);
    if (n > context(request)) return false;
    const int keep = keep_cached(request, history);
    run(request, history.subspan(static_cast<std::size_t>(keep)), keep);
    s.cached[request].insert(s.cached[request].end(), history.begin() + keep, history.end());
    return true;
  }

  // How much of `history` the draft's cache still holds: its common prefix with what the cache
  // holds, short of the root, which is always run again (its logits). The cache's record is cut
  // to it.
  int keep_cached(int request, std::span<const std::int32_t> history) {
    std::vector<std::int32_t>& cached = state_->cached[request];
    int keep = 0;
    const int common = std::min(static_cast<int>(cached.size()), static_cast<int>(history.size()) - 1);
    while (keep < common && cached[static_cast<std::size_t>(keep)] == history[static_cast<std::size_t>(keep)]) ++keep;
    cached.assign(history.begin(), history.begin() + keep);
    return keep;
  }

  // `reserve`, throwing `kv_cache_error` (`pool_exhausted`) when the pool grants fewer slots.
  void map_slots(int request, int slots) {
    if (!reserve(request, slots))
      throw kv_cache_error(kv_errc::pool_exhausted, "draft model: its cache could not map " + std::to_string(slots) + " slots");
  }

  // Makes slots [0, slots) of `request` addressable in a draft that maps its cache on demand; false
  // when its pool grants fewer.
  bool reserve(int request, int slots) {
    return as_batch([&](auto& m) {
      using M = std::remove_reference_t<decltype(m)>;
      if constexpr (kv_granting_model<M>) return static_cast<int>(m.reserve(request, slots)) >= slots;
      else if constexpr (kv_reserving_model<M>) m.reserve(request, slots);
      return true;
    });
  }

  // Runs `f` (one forward pass), adding its time, one pass and `tokens` rows to the draft's counts.
  template <class F>
  void timed(F&& f, int tokens) {
    state& s = *state_;
    const auto t0 = std::chrono::steady_clock::now();
    f();
    s.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    s.tokens_run += tokens;
    ++s.passes;
  }

  // Runs `tokens` at slots [length, length + T) of `request` (causal); the last row's logits are
  // left in `state_->logits`.
  void run(int request, std::span<const std::int32_t> tokens, int length) {
    state& s = *state_;
    const int T = static_cast<int>(tokens.size());
    s.positions.resize(static_cast<std::size_t>(T));
    for (int i = 0; i < T; ++i) s.positions[static_cast<std::size_t>(i)] = length + i;
    s.logits.resize(static_cast<std::size_t>(s.model->vocab_size()));
    s.hidden.resize(static_cast<std::size_t>(s.model->hidden_size()));
    map_slots(request, length + T);
    timed([&] {
      as_batch([&](auto& m) {
        detail::forward_request(m, request, tokens, s.positions, length, /*last_row_only=*/true, s.logits, s.hidden);
      });
    }, T);
  }

  std::shared_ptr<state> state_;
  batch_rows batch_;  // scratch of a batched pass
};

MEDUSA_NAMESPACE_END
