// SPDX-License-Identifier: Apache-2.0
//! @file dense_model.hpp
//! A Llama model whose every weight trains (embedding, which is also the classifier, norms and
//! all projections), with the forward and backward pass of whole sequences: the small draft model
//! that `medusa-train --recipe draft` distils from the target (docs/training.md, "Draft models").
//!
//! It computes what the engine computes (`block_stack`: the same RMSNorm, RoPE, attention and
//! SwiGLU as `lora_model`), so `to_model()` decodes in `medusa_llama::engine` exactly as trained.
//! Parameters and gradients are one flat array: the token embedding `[V][d]`, then per block
//! `rms_att, wq, wk, wv, wo, rms_ffn, w1 (gate), w2 (down), w3 (up)`, then the final norm.
//!
//! @code
//! medusa_llama::model_config c{.dim = 128, .hidden_dim = 384, .n_layers = 2, .n_heads = 4,
//!                              .n_kv_heads = 4, .vocab_size = 2048, .seq_len = 512};
//! medusa_train::dense_model dm(c, 7);
//! medusa_train::sequence_state st;
//! dm.forward(tokens, st);
//! dm.logits(st, 0, st.n, z.data());              // z: [n][V]
//! dm.backward(st, st.n, dz.data(), grads.data()); // grads += d loss / d every weight
//! dm.to_model().save_llama2c("draft.bin");
//! @endcode
#pragma once

#include <medusa_train/lora_model.hpp>

#include <medusa_llama/model.hpp>

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace medusa_train {

//! A Llama model with every weight trainable; the classifier is the token embedding.
class dense_model {
 public:
  //! Random weights for `config` (its `shared_classifier` must be true): matrices uniform with
  //! standard deviation 0.02 (the block outputs wo and w2 scaled by 1/√(2L)), norms at 1. Throws
  //! `medusa_llama::load_error` for an invalid shape, `medusa::invalid_input` for a separate classifier.
  dense_model(const medusa_llama::model_config& config, std::uint64_t seed);
  //! A trainable copy of `m`'s weights (a model with a shared classifier).
  explicit dense_model(const medusa_llama::model& m);

  //! The shape.
  [[nodiscard]] const medusa_llama::model_config& config() const noexcept { return config_; }
  //! Every weight, flat (layout in the file comment).
  [[nodiscard]] std::span<float> params() noexcept { return params_; }
  //! Every weight (read-only).
  [[nodiscard]] std::span<const float> params() const noexcept { return params_; }

  //! Runs `tokens` (positions 0…n−1) and keeps what `backward` needs in `st`. Throws
  //! `medusa::invalid_input` for an empty or over-long sequence or a token outside the vocabulary.
  void forward(std::span<const std::int32_t> tokens, sequence_state& st) const;
  //! Logits of rows [row0, row0 + rows) of `st.hidden`, into `out` [rows][V].
  void logits(const sequence_state& st, std::size_t row0, std::size_t rows, float* out) const;
  //! Given `dlogits` ([rows][V], the loss's gradient at the logits of rows 0…rows−1 of `st`),
  //! *adds* the gradient of every weight to `grads` (layout of `params()`).
  void backward(const sequence_state& st, std::size_t rows, const float* dlogits, float* grads) const;

  //! The weights as an engine model (a copy).
  [[nodiscard]] medusa_llama::model to_model() const;

 private:
  [[nodiscard]] std::vector<medusa_llama::layer_weights> layers(const float* base) const;
  [[nodiscard]] std::size_t final_norm_offset() const noexcept;

  medusa_llama::model_config config_;
  std::vector<float> params_;
};

}  // namespace medusa_train
