// SPDX-License-Identifier: Apache-2.0
//! @file lora_model.hpp
//! A Llama backbone with LoRA adapters on every block's q, k, v, o, gate, up and down projections,
//! with the forward and backward pass of whole sequences: what Medusa-2 trains (docs/training.md).
//!
//! The base weights are the engine's `medusa_llama::model` and stay frozen; the adapters are
//! `A [r][in]`, `B [out][r]` per projection (PEFT's `lora_A`, `lora_B`), scaled by α/r, with
//! dropout on the adapter's input while training. `A` starts uniform in ±1/√in and `B` at 0
//! (PEFT's initialisation), so a new adapter computes the base model exactly.
//!
//! One sequence runs at a time per `sequence_state` (causal attention over its own tokens, positions
//! 0…n−1); callers run several states on several threads. Parameters and gradients are flat
//! arrays in the order of `adapter(l, p)`.
//!
//! @code
//! medusa_train::lora_model lm(model, {.rank = 32, .alpha = 16, .dropout = 0.05}, 7);
//! medusa_train::sequence_state st;
//! lm.forward(tokens, st, {.train = true, .seed = 1});       // st.hidden(): [n][d] final-normed
//! lm.backward(st, d_hidden.data(), grads.data());            // grads += d loss / d adapters
//! auto merged = lm.merged();                                 // a plain medusa_llama::model
//! @endcode
#pragma once

#include <medusa_train/backbone_math.hpp>

#include <medusa_llama/model.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace medusa_train {

//! LoRA hyper-parameters.
struct lora_options {
  std::size_t rank = 32;  //!< r: 1 ≤ r ≤ the narrowest adapted width (the model's d)
  double alpha = 16;      //!< scaling α (the update is (α/r)·B A)
  double dropout = 0.05;  //!< dropout of the adapter's input while training, in [0, 1)
};

//! The adapted projections of a block, in PEFT's module names.
enum class projection : std::uint8_t { q, k, v, o, gate, up, down };
//! Projections per block.
inline constexpr std::size_t projections_per_layer = 7;
//! PEFT / Hugging Face module name of a projection ("q_proj", …, "down_proj").
[[nodiscard]] std::string_view module_name(projection p) noexcept;
//! Module path within a Hugging Face Llama ("model.layers.3.self_attn.q_proj").
[[nodiscard]] std::string module_path(std::size_t layer, projection p);

//! How `lora_model::forward` runs.
struct forward_options {
  bool train = false;       //!< apply dropout (else the adapters run deterministically)
  bool adapters = true;     //!< false: the base model alone (the self-distillation teacher)
  std::uint64_t seed = 0;   //!< dropout masks: a counter-based stream of this seed
};

//! Activations of one sequence kept for the backward pass, and its outputs.
struct sequence_state {
  std::size_t n = 0;                 //!< tokens
  std::vector<std::int32_t> tokens;  //!< [n]
  std::vector<float> x;              //!< residual stream per block input and the last output [L+1][n][d]
  std::vector<float> hidden;         //!< final-normed hidden states [n][d]
  std::vector<float> final_r;        //!< final RMSNorm 1/rms [n]
  // Per block (index l), each [n][width]:
  std::vector<std::vector<float>> r_att, xn_att, q, k, v, probs, att, x_mid, r_ffn, xn_ffn, a, b, h;
  std::vector<std::vector<float>> xa;    //!< [L·7][n][r]: drop(x) Aᵀ per adapter
  std::vector<std::vector<float>> keep;  //!< [L·7][n][in]: dropout masks (empty without dropout)
  bool adapters = true;              //!< the forward used the adapters
};

//! A frozen Llama model plus trainable LoRA adapters.
class lora_model {
 public:
  //! Adapters of `opt` on every block of `base` (`A` from `seed`, `B` = 0). Throws
  //! `medusa::invalid_input` for a rank of 0 or above d, α ≤ 0, or dropout outside [0, 1).
  lora_model(medusa_llama::model base, const lora_options& opt, std::uint64_t seed);

  //! The frozen base model.
  [[nodiscard]] const medusa_llama::model& base() const noexcept { return base_; }
  //! The hyper-parameters.
  [[nodiscard]] const lora_options& options() const noexcept { return opt_; }
  //! All adapter parameters, flat (`A` then `B` of each adapter, adapters in block-major order).
  [[nodiscard]] std::span<float> params() noexcept { return params_; }
  //! All adapter parameters (read-only).
  [[nodiscard]] std::span<const float> params() const noexcept { return params_; }
  //! The linear layer of block `l`, projection `p`, with its adapter (pointers into `params()`).
  [[nodiscard]] backbone::lora_linear<float> adapter(std::size_t l, projection p) const;
  //! Offset of adapter (l, p)'s `A` in `params()` (`B` follows it).
  [[nodiscard]] std::size_t offset(std::size_t l, projection p) const noexcept { return offsets_[l * projections_per_layer + static_cast<std::size_t>(p)]; }

  //! Runs `tokens` (positions 0…n−1, n ≤ seq_len) and keeps what `backward` needs in `st`;
  //! `st.hidden` is the final-normed hidden state of every position (the classifier's input).
  //! Throws `medusa::invalid_input` for an empty or over-long sequence or a token outside the vocabulary.
  void forward(std::span<const std::int32_t> tokens, sequence_state& st, const forward_options& fo) const;
  //! Logits of rows [row0, row0 + rows) of `st.hidden` through the frozen classifier, into `out` [rows][V].
  void logits(const sequence_state& st, std::size_t row0, std::size_t rows, float* out) const;
  //! Adds to `d_hidden` ([rows][d], rows from `row0`) the gradient of the classifier's input given
  //! `dlogits` ([rows][V]).
  void classifier_backward(std::size_t rows, const float* dlogits, float* d_hidden) const;
  //! Back-propagates `d_hidden` ([n][d], gradient of the loss with respect to `st.hidden`) through
  //! the whole stack and *adds* the adapters' gradients to `grads` (layout of `params()`).
  //! `st` must come from a forward with the adapters on; its activations are overwritten.
  void backward(sequence_state& st, const float* d_hidden, float* grads) const;

  //! The base model with every adapter merged (W + (α/r)·B A), as a plain model.
  [[nodiscard]] medusa_llama::model merged() const;

 private:
  [[nodiscard]] std::vector<medusa_llama::layer_weights> layers() const;

  medusa_llama::model base_;
  lora_options opt_;
  std::vector<float> params_;
  std::vector<std::size_t> offsets_;
};

}  // namespace medusa_train
