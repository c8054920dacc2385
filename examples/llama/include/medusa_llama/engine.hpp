// SPDX-License-Identifier: Apache-2.0
//! @file engine.hpp
//! The batched CPU forward pass of the example Llama engine, with an engine-owned KV cache.
//!
//! One `forward` call runs T tokens through the model together (one small-M GEMM per projection
//! over all T tokens), writes their keys/values at the given cache slots, attends under a causal
//! or tree mask, and returns logits and final-normed hidden states for the rows asked for.
//!
//! @code
//! medusa_llama::engine e(medusa_llama::model::load_llama2c("stories260K.bin"));
//! std::vector<float> logits(e.config().vocab_size);
//! const int bos = 1;
//! e.prefill({&bos, 1}, 0, logits, {});        // position 0, slot 0; cache length 1
//! // A tree of 3 nodes (root + two children) after the prefix of length 1:
//! const int tok[3] = {5, 7, 9}, pos[3] = {1, 2, 2}, slot[3] = {1, 2, 3};
//! const std::uint32_t mask[3] = {0b001, 0b011, 0b101};   // row i sees its ancestors and itself
//! const int rows[3] = {0, 1, 2};
//! std::vector<float> tree_logits(3 * e.config().vocab_size);
//! e.forward(tok, pos, slot, medusa_llama::mask_source::tree(1, mask), {rows, tree_logits, {}});
//! @endcode
#pragma once

#include <medusa_llama/errors.hpp>
#include <medusa_llama/model.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
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
};

//! Sizes and threading of an engine.
struct engine_options {
  int capacity = 0;        //!< KV slots per layer; 0 = the model's seq_len
  int max_batch = 64;      //!< most tokens in one `forward` (sizes the activation buffers)
  int prefill_chunk = 64;  //!< tokens per chunk in `prefill` (≤ max_batch)
  int threads = 0;         //!< threads including the caller; 0 = all hardware threads
  gemm_backend backend = gemm_backend::automatic;  //!< projection kernels
  //! With `automatic`, batches of at least this many tokens use OpenBLAS (the built-in packed
  //! kernel is faster at every batch size measured, so by default never).
  int blas_min_batch = 1 << 20;
  //! Use the core `medusa::tree_attention` (include/medusa/attention.hpp) when the batch sits at
  //! slots prefix_len + i (prefill, decode, tree steps); other slot layouts and `false` use the
  //! engine's own kernel.
  bool core_attention = true;
  //! Weight precision of the projections (packed once at construction). With `bf16` every
  //! projection runs the bf16 kernel whatever `backend` says.
  weight_format weights = weight_format::f32;
};

//! Which earlier tokens each row of a batch attends to.
//!
//! Every row sees the committed prefix, KV slots `[0, prefix_len)`. Within the batch, a causal
//! source lets row i see rows j ≤ i; a tree source lets it see the rows whose bit is set in its
//! packed mask row (row-major `[T][ceil(T/32)]` uint32 words, bit j%32 of word j/32 of row i).
class mask_source {
 public:
  //! Causal batch after a prefix of `prefix_len` slots (prefill chunk or single token).
  static mask_source causal(int prefix_len) noexcept { return {prefix_len, {}, false}; }
  //! Tree batch after a prefix of `prefix_len` slots; `words` holds T × ceil(T/32) words.
  static mask_source tree(int prefix_len, std::span<const std::uint32_t> words) noexcept { return {prefix_len, words, true}; }

  //! Slots [0, prefix_len) are visible to every row.
  [[nodiscard]] int prefix_len() const noexcept { return prefix_len_; }
  //! True for a tree (packed) mask.
  [[nodiscard]] bool is_tree() const noexcept { return tree_; }
  //! The packed words (empty for causal).
  [[nodiscard]] std::span<const std::uint32_t> words() const noexcept { return words_; }
  //! Whether batch row i may see batch row j (T = batch size; unchecked).
  [[nodiscard]] bool visible(int i, int j, int T) const noexcept {
    if (!tree_) return j <= i;
    const std::size_t w = static_cast<std::size_t>((T + 31) / 32);
    return (words_[static_cast<std::size_t>(i) * w + static_cast<std::size_t>(j / 32)] >> (j % 32)) & 1u;
  }

 private:
  mask_source(int p, std::span<const std::uint32_t> w, bool t) noexcept : prefix_len_(p), words_(w), tree_(t) {}
  int prefix_len_;
  std::span<const std::uint32_t> words_;
  bool tree_;
};

//! What a `forward` returns: for each entry r of `rows` (batch row indices), logits at
//! `logits[k*vocab ...]` and final-normed hidden states at `hidden[k*dim ...]`, k = index in rows.
//! Either buffer may be empty (not wanted); non-empty ones must have exactly rows.size() entries.
struct forward_outputs {
  std::span<const int> rows;   //!< batch rows to output
  std::span<float> logits;     //!< rows.size() × vocab_size, or empty
  std::span<float> hidden;     //!< rows.size() × dim, or empty
};

//! One layer of the KV cache: K and V are `[capacity][n_kv_heads][head_dim]` float, contiguous.
struct kv_layer_view {
  float* k;                 //!< keys of slot 0
  float* v;                 //!< values of slot 0
  std::size_t slot_stride;  //!< floats between consecutive slots (= n_kv_heads × head_dim)
  int n_kv_heads;           //!< heads per slot
  int head_dim;             //!< floats per head
  int capacity;             //!< slots
};

//! A model plus its KV cache, activation buffers and threads.
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

  //! Runs a batch of T = tokens.size() tokens (1 ≤ T ≤ max_batch) at `positions` (RoPE), writing
  //! their K/V at `kv_slots` (distinct, ≥ mask.prefix_len(), < capacity), attending under `mask`
  //! (`mask.prefix_len()` ≤ `length()`), and fills `out`. Afterwards `length()` is at least
  //! max(kv_slots) + 1. Throws `engine_error` for any inconsistent argument (nothing is written).
  void forward(std::span<const int> tokens, std::span<const int> positions, std::span<const int> kv_slots,
               const mask_source& mask, const forward_outputs& out);

  //! Causal prefill of `tokens` at positions/slots `start, start+1, ...` in chunks of
  //! `prefill_chunk`, after the prefix [0, start) (`start` ≤ `length()`). Writes the last token's
  //! logits / hidden state (each may be empty). Sets `length()` to start + tokens.size().
  void prefill(std::span<const int> tokens, int start, std::span<float> last_logits, std::span<float> last_hidden);

  //! One token at position and slot `pos` (= `length()` usually) after the prefix [0, pos).
  void decode(int token, int pos, std::span<float> logits, std::span<float> hidden = {});

  //! Number of cache slots holding data (the high-water mark of written slots, or what
  //! `truncate` set).
  [[nodiscard]] int length() const noexcept;
  //! Forgets slots [n, length()). Throws `engine_error` when n < 0 or n > length().
  void truncate(int n);
  //! Slots per layer.
  [[nodiscard]] int capacity() const noexcept;
  //! The KV memory of layer `l` (for commit routines that move rows). Throws on a bad index.
  [[nodiscard]] kv_layer_view kv_layer(int l);
  //! Threads in use (including the caller).
  [[nodiscard]] int threads() const noexcept;
  //! The engine's worker threads, for work between forwards (e.g. the Medusa heads): sharing them
  //! keeps a second pool from spinning on the cores the next forward needs.
  [[nodiscard]] thread_pool& pool() noexcept;

 private:
  struct impl;
  std::unique_ptr<impl> p_;
};

}  // namespace medusa_llama
