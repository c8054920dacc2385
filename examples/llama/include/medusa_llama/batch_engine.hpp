// SPDX-License-Identifier: Apache-2.0
//! @file batch_engine.hpp
//! The serving form of the example Llama engine: one forward runs the new tokens of several
//! requests (a `medusa::ragged_batch`) over a paged KV cache, as a `medusa::batch_decoder_model`
//! with the optional hooks `reserve`, `release` and `max_context`.
//!
//! The engine owns one K pool and one V pool of `num_pages` pages, each page
//! `[page_size][n_kv_heads][head_dim]` per layer (`medusa::layout_kv_paged`, NHD pages), a free
//! list, and one block table per request (ids `0 .. max_requests-1`). Pages are mapped lazily:
//! `reserve(r, slots)` appends pages to request r's table until `slots` fit, `release(r, length)`
//! returns the pages wholly past `length` to the free list. `kv_cache(r)` is the paged view of
//! request r over the pages it holds now. Free pages are handed out in a scattered order, so a
//! request's pages are rarely adjacent in the pool.
//!
//! A forward runs the projections once over the tokens of all requests (the weights are read once
//! per pass), RoPE at each token's position, and attention per request over its own pages. A batch
//! of more than `max_tokens` tokens runs in several passes, cut between requests and, for causal
//! requests, inside one; a tree request's tokens must fit one pass.
//!
//! @code
//! medusa_llama::batch_engine e(medusa_llama::model::load_llama2c("stories260K.bin"),
//!                              {.page_size = 16, .max_requests = 8});
//! e.reserve(0, 5);  e.reserve(1, 3);                       // map pages for two prompts
//! const int requests[] = {0, 1}, indptr[] = {0, 5, 8}, lengths[] = {0, 0};
//! medusa::ragged_batch b;
//! b.requests = requests;  b.qo_indptr = indptr;  b.cache_lengths = lengths;
//! b.tokens = tokens;      b.positions = positions;          // 8 tokens: 5 of request 0, 3 of request 1
//! b.last_row_only = true; b.logits = logits;                // 2 × vocab: each prompt's last row
//! e.forward(b);
//! e.release(1, 0);                                          // request 1 is done: its pages are free
//! @endcode
#pragma once

#include <medusa/decoder/model.hpp>
#include <medusa/kv_cache.hpp>

#include <medusa_llama/engine.hpp>
#include <medusa_llama/errors.hpp>
#include <medusa_llama/model.hpp>

#include <memory>
#include <optional>

namespace medusa_llama {

class thread_pool;

//! Sizes, threads and weight precision of a `batch_engine`.
struct batch_engine_options {
  int page_size = 16;    //!< KV slots per page
  int num_pages = 0;     //!< pages in the pool; 0 = enough for `max_requests` full contexts
  int max_requests = 8;  //!< request ids are `0 .. max_requests-1`
  int max_context = 0;   //!< most slots of one request; 0 = the model's seq_len
  int max_tokens = 256;  //!< most tokens in one pass (sizes the activation buffers); more run in several passes
  int threads = 0;       //!< threads including the caller; 0 = all hardware threads
  thread_pool* pool = nullptr;  //!< run on this pool instead of starting threads (see `engine_options::pool`)
  weight_format weights = weight_format::f32;  //!< precision of the packed projections (see `engine_options`)
  std::optional<weight_format> classifier_weights = {};  //!< the classifier's (see `engine_options`)
};

//! A model, a paged KV pool shared by its requests, activation buffers and threads; a
//! `medusa::batch_decoder_model` with the `reserve`, `release` and `max_context` hooks.
class batch_engine {
 public:
  //! Allocates the pools (`2 × num_pages × page_size × n_layers × kv_dim` floats) and buffers.
  //! Throws `engine_error` (`bad_option`) for options out of range.
  explicit batch_engine(model m, batch_engine_options options = {});
  batch_engine(const batch_engine&) = delete;
  batch_engine& operator=(const batch_engine&) = delete;
  batch_engine(batch_engine&&) noexcept;
  batch_engine& operator=(batch_engine&&) noexcept;
  ~batch_engine();

  //! The model's configuration.
  [[nodiscard]] const model_config& config() const noexcept;
  //! The model.
  [[nodiscard]] const model& weights() const noexcept;
  //! The options in effect (after defaults were resolved).
  [[nodiscard]] const batch_engine_options& options() const noexcept;
  //! Vocabulary size.
  [[nodiscard]] int vocab_size() const noexcept;
  //! Hidden size (the model width).
  [[nodiscard]] int hidden_size() const noexcept;
  //! Most slots one request may use (`options().max_context`).
  [[nodiscard]] int max_context() const noexcept;

  //! The paged view of request `request`'s cache over the pages it holds now (capacity
  //! `pages_mapped(request) × page_size`). It stays valid until the next `reserve` or `release`
  //! of that request. Throws `engine_error` (`bad_request`) for an id out of range.
  [[nodiscard]] medusa::paged_kv_cache_view<float> kv_cache(int request);

  //! Maps pages to `request` until slots `[0, slots)` are addressable. Throws `engine_error`
  //! (`bad_request`, `bad_slot` when `slots` is negative or beyond `max_context()`,
  //! `out_of_pages` when the pool has too few free pages) and then changes nothing.
  void reserve(int request, int slots);
  //! Returns `request`'s pages wholly past slot `length` to the pool; `release(r, 0)` frees all of
  //! r's pages. Throws `engine_error` (`bad_request`, `bad_slot` for a negative length).
  void release(int request, int length);

  //! Runs `batch` (see `medusa::ragged_batch`): request `b`'s tokens write their K/V at slots
  //! `[cache_lengths[b], cache_lengths[b] + n_b)` of its cache, which must be mapped (`reserve`),
  //! and attend to its slots before them and to each other (causally, or under the tree mask);
  //! logits and final-normed hidden states of every row, or of each request's last row, go to the
  //! non-empty output spans. Throws `engine_error` for any inconsistent argument (naming the
  //! request where one is at fault) before anything is written.
  void forward(const medusa::ragged_batch& batch);

  //! Pages mapped to `request` now. Throws `engine_error` (`bad_request`) for an id out of range.
  [[nodiscard]] int pages_mapped(int request) const;
  //! Pages mapped to any request.
  [[nodiscard]] int pages_in_use() const noexcept;
  //! The most pages in use at once since construction or the last `reset_peak()`.
  [[nodiscard]] int peak_pages_in_use() const noexcept;
  //! Starts a new peak at the pages in use now.
  void reset_peak() noexcept;
  //! Pages not mapped to any request.
  [[nodiscard]] int free_pages() const noexcept;

  //! Threads in use (including the caller).
  [[nodiscard]] int threads() const noexcept;
  //! The engine's worker threads, for work between forwards (e.g. the Medusa heads).
  [[nodiscard]] thread_pool& pool() noexcept;

 private:
  struct impl;
  std::unique_ptr<impl> p_;
};

static_assert(medusa::batch_decoder_model<batch_engine>);
static_assert(medusa::kv_reserving_model<batch_engine>);
static_assert(medusa::kv_releasing_model<batch_engine>);
static_assert(medusa::context_bounded_model<batch_engine>);

}  // namespace medusa_llama
