// SPDX-License-Identifier: Apache-2.0
// Private: the GPU engine's forward pass, written once over an executor so that the same code runs
// on a CUDA device (device_executor.cuh: cuBLAS GEMMs, real launches) and in CI on the host
// (host_executor.hpp: reference GEMMs, the kernel emulation).
//
// An executor provides memory (`alloc`, `upload`, `download`, `fill_zero`), `launch(shape, body)`
// for the functors of kernels.hpp, `gemm` (Y = X·Wᵀ (+ Y), float output), and `attention` (the
// library's tree-attention launch). Weights and activations are in T (float, half or bfloat16),
// the residual stream, logits and hidden states in float. Per layer:
//
//   RMSNorm → X (T) → [Wq; Wk; Wv] GEMM → RoPE + K/V to the cache → attention (T out)
//   → Wo GEMM (+= residual) → RMSNorm → [W1; W3] GEMM → SwiGLU (T) → W2 GEMM (+= residual)
//
// (the [W1; W3] GEMM and SwiGLU are one `gemm_swiglu` where the executor's `fused_swiglu<T>()`)
//
// then the final RMSNorm of the output rows (float hidden + T) and the classifier GEMM.
#pragma once

#include <medusa_llama/model.hpp>

#include <medusa/cuda/kernels/attention.hpp>
#include <medusa/cuda/executor.hpp>
#include <medusa/cuda/kernels/batch_kv.hpp>
#include <medusa/cuda/kernels/skinny_gemm.hpp>
#include <medusa/cuda/launch.hpp>
#include <medusa/half.hpp>

#include "kernels.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace medusa_llama::cuda_detail {

inline std::size_t sz(long long v) { return static_cast<std::size_t>(v); }

// float → T on the host, rounded to nearest even.
template <class T>
T to_element(float x) {
  if constexpr (std::is_same_v<T, float>) return x;
  else return T(x);
}

// Executor memory that frees itself (the executor outlives it).
template <class Exec>
using buffer = medusa::cuda::executor_buffer<Exec>;

// Uploads `n` floats converted to T; returns the executor buffer.
template <class T, class Exec>
buffer<Exec> upload_as(Exec& ex, const float* src, std::size_t n) {
  buffer<Exec> b(ex, n * sizeof(T));
  if constexpr (std::is_same_v<T, float>) {
    ex.upload(b.template as<T>(), src, n * sizeof(T));
  } else {
    std::vector<T> staging(n);
    for (std::size_t i = 0; i < n; ++i) staging[i] = to_element<T>(src[i]);
    ex.upload(b.template as<T>(), staging.data(), n * sizeof(T));
  }
  return b;
}

// Uploads the row blocks `parts` (each `rows × cols` floats) stacked into one T matrix.
template <class T, class Exec>
buffer<Exec> upload_stacked(Exec& ex, std::initializer_list<std::pair<const float*, std::size_t>> parts, std::size_t cols) {
  std::size_t rows = 0;
  for (const auto& p : parts) rows += p.second;
  std::vector<float> staging;
  staging.reserve(rows * cols);
  for (const auto& p : parts) staging.insert(staging.end(), p.first, p.first + p.second * cols);
  return upload_as<T>(ex, staging.data(), staging.size());
}

// [W1; W3] with the rows interleaved for the skinny GEMM's SwiGLU epilogue: groups of eight gate
// rows and their eight up rows (`skinny_gemm_swiglu_source`), zero rows past the last column.
template <class T, class Exec>
buffer<Exec> upload_swiglu(Exec& ex, const float* w1, const float* w3, std::size_t hidden, std::size_t cols) {
  namespace mk = medusa::cuda::kernels;
  const int columns = static_cast<int>(hidden);
  const std::size_t features = sz(mk::skinny_gemm_swiglu_features(columns));
  std::vector<float> staging(features * cols, 0.0f);
  for (std::size_t f = 0; f < features; ++f) {
    const int src = mk::skinny_gemm_swiglu_source(static_cast<int>(f), columns);
    if (src < 0) continue;
    const float* row = src < columns ? w1 + sz(src) * cols : w3 + sz(src - columns) * cols;
    std::copy(row, row + cols, staging.begin() + static_cast<std::ptrdiff_t>(f * cols));
  }
  return upload_as<T>(ex, staging.data(), staging.size());
}

// The model's weights in executor memory: projections in T (fused [Wq; Wk; Wv] and [W1; W3], the
// latter interleaved where the executor fuses SwiGLU into its GEMM), norms in float, RoPE tables
// as the CPU engine computes them.
template <class Exec, class T>
struct device_weights {
  struct layer {
    buffer<Exec> rms_att, wqkv, wo, rms_ffn, w13, w2;
  };
  buffer<Exec> embedding, classifier, rms_final, rope_cos, rope_sin;
  std::vector<layer> layers;
  bool shared_classifier = true;
  bool swiglu_w13 = false;  // w13 interleaved for `Exec::gemm_swiglu`

  model_config config;

  device_weights(Exec& ex, const model& m) : swiglu_w13(ex.template fused_swiglu<T>()), config(m.config()) {
    const model_config& c = m.config();
    const std::size_t d = sz(c.dim), kvd = sz(c.kv_dim()), H = sz(c.hidden_dim), V = sz(c.vocab_size);
    embedding = upload_as<T>(ex, m.token_embedding(), V * d);
    shared_classifier = m.classifier() == m.token_embedding();
    if (!shared_classifier) classifier = upload_as<T>(ex, m.classifier(), V * d);
    rms_final = upload_as<float>(ex, m.rms_final(), d);
    for (int l = 0; l < c.n_layers; ++l) {
      const layer_weights& w = m.layer(l);
      layer dl;
      dl.rms_att = upload_as<float>(ex, w.rms_att, d);
      dl.wqkv = upload_stacked<T>(ex, {{w.wq, d}, {w.wk, kvd}, {w.wv, kvd}}, d);
      dl.wo = upload_as<T>(ex, w.wo, d * d);
      dl.rms_ffn = upload_as<float>(ex, w.rms_ffn, d);
      dl.w13 = swiglu_w13 ? upload_swiglu<T>(ex, w.w1, w.w3, H, d) : upload_stacked<T>(ex, {{w.w1, H}, {w.w3, H}}, d);
      dl.w2 = upload_as<T>(ex, w.w2, d * H);
      layers.push_back(std::move(dl));
    }
    upload_rope(ex);
  }

  // Random weights of `c`'s shape made on the device (benchmarks of real shapes without their
  // checkpoints): projections uniform in ±1/sqrt(inputs), the embedding in ±1, norms 1.
  device_weights(Exec& ex, const model_config& c, std::uint64_t seed)
      : swiglu_w13(ex.template fused_swiglu<T>()), config(c) {
    const std::size_t d = sz(c.dim), kvd = sz(c.kv_dim()), H = sz(c.hidden_dim), V = sz(c.vocab_size);
    std::uint64_t salt = seed * 0x2545F4914F6CDD1Dull + 1;
    auto fill = [&](buffer<Exec>& b, std::size_t n, float scale, auto element) {
      using E = decltype(element);
      b = buffer<Exec>(ex, n * sizeof(E));
      const int blocks = static_cast<int>(std::min<std::size_t>((n + 255) / 256, 4096));
      ex.launch({.grid_x = blocks, .grid_y = 1, .threads = 256, .shared_bytes = 0},
                fill_body<E>{b.template as<E>(), n, scale, 1.0f, salt++});
    };
    const float in_d = 1.0f / std::sqrt(static_cast<float>(d)), in_h = 1.0f / std::sqrt(static_cast<float>(H));
    fill(embedding, V * d, 1.0f, T{});
    shared_classifier = c.shared_classifier;
    if (!shared_classifier) fill(classifier, V * d, in_d, T{});
    fill(rms_final, d, 0.0f, float{});
    for (int l = 0; l < c.n_layers; ++l) {
      layer dl;
      fill(dl.rms_att, d, 0.0f, float{});
      fill(dl.wqkv, (d + 2 * kvd) * d, in_d, T{});
      fill(dl.wo, d * d, in_d, T{});
      fill(dl.rms_ffn, d, 0.0f, float{});
      const std::size_t ffn_rows =
          swiglu_w13 ? sz(medusa::cuda::kernels::skinny_gemm_swiglu_features(static_cast<int>(H))) : 2 * H;
      fill(dl.w13, ffn_rows * d, in_d, T{});  // an interleaved W's pad rows (if any) are never read out
      fill(dl.w2, d * H, in_h, T{});
      layers.push_back(std::move(dl));
    }
    upload_rope(ex);
  }

  // The CPU engine's RoPE tables, to the bit: freq = θ^(−2i/D) in float, angle = pos · freq.
  void upload_rope(Exec& ex) {
    const model_config& c = config;
    const int hd = c.head_dim(), half = hd / 2;
    std::vector<float> cs(sz(c.seq_len) * sz(half)), sn(cs.size());
    for (int pos = 0; pos < c.seq_len; ++pos)
      for (int i = 0; i < half; ++i) {
        const float freq = 1.0f / std::pow(c.rope_theta, static_cast<float>(2 * i) / static_cast<float>(hd));
        const float val = static_cast<float>(pos) * freq;
        cs[sz(pos) * sz(half) + sz(i)] = std::cos(val);
        sn[sz(pos) * sz(half) + sz(i)] = std::sin(val);
      }
    rope_cos = upload_as<float>(ex, cs.data(), cs.size());
    rope_sin = upload_as<float>(ex, sn.data(), sn.size());
  }

  [[nodiscard]] const T* classifier_weights() const noexcept {
    return shared_classifier ? embedding.template as<const T>() : classifier.template as<const T>();
  }
};

// One forward pass; every pointer is executor memory.
struct pass_desc {
  int tokens = 0;  // T rows
  int batch = 0;   // B requests
  int max_tokens_per_request = 0;
  const std::int32_t* token_ids = nullptr;      // [T]
  const std::int32_t* positions = nullptr;      // [T]
  const std::int32_t* qo_indptr = nullptr;      // [B + 1]
  const std::int32_t* cache_lengths = nullptr;  // [B]
  medusa::cuda::kernels::batch_kv kv;           // the caches in batch order (block tables [B][..])
  medusa::cuda::kernels::attention_mask_kind mask = medusa::cuda::kernels::attention_mask_kind::causal;
  const std::uint32_t* tree_mask = nullptr;
  int words_per_row = 0;
  const std::int32_t* tree_mask_offsets = nullptr;
  int out_rows = 0;                             // rows of logits / hidden
  const std::int32_t* out_row_index = nullptr;  // [out_rows] pass row of each output row; null: rows 0..out_rows-1
  float* logits = nullptr;                      // [out_rows][vocab] or null
  float* hidden = nullptr;                      // [out_rows][dim] or null
};

// Sizes of the activation buffers and the attention split, fixed for an engine.
struct forward_sizes {
  int max_tokens = 0;     // rows of one pass
  int max_batch = 0;      // requests of one pass
  int max_context = 0;    // most keys of one request
  int kv_split = 0;       // keys per attention split (0: from max_context)
  bool single_query_attention = true;  // decode passes on the single-query attention kernel
};

// The activations of one pass and the layer loop.
template <class Exec, class T>
class forward_core {
 public:
  forward_core(Exec& ex, device_weights<Exec, T> w, const forward_sizes& s)
      : ex_(ex), c_(w.config), w_(std::move(w)), s_(s) {
    namespace mk = medusa::cuda::kernels;
    if (s_.kv_split == 0) s_.kv_split = mk::default_attention_kv_split(s_.max_context);
    const std::size_t rows = sz(s.max_tokens), d = sz(c_.dim), H = sz(c_.hidden_dim);
    qkv_cols_ = (c_.n_heads + 2 * c_.n_kv_heads) * c_.head_dim();
    x_ = buffer<Exec>(ex, rows * d * sizeof(float));
    xb_ = buffer<Exec>(ex, rows * d * sizeof(T));
    qkv_ = buffer<Exec>(ex, rows * sz(qkv_cols_) * sizeof(float));
    att_ = buffer<Exec>(ex, rows * d * sizeof(T));
    if (!w_.swiglu_w13) gu_ = buffer<Exec>(ex, rows * 2 * H * sizeof(float));  // fused: no float gate/up
    h_ = buffer<Exec>(ex, rows * H * sizeof(T));
    // The attention workspace for the largest pass this engine runs.
    const mk::attention_plan worst = mk::plan_attention(problem(s.max_batch, s.max_tokens, std::min(s.max_tokens, s.max_context), mk::attention_mask_kind::tree));
    attn_ws_ = buffer<Exec>(ex, worst.workspace_bytes);
  }

  [[nodiscard]] const model_config& config() const noexcept { return c_; }
  [[nodiscard]] const device_weights<Exec, T>& weights() const noexcept { return w_; }
  [[nodiscard]] const forward_sizes& sizes() const noexcept { return s_; }

  // The attention problem of a pass (`kv_split` the engine's).
  [[nodiscard]] medusa::cuda::kernels::attention_problem problem(int batch, int tokens, int per_request,
                                                                 medusa::cuda::kernels::attention_mask_kind mask) const {
    return {.batch = batch, .max_tokens = tokens, .max_tokens_per_request = per_request,
            .max_kv_length = s_.max_context, .num_q_heads = c_.n_heads, .num_kv_heads = c_.n_kv_heads,
            .head_dim = c_.head_dim(), .mask = mask, .kv_split = s_.kv_split,
            .single_query_kernel = s_.single_query_attention};
  }

  // Runs a pass (sizes checked by the caller: T ≤ max_tokens, B ≤ max_batch, slots mapped).
  void run(const pass_desc& p) {
    namespace mk = medusa::cuda::kernels;
    namespace mc = medusa::cuda;
    const int n = p.tokens, d = c_.dim, H = c_.hidden_dim, D = c_.head_dim();
    const mc::launch_shape norm_rows = row_shape(n, d);
    const mc::launch_shape rope_rows = rope_shape(n, c_.n_heads, c_.n_kv_heads, D);
    ex_.launch(elementwise_shape(n, d), embed_body<T>{w_.embedding.template as<const T>(), p.token_ids, x_.template as<float>(), d,
                                    c_.vocab_size});
    const mk::attention_plan plan = mk::plan_attention(problem(p.batch, n, p.max_tokens_per_request, p.mask));
    for (int l = 0; l < c_.n_layers; ++l) {
      const auto& w = w_.layers[sz(l)];
      ex_.launch(norm_rows, rmsnorm_body<T>{x_.template as<const float>(), w.rms_att.template as<const float>(), nullptr,
                                             xb_.template as<T>(), nullptr, d, c_.rms_eps});
      ex_.gemm(w.wqkv.template as<const T>(), xb_.template as<const T>(), qkv_.template as<float>(), qkv_cols_, n, d, false);
      mk::batch_kv kv = p.kv;
      rope_kv_body<T> rope;
      rope.qkv = qkv_.template as<float>();
      rope.positions = p.positions;
      rope.qo_indptr = p.qo_indptr;
      rope.cache_lengths = p.cache_lengths;
      rope.batch = p.batch;
      rope.cos = w_.rope_cos.template as<const float>();
      rope.sin = w_.rope_sin.template as<const float>();
      rope.seq_len = c_.seq_len;
      rope.hq = c_.n_heads;
      rope.hkv = c_.n_kv_heads;
      rope.head_dim = D;
      rope.split_halves = c_.rope == rope_style::split_halves;
      rope.kv = kv;
      rope.layer = l;
      ex_.launch(rope_rows, rope);
      mk::attention_params<T, T> a;
      a.q = qkv_.template as<const float>();
      a.q_row_stride = qkv_cols_;
      a.out = att_.template as<T>();
      a.out_row_stride = d;
      a.batch = p.batch;
      a.qo_indptr = p.qo_indptr;
      a.cache_lengths = p.cache_lengths;
      a.kv = kv;
      a.layer = l;
      a.tree_mask = p.tree_mask;
      a.words_per_row = p.words_per_row;
      a.tree_mask_offsets = p.tree_mask_offsets;
      ex_.attention(plan, a, attn_ws_.template as<void>(), attn_ws_.bytes());
      ex_.gemm(w.wo.template as<const T>(), att_.template as<const T>(), x_.template as<float>(), d, n, d, true);
      ex_.launch(norm_rows, rmsnorm_body<T>{x_.template as<const float>(), w.rms_ffn.template as<const float>(), nullptr,
                                             xb_.template as<T>(), nullptr, d, c_.rms_eps});
      if (w_.swiglu_w13) {
        if constexpr (!std::is_same_v<T, float>)
          ex_.gemm_swiglu(w.w13.template as<const T>(), xb_.template as<const T>(), h_.template as<T>(), H, n, d);
      } else {
        ex_.gemm(w.w13.template as<const T>(), xb_.template as<const T>(), gu_.template as<float>(), 2 * H, n, d, false);
        ex_.launch(elementwise_shape(n, H), swiglu_body<T>{gu_.template as<const float>(), h_.template as<T>(), H});
      }
      ex_.gemm(w.w2.template as<const T>(), h_.template as<const T>(), x_.template as<float>(), d, n, H, true);
    }
    if (p.out_rows == 0 || (p.logits == nullptr && p.hidden == nullptr)) return;
    ex_.launch(row_shape(p.out_rows, d), rmsnorm_body<T>{x_.template as<const float>(), w_.rms_final.template as<const float>(),
                                          p.out_row_index, xb_.template as<T>(), p.hidden, d, c_.rms_eps});
    if (p.logits != nullptr)
      ex_.gemm(w_.classifier_weights(), xb_.template as<const T>(), p.logits, c_.vocab_size, p.out_rows, d, false);
  }

 private:
  Exec& ex_;
  model_config c_;
  device_weights<Exec, T> w_;
  forward_sizes s_;
  int qkv_cols_ = 0;
  buffer<Exec> x_, xb_, qkv_, att_, gu_, h_, attn_ws_;
};

}  // namespace medusa_llama::cuda_detail
