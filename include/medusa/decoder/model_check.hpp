// SPDX-License-Identifier: Apache-2.0
//! @file decoder/model_check.hpp
//! One line per missing or wrong member of an engine's model, heads or drafter, instead of the
//! nested concept diagnostics a decoder's constraints print.
//!
//! Each `check_*<T>()` holds one `static_assert` per requirement of the matching concept
//! (`decoder_model`, `batch_decoder_model`, `draft_heads`, `step_drafts`): the compiler names every
//! requirement `T` misses, each in one sentence that says what to add. Put the check next to the
//! type, where its author reads the error first:
//!
//! @code
//! #include <medusa/decoder/model_check.hpp>
//! struct my_model { ... };
//! static_assert(medusa::check_decoder_model<my_model>());
//! static_assert(medusa::check_batch_decoder_model<my_engine>());
//! static_assert(medusa::check_draft_heads<my_heads>());
//! @endcode
//!
//! A check that passes returns true, so the `static_assert` around it only exists to run it; a
//! check never passes a type its concept refuses (`tests/unit/test_model_check.cpp`).
#pragma once

#include <medusa/config.hpp>
#include <medusa/decoder/model.hpp>
#include <medusa/drafts.hpp>

#include <concepts>
#include <cstdint>
#include <optional>
#include <span>

MEDUSA_NAMESPACE_BEGIN

namespace detail {
template <class M>
concept has_kv_cache_member = requires(M& m) { m.kv_cache(); };
template <class M>
concept has_request_kv_cache_member = requires(M& m, int request) { m.kv_cache(request); };
}  // namespace detail

//! Checks `M` against `decoder_model` (the single-request `decoder`, `generate_vanilla`).
template <class M>
constexpr bool check_decoder_model() {
  static_assert(requires(M& m) { { m.vocab_size() } -> std::convertible_to<int>; },
                "medusa: the model needs `int vocab_size()`");
  static_assert(requires(M& m) { { m.hidden_size() } -> std::convertible_to<int>; },
                "medusa: the model needs `int hidden_size()` (the width of the hidden states the heads read)");
  static_assert(requires(M& m, const forward_batch& b) { m.forward(b); },
                "medusa: the model needs `void forward(const medusa::forward_batch&)`");
  static_assert(detail::has_kv_cache_member<M> || detail::has_single_kv_commit<M>,
                "medusa: the model needs `kv_cache()` (a writable kv_cache_view the decoder commits in), "
                "or `int commit(int L, int N, std::span<const int> path)` with `int max_context()`");
  static_assert(!detail::has_kv_cache_member<M> || detail::writable_kv_cache_model<M> ||
                    kv_committing_single_model<M>,
                "medusa: the model's `kv_cache()` must return a writable cache: a kv_cache_view of non-const "
                "elements (or a range of them, one per layer) from a non-const member function");
  static_assert(!detail::has_single_kv_commit<M> || context_bounded_model<M>,
                "medusa: a model that commits itself (`commit(L, N, path)`) needs `int max_context()`");
  return decoder_model<M>;
}

//! Checks `M` against `batch_decoder_model` (`batch_decoder`, continuous batching).
template <class M>
constexpr bool check_batch_decoder_model() {
  static_assert(requires(M& m) { { m.vocab_size() } -> std::convertible_to<int>; },
                "medusa: the batch model needs `int vocab_size()`");
  static_assert(requires(M& m) { { m.hidden_size() } -> std::convertible_to<int>; },
                "medusa: the batch model needs `int hidden_size()` (the width of the hidden states the heads read)");
  static_assert(requires(M& m, const ragged_batch& b) { m.forward(b); },
                "medusa: the batch model needs `void forward(const medusa::ragged_batch&)` (read each request's "
                "mask with `batch.mask_of(b)`)");
  static_assert(detail::has_request_kv_cache_member<M> || detail::has_request_kv_commit<M>,
                "medusa: the batch model needs `kv_cache(int request)` (a writable kv_cache_view per request), or "
                "`int commit(int request, int L, int N, std::span<const int> path)` with `int max_context()`");
  static_assert(!detail::has_request_kv_cache_member<M> || detail::writable_request_kv_cache_model<M> ||
                    kv_committing_model<M>,
                "medusa: the batch model's `kv_cache(request)` must return a writable cache: a kv_cache_view of "
                "non-const elements (or a range of them, one per layer) from a non-const member function");
  static_assert(!detail::has_request_kv_commit<M> || context_bounded_model<M>,
                "medusa: a batch model that commits itself (`commit(request, L, N, path)`) needs `int max_context()`");
  return batch_decoder_model<M>;
}

//! Checks `H` against `draft_heads`.
template <class H>
constexpr bool check_draft_heads() {
  static_assert(requires(H& h) { { h.num_heads() } -> std::convertible_to<int>; },
                "medusa: the heads need `int num_heads()`");
  static_assert(requires(H& h, std::span<const float> hidden, std::span<float> logits) { h.forward(hidden, logits); },
                "medusa: the heads need `void forward(std::span<const float> hidden, std::span<float> logits)` "
                "(logits: [num_heads][vocab])");
  return draft_heads<H>;
}

//! Checks `D` against `step_drafts` (a per-step tree source such as `step_drafter`).
template <class D>
constexpr bool check_step_drafts() {
  static_assert(requires(D& d) { { d.max_nodes() } -> std::convertible_to<int>; },
                "medusa: the drafter needs `int max_nodes()` (the most nodes a drafted tree has)");
  static_assert(requires(D& d) { { d.max_depth() } -> std::convertible_to<int>; },
                "medusa: the drafter needs `int max_depth()`");
  static_assert(requires(D& d) { { d.heads_depth() } -> std::convertible_to<int>; },
                "medusa: the drafter needs `int heads_depth()` (how many heads its trees read)");
  static_assert(request_step_drafts<D> ||
                    requires(D& d, std::span<const std::int32_t> history, std::span<const float> logits, int vocab,
                             std::span<std::int32_t> tokens) {
                      { d.draft(history, logits, vocab, tokens) } -> std::same_as<std::optional<tree>>;
                    },
                "medusa: the drafter needs `std::optional<medusa::tree> draft(std::span<const std::int32_t> history, "
                "std::span<const float> head_logits, int vocab, std::span<std::int32_t> tokens)`, or the same with "
                "`int request` first");
  return step_drafts<D>;
}

MEDUSA_NAMESPACE_END
