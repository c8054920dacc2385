// SPDX-License-Identifier: Apache-2.0
//! @file cuda/device_step.hpp
//! Greedy decoding of a batch where every step stays on the device, around the engine's forward:
//! the step is captured once (a CUDA graph on a device) and replayed; after each replay the host
//! downloads only the committed tokens and each request's status.
//!
//!   Medusa step: heads(h) → candidates (per-head top-k + gather: tree tokens, positions L + depth)
//!                → the engine's forward over the B × N tree tokens → verify (greedy: accepted
//!                path, bonus) → KV commit of the accepted rows → bookkeeping (lengths, h of the
//!                final node for the next heads)
//!   plain step:  the engine's forward over B tokens → argmax → bookkeeping (length + 1)
//!
//! Near the end of its context, where the whole tree no longer fits, a request takes the largest
//! smaller tree that does (the tree cut at a lower depth), then plain steps, as
//! `medusa::batch_decoder` does: each size is a captured sequence of its own, replayed for the
//! requests of that size while the others go on with theirs. Every slot of the context is used, so
//! the tokens and their number equal plain greedy decoding's whenever each row of the engine's
//! pass is computed as it would be alone (see `check_row_invariance`).
//!
//! The engine supplies three things:
//! - an executor (executor.hpp): `stream_executor` on a device, `emulated_executor` in CI, or one
//!   derived from them;
//! - its prefill's results (`device_prefill`): the first token of each request, its committed
//!   length and (Medusa) the final-normed hidden state of its last prompt row;
//! - a capture-friendly `forward(const step_pass&)`: the model over the pass's rows, writing their
//!   K/V at slots `cache_lengths[b] + i`, their logits and (when asked) hidden states. It is called
//!   while a sequence is recorded, so it must not allocate or synchronise.
//!
//! @code
//! medusa::cuda::stream_executor ex(0);
//! medusa::cuda::device_step<medusa::cuda::stream_executor, medusa::bfloat16> step(ex, tree, heads);
//! auto results = step.generate(prefill, kv, {.max_new_tokens = 256, .max_context = 2048},
//!                              [&](const medusa::cuda::step_pass& p) { engine.forward_on_device(p); });
//! @endcode
#pragma once

#include <medusa/config.hpp>
#include <medusa/cuda/executor.hpp>
#include <medusa/cuda/kernels/batch_kv.hpp>
#include <medusa/cuda/kernels/kv_commit.hpp>
#include <medusa/cuda/kernels/step_bookkeeping.hpp>
#include <medusa/cuda/kernels/verify.hpp>
#include <medusa/cuda/launch.hpp>
#include <medusa/decoder/options.hpp>
#include <medusa/error.hpp>
#include <medusa/heads.hpp>
#include <medusa/tree.hpp>
#include <medusa/tree/mask.hpp>
#include <medusa/tree/prefix.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

MEDUSA_NAMESPACE_BEGIN
namespace cuda {

//! The rows a device step asks the engine's forward to run. Every pointer is executor memory that
//! stays valid for the whole `generate` (the forward is recorded once and replayed).
struct step_pass {
  int batch = 0;                               //!< B
  int rows_per_request = 1;                    //!< N: tree nodes (Medusa) or 1 (plain); B·N rows
  const std::int32_t* tokens = nullptr;        //!< [B·N] input tokens
  const std::int32_t* positions = nullptr;     //!< [B·N] their positions
  const std::int32_t* qo_indptr = nullptr;     //!< [B + 1] b·N
  const std::int32_t* cache_lengths = nullptr;  //!< [B] committed slots: row (b, i) writes K/V at slot L_b + i
  const std::uint32_t* tree_mask = nullptr;    //!< [N][words_per_row] packed ancestors; null: causal (N = 1)
  int words_per_row = 0;                       //!< of `tree_mask`
  float* logits = nullptr;                     //!< [B·N][vocab] out
  float* hidden = nullptr;                     //!< [B·N][dim] out: final-normed states; null: not needed
};

//! What the engine's prefill produced, one entry per request of the batch.
struct device_prefill {
  std::span<const std::int32_t> first;  //!< [B] the token chosen at the last prompt row
  std::span<const int> lengths;         //!< [B] committed slots (the prompt's length)
  std::span<const float> hidden;        //!< [B][dim] final-normed state of the last prompt row (Medusa)
};

//! Limits of one `generate`.
struct device_decode_options {
  int max_new_tokens = 0;  //!< at least 1
  int max_context = 0;     //!< slots of each request the KV holds (at least each prompt's length)
  int eos_token = -1;      //!< ends a request without being emitted (-1: none)
};

//! One request's output.
struct device_request_result {
  std::vector<std::int32_t> tokens;                //!< generated tokens
  stop_reason stop = stop_reason::max_tokens;     //!< `callback`: the token callback returned false
  int steps = 0;                                   //!< steps the request took part in
  std::string error;                               //!< with `failed`: the request, the step and the status
};

//! Figures of the last `generate`.
struct device_step_stats {
  int steps = 0;                    //!< replays
  std::vector<long long> accepted;  //!< Medusa: tree steps of requests by accepted drafts (0..depth)
  std::vector<long long> by_size;   //!< request steps by tree size, largest first (the plain step last)
  double capture_seconds = 0;       //!< warm-up runs and captures
  double step_seconds = 0;          //!< replays and their downloads
};

//! A token callback that never stops a request.
struct keep_decoding {
  constexpr bool operator()(int, std::int32_t) const noexcept { return true; }
};

namespace detail {

// The first `n` heads of `stack` (the ones a tree of depth n reaches).
inline head_stack<> first_heads(const head_stack<>& stack, std::size_t n) {
  head_stack<> out(stack.hidden_size(), stack.vocab_size(), n, stack.num_layers(), stack.kind());
  for (std::size_t h = 0; h < n; ++h) {
    for (std::size_t l = 0; l < stack.num_layers(); ++l) {
      const resblock_weights w = stack.resblock(h, l);
      out.set_resblock(h, l, w.weight, w.bias);
    }
    if (stack.kind() == projection_kind::per_head) out.set_projection(h, stack.projection(h));
  }
  if (stack.kind() == projection_kind::shared_lm_head) out.set_lm_head(stack.projection(0));
  return out;
}

template <class T>
struct step_bookkeeping_body {
  static constexpr int max_threads = 128;
  kernels::step_bookkeeping_args<T> args;
  template <class Ctx>
  MEDUSA_KERNEL_FN void operator()(Ctx& ctx) const {
    kernels::step_bookkeeping(ctx, args);
  }
};

struct plain_bookkeeping_body {
  static constexpr int max_threads = 128;
  kernels::plain_bookkeeping_args args;
  template <class Ctx>
  MEDUSA_KERNEL_FN void operator()(Ctx& ctx) const {
    kernels::plain_bookkeeping(ctx, args);
  }
};

}  // namespace detail

//! Greedy decoding with the step on the device (see the file comment). `Exec` is the executor,
//! `T` the element type of the hidden states the heads read (the engine's activation type).
template <class Exec, class T>
class device_step {
  static_assert(step_executor<Exec>, "device_step: Exec lacks what cuda/executor.hpp lists");

 public:
  //! Plain decoding of a model of `vocab_size` tokens.
  device_step(Exec& ex, int vocab_size) : ex_(ex), vocab_(vocab_size) {
    if (vocab_size < 1) throw invalid_input("device_step: vocabulary size " + std::to_string(vocab_size));
  }
  //! Medusa decoding over `tree` with the first `tree.depth()` of `heads`. Throws `invalid_input`
  //! for a tree of one node or fewer heads than its depth.
  device_step(Exec& ex, const medusa::tree& tree, const head_stack<>& heads)
      : ex_(ex), vocab_(static_cast<int>(heads.vocab_size())), dim_(static_cast<int>(heads.hidden_size())) {
    if (tree.num_nodes() < 2) throw invalid_input("device_step: a Medusa step needs a tree of at least 2 nodes");
    if (static_cast<int>(heads.num_heads()) < tree.depth())
      throw invalid_input("device_step: a depth-" + std::to_string(tree.depth()) + " tree needs " +
                          std::to_string(tree.depth()) + " heads, " + std::to_string(heads.num_heads()) + " are loaded");
    heads_.emplace(detail::first_heads(heads, static_cast<std::size_t>(tree.depth())));
    // The tree, then the tree cut at each lower depth: nodes are ordered by depth, so the first
    // depth_begin(d + 1) nodes are the ones of depth <= d.
    for (int d = tree.depth(); d >= 1; --d) {
      const int n = d == tree.depth() ? tree.num_nodes() : tree.depth_begin(d + 1);
      trees_.push_back(d == tree.depth() ? tree : medusa::detail::first_nodes(tree, n));
    }
  }

  [[nodiscard]] bool medusa() const noexcept { return heads_.has_value(); }  //!< Medusa or plain
  [[nodiscard]] const device_step_stats& stats() const noexcept { return stats_; }  //!< of the last `generate`
  //! Rows per request of the largest step (the tree's nodes, or 1).
  [[nodiscard]] int rows_per_request() const noexcept { return medusa() ? trees_.front().num_nodes() : 1; }
  //! Rows per request of each step size, largest first, the plain step (1) last.
  [[nodiscard]] std::vector<int> step_sizes() const {
    std::vector<int> n;
    for (const auto& t : trees_) n.push_back(t.num_nodes());
    n.push_back(1);
    return n;
  }

  //! Decodes the batch `start` describes for up to `opt.max_new_tokens` each. `kv` is the engine's
  //! cache with every request's slots `[0, opt.max_context)` addressable; `forward` runs the model
  //! over a `step_pass`; `on_token(request, token)` sees each emitted token and ends the request
  //! after it by returning false (`stop_reason::callback`). A request whose step reports a bad
  //! status (a NaN logit) ends alone with `failed`. Throws `invalid_input` for inconsistent
  //! arguments, before anything runs; executor errors propagate.
  template <class Forward, class OnToken = keep_decoding>
  std::vector<device_request_result> generate(const device_prefill& start, const kernels::batch_kv& kv,
                                              const device_decode_options& opt, Forward&& forward,
                                              OnToken&& on_token = {}) {
    using clock = std::chrono::steady_clock;
    const int B = static_cast<int>(start.first.size());
    check_arguments(start, kv, opt, B);
    stats_ = {};
    stats_.accepted.assign(medusa() ? sz(trees_.front().depth() + 1) : 1, 0);
    stats_.by_size.assign(trees_.size() + 1, 0);
    results_.assign(sz(B), {});
    std::vector<std::int32_t> length(start.lengths.begin(), start.lengths.end());  // committed slots
    std::vector<std::int32_t> pending(start.first.begin(), start.first.end());  // chosen, not yet committed

    const auto t0 = clock::now();
    allocate(B, kv);
    // Each sequence runs once outside the capture (so that libraries load what they load lazily),
    // then is captured; their effects (on uncommitted slots only: no request is a member yet) are
    // undone by uploading the state again.
    upload_state(B, start, opt.eos_token);
    for (std::size_t j = 0; j < levels_.size(); ++j) record(j, B, forward);
    ex_.sync();
    upload_state(B, start, opt.eos_token);
    for (std::size_t j = 0; j < levels_.size(); ++j)
      levels_[j].graph.emplace(ex_.capture([this, j, B, &forward] { record(j, B, forward); }));
    stats_.capture_seconds = std::chrono::duration<double>(clock::now() - t0).count();

    const auto t1 = clock::now();
    std::vector<char> active(sz(B), 1);
    int live = B;
    std::vector<std::int32_t> out_tokens, out_accept(sz(B)), out_bonus(sz(B)), out_status(sz(B));
    while (live > 0) {
      // Each live request takes the largest step that fits before the context's end. A plain step
      // commits the pending token, which is emitted now (a tree step emits it as its root); with
      // no slot left, the request ends here.
      for (auto& l : levels_) std::fill(l.members.begin(), l.members.end(), 0);
      const std::size_t plain = levels_.size() - 1;
      for (int b = 0; b < B; ++b) {
        if (!active[sz(b)]) continue;
        std::size_t j = 0;
        while (j < plain && length[sz(b)] + levels_[j].nodes > opt.max_context) ++j;
        if (j == plain) {
          if (!emit(b, pending[sz(b)], opt, on_token, active, live)) continue;
          if (length[sz(b)] >= opt.max_context) {
            finish(b, stop_reason::context_full, active, live);
            continue;
          }
        }
        levels_[j].members[sz(b)] = 1;
      }
      for (std::size_t j = 0; j < levels_.size() && live > 0; ++j) {
        level& l = levels_[j];
        if (std::find(l.members.begin(), l.members.end(), 1) == l.members.end()) continue;
        if (l.members != l.on_device) {
          // A request enters or leaves: what the sequence reported for it as a bystander is void.
          l.on_device = l.members;
          ex_.upload(l.active.template as<void>(), l.on_device.data(), sz(B) * 4);
          std::vector<std::int32_t> zeros(sz(B), 0);
          ex_.upload(l.status.template as<void>(), zeros.data(), sz(B) * 4);
        }
        if (j == plain) {
          // The plain step's inputs are each request's pending token at its next slot.
          ex_.upload(d_tokens_.template as<void>(), pending.data(), sz(B) * 4);
          ex_.upload(d_positions_.template as<void>(), length.data(), sz(B) * 4);
        } else {
          // The roots: every verify writes the bonus of every request, members or not, so the
          // host's copy is the one to trust when sequences alternate.
          ex_.upload(d_bonus_.template as<void>(), pending.data(), sz(B) * 4);
        }
        ex_.replay(*l.graph);
        ++stats_.steps;
        const int stride = l.stride;
        out_tokens.resize(sz(B) * sz(stride));
        ex_.download(out_tokens.data(), (j == plain ? d_chosen_ : d_path_tokens_).template as<const void>(),
                     out_tokens.size() * 4);
        if (j != plain) {
          ex_.download(out_accept.data(), d_accept_.template as<const void>(), sz(B) * 4);
          ex_.download(out_bonus.data(), d_bonus_.template as<const void>(), sz(B) * 4);
        }
        ex_.download(out_status.data(), l.status.template as<const void>(), sz(B) * 4);
        ex_.sync();
        for (int b = 0; b < B; ++b) {
          if (!l.members[sz(b)] || !active[sz(b)]) continue;
          ++results_[sz(b)].steps;
          ++stats_.by_size[j];
          if (out_status[sz(b)] != 0) {
            fail(b, out_status[sz(b)], j, active, live);
            continue;
          }
          if (j == plain) {
            length[sz(b)] += 1;
            pending[sz(b)] = out_tokens[sz(b)];
            continue;
          }
          const int a = out_accept[sz(b)];
          ++stats_.accepted[sz(a)];
          length[sz(b)] += a + 1;
          pending[sz(b)] = out_bonus[sz(b)];
          for (int i = 0; i <= a; ++i)
            if (!emit(b, out_tokens[sz(b) * sz(stride) + sz(i)], opt, on_token, active, live)) break;
        }
      }
    }
    stats_.step_seconds = std::chrono::duration<double>(clock::now() - t1).count();
    return std::move(results_);
  }

 private:
  static constexpr std::size_t sz(int v) noexcept { return static_cast<std::size_t>(v); }

  // One step size: a tree (Medusa) or the plain step, its buffers and its captured sequence.
  struct level {
    int nodes = 1;   // N
    int stride = 1;  // verify's path stride: depth + 1
    const medusa::tree* tree = nullptr;
    std::optional<typename Exec::step_op> op;
    executor_buffer<Exec> indptr, active, status, mask;
    std::optional<kernels::kv_commit_params> commit;
    std::optional<typename Exec::graph> graph;
    std::vector<std::int32_t> members, on_device;  // requests it advances, and what the device holds
  };

  void check_arguments(const device_prefill& start, const kernels::batch_kv& kv, const device_decode_options& opt,
                       int B) const {
    if (B < 1) throw invalid_input("device_step: an empty batch");
    if (start.lengths.size() != sz(B))
      throw invalid_input("device_step: " + std::to_string(start.lengths.size()) + " lengths for " + std::to_string(B) +
                          " requests");
    if (medusa() && start.hidden.size() != sz(B) * sz(dim_))
      throw invalid_input("device_step: " + std::to_string(start.hidden.size()) + " hidden values for " +
                          std::to_string(B) + " requests of " + std::to_string(dim_));
    if (opt.max_new_tokens < 1) throw invalid_input("device_step: max_new_tokens must be at least 1");
    if (opt.max_context < 1 || opt.max_context > kernels::batch_kv_capacity(kv))
      throw invalid_input("device_step: a context of " + std::to_string(opt.max_context) + " slots for a cache of " +
                          std::to_string(kernels::batch_kv_capacity(kv)));
    for (int b = 0; b < B; ++b) {
      const int L = start.lengths[sz(b)];
      if (L < 1 || L > opt.max_context)
        throw invalid_input("device_step: request " + std::to_string(b) + " has " + std::to_string(L) +
                            " committed slots, outside [1, " + std::to_string(opt.max_context) + "]");
      const std::int32_t t = start.first[sz(b)];
      if (t < 0 || t >= vocab_)
        throw invalid_input("device_step: request " + std::to_string(b) + "'s first token " + std::to_string(t) +
                            " is outside the vocabulary of " + std::to_string(vocab_));
    }
  }

  // Appends `token` to request b under its stop rules; false once the request is over.
  template <class OnToken>
  bool emit(int b, std::int32_t token, const device_decode_options& opt, OnToken& on_token, std::vector<char>& active,
            int& live) {
    if (!active[sz(b)]) return false;
    if (token == opt.eos_token) {
      finish(b, stop_reason::eos, active, live);
      return false;
    }
    results_[sz(b)].tokens.push_back(token);
    if (!on_token(b, token)) {
      finish(b, stop_reason::callback, active, live);
      return false;
    }
    if (static_cast<int>(results_[sz(b)].tokens.size()) >= opt.max_new_tokens) {
      finish(b, stop_reason::max_tokens, active, live);
      return false;
    }
    return true;
  }

  void finish(int b, stop_reason why, std::vector<char>& active, int& live) {
    results_[sz(b)].stop = why;
    active[sz(b)] = 0;
    --live;
  }

  void fail(int b, std::int32_t status, std::size_t j, std::vector<char>& active, int& live) {
    const level& l = levels_[j];
    results_[sz(b)].error = "request " + std::to_string(b) + ": step " + std::to_string(stats_.steps) + " (" +
                            (l.tree != nullptr ? std::to_string(l.nodes) + "-node tree" : std::string("plain")) +
                            "): " + std::string(to_string(static_cast<request_status>(status)));
    finish(b, stop_reason::failed, active, live);
  }

  void allocate(int B, const kernels::batch_kv& kv) {
    kv_ = kv;
    const std::size_t b = sz(B), V = sz(vocab_), d = sz(dim_);
    const int N = rows_per_request();
    auto i32 = [&](std::size_t count) { return executor_buffer<Exec>(ex_, std::max<std::size_t>(count, 1) * 4); };
    d_tokens_ = i32(b * sz(N));
    d_positions_ = i32(b * sz(N));
    d_lengths_ = i32(b);
    d_logits_ = executor_buffer<Exec>(ex_, b * sz(N) * V * sizeof(float));
    d_chosen_ = i32(b);
    levels_.clear();
    levels_.resize(trees_.size() + 1);
    for (std::size_t j = 0; j <= trees_.size(); ++j) {
      level& l = levels_[j];
      if (j < trees_.size()) {
        l.tree = &trees_[j];
        l.nodes = l.tree->num_nodes();
        l.stride = l.tree->depth() + 1;
      }
      l.indptr = i32(b + 1);
      l.active = i32(b);
      l.status = i32(b);
      l.members.assign(b, 0);
      l.on_device.assign(b, 0);
      std::vector<std::int32_t> indptr(b + 1);
      for (int r = 0; r <= B; ++r) indptr[sz(r)] = r * l.nodes;
      ex_.upload(l.indptr.template as<void>(), indptr.data(), indptr.size() * 4);
      if (l.tree == nullptr) continue;
      std::vector<std::uint32_t> words(sz(l.nodes) * sz(l.tree->words_per_row()));
      copy_packed_mask(*l.tree, std::span<std::uint32_t>(words));
      l.mask = executor_buffer<Exec>(ex_, words.size() * 4);
      ex_.upload(l.mask.template as<void>(), words.data(), words.size() * 4);
      l.op.emplace(ex_.make_step_op(*l.tree, static_cast<int>(heads_->num_heads()), B, vocab_));
    }
    if (medusa()) {
      const int stride = trees_.front().depth() + 1;
      d_hidden_ = executor_buffer<Exec>(ex_, b * sz(N) * d * sizeof(float));
      d_head_input_ = executor_buffer<Exec>(ex_, b * d * sizeof(T));
      d_head_logits_ = executor_buffer<Exec>(ex_, b * heads_->num_heads() * V * sizeof(float));
      d_accept_ = i32(b);
      d_next_node_ = i32(b);
      d_bonus_ = i32(b);
      d_eos_ = i32(b);
      d_best_row_ = i32(b);
      d_path_nodes_ = i32(b * sz(stride));
      d_path_tokens_ = i32(b * sz(stride));
      d_new_lengths_ = i32(b);
      d_eos_tokens_ = i32(b);
      heads_op_.emplace(ex_.template make_heads_op<T>(*heads_, B));
    }
    argmax_op_.emplace(ex_.make_argmax_op(B, vocab_));
  }

  void upload_state(int B, const device_prefill& start, int eos_token) {
    std::vector<std::int32_t> lengths(start.lengths.begin(), start.lengths.end()), zeros(sz(B), 0);
    ex_.upload(d_lengths_.template as<void>(), lengths.data(), sz(B) * 4);
    // Valid inputs in every row, so that no pass ever reads a token outside the vocabulary.
    const int N = rows_per_request();
    std::vector<std::int32_t> tokens(sz(B) * sz(N)), positions(tokens.size());
    for (std::size_t r = 0; r < tokens.size(); ++r) {
      tokens[r] = start.first[r / sz(N)];
      positions[r] = lengths[r / sz(N)];
    }
    ex_.upload(d_tokens_.template as<void>(), tokens.data(), tokens.size() * 4);
    ex_.upload(d_positions_.template as<void>(), positions.data(), positions.size() * 4);
    for (level& l : levels_) {
      std::fill(l.on_device.begin(), l.on_device.end(), 0);
      ex_.upload(l.active.template as<void>(), zeros.data(), sz(B) * 4);
      ex_.upload(l.status.template as<void>(), zeros.data(), sz(B) * 4);
    }
    if (!medusa()) return;
    ex_.upload(d_bonus_.template as<void>(), start.first.data(), sz(B) * 4);
    std::vector<T> h(sz(B) * sz(dim_));
    for (std::size_t i = 0; i < h.size(); ++i) h[i] = store_float<T>(start.hidden[i]);
    ex_.upload(d_head_input_.template as<void>(), h.data(), h.size() * sizeof(T));
    std::vector<std::int32_t> eos(sz(B), eos_token);
    ex_.upload(d_eos_tokens_.template as<void>(), eos.data(), eos.size() * 4);
  }

  step_pass pass_of(const level& l, int B) const {
    step_pass p;
    p.batch = B;
    p.rows_per_request = l.nodes;
    p.tokens = d_tokens_.template as<const std::int32_t>();
    p.positions = d_positions_.template as<const std::int32_t>();
    p.qo_indptr = l.indptr.template as<const std::int32_t>();
    p.cache_lengths = d_lengths_.template as<const std::int32_t>();
    p.logits = d_logits_.template as<float>();
    if (l.tree != nullptr) {
      p.tree_mask = l.mask.template as<const std::uint32_t>();
      p.words_per_row = l.tree->words_per_row();
      p.hidden = d_hidden_.template as<float>();
    }
    return p;
  }

  // The launches of level j's step: what its graph holds.
  template <class Forward>
  void record(std::size_t j, int B, Forward& forward) {
    level& l = levels_[j];
    auto* status = l.status.template as<std::int32_t>();
    if (l.tree == nullptr) {
      forward(pass_of(l, B));
      ex_.argmax(*argmax_op_, d_logits_.template as<const float>(), d_chosen_.template as<std::int32_t>(), status);
      detail::plain_bookkeeping_body body;
      body.args.batch = B;
      body.args.chosen = d_chosen_.template as<const std::int32_t>();
      body.args.active = l.active.template as<const std::int32_t>();
      body.args.lengths = d_lengths_.template as<std::int32_t>();
      body.args.tokens = d_tokens_.template as<std::int32_t>();
      body.args.positions = d_positions_.template as<std::int32_t>();
      ex_.launch(kernels::plan_bookkeeping(B), body);
      return;
    }
    ex_.heads(*heads_op_, d_head_input_.template as<const T>(), d_head_logits_.template as<float>());
    ex_.candidates(*l.op, d_head_logits_.template as<const float>(), d_bonus_.template as<const std::int32_t>(),
                   d_lengths_.template as<const std::int32_t>(), d_tokens_.template as<std::int32_t>(),
                   d_positions_.template as<std::int32_t>(), status);
    forward(pass_of(l, B));
    kernels::verify_args<float> v{};
    v.logits = d_logits_.template as<const float>();
    v.row_stride = vocab_;
    v.node_tokens = d_tokens_.template as<const std::int32_t>();
    v.eos_tokens = d_eos_tokens_.template as<const std::int32_t>();
    v.path_stride = l.stride;
    v.accept_length = d_accept_.template as<std::int32_t>();
    v.next_node = d_next_node_.template as<std::int32_t>();
    v.bonus = d_bonus_.template as<std::int32_t>();
    v.eos = d_eos_.template as<std::int32_t>();
    v.best_row = d_best_row_.template as<std::int32_t>();
    v.path_nodes = d_path_nodes_.template as<std::int32_t>();
    v.path_tokens = d_path_tokens_.template as<std::int32_t>();
    v.status = status;
    ex_.verify(*l.op, v);
    if (!l.commit) {
      kernels::kv_commit_params cp;
      static_cast<kernels::batch_kv&>(cp) = kv_;
      cp.batch.size = B;
      cp.batch.committed_lengths = d_lengths_.template as<const std::int32_t>();
      cp.batch.paths = d_path_nodes_.template as<const std::int32_t>();
      cp.batch.new_lengths = d_new_lengths_.template as<std::int32_t>();
      cp.batch.path_stride = l.stride;  // the paths are verify's output rows
      cp.batch.accept_lengths = d_accept_.template as<const std::int32_t>();
      l.commit = cp;
    }
    ex_.kv_commit(*l.commit);
    detail::step_bookkeeping_body<T> body;
    body.args.batch = B;
    body.args.nodes = l.nodes;
    body.args.dim = dim_;
    body.args.next_node = d_next_node_.template as<const std::int32_t>();
    body.args.new_lengths = d_new_lengths_.template as<const std::int32_t>();
    body.args.active = l.active.template as<const std::int32_t>();
    body.args.lengths = d_lengths_.template as<std::int32_t>();
    body.args.hidden = d_hidden_.template as<const float>();
    body.args.head_input = d_head_input_.template as<T>();
    ex_.launch(kernels::plan_bookkeeping(B), body);
  }

  Exec& ex_;
  int vocab_ = 0, dim_ = 0;
  std::optional<head_stack<>> heads_;
  std::vector<medusa::tree> trees_;  // the tree, then cut at each lower depth
  kernels::batch_kv kv_{};
  device_step_stats stats_;
  std::vector<device_request_result> results_;
  std::vector<level> levels_;  // one per tree of trees_, then the plain step
  executor_buffer<Exec> d_tokens_, d_positions_, d_lengths_, d_logits_, d_chosen_, d_hidden_, d_head_input_,
      d_head_logits_, d_accept_, d_next_node_, d_bonus_, d_eos_, d_best_row_, d_path_nodes_, d_path_tokens_,
      d_new_lengths_, d_eos_tokens_;
  std::optional<typename Exec::template heads_op<T>> heads_op_;
  std::optional<typename Exec::argmax_op> argmax_op_;
};

}  // namespace cuda
MEDUSA_NAMESPACE_END
