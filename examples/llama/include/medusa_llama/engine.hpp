// SPDX-License-Identifier: Apache-2.0
//! @file engine.hpp
//! The example Llama engine: a batched CPU forward pass over an engine-owned KV cache, written
//! as a `medusa::decoder_model`, so `medusa::decoder` and `medusa::generate_vanilla` drive it.
//!
//! One `forward` call runs the T tokens of a `medusa::forward_batch` through the model together
//! (one small-M GEMM per projection over all T tokens), writes their keys and values at cache slots
//! `[L, L+T)` of `kv_cache()` (a `medusa::kv_cache_view`, `[layer][slot][kv_head][head_dim]`),
//! attends with `medusa::tree_attention` under the batch's causal or tree mask, and returns
//! logits and final-normed hidden states for the rows asked for. The decoder commits accepted
//! paths in the same view.
//!
//! @code
//! medusa_llama::engine e(medusa_llama::model::load_llama2c("stories260K.bin"));
//! auto heads = medusa::load_heads("heads/");                         // <medusa/io.hpp>
//! medusa_llama::packed_heads drafts(e, heads.heads.view());
//! medusa::decoder dec(e, drafts, medusa::tree::from_text("[[0],[0,0],[1]]"), medusa::greedy_policy{});
//! auto out = dec.generate(prompt, {.max_new_tokens = 128});
//! // the same tokens as medusa::generate_vanilla(e, prompt, medusa::greedy_policy{}, {.max_new_tokens = 128})
//! @endcode
#pragma once

#include <medusa/decoder.hpp>
#include <medusa/kv_cache.hpp>

#include <medusa_llama/errors.hpp>
#include <medusa_llama/model.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>

namespace medusa_llama {

class thread_pool;

//! How the projections of a batch are computed.
enum class gemm_backend {
  automatic,  //!< built-in small-M kernel below `engine_options::blas_min_batch` tokens, OpenBLAS above
  builtin,    //!< always the built-in register-blocked kernel
  blas,       //!< always OpenBLAS sgemm when T > 1 (falls back to built-in when not linked)
};

//! Precision of the projection weights inside the engine (the `model` itself stays float32).
enum class weight_format {
  f32,   //!< float32 weights and arithmetic (default; matches the reference outputs)
  bf16,  //!< weights rounded once to bf16 at construction and widened in registers; float32
         //!< activations and accumulation: half the weight bytes; logits move by ~1e-2
         //!< (see docs/engine.md)
  int8,  //!< symmetric int8 per output column (scale = max |w| / 127), activations quantized
         //!< per row the same way, exact int32 dot products (AVX512-VNNI; a portable path
         //!< elsewhere): a quarter of the bytes. For Medusa heads (`packed_heads`) only, whose
         //!< precision changes which drafts are proposed, never the output; the engine rejects it.
  q8_0,  //!< int8 in blocks of 32 weights along the input with one binary16 scale each: GGUF's
         //!< Q8_0, quantized by its reference rule (d = max |w| / 127, q = round(w / d)), so a
         //!< Q8_0 file packs without loss. Activations are quantized per row and block of 32
         //!< (int8, float32 scale); products summed exactly in int32 per block (AVX512-VNNI,
         //!< portable path elsewhere). 1.06 bytes a weight. See docs/engine.md.
  q4_0,  //!< 4-bit in blocks of 32 with one binary16 scale: GGUF's Q4_0 (d = w_max / -8, where
         //!< w_max is the weight of largest magnitude; q = min(15, ⌊w / d + 8.5⌋), w ≈ d · (q − 8)),
         //!< activations as for `q8_0`. 0.56 bytes a weight.
};

//! Name of a weight format ("f32", "bf16", "int8", "q8_0", "q4_0").
[[nodiscard]] constexpr const char* to_string(weight_format f) noexcept {
  switch (f) {
    case weight_format::f32: return "f32";
    case weight_format::bf16: return "bf16";
    case weight_format::int8: return "int8";
    case weight_format::q8_0: return "q8_0";
    case weight_format::q4_0: return "q4_0";
  }
  return "unknown";
}

//! The classifier's format: `classifier`, or when unset `weights` (`q8_0` under `q4_0`: 4-bit logits
//! cost the most accuracy for the fewest bytes).
[[nodiscard]] constexpr weight_format classifier_format(weight_format weights, std::optional<weight_format> classifier) noexcept {
  if (classifier) return *classifier;
  return weights == weight_format::q4_0 ? weight_format::q8_0 : weights;
}

//! Sizes and threading of an engine.
struct engine_options {
  int capacity = 0;        //!< KV slots per layer; 0 = the model's seq_len
  int max_batch = 64;      //!< most tokens in one pass (sizes the activation buffers); longer causal batches run in chunks
  int threads = 0;         //!< threads including the caller; 0 = all hardware threads
  //! Run on this pool (another engine's `pool()`, e.g. the target's for a draft model) instead of
  //! starting threads: `threads` is then ignored, and the pool must outlive the engine. Two
  //! engines used in turn on one pool leave no idle workers spinning on the cores the other needs.
  thread_pool* pool = nullptr;
  gemm_backend backend = gemm_backend::automatic;  //!< projection kernels
  //! With `automatic`, batches of at least this many tokens use OpenBLAS (the built-in packed
  //! kernel is faster at every batch size measured, so by default never).
  int blas_min_batch = 1 << 20;
  //! Weight precision of the projections (packed once at construction). With any format but
  //! `f32` every projection runs the built-in kernels whatever `backend` says.
  weight_format weights = weight_format::f32;
  //! Weight precision of the classifier; unset: `weights`, except `q8_0` when `weights` is `q4_0`
  //! (see `classifier_format`).
  std::optional<weight_format> classifier_weights = {};
};

//! A model plus its KV cache, activation buffers and threads; a `medusa::decoder_model`.
class engine {
 public:
  //! Allocates the cache (`capacity × n_layers × 2 × kv_dim` floats) and buffers. Throws
  //! `engine_error` (`bad_option`) for inconsistent options.
  explicit engine(model m, engine_options options = {});
  engine(const engine&) = delete;
  engine& operator=(const engine&) = delete;
  engine(engine&&) noexcept;
  engine& operator=(engine&&) noexcept;
  ~engine();

  //! The model's configuration.
  [[nodiscard]] const model_config& config() const noexcept;
  //! The model.
  [[nodiscard]] const model& weights() const noexcept;
  //! The options in effect (after defaults were resolved).
  [[nodiscard]] const engine_options& options() const noexcept;
  //! Bytes of packed weights one forward streams (projections and classifier, with their scales).
  [[nodiscard]] std::size_t weight_bytes() const noexcept;

  //! Vocabulary size.
  [[nodiscard]] int vocab_size() const noexcept;
  //! Hidden size (the model width).
  [[nodiscard]] int hidden_size() const noexcept;
  //! The KV cache: `[n_layers][capacity][n_kv_heads][head_dim]` floats (NHD).
  [[nodiscard]] medusa::kv_cache_view<float> kv_cache() noexcept;

  //! Runs `batch` (see `medusa::forward_batch`): T tokens at `batch.positions` (RoPE), their K/V
  //! written at slots `[L, L+T)` with `L = batch.cache_length`, attending to slots `[0, L)` and
  //! to the batch under its mask (causal when `batch.tree_mask` is empty); fills logits and hidden
  //! states of rows `[first_output_row, T)` into the non-empty output spans. Causal batches longer
  //! than `max_batch` run in chunks; a tree batch holds at most `max_batch` tokens. Throws
  //! `engine_error` for any inconsistent argument before anything is written.
  void forward(const medusa::forward_batch& batch);

  //! Causal prefill of `tokens` at positions and slots `start, start+1, ...`: the last token's
  //! logits and hidden state go to the non-empty spans.
  void prefill(std::span<const int> tokens, int start, std::span<float> last_logits,
               std::span<float> last_hidden = {});
  //! One token at position and slot `pos`, attending to `[0, pos)`.
  void decode(int token, int pos, std::span<float> logits, std::span<float> hidden = {});

  //! Slots per layer.
  [[nodiscard]] int capacity() const noexcept;
  //! Threads in use (including the caller).
  [[nodiscard]] int threads() const noexcept;
  //! The engine's worker threads, for work between forwards (e.g. the Medusa heads): sharing them
  //! keeps a second pool from spinning on the cores the next forward needs.
  [[nodiscard]] thread_pool& pool() noexcept;

 private:
  struct impl;
  std::unique_ptr<impl> p_;
};

static_assert(medusa::decoder_model<engine>);

}  // namespace medusa_llama
