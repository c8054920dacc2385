// SPDX-License-Identifier: Apache-2.0
//! @file feature_draft.hpp
//! An EAGLE-style feature drafter as the branch source of a `basic_step_drafter` (drafts.hpp): a
//! small model that reads the *target's own* last hidden states (its features, the final-normed
//! states its LM head reads) and drafts a chain of tokens after each step's root.
//!
//! Row i of the drafter takes (f_i, t_{i+1}): the target's feature at position i and the token
//! that followed it. It predicts f_{i+1} and, through the target's LM head, the logits of
//! t_{i+2}. Drafting after a root at position n − 1 runs the rows the drafter has not seen yet
//! (positions up to n − 2, all with real features: a causal catch-up pass over what the last step
//! accepted), then feeds each predicted feature forward with the token drafted from it.
//! Predicted rows are overwritten by real ones at the next step. Verification decides what is
//! kept, so decoding stays lossless whatever the drafter proposes.
//!
//! The decoders hand the target's features to the drafter (`observe`, the `feature_observing`
//! concept of drafts.hpp): every prompt position after the prefill, then the rows of each step's
//! accepted path. The drafter model is any `feature_draft_model`, e.g. the example's
//! `medusa_llama::eagle_engine` (one decoder layer over the target's embedding and LM head).
//!
//! The branch is also a `tree_draft_source` (draft_tree.hpp): `tree_drafter` grows each step's
//! tree from it (EAGLE-2), each node's row fed its parent's predicted feature. Over a model with a
//! batched forward (`feature_draft_batch_model`) it is a `tree_draft_batch_source`: a serving
//! step's trees grow together, one drafter pass per depth for every request.
//!
//! @code
//! medusa::feature_draft_branch<medusa_llama::eagle_engine> eagle(drafter, target.vocab_size(),
//!                                                                target.hidden_size(), {.max_tokens = 5});
//! medusa::basic_step_drafter<medusa::feature_draft_branch<medusa_llama::eagle_engine>> drafts({.lookup = eagle}, 1);
//! medusa::no_heads none;
//! medusa::decoder dec(target, none, drafts, medusa::greedy_policy{});
//! @endcode
#pragma once

#include <medusa/config.hpp>
#include <medusa/candidates.hpp>
#include <medusa/draft_tree.hpp>
#include <medusa/error.hpp>
#include <medusa/tree/mask.hpp>

#include <algorithm>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

MEDUSA_NAMESPACE_BEGIN

//! One forward of a feature drafter for one request: `T = tokens.size()` rows, row i being
//! (`features[i]`, `tokens[i]`) at position `positions[i]`, its K/V written at slot
//! `cache_length + i` of the request's own cache, attending to slots `[0, cache_length)` and to
//! rows 0…i (causal), or to the rows `tree_mask` shows it (a draft tree's pass).
struct feature_batch {
  int request = 0;                          //!< the engine's id of the request
  std::span<const std::int32_t> tokens;     //!< `[T]` the token following each feature's position
  std::span<const float> features;          //!< `[T][hidden]` the feature of each row's position
  std::span<const std::int32_t> positions;  //!< `[T]` absolute positions (RoPE)
  int cache_length = 0;                     //!< slots of the request's drafter cache kept
  std::span<float> logits;                  //!< `[outputs][vocab]`: the last rows' logits
  std::span<float> hidden;                  //!< `[outputs][hidden]`: the last rows' predicted features
  //! Visibility among the rows: empty = causal; otherwise a tree's packed mask (row i sees row j
  //! iff `tree_mask.visible(i, j)`), a draft tree's pass (draft_tree.hpp).
  tree_mask_view tree_mask = {};
  int outputs = 1;                          //!< rows whose outputs are wanted: the last `outputs` (≥ 1)
};

//! A feature drafter model: `forward(feature_batch)` (see there), `vocab_size()` and
//! `hidden_size()` equal to the target's, `max_context()` (the most slots of a request's cache),
//! and `release(request)`: the request left, its cache may go.
template <class M>
concept feature_draft_model = requires(M& m, const feature_batch& b, int request) {
  { m.vocab_size() } -> std::convertible_to<int>;
  { m.hidden_size() } -> std::convertible_to<int>;
  { m.max_context() } -> std::convertible_to<int>;
  m.forward(b);
  m.release(request);
};

//! A `feature_draft_model` that also runs many requests' batches as one pass: `forward_batch(bs)`
//! does for each batch what `forward` would (each request at most once), so that one pass reads
//! the drafter's weights once for all of them (the example's `eagle_engine`). A
//! `feature_draft_branch` over one is a `tree_draft_batch_source`: `tree_drafter::draft_batch`
//! then grows a serving step's trees with one drafter pass per depth.
template <class M>
concept feature_draft_batch_model =
    feature_draft_model<M> && requires(M& m, std::span<const feature_batch> batches) { m.forward_batch(batches); };

//! What a `feature_draft_branch` drafts.
struct feature_draft_options {
  int max_tokens = 4;  //!< tokens drafted after each root (≥ 1): the chain's length
};

//! The branch source of a `basic_step_drafter` that runs a feature drafter (see the file comment).
//! Copies share the drafter's state, as they share the model.
template <feature_draft_model Model>
class feature_draft_branch {
 public:
  //! `model` must outlive the branch and serve it alone. Throws `invalid_input` when its
  //! vocabulary or hidden size differs from the target's (naming both) or `max_tokens < 1`.
  feature_draft_branch(Model& model, int target_vocab, int target_hidden, feature_draft_options opt = {})
      : state_(std::make_shared<state>()) {
    state_->model = &model;
    state_->opt = opt;
    const int v = static_cast<int>(model.vocab_size()), d = static_cast<int>(model.hidden_size());
    if (v != target_vocab || d != target_hidden)
      throw invalid_input("feature drafter: it has a vocabulary of " + std::to_string(v) + " and features of " +
                          std::to_string(d) + ", the target " + std::to_string(target_vocab) + " and " +
                          std::to_string(target_hidden));
    validate();
  }

  //! Throws `invalid_input` unless `max_tokens ≥ 1`.
  void validate() const {
    if (state_->opt.max_tokens < 1)
      throw invalid_input("feature drafter: max_tokens must be >= 1, got " + std::to_string(state_->opt.max_tokens));
  }

  //! The longest chain drafted.
  [[nodiscard]] int max_tokens() const noexcept { return state_->opt.max_tokens; }

  //! The decoders pass the target's features (`feature_observing`).
  [[nodiscard]] static constexpr bool observes_features() noexcept { return true; }

  //! The target's features of request `request`'s positions `[position, position + rows/hidden)`
  //! (`rows`: `[count][hidden]`). Positions arrive in order, each once, from 0 on. Throws
  //! `invalid_input` for rows that are not whole features or do not follow the last ones.
  void observe(int request, int position, std::span<const float> rows) {
    state& s = *state_;
    const auto d = static_cast<std::size_t>(s.model->hidden_size());
    if (rows.size() % d != 0)
      throw invalid_input("feature drafter: " + std::to_string(rows.size()) + " values are not whole features of " +
                          std::to_string(d));
    request_state& r = s.requests[request];
    const int known = r.fed + static_cast<int>(r.pending.size() / d);
    if (position != known)
      throw invalid_input("feature drafter: request " + std::to_string(request) + " sent the features of position " +
                          std::to_string(position) + " where position " + std::to_string(known) + " was next");
    r.pending.insert(r.pending.end(), rows.begin(), rows.end());
  }

  //! Writes the drafter's greedy chain after `history` (request `request`'s tokens, ending with the
  //! step's root) to `out`: `min(max_tokens, out.size())` tokens, fewer where the drafter's context
  //! ends; returns how many. Needs the features of every position but the root's (`observe`).
  //! Throws `invalid_input` for a history token outside the vocabulary or missing features,
  //! `acceptance_error` for a non-finite drafter logit row, and what the drafter's forward throws.
  int find(int request, std::span<const std::int32_t> history, std::span<std::int32_t> out) {
    return find_with(request, history, out, [](std::span<const float> logits, int) { return argmax(logits); });
  }

  //! `find` with `choose(logits, i)` picking draft i (0-based) from the drafter's logit row.
  template <class Choose>
  int find_with(int request, std::span<const std::int32_t> history, std::span<std::int32_t> out, Choose&& choose) {
    state& s = *state_;
    const int n = static_cast<int>(history.size());
    if (n < 2 || out.empty()) return 0;
    request_state& r = s.requests[request];
    check_history(request, r, history);
    // Drafting K tokens writes rows at positions [fed, n − 2 + K): the last must fit the context.
    const int count = std::min({s.opt.max_tokens, static_cast<int>(out.size()), context() - n + 2});
    if (count < 1 || !catch_up(request, r, history)) return 0;
    for (int i = 0;; ++i) {
      const std::int32_t next = choose(std::span<const float>(s.chain.logits), i);
      out[static_cast<std::size_t>(i)] = next;
      if (i + 1 == count) break;
      // The predicted feature of position n − 1 + i with the token drafted from it.
      s.feature.assign(s.chain.hidden.begin(), s.chain.hidden.end());
      const std::int32_t token[1] = {next};
      run(request, token, s.feature, n - 1 + i);
    }
    return count;
  }

  //! The drafter's vocabulary size (`tree_draft_source`).
  [[nodiscard]] int vocab_size() const { return static_cast<int>(state_->model->vocab_size()); }

  //! `tree_draft_source` (draft_tree.hpp): runs the catch-up rows (as `find` does) and returns the
  //! logit row after the root; empty when the drafter's context is full or it drafted after this
  //! history already. Throws as `find` does.
  std::span<const float> draft_root(int request, std::span<const std::int32_t> history) {
    pass_rows& p = scratch(1)[0];
    if (!stage_root(p, request, history)) return {};
    forward(p.batch);
    return finish_root(p, request, history);
  }

  //! `tree_draft_source`: runs a draft tree's pass. Row 0 is the root's again ((its real feature,
  //! the root) at position n − 2 of a history of n tokens); node i's row takes its parent's
  //! predicted feature and its own token. A chain's rows before `pass.cached` do not run again.
  //! Returns the logit rows of the last `pass.outputs` nodes (and keeps their predicted features
  //! for their children); empty when the pass does not fit the drafter's context.
  std::span<const float> draft_pass(int request, std::span<const std::int32_t> history, const draft_tree_pass& pass) {
    pass_rows& p = scratch(1)[0];
    if (!stage_pass(p, request, history, pass)) return {};
    forward(p.batch);
    return finish_pass(p, request, pass);
  }

  //! `tree_draft_batch_source`, over a `feature_draft_batch_model`: `rows[i]` is what `draft_root`
  //! gives for call i, the catch-up rows of every call run as one pass. Throws as `draft_root`
  //! does, and `invalid_input` when a request appears twice; what throws before the pass changes
  //! no request's state.
  void draft_roots(std::span<const draft_root_call> calls, std::span<std::span<const float>> rows)
    requires feature_draft_batch_model<Model>
  {
    detail::check_distinct_requests(calls, "feature drafter");
    std::vector<pass_rows>& slots = scratch(calls.size());
    run_together(calls.size(), rows, [&](std::size_t i) { return stage_root(slots[i], calls[i].request, calls[i].history); });
    for (const std::size_t i : state_->staged) rows[i] = finish_root(slots[i], calls[i].request, calls[i].history);
  }

  //! `tree_draft_batch_source`: `rows[i]` is what `draft_pass` gives for call i, every call's tree
  //! pass run as one ragged pass (each with its own mask). Throws as `draft_roots` does.
  void draft_passes(std::span<const draft_pass_call> calls, std::span<std::span<const float>> rows)
    requires feature_draft_batch_model<Model>
  {
    detail::check_distinct_requests(calls, "feature drafter");
    std::vector<pass_rows>& slots = scratch(calls.size());
    run_together(calls.size(), rows,
                 [&](std::size_t i) { return stage_pass(slots[i], calls[i].request, calls[i].history, *calls[i].pass); });
    for (const std::size_t i : state_->staged) rows[i] = finish_pass(slots[i], calls[i].request, *calls[i].pass);
  }

  //! The request left: its state and the drafter's cache of it go.
  void release(int request) {
    state_->requests.erase(request);
    state_->model->release(request);
  }

  //! Rows the drafter has run so far (catch-up rows and chain rows), for its cost.
  [[nodiscard]] std::int64_t tokens_run() const noexcept { return state_->tokens_run; }
  //! Forward passes of the drafter so far.
  [[nodiscard]] std::int64_t passes() const noexcept { return state_->passes; }
  //! Wall-clock seconds of the drafter's forward passes so far.
  [[nodiscard]] double seconds() const noexcept { return state_->seconds; }

 private:
  struct request_state {
    int fed = 0;                 // cache slots [0, fed) hold rows made from real features
    std::vector<float> pending;  // real features of positions [fed, fed + pending/hidden)
    // A draft tree's step: the root row's real feature and each expanded node's predicted feature
    // (`[id][hidden]`, node 0 the root), kept per request while a batch's trees grow together.
    std::vector<float> root_feature, node_features;
  };
  // One request's rows of a drafter pass (a chain's, a root's catch-up or a tree depth's) and
  // their outputs.
  struct pass_rows {
    std::vector<std::int32_t> positions;
    std::vector<float> features, logits, hidden;
    feature_batch batch;
  };
  struct state {
    Model* model = nullptr;
    feature_draft_options opt;
    std::map<int, request_state> requests;
    pass_rows chain;                    // a chain's rows (`find`)
    std::vector<float> feature;         // the predicted feature a chain's next row takes
    std::vector<pass_rows> slots;       // a tree pass's rows, one per request of a batched call
    std::vector<std::size_t> staged;    // the calls of a batched call that run rows
    std::vector<feature_batch> batches;
    std::int64_t tokens_run = 0, passes = 0;
    double seconds = 0;
  };

  [[nodiscard]] int context() const { return static_cast<int>(state_->model->max_context()); }

  std::vector<pass_rows>& scratch(std::size_t n) {
    if (state_->slots.size() < n) state_->slots.resize(n);
    return state_->slots;
  }

  // Stages in `p` the catch-up rows `draft_root` runs: positions [fed, n − 1) of a history of n
  // tokens with their real features. False when nothing runs (see `draft_root`).
  bool stage_root(pass_rows& p, int request, std::span<const std::int32_t> history) {
    state& s = *state_;
    const int n = static_cast<int>(history.size());
    if (n < 2) return false;
    request_state& r = s.requests[request];
    check_history(request, r, history);
    if (n - 1 > context() || n - 1 - r.fed < 1) return false;
    stage_causal(p, request, history.subspan(static_cast<std::size_t>(r.fed) + 1), r.pending, r.fed);
    return true;
  }

  // After the catch-up ran: the cache holds every real row. The root's row (position n − 2) runs
  // again in every pass of the tree, so its real feature is kept.
  std::span<const float> finish_root(const pass_rows& p, int request, std::span<const std::int32_t> history) {
    request_state& r = state_->requests[request];
    const auto d = static_cast<std::ptrdiff_t>(state_->model->hidden_size());
    r.root_feature.assign(r.pending.end() - d, r.pending.end());
    r.fed = static_cast<int>(history.size()) - 1;
    r.pending.clear();
    r.node_features.assign(p.hidden.begin(), p.hidden.end());  // node 0's: the root's predicted feature
    return p.logits;
  }

  // Stages in `p` the rows of a draft tree's pass (see `draft_pass`); false when it does not fit
  // the drafter's context. Reads the request's state, changes none of it.
  bool stage_pass(pass_rows& p, int request, std::span<const std::int32_t> history, const draft_tree_pass& pass) {
    state& s = *state_;
    const int n = static_cast<int>(history.size());
    const int T = pass.shape.num_nodes();
    const auto d = static_cast<std::size_t>(s.model->hidden_size());
    const auto V = static_cast<std::size_t>(s.model->vocab_size());
    if (n < 2 || n - 2 + T > context()) return false;
    const request_state& r = s.requests[request];
    // Rows [c, T) run after slot n − 2 + c: all of them with the tree's mask, or a chain's last.
    const int c = pass.cached, R = T - c;
    p.features.resize(static_cast<std::size_t>(R) * d);
    for (int i = c; i < T; ++i) {
      const auto row = p.features.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(i - c) * d);
      if (i == 0) {
        if (r.root_feature.size() != d)
          throw invalid_input("feature drafter: request " + std::to_string(request) + " runs a tree pass before its root's");
        std::copy(r.root_feature.begin(), r.root_feature.end(), row);
        continue;
      }
      const auto parent = static_cast<std::size_t>(pass.ids[static_cast<std::size_t>(pass.shape.parent(i))]);
      if ((parent + 1) * d > r.node_features.size())
        throw invalid_input("feature drafter: a draft tree's pass expands node " + std::to_string(parent) +
                            " before its own row ran");
      std::copy_n(r.node_features.begin() + static_cast<std::ptrdiff_t>(parent * d), d, row);
    }
    p.positions.resize(static_cast<std::size_t>(R));
    for (int i = 0; i < R; ++i) p.positions[static_cast<std::size_t>(i)] = n - 2 + pass.shape.node_depth(c + i);
    const auto outs = static_cast<std::size_t>(pass.outputs);
    p.logits.resize(outs * V);
    p.hidden.resize(outs * d);
    p.batch = {};
    p.batch.request = request;
    p.batch.tokens = pass.tokens.subspan(static_cast<std::size_t>(c), static_cast<std::size_t>(R));
    p.batch.features = p.features;
    p.batch.positions = p.positions;
    p.batch.cache_length = n - 2 + c;
    p.batch.logits = p.logits;
    p.batch.hidden = p.hidden;
    if (c == 0) p.batch.tree_mask = pass.shape.mask_view();
    p.batch.outputs = pass.outputs;
    return true;
  }

  // After a tree pass ran: keeps its output nodes' predicted features for their children.
  std::span<const float> finish_pass(const pass_rows& p, int request, const draft_tree_pass& pass) {
    request_state& r = state_->requests[request];
    const auto d = static_cast<std::size_t>(state_->model->hidden_size());
    const auto T = static_cast<std::size_t>(pass.shape.num_nodes()), outs = static_cast<std::size_t>(pass.outputs);
    for (std::size_t j = 0; j < outs; ++j) {
      const auto id = static_cast<std::size_t>(pass.ids[T - outs + j]);
      if (r.node_features.size() < (id + 1) * d) r.node_features.resize((id + 1) * d);
      std::copy_n(p.hidden.begin() + static_cast<std::ptrdiff_t>(j * d), d,
                  r.node_features.begin() + static_cast<std::ptrdiff_t>(id * d));
    }
    return p.logits;
  }

  // A batched call: `stage(i)` stages call i's rows in slot i (false: it runs none, and its row
  // stays empty); then every staged call's rows run as one pass. `state_->staged` lists them.
  template <class Stage>
  void run_together(std::size_t n, std::span<std::span<const float>> rows, Stage&& stage) {
    state& s = *state_;
    s.staged.clear();
    for (std::size_t i = 0; i < n; ++i) {
      rows[i] = {};
      if (stage(i)) s.staged.push_back(i);
    }
    if (s.staged.empty()) return;
    s.batches.clear();
    std::size_t rows_run = 0;
    for (const std::size_t i : s.staged) {
      s.batches.push_back(s.slots[i].batch);
      rows_run += s.batches.back().tokens.size();
    }
    timed([&] { s.model->forward_batch(std::span<const feature_batch>(s.batches)); }, rows_run);
  }

  // The catch-up pass: positions [fed, n − 1) of a history of n tokens with their real features,
  // each row's token the one after it; the last row's outputs are left in `chain`.
  // False (nothing run) when the drafter drafted after this history already and nothing was
  // accepted since.
  bool catch_up(int request, request_state& r, std::span<const std::int32_t> history) {
    const int n = static_cast<int>(history.size());
    if (n - 1 - r.fed < 1) return false;
    run(request, history.subspan(static_cast<std::size_t>(r.fed) + 1), r.pending, r.fed);
    r.fed = n - 1;
    r.pending.clear();
    return true;
  }

  // Throws `invalid_input` unless the features of every position of `history` but the root's
  // arrived and its tokens the drafter has not run lie in the vocabulary.
  void check_history(int request, const request_state& r, std::span<const std::int32_t> history) const {
    const int n = static_cast<int>(history.size());
    const int vocab = static_cast<int>(state_->model->vocab_size());
    const int known = r.fed + static_cast<int>(r.pending.size() / static_cast<std::size_t>(state_->model->hidden_size()));
    if (known != n - 1)
      throw invalid_input("feature drafter: request " + std::to_string(request) + " has the features of " +
                          std::to_string(known) + " positions, drafting after " + std::to_string(n) +
                          " tokens needs " + std::to_string(n - 1));
    for (const std::int32_t t : history.subspan(static_cast<std::size_t>(r.fed)))
      if (t < 0 || t >= vocab)
        throw invalid_input("feature drafter: history token " + std::to_string(t) + " is outside its vocabulary of " +
                            std::to_string(vocab));
  }

  // Stages in `p` the causal rows (tokens[i], features[i]) at slots and positions `length + i`,
  // the last row's outputs wanted.
  void stage_causal(pass_rows& p, int request, std::span<const std::int32_t> tokens, std::span<const float> features,
                    int length) {
    p.positions.resize(tokens.size());
    for (std::size_t i = 0; i < tokens.size(); ++i) p.positions[i] = length + static_cast<int>(i);
    p.logits.resize(static_cast<std::size_t>(state_->model->vocab_size()));
    p.hidden.resize(static_cast<std::size_t>(state_->model->hidden_size()));
    p.batch = {};
    p.batch.request = request;
    p.batch.tokens = tokens;
    p.batch.features = features;
    p.batch.positions = p.positions;
    p.batch.cache_length = length;
    p.batch.logits = p.logits;
    p.batch.hidden = p.hidden;
  }

  // Runs a chain's rows (as `stage_causal` stages them); the last row's logits and predicted
  // feature are left in `state_->chain`.
  void run(int request, std::span<const std::int32_t> tokens, std::span<const float> features, int length) {
    stage_causal(state_->chain, request, tokens, features, length);
    forward(state_->chain.batch);
  }

  // The drafter's forward, counted in its cost.
  void forward(const feature_batch& b) {
    timed([&] { state_->model->forward(b); }, b.tokens.size());
  }

  // Runs `f` (one drafter pass), adding its time, one pass and `rows` rows to the drafter's counts.
  template <class F>
  void timed(F&& f, std::size_t rows) {
    state& s = *state_;
    const auto t0 = std::chrono::steady_clock::now();
    f();
    s.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    s.tokens_run += static_cast<std::int64_t>(rows);
    ++s.passes;
  }

  std::shared_ptr<state> state_;
};

MEDUSA_NAMESPACE_END
