// SPDX-License-Identifier: Apache-2.0
//! @file packed_heads.hpp
//! Medusa heads on the engine's own kernels and threads: a `medusa::batched_draft_heads` for
//! `medusa::decoder` and `medusa::batch_decoder` that packs a `head_stack` once into the engine's panel layout.
//!
//! The heads only propose drafts, which the base model verifies, so their precision changes how
//! many drafts are accepted, never the output. They are therefore packed in int8 by default (per
//! output column scales, 8-bit activations, int32 sums): a quarter of the bytes of float32
//! weights to stream per step.
//!
//! @code
//! medusa_llama::engine eng(std::move(m), opts);
//! medusa_llama::decoder_model model(eng);
//! auto loaded = medusa::load_heads("heads/");                       // medusa/io/head_checkpoint.hpp
//! medusa_llama::packed_heads heads(eng, loaded.heads.view());       // per-head projections
//! medusa::decoder dec(model, heads, medusa::tree::preset("mc_sim_7b_63"), medusa::greedy_policy{});
//! @endcode
#pragma once

#include <medusa_llama/batch_engine.hpp>
#include <medusa_llama/engine.hpp>

#include <medusa/heads.hpp>

#include <memory>
#include <span>

namespace medusa_llama {

//! K Medusa heads (ResBlocks and vocabulary projections) packed for the engine's kernels; runs on
//! the engine's thread pool. The engine must outlive the heads.
class packed_heads {
 public:
  //! Packs the first `num_heads` heads of `stack` (0 = all; a tree of depth D needs only D, and
  //! every head left out is weight streaming saved per step). Any weight dtype; a shared-lm_head
  //! stack packs its lm_head view too. Throws `engine_error` (`bad_option`) when the stack's
  //! hidden or vocabulary size differs from the model's or `num_heads` exceeds the stack's, and
  //! `medusa::invalid_input` from the stack's own checks (e.g. an unset weight).
  packed_heads(engine& eng, const medusa::head_stack<>& stack, weight_format format = weight_format::int8,
               int num_heads = 0);
  //! The same on a serving engine's threads (`batch_decoder`: use `forward(hidden, rows, logits)`).
  packed_heads(batch_engine& eng, const medusa::head_stack<>& stack, weight_format format = weight_format::int8,
               int num_heads = 0);
  packed_heads(packed_heads&&) noexcept;
  packed_heads& operator=(packed_heads&&) noexcept;
  ~packed_heads();

  [[nodiscard]] int num_heads() const noexcept;   //!< K
  [[nodiscard]] int vocab_size() const noexcept;  //!< V
  //! Logits `[K][V]` of one final-normed hidden state `[d]`. Throws `engine_error` (`bad_output`)
  //! on wrong span sizes.
  void forward(std::span<const float> hidden, std::span<float> logits);
  //! Logits `[rows][K][V]` of `rows` hidden states `[rows][d]` (a batch of requests): every
  //! weight is read once for all rows. Row m equals `forward` of hidden state m alone.
  void forward(std::span<const float> hidden, int rows, std::span<float> logits);

 private:
  packed_heads(thread_pool& pool, const model_config& config, const medusa::head_stack<>& stack,
               weight_format format, int num_heads);
  struct impl;
  std::unique_ptr<impl> p_;
};

}  // namespace medusa_llama
