// SPDX-License-Identifier: Apache-2.0
//! @file model.hpp
//! Llama-family model weights: configuration, loaders for llama2.c, Hugging Face and GGUF checkpoints.
//!
//! A `model` is an immutable set of float32 weights plus its `model_config`. It is cheap to copy:
//! copies share the storage (a read-only memory map of the checkpoint, or an owned buffer), which
//! lives until the last copy goes. Every pointer stays valid and every value unchanged for that
//! long; `release_pages` only takes mapped pages out of the resident set (the engines do so for the
//! matrices they have packed copies of), and a later read maps them in again from the file.
//! Quantized GGUF tensors are dequantized to float32 on load; `stored()` says what the file held.
//!
//! @code
//! auto m = medusa_llama::model::load_llama2c("stories260K.bin");
//! medusa_llama::engine e(m);
//! @endcode
#pragma once

#include <medusa_llama/errors.hpp>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace medusa_llama {

namespace detail {
class mapped_file;
}  // namespace detail

//! How RoPE pairs the dimensions of a head.
enum class rope_style {
  adjacent_pairs,  //!< (0,1), (2,3), ...: llama2.c and Meta checkpoints
  split_halves,    //!< (i, i + head_dim/2): Hugging Face `rotate_half`
};

//! Shape and hyper-parameters of a Llama model.
struct model_config {
  int dim = 0;          //!< model width
  int hidden_dim = 0;   //!< SwiGLU FFN width
  int n_layers = 0;     //!< transformer blocks
  int n_heads = 0;      //!< query heads
  int n_kv_heads = 0;   //!< key/value heads (GQA when < n_heads)
  int vocab_size = 0;   //!< vocabulary size
  int seq_len = 0;      //!< maximum position + 1
  float rms_eps = 1e-5f;        //!< RMSNorm epsilon
  float rope_theta = 10000.0f;  //!< RoPE base
  rope_style rope = rope_style::adjacent_pairs;  //!< RoPE pairing
  bool shared_classifier = true;  //!< classifier tied to the token embedding

  //! Width of one head.
  [[nodiscard]] int head_dim() const noexcept { return n_heads > 0 ? dim / n_heads : 0; }
  //! Width of all key (or value) heads of one token.
  [[nodiscard]] int kv_dim() const noexcept { return head_dim() * n_kv_heads; }
  //! Throws `load_error` (`bad_header`) naming the first inconsistent field; `origin` names the file.
  void validate(const std::string& origin) const;
  //! Number of float32 parameters (the classifier counted once when shared).
  [[nodiscard]] std::uint64_t parameter_count() const noexcept;
};

//! Reads the text of a Hugging Face `config.json` into the `model_config` that `model::load_hf`
//! uses (same checks: Llama or Mistral, silu, no RoPE scaling or biases, a valid shape). Throws
//! `load_error` (`bad_json`, `bad_header`, `unsupported`) with `origin` as the file name.
[[nodiscard]] model_config parse_hf_config(std::string_view json_text, const std::string& origin);

//! How a checkpoint stored a group of weight matrices (they are float32 in the `model` either way).
enum class stored_type {
  f32,    //!< float32
  f16,    //!< IEEE binary16
  bf16,   //!< bfloat16
  q8_0,   //!< ggml Q8_0: blocks of 32 int8 with one fp16 scale
  q4_0,   //!< ggml Q4_0: blocks of 32 4-bit values with one fp16 scale
  mixed,  //!< the matrices of the group differ
};

//! Name of a `stored_type` ("f32", "q8_0", ...).
[[nodiscard]] std::string_view to_string(stored_type type) noexcept;

//! Whether `path` is a GGUF file: its name ends in `.gguf`, or it is a regular file that starts
//! with the magic "GGUF".
[[nodiscard]] bool is_gguf(const std::filesystem::path& path);

//! Rows of a matrix with `heads` heads of `head_dim` rows (`cols` wide each), every head reordered
//! from RoPE on adjacent pairs (rows 2i, 2i+1) to RoPE on halves (rows i, i + head_dim/2): what
//! Hugging Face's conversion does to `wq` and `wk` of a Meta / llama2.c checkpoint (and to anything
//! with their output rows, such as a LoRA `lora_B`).
[[nodiscard]] std::vector<float> adjacent_to_halves(const float* w, std::size_t heads, std::size_t head_dim, std::size_t cols);

//! Pointers to one transformer block's weights (row-major `[out][in]`).
struct layer_weights {
  const float* rms_att = nullptr;  //!< `[dim]`
  const float* wq = nullptr;       //!< `[dim][dim]`
  const float* wk = nullptr;       //!< `[kv_dim][dim]`
  const float* wv = nullptr;       //!< `[kv_dim][dim]`
  const float* wo = nullptr;       //!< `[dim][dim]`
  const float* rms_ffn = nullptr;  //!< `[dim]`
  const float* w1 = nullptr;       //!< gate `[hidden][dim]`
  const float* w2 = nullptr;       //!< down `[dim][hidden]`
  const float* w3 = nullptr;       //!< up `[hidden][dim]`
};

//! Immutable float32 weights of a Llama model.
class model {
 public:
  //! Loads a llama2.c checkpoint (legacy "version 0": 7 × int32 header then float32 weights in
  //! run.c order), memory-mapped. Throws `load_error` on any inconsistency.
  static model load_llama2c(const std::filesystem::path& path);
  //! Loads a Hugging Face Llama directory (`config.json` + `model.safetensors`). F32 tensors are
  //! mapped, BF16/F16 converted. Throws `load_error`.
  static model load_hf(const std::filesystem::path& dir);
  //! Loads a GGUF file (versions 2 and 3) of architecture "llama" (llama.cpp's tensor names and
  //! layout: RoPE on adjacent pairs). F32, F16, BF16, Q8_0 and Q4_0 tensors are decoded into one
  //! owned float32 buffer; an absent `output.weight` means a shared classifier. Throws `load_error`
  //! naming the key or tensor at fault (`unsupported` for other architectures, tensor types, RoPE
  //! scaling or partial RoPE).
  static model load_gguf(const std::filesystem::path& path);
  //! A model with random weights (seeded; uniform in ±`scale`, norms around 1), for tests.
  static model random(const model_config& config, std::uint64_t seed, float scale = 0.1f);
  //! A model that owns a copy of the given weights (same layout as `layer_weights`, row-major
  //! `[out][in]`; `embedding` and `classifier` are `[vocab][dim]`, `rms_final` is `[dim]`);
  //! `classifier` is ignored (may be null) when `config.shared_classifier`: the embedding is used.
  //! Validates the config. Throws `load_error`: `bad_header` for the config, `size_mismatch` when
  //! `layers.size() != n_layers`, `missing_tensor` for a null pointer.
  static model from_parts(const model_config& config, const float* embedding, std::span<const layer_weights> layers,
                          const float* rms_final, const float* classifier);

  //! Writes the model as a llama2.c checkpoint (negative vocab when the classifier is separate,
  //! RoPE tables zero-filled), through a temporary file beside `path` renamed over it when
  //! complete. Only adjacent-pair RoPE models round-trip through this format.
  void save_llama2c(const std::filesystem::path& path) const;
  //! Writes a Hugging Face Llama directory that `load_hf` reads back: `dir/model.safetensors` (F32,
  //! `lm_head.weight` only when the classifier is separate) and `dir/config.json`; creates `dir`.
  //! Hugging Face RoPE is `split_halves`, so for an `adjacent_pairs` model the rows of every head of
  //! wq and wk are permuted into that order (the inverse of `convert_llama_weights_to_hf.py`): the
  //! directory computes the same function. Throws `load_error` (`open_failed`) when writing fails.
  void save_hf(const std::filesystem::path& dir) const;

  //! The same weights with only the first `layers` blocks (then the final norm and the
  //! classifier): the draft of self-speculative decoding. Shares the weights' storage.
  //! Throws `load_error` (`bad_header`) unless `1 <= layers <= n_layers`.
  [[nodiscard]] model first_layers(int layers) const;
  //! The same weights with another classifier (`[vocab][dim]`, owned by the new model; the token
  //! embedding stays, so the classifier is no longer shared), e.g. a self-speculative draft's
  //! classifier with a trained exit projection folded in (exit_projection.hpp). Shares the other
  //! weights' storage. Throws `load_error` (`size_mismatch`) unless it holds vocab × dim values.
  [[nodiscard]] model with_classifier(std::vector<float> classifier) const;

  //! The configuration.
  [[nodiscard]] const model_config& config() const noexcept { return config_; }
  //! `[vocab][dim]` token embedding.
  [[nodiscard]] const float* token_embedding() const noexcept { return embedding_; }
  //! Weights of block `l` (unchecked index).
  [[nodiscard]] const layer_weights& layer(int l) const noexcept { return layers_[static_cast<std::size_t>(l)]; }
  //! `[dim]` final RMSNorm weights.
  [[nodiscard]] const float* rms_final() const noexcept { return rms_final_; }
  //! `[vocab][dim]` classifier (the embedding when shared).
  [[nodiscard]] const float* classifier() const noexcept { return classifier_; }
  //! Bytes of weights one decoding step streams (all block matrices, norms and the classifier).
  [[nodiscard]] std::size_t weight_bytes() const noexcept;
  //! How the checkpoint stored the block matrices (wq, wk, wv, wo, w1, w2, w3 of every layer):
  //! `mixed` if they differ; f32 for llama2.c; the safetensors dtype for Hugging Face.
  [[nodiscard]] stored_type stored() const noexcept { return stored_; }
  //! How the checkpoint stored the classifier (`output.weight` / `lm_head.weight`, or the token
  //! embedding when the classifier is shared).
  [[nodiscard]] stored_type classifier_stored() const noexcept { return classifier_stored_; }

  //! Whether the weights are a read-only memory map of the checkpoint (llama2.c files) rather than
  //! an owned buffer (Hugging Face, GGUF, `random`, `from_parts`).
  [[nodiscard]] bool mapped() const noexcept { return mapping_ != nullptr; }
  //! A hint that `[first, first + count)` of the weights will not be read for a while: for a
  //! mapped model the whole pages inside the range leave the process's resident set (a later read
  //! maps them in again from the file: pointers and values stay as they were). Does nothing for
  //! owned buffers, whose pages cannot be dropped without losing them, and outside the weights.
  void release_pages(const float* first, std::size_t count) const noexcept;

 private:
  model() = default;
  // Pointers in run.c order; without the RoPE tables the classifier follows the final norm.
  void bind_llama2c(const float* data, bool rope_tables = true);

  model_config config_;
  std::shared_ptr<const void> storage_;
  std::shared_ptr<const detail::mapped_file> mapping_;  // storage_ again when that is a file mapping
  const float* embedding_ = nullptr;
  const float* rms_final_ = nullptr;
  const float* classifier_ = nullptr;
  std::vector<layer_weights> layers_;
  stored_type stored_ = stored_type::f32;
  stored_type classifier_stored_ = stored_type::f32;
};

}  // namespace medusa_llama
