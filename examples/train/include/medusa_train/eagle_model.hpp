// SPDX-License-Identifier: Apache-2.0
//! @file eagle_model.hpp
//! An EAGLE-style feature drafter (docs/training.md, "EAGLE-style feature drafters"): one Llama
//! block that predicts the target's next final-normed hidden state from the current one and the
//! next token, read out through the target's own classifier.
//!
//! Row i of a sequence t_0…t_{n−1} with the target's features f_0…f_{n−1} (its final-normed
//! hidden states, what its classifier consumes):
//!
//!     u_i = [E t_{i+1} ; f_i] (2d)   x_i = W_fc u_i (d)   g_i = norm(block(x)_i)   z_i = W_cls g_i
//!
//! with E the target's token embedding, W_cls its classifier (both frozen), the block a standard
//! Llama block (RoPE at position i, causal over rows ≤ i) and the final RMSNorm trainable. g_i
//! predicts f_{i+1}, z_i predicts t_{i+2}. Parameters and gradients are one flat array: W_fc
//! `[d][2d]` (out × in), then the block `rms_att, wq, wk, wv, wo, rms_ffn, w1 (gate), w2 (down),
//! w3 (up)`, then the final norm.
//!
//! @code
//! medusa_train::eagle_model em(target, 0, 7);     // hidden_dim 0: the target's
//! medusa_train::eagle_state st;
//! em.forward(next_tokens, features, st);          // rows: (E t_{i+1}, f_i), i = 0…m−1
//! em.logits(st, 0, m, z.data());                  // z: [m][V], row i predicts t_{i+2}
//! em.backward(st, m, dz.data(), dg.data(), grads.data());
//! em.to_model().save_llama2c("eagle/model.bin");  // the block, the target's E and classifier
//! em.save_fc("eagle/fc.bin");
//! @endcode
#pragma once

#include <medusa_train/lora_model.hpp>

#include <medusa_llama/model.hpp>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <vector>

namespace medusa_train {

//! Activations of one sequence through an `eagle_model`.
struct eagle_state {
  std::vector<float> u;   //!< [m][2d]: the rows' inputs [E t ; f] (with the noise, if any)
  sequence_state stack;   //!< the block's activations; `stack.hidden` is g ([m][d])
};

//! How `eagle_model::forward` runs.
struct eagle_forward_options {
  float noise = 0;         //!< add U(−noise, noise) to every feature input (training only)
  std::uint64_t seed = 0;  //!< the noise: a counter-based stream of this seed
};

//! The keys and values (after RoPE) of the rows a drafted row attends to, for `extend`.
struct eagle_chain {
  std::span<const float> prefix_k, prefix_v;  //!< [p][kv_dim] of rows 0…p−1 (e.g. from a forward)
  std::vector<float> k, v;                    //!< rows appended by `extend` after them
};

//! A one-block feature drafter on top of a frozen target (see the file comment).
class eagle_model {
 public:
  //! A fresh drafter for `target`: its config with one block, SwiGLU width `hidden_dim` (0: the
  //! target's). W_fc passes the features through (identity on their half) plus uniform noise of
  //! standard deviation 0.02, the block as `dense_model` initialises one, the final norm the
  //! target's (g starts on the features' scale). Throws `medusa::invalid_input` for a negative
  //! width.
  eagle_model(const medusa_llama::model& target, int hidden_dim, std::uint64_t seed);

  //! The drafter's shape: the target's with n_layers = 1 (and its own hidden_dim).
  [[nodiscard]] const medusa_llama::model_config& config() const noexcept { return config_; }
  //! The frozen target (its embedding and classifier are the drafter's).
  [[nodiscard]] const medusa_llama::model& target() const noexcept { return target_; }
  //! Every trainable weight, flat (layout in the file comment).
  [[nodiscard]] std::span<float> params() noexcept { return params_; }
  //! Every trainable weight (read-only).
  [[nodiscard]] std::span<const float> params() const noexcept { return params_; }
  //! W_fc, `[d][2d]` row-major.
  [[nodiscard]] std::span<const float> fc() const noexcept;

  //! Runs m = tokens.size() rows: row i takes (E[tokens[i]], features[i·d…]) at position i (the
  //! caller passes t_1…t_m and f_0…f_{m−1}). Keeps what `backward` needs in `st`. Throws
  //! `medusa::invalid_input` for an empty or over-long sequence or a token outside the vocabulary.
  void forward(std::span<const std::int32_t> tokens, const float* features, eagle_state& st, const eagle_forward_options& fo = {}) const;
  //! Logits of rows [row0, row0 + rows) of g, into `out` [rows][V].
  void logits(const eagle_state& st, std::size_t row0, std::size_t rows, float* out) const;
  //! Given the loss's gradient at the logits of rows 0…rows−1 (`dlogits`, [rows][V]) and, unless
  //! null, at g of those rows (`dg`, [rows][d]), *adds* the gradient of every trainable weight to
  //! `grads` (layout of `params()`).
  void backward(const eagle_state& st, std::size_t rows, const float* dlogits, const float* dg, float* grads) const;

  //! Drafts one row after those of `chain` (position = prefix rows + appended rows): input
  //! (E[token], feature), writes g [d] and, unless null, the logits [V]; appends its key and value.
  //! The same function as `forward`'s last row over the same inputs, one row at a time.
  void extend(eagle_chain& chain, std::int32_t token, const float* feature, float* g, float* logits) const;
  //! The keys (after RoPE) and values of a forward's rows, [m][kv_dim] each, for an `eagle_chain`.
  [[nodiscard]] static std::span<const float> keys(const eagle_state& st) noexcept { return st.stack.k[0]; }
  [[nodiscard]] static std::span<const float> values(const eagle_state& st) noexcept { return st.stack.v[0]; }

  //! The block, the final norm and the target's embedding and classifier as a one-layer engine
  //! model (a copy; the classifier tied to the embedding when the target's is).
  [[nodiscard]] medusa_llama::model to_model() const;
  //! Writes W_fc: `MEDUSAFC`, int32 version 1, int32 in (2d), int32 out (d), then out × in float32
  //! little-endian row-major; through a temporary file renamed over `path`. Throws
  //! `medusa::io_error`.
  void save_fc(const std::filesystem::path& path) const;

 private:
  [[nodiscard]] medusa_llama::layer_weights block(const float* base) const;

  medusa_llama::model target_;
  medusa_llama::model_config config_;
  std::vector<float> params_;
};

}  // namespace medusa_train
