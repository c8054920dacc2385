// SPDX-License-Identifier: Apache-2.0
//! @file decoder/model.hpp
//! What the decoding loops ask of an engine: a forward pass (one request, `forward_batch`, or a
//! ragged batch of requests, `ragged_batch`), its KV cache, optional hooks for caches whose pages
//! are mapped on demand, and draft heads.
//!
//! The accepted path of a tree step is committed in one of two ways:
//! - the model hands out a host-writable view of its cache (`kv_cache()`, `kv_cache(request)`)
//!   and the decoder moves the rows itself (`kv_commit`);
//! - the model commits itself (`commit(request, L, N, path)`, or `commit(L, N, path)` for one
//!   request), for a cache the host cannot write (device memory). It must then report
//!   `max_context()`, which bounds the context in place of a view's capacity. The decoder checks
//!   the path as `kv_commit` would before the call (`kv_cache_error`) and the returned length
//!   after it, and never calls `kv_cache` of such a model, even when it has one.
//!
//! Optional hooks, detected with `requires` (an engine without them is unchanged):
//! - `reserve(request, slots)`: before a forward that writes slots `[L, slots)` of `request`'s
//!   cache, the engine makes slots `[0, slots)` addressable (maps pages: `kv_pages_to_map`). It
//!   may return how many it made addressable, `[0, granted)` (`kv_granting_model`): when its pool
//!   is short, fewer than asked. The decoder then runs what fits: the first nodes of the tree (a
//!   subtree holding the root, closed under parent), a plain step, or a shorter prefill chunk; a
//!   request of which not one more slot fits fails with `kv_cache_error` (`kv_errc::pool_exhausted`).
//!   A `reserve` returning nothing grants every slot or throws.
//! - `release(request, length)`: after a commit (or a finished prefill), slots from `length` on
//!   are free; the engine may unmap whole pages past it (`kv_pages_releasable`).
//! - `max_context()`: the most slots a request may use. Without it the cache's capacity is the
//!   context, which for a lazily mapped cache is only what is mapped now. A model that commits
//!   itself must have it.
//!
//! The single-request `decoder` passes request id 0 to the hooks.
#pragma once

#include <medusa/config.hpp>
#include <medusa/kv_cache.hpp>
#include <medusa/tree/mask.hpp>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

MEDUSA_NAMESPACE_BEGIN

// ------------------------------------------------------------------------------------------------
// One request per forward
// ------------------------------------------------------------------------------------------------

//! One forward call of one request: `T = tokens.size()` new tokens whose K/V the model appends at
//! cache slots `[cache_length, cache_length + T)`.
//!
//! Output layout: row-major, one row per output token, rows `first_output_row .. T-1` in batch
//! order: `logits[(i - first_output_row) * vocab + v]`, `hidden[(i - first_output_row) * hidden_size + c]`.
//! An empty output span means "not wanted".
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

//! A model whose context is bounded apart from what its cache maps now: `max_context()`.
template <class M>
concept context_bounded_model = requires(const M& m) {
  { m.max_context() } -> std::convertible_to<int>;
};

namespace detail {
// A host-writable cache the decoder commits in: one request's, or any request's of a batch model.
template <class M>
concept writable_kv_cache_model = requires(M& m) {
  { m.kv_cache() } -> writable_kv_cache;
};
template <class M>
concept writable_request_kv_cache_model = requires(M& m, int request) {
  { m.kv_cache(request) } -> writable_kv_cache;
};
// A `commit` member of either form (the public concepts add `max_context()`).
template <class M>
concept has_single_kv_commit = requires(M& m, int committed_length, int num_tree_nodes, std::span<const int> path) {
  { m.commit(committed_length, num_tree_nodes, path) } -> std::convertible_to<int>;
};
template <class M>
concept has_request_kv_commit =
    requires(M& m, int request, int committed_length, int num_tree_nodes, std::span<const int> path) {
      { m.commit(request, committed_length, num_tree_nodes, path) } -> std::convertible_to<int>;
    };
}  // namespace detail

//! A single-request model that commits accepted paths in its own cache (which the host need not be
//! able to write, e.g. device memory): `commit(committed_length, num_tree_nodes, path)` moves the
//! K/V rows of nodes `path[j]` at slots `L + path[j]` to `L + j` and returns the new length
//! `L + A + 1` (`path` is `0 = p_0 < p_1 < ... < p_A`, as in `kv_commit`), and `max_context()`
//! bounds the context (there is no view to read a capacity from).
template <class M>
concept kv_committing_single_model = detail::has_single_kv_commit<M> && context_bounded_model<M>;

//! An engine's model as the single-request `decoder` drives it.
//!
//! - `forward(batch)` runs `batch.tokens` at `batch.positions`, writes their K/V at slots
//!   `[L, L+T)` of its cache, and fills logits and hidden states of the requested rows.
//! - Either `kv_cache()`, a writable `kv_cache_view` over all layers or a range of writable views
//!   (one per layer, `kv_layer_views`); the decoder commits accepted paths in it (any layout whose
//!   mapping satisfies `kv_layout_mapping`); its capacity bounds the context unless the model has
//!   `max_context()`.
//! - Or `commit(L, N, path)` and `max_context()` (`kv_committing_single_model`): the model commits
//!   itself, after the decoder has checked the path. A model with both forms is committed through
//!   `commit`.
//! - `vocab_size()`, `hidden_size()`.
template <class M>
concept decoder_model = requires(M& m, const forward_batch& batch) {
  { m.vocab_size() } -> std::convertible_to<int>;
  { m.hidden_size() } -> std::convertible_to<int>;
  m.forward(batch);
} && (detail::writable_kv_cache_model<M> || kv_committing_single_model<M>);

// ------------------------------------------------------------------------------------------------
// Several requests per forward (continuous batching)
// ------------------------------------------------------------------------------------------------

//! One forward call over the new tokens of B requests, concatenated (a ragged batch, in
//! FlashInfer's `qo_indptr` layout). Request `b` owns rows `[qo_indptr[b], qo_indptr[b+1])`:
//! `n_b` tokens whose K/V go to slots `[cache_lengths[b], cache_lengths[b] + n_b)` of request
//! `requests[b]`'s cache, and which see that request's committed slots `[0, cache_lengths[b])`.
//!
//! Within a request, visibility is `mask_of(b)`, the one accessor an engine needs: empty = causal
//! (prefill chunks); otherwise the request's tokens are the first `n_b` nodes of that tree
//! (`n_b = 1` is a plain step: the root sees itself) and token i sees token j iff
//! `mask_of(b).visible(i, j)`, i and j local to the request. Requests never see each other. The
//! decoders set one mask per request in every tree pass (`request_masks`), so requests of one pass
//! may run different trees or different parts of one tree.
//!
//! Output layout, row-major: with `last_row_only == false`, one row per token in batch order
//! (`logits[t * vocab + v]`, `t` in `[0, T)`); with `true`, one row per request, its last token
//! (`logits[b * vocab + v]`, as a prefill wants). The same for `hidden` (final-normed states).
//! An empty output span means "not wanted".
struct ragged_batch {
  std::span<const int> requests;            //!< `[B]` the engine's request ids
  std::span<const int> qo_indptr;           //!< `[B + 1]`, `qo_indptr[0] == 0`, non-decreasing, `qo_indptr[B] == T`
  std::span<const std::int32_t> tokens;     //!< `[T]` token ids
  std::span<const std::int32_t> positions;  //!< `[T]` absolute positions (RoPE)
  std::span<const int> cache_lengths;       //!< `[B]` committed slots of each request
  //! `[B]`: request b's mask (see `mask_of`); empty: every request is causal (a prefill pass)
  std::span<const tree_mask_view> request_masks = {};
  bool last_row_only = false;               //!< outputs for each request's last row only (`[B]` rows)
  std::span<float> logits;                  //!< `[T or B][vocab]`
  std::span<float> hidden;                  //!< `[T or B][hidden]`

  //! Number of requests.
  [[nodiscard]] int size() const noexcept { return static_cast<int>(requests.size()); }
  //! The mask of request `b`'s tokens: empty = causal, else its tree's (the first `count(b)` nodes).
  [[nodiscard]] tree_mask_view mask_of(int b) const noexcept {
    return request_masks.empty() ? tree_mask_view{} : request_masks[static_cast<std::size_t>(b)];
  }
  //! Tokens of request `b`.
  [[nodiscard]] int count(int b) const noexcept {
    return qo_indptr[static_cast<std::size_t>(b) + 1] - qo_indptr[static_cast<std::size_t>(b)];
  }
};

//! A batch model that commits accepted paths in its own caches (a GPU engine whose caches live in
//! device memory): `commit(request, committed_length, num_tree_nodes, path)` moves request
//! `request`'s K/V rows of nodes `path[j]` at slots `L + path[j]` to `L + j` and returns the new
//! length `L + A + 1` (`path` is `0 = p_0 < p_1 < ... < p_A`, as in `kv_commit`), and
//! `max_context()` bounds every request's context (there is no view to read a capacity from).
template <class M>
concept kv_committing_model = detail::has_request_kv_commit<M> && context_bounded_model<M>;

//! An engine's model as `batch_decoder` drives it: `forward(ragged_batch)`, `vocab_size()`,
//! `hidden_size()`, and either one KV cache per request (`kv_cache(request)`: a writable view, or
//! per-layer views) the decoder commits in, or `commit(request, L, N, path)` and `max_context()`
//! (`kv_committing_model`) for caches the host cannot write. A model with both forms is committed
//! through `commit`. The hooks of the file comment are optional.
template <class M>
concept batch_decoder_model = requires(M& m, const ragged_batch& batch) {
  { m.vocab_size() } -> std::convertible_to<int>;
  { m.hidden_size() } -> std::convertible_to<int>;
  m.forward(batch);
} && (detail::writable_request_kv_cache_model<M> || kv_committing_model<M>);

//! A model that maps cache pages on demand: `reserve(request, slots)`.
template <class M>
concept kv_reserving_model = requires(M& m, int request, int slots) { m.reserve(request, slots); };
//! A model whose `reserve(request, slots)` returns the slots it made addressable, which may be
//! fewer than asked when its pool is short (the decoder then takes a smaller step).
template <class M>
concept kv_granting_model = requires(M& m, int request, int slots) {
  { m.reserve(request, slots) } -> std::convertible_to<int>;
};
//! A model that frees cache pages past a request's length: `release(request, length)`.
template <class M>
concept kv_releasing_model = requires(M& m, int request, int length) { m.release(request, length); };

namespace detail {
// Slots a request of a batch model can hold: its `max_context()` when it has one (always, for a
// model that commits itself), else what its cache view addresses.
template <batch_decoder_model Model>
int request_context(Model& model, int request) {
  if constexpr (context_bounded_model<Model>) return static_cast<int>(model.max_context());
  else return kv_capacity(model.kv_cache(request));
}

// One causal forward of one request: `tokens` at `positions` after `cache_length` committed slots,
// outputs for every row (or the last one only).
template <batch_decoder_model Model>
void forward_request(Model& model, const int& request, std::span<const std::int32_t> tokens,
                     std::span<const std::int32_t> positions, int cache_length, bool last_row_only,
                     std::span<float> logits, std::span<float> hidden) {
  const int indptr[2] = {0, static_cast<int>(tokens.size())};
  const int lengths[1] = {cache_length};
  ragged_batch b;
  b.requests = std::span<const int>(&request, 1);
  b.qo_indptr = indptr;
  b.tokens = tokens;
  b.positions = positions;
  b.cache_lengths = lengths;
  b.last_row_only = last_row_only;
  b.logits = logits;
  b.hidden = hidden;
  model.forward(b);
}
}  // namespace detail

// ------------------------------------------------------------------------------------------------
// Draft heads
// ------------------------------------------------------------------------------------------------

//! Draft heads as the decoders drive them: `forward(hidden [d], logits [num_heads][vocab])`.
template <class H>
concept draft_heads = requires(H& h, std::span<const float> hidden, std::span<float> logits) {
  { h.num_heads() } -> std::convertible_to<int>;
  h.forward(hidden, logits);
};

//! Draft heads that also take several hidden states at once (`batch_decoder` uses this form when
//! present, unless the heads take request ids, `request_draft_heads`: the head weights are read
//! once for the whole batch): `forward(hidden [rows][d], rows, logits [rows][num_heads][vocab])`,
//! rows in the order `request_draft_heads` describes.
template <class H>
concept batched_draft_heads =
    draft_heads<H> && requires(H& h, std::span<const float> hidden, int rows, std::span<float> logits) {
      h.forward(hidden, rows, logits);
    };

//! Draft heads told which request each row serves (for heads keeping per-request state, e.g. a
//! draft model's own cache): `forward(hidden [rows][d], rows, requests [rows], logits
//! [rows][num_heads][vocab])`, `requests[r]` the engine's id of the request whose hidden state is
//! row `r`. `batch_decoder` uses this form when present (before the batched one), once per step
//! with at least one row. The rows are the requests chosen for a tree step (prefilled, no pending
//! EOS, at least two tokens to go and a whole tree's room in their context), in slot order: the
//! order of `step()`'s updates and of the members of the step's `ragged_batch` (a joining request
//! takes the first free slot, so this is not join order); requests still prefilling or taking a
//! plain step have no row. A row's request may still end with a plain step (its per-step drafter drafts
//! nothing, or its KV pool grants too little). Each id appears at most once per call. The
//! single-request `decoder` passes request id 0.
//!
//! Optionally `release(request)`: the request left the batch (finished, failed or `leave`); its
//! state may go. Called once per request that left, after its slot is free (not for requests
//! still in the batch when the decoder is destroyed); it should not throw.
//! The single-row form (`draft_heads`) is still required: calibration and the step-cost probes
//! call it outside any request.
template <class H>
concept request_draft_heads =
    draft_heads<H> &&
    requires(H& h, std::span<const float> hidden, int rows, std::span<const int> requests, std::span<float> logits) {
      h.forward(hidden, rows, requests, logits);
    };

//! Heads (or a per-step drafter, drafts.hpp) told when a request leaves: `release(request)`.
template <class H>
concept request_releasing = requires(H& h, int request) { h.release(request); };

//! No draft heads: plain decoding through `batch_decoder` with a root-only tree.
struct no_heads {
  [[nodiscard]] static constexpr int num_heads() noexcept { return 0; }
  void forward(std::span<const float>, std::span<float>) const noexcept {}
};

//! Adapts a `head_stack` (heads.hpp) and a GEMM policy to `batched_draft_heads`. Owns the
//! stack's forward workspace, sized for one hidden state and grown (once) for larger batches.
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
  //! Head logits `[K][V]` of one hidden state.
  void forward(std::span<const float> hidden, std::span<float> logits) { forward(hidden, 1, logits); }
  //! Head logits `[rows][K][V]` of `rows` hidden states `[rows][d]`.
  void forward(std::span<const float> hidden, int rows, std::span<float> logits) {
    const auto m = static_cast<std::size_t>(rows);
    if (workspace_.size() < stack_->workspace_size(m)) workspace_.resize(stack_->workspace_size(m));
    stack_->forward(*gemm_, hidden, m, logits, workspace_);
  }

 private:
  const Stack* stack_;
  Gemm* gemm_;
  std::vector<float> workspace_;
};

MEDUSA_NAMESPACE_END
