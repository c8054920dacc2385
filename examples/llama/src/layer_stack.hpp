// SPDX-License-Identifier: Apache-2.0
// Private: the transformer layers shared by `engine` (one request, contiguous cache) and
// `batch_engine` (ragged batches over paged caches).
//
// A pass runs T rows. The projections are GEMMs over all T rows, so the weights are read once per
// pass whatever the number of requests; RoPE, the K/V writes and attention follow each row's
// segment: the rows of one request, its cache view, its committed length and its mask.
#pragma once

#include <medusa_llama/engine.hpp>
#include <medusa_llama/errors.hpp>
#include <medusa_llama/model.hpp>
#include <medusa_llama/thread_pool.hpp>

#include <medusa/kv_cache.hpp>
#include <medusa/tree/mask.hpp>

#include "gemm.hpp"

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace medusa_llama::detail {

//! The rows of one request in a pass: rows `[row0, row0 + rows)` of the pass, their K/V written at
//! slots `[cache_length, cache_length + rows)` of `kv`, attending to `[0, cache_length)` and to
//! each other under `mask` (empty: causal; else the first `rows` nodes of a tree).
template <class View>
struct segment {
  int row0 = 0;
  int rows = 0;
  int cache_length = 0;
  View kv{};
  medusa::tree_mask_view mask{};
};

//! Sizes, threads and kernels of a layer stack.
struct stack_options {
  int max_rows = 64;  //!< rows of one pass (sizes the activation buffers)
  int threads = 0;    //!< 0 = all hardware threads
  thread_pool* pool = nullptr;  //!< run on this pool instead of starting threads (`threads` ignored)
  gemm_backend backend = gemm_backend::automatic;
  int blas_min_batch = 1 << 20;
  weight_format weights = weight_format::f32;
  std::optional<weight_format> classifier_weights = {};

  //! The classifier's format (see medusa_llama::classifier_format).
  [[nodiscard]] weight_format classifier_format() const noexcept {
    return medusa_llama::classifier_format(weights, classifier_weights);
  }
};

//! Throws `engine_error` (`bad_option`) for a thread count, weight format or BLAS threshold out of range.
void check_stack_options(const stack_options& o);

//! Throws `engine_error` unless every token is in `[0, vocab)` (`bad_token`) and every position in
//! `[0, seq_len)` (`bad_position`). Rows are named from `row0` on, after `context` (e.g. "request 3: ");
//! `request` goes to the error.
void check_rows(const model_config& c, std::span<const std::int32_t> tokens, std::span<const std::int32_t> positions,
                int row0, const std::string& context = {}, int request = -1);

//! Throws `engine_error` (`bad_output`) unless each output span is empty or holds `rows` rows
//! (`vocab` floats a row for logits, `dim` for hidden states).
void check_outputs(const model_config& c, std::size_t rows, std::span<const float> logits, std::span<const float> hidden);

//! Throws `engine_error` (`bad_mask`) unless `mask` covers `n` rows, each of which sees itself and
//! no later row.
void check_tree_mask(const medusa::tree_mask_view& mask, int n);

//! Model, packed weights, RoPE tables, activation buffers and threads; runs passes of segments.
class layer_stack {
 public:
  //! Packs the weights and allocates buffers for `o.max_rows` rows (options checked by the caller).
  layer_stack(model m, const stack_options& o);

  [[nodiscard]] const model& weights() const noexcept { return m_; }
  [[nodiscard]] const model_config& config() const noexcept { return c_; }
  [[nodiscard]] thread_pool& pool() noexcept { return *pool_; }
  [[nodiscard]] int max_rows() const noexcept { return opt_.max_rows; }
  //! Bytes of packed projection weights (block matrices and classifier) one pass streams.
  [[nodiscard]] std::size_t packed_bytes() const noexcept;

  //! One pass of `T = tokens.size() <= max_rows()` rows at `positions`, split into `segments`
  //! (covering the rows, each row once). Final-normed hidden states and logits of the rows listed
  //! in `out_rows` go to consecutive rows of `hidden` / `logits` (null: not wanted). `inputs`
  //! (`[T][dim]`, null: the tokens' embeddings) are the first block's input rows, e.g. a feature
  //! drafter's projected features. No checks.
  template <class View>
  void run(std::span<const std::int32_t> tokens, std::span<const std::int32_t> positions,
           std::span<const segment<View>> segments, std::span<const int> out_rows, float* logits, float* hidden,
           const float* inputs = nullptr);

 private:
  struct packed_layer {
    packed_matrix wq, wk, wv, wo, w13, w2;  // w13: w1/w3 interleaved for the fused SwiGLU
  };
  // One projection of a job: Y (=|+=|swiglu) X · W^T, Y rows ldy apart.
  struct pjob {
    const packed_matrix* W;
    const float* raw;  // the model's row-major weights (OpenBLAS path); null for the SwiGLU pair
    float* Y;
    int ldy;
    epilogue op;
  };

  [[nodiscard]] bool use_blas(int T) const;
  void pack_weights();
  void linear(std::initializer_list<pjob> jobs, const float* X, int T, int in);
  void linear_blas(std::initializer_list<pjob> jobs, const float* X, int T, int in);
  void swiglu_blas(const float* X, int T);
  void rope(float* vec, int n_heads_here, int pos) const;
  // The pieces of a pass around the per-segment K/V writes and attention.
  void embed(std::span<const std::int32_t> tokens);
  void project_qkv(int layer, std::span<const std::int32_t> positions);
  void finish_layer(int layer, int T);
  void outputs(std::span<const int> out_rows, float* logits, float* hidden);

  model m_;
  model_config c_;
  stack_options opt_;
  std::unique_ptr<thread_pool> own_pool_;  // null when running on another's pool
  thread_pool* pool_;
  std::vector<packed_layer> packed_;
  packed_matrix cls_;
  std::vector<float> rope_cos_, rope_sin_;  // [seq_len][head_dim / 2]
  std::vector<float> x_, xb_, q_, k_, v_, att_, h1_, h3_, xf_;
  int cur_layer_ = 0;
};

extern template void layer_stack::run(std::span<const std::int32_t>, std::span<const std::int32_t>,
                                      std::span<const segment<medusa::kv_cache_view<float>>>, std::span<const int>,
                                      float*, float*, const float*);
extern template void layer_stack::run(std::span<const std::int32_t>, std::span<const std::int32_t>,
                                      std::span<const segment<medusa::paged_kv_cache_view<float>>>,
                                      std::span<const int>, float*, float*, const float*);

}  // namespace medusa_llama::detail
