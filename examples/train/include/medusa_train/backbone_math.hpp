// SPDX-License-Identifier: Apache-2.0
//! @file backbone_math.hpp
//! Forward and backward of the pieces of a Llama block, one sequence at a time, in float or
//! double: the building blocks of Medusa-2 training (a LoRA-adapted backbone trained jointly with
//! the heads, docs/training.md). The conventions are the CPU engine's (`medusa_llama`):
//!
//! - RMSNorm `y = w ⊙ x / sqrt(mean(x²) + eps)`;
//! - RoPE on adjacent pairs or split halves, angle `pos · theta^(−2i/head_dim)`;
//! - causal attention with grouped-query heads (query head h reads key/value head
//!   `h / (H / H_kv)`), scale `1/sqrt(head_dim)`;
//! - SwiGLU `silu(x W1ᵀ) ⊙ (x W3ᵀ)`;
//! - LoRA linear `y = x Wᵀ + (α/r) · (drop(x) Aᵀ) Bᵀ` with `A [r][in]`, `B [out][r]` (PEFT's
//!   `lora_A`, `lora_B`), the dropout mask given by the caller;
//! - the self-distillation loss: KL(teacher ‖ softmax(z)) of a row of logits `z` against the
//!   original model's top-k distribution.
//!
//! Matrices are row-major, `[rows][cols]`; a sequence of n tokens is `[n][width]`. Backward
//! functions *add* to parameter gradients (so a batch accumulates) and *write* input gradients.
//! The gradient-check test (`examples/train/tests/test_backbone_math.cpp`) runs every piece in
//! double against finite differences.
#pragma once

#include "head_math.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <type_traits>
#include <vector>

namespace medusa_train::detail {
// drop(x): x itself without a mask, else x ⊙ keep in `buffer`.
template <class T>
const T* dropped(const T* x, const T* keep, std::size_t count, std::vector<T>& buffer) {
  if (!keep) return x;
  buffer.resize(count);
  for (std::size_t i = 0; i < count; ++i) buffer[i] = x[i] * keep[i];
  return buffer.data();
}
}  // namespace medusa_train::detail

namespace medusa_train::backbone {

//! How RoPE pairs a head's dimensions (the engine's `medusa_llama::rope_style`).
enum class rope_pairs { adjacent, halves };

// ---------------------------------------------------------------------------------------------
// RMSNorm

//! y[i] = w ⊙ x[i] · r[i], r[i] = 1/sqrt(mean(x[i]²) + eps); stores r (`[n]`) for the backward.
template <class T>
void rmsnorm_forward(std::size_t n, std::size_t d, const T* x, const T* w, T eps, T* y, T* r) {
  for (std::size_t i = 0; i < n; ++i) {
    const T* xi = x + i * d;
    T ss = 0;
    for (std::size_t j = 0; j < d; ++j) ss += xi[j] * xi[j];
    r[i] = T(1) / std::sqrt(ss / static_cast<T>(d) + eps);
    for (std::size_t j = 0; j < d; ++j) y[i * d + j] = w[j] * xi[j] * r[i];
  }
}

//! dx = r·(w⊙dy) − x·r³/d·Σ(w⊙dy⊙x); dw += Σ_i dy⊙x·r (dw may be null: a frozen norm).
template <class T>
void rmsnorm_backward(std::size_t n, std::size_t d, const T* x, const T* w, const T* r, const T* dy, T* dx, T* dw) {
  for (std::size_t i = 0; i < n; ++i) {
    const T* xi = x + i * d;
    const T* dyi = dy + i * d;
    T dot = 0;
    for (std::size_t j = 0; j < d; ++j) dot += w[j] * dyi[j] * xi[j];
    const T ri = r[i], c = dot * ri * ri * ri / static_cast<T>(d);
    for (std::size_t j = 0; j < d; ++j) dx[i * d + j] = ri * w[j] * dyi[j] - xi[j] * c;
    if (dw)
      for (std::size_t j = 0; j < d; ++j) dw[j] += dyi[j] * xi[j] * ri;
  }
}

// ---------------------------------------------------------------------------------------------
// RoPE

//! Rotates each of the `heads` heads of every row of `x` (`[n][heads·hd]`) in place by its
//! position's angles; `inverse` rotates back (the backward pass: a rotation's transpose).
template <class T>
void rope(std::size_t n, std::size_t heads, std::size_t hd, T* x, std::span<const std::int32_t> positions, double theta,
          rope_pairs pairs, bool inverse = false) {
  const std::size_t half = hd / 2;
  for (std::size_t t = 0; t < n; ++t)
    for (std::size_t i = 0; i < half; ++i) {
      // The engine's angles, in float as its tables (run.c and HF compute them the same way).
      const float freq = 1.0f / std::pow(static_cast<float>(theta), static_cast<float>(2 * i) / static_cast<float>(hd));
      const float angle = static_cast<float>(positions[t]) * freq;
      const T c = std::cos(static_cast<T>(angle));
      const T s = inverse ? -std::sin(static_cast<T>(angle)) : std::sin(static_cast<T>(angle));
      const std::size_t a = pairs == rope_pairs::adjacent ? 2 * i : i;
      const std::size_t b = pairs == rope_pairs::adjacent ? 2 * i + 1 : i + half;
      for (std::size_t h = 0; h < heads; ++h) {
        T* v = x + t * heads * hd + h * hd;
        const T x0 = v[a], x1 = v[b];
        v[a] = x0 * c - x1 * s;
        v[b] = x0 * s + x1 * c;
      }
    }
}

// ---------------------------------------------------------------------------------------------
// Causal attention with grouped-query heads

//! Sizes of one attention: n tokens, H query heads, H_kv key/value heads of width hd.
struct attention_shape {
  std::size_t n = 0, heads = 0, kv_heads = 0, hd = 0;
  [[nodiscard]] std::size_t group() const noexcept { return heads / kv_heads; }
};

//! out[t][h] = Σ_{s ≤ t} P[h][t][s] · v[s][h/group], P = softmax(q·k/sqrt(hd)) over s ≤ t.
//! q `[n][H·hd]` (after RoPE), k and v `[n][H_kv·hd]`; stores P (`[H][n][n]`, 0 above the
//! diagonal) for the backward. The products are GEMMs over each head's strided columns.
template <class T>
void attention_forward(const attention_shape& s, const T* q, const T* k, const T* v, T* out, T* probs) {
  const std::size_t qw = s.heads * s.hd, kw = s.kv_heads * s.hd, n = s.n;
  const T scale = T(1) / std::sqrt(static_cast<T>(s.hd));
  for (std::size_t h = 0; h < s.heads; ++h) {
    const std::size_t g = h / s.group();
    T* P = probs + h * n * n;
    detail::blas_gemm(false, true, n, n, s.hd, scale, q + h * s.hd, qw, k + g * s.hd, kw, T(0), P, n);
    for (std::size_t t = 0; t < n; ++t) {
      T* p = P + t * n;
      T mx = p[0];
      for (std::size_t u = 1; u <= t; ++u) mx = std::max(mx, p[u]);
      T sum = 0;
      for (std::size_t u = 0; u <= t; ++u) sum += (p[u] = std::exp(p[u] - mx));
      const T inv = T(1) / sum;
      for (std::size_t u = 0; u <= t; ++u) p[u] *= inv;
      std::fill(p + t + 1, p + n, T(0));
    }
    detail::blas_gemm(false, false, n, s.hd, n, T(1), P, n, v + g * s.hd, kw, T(0), out + h * s.hd, qw);
  }
}

//! From dout: dq (written), dk and dv (written; each key/value head sums its group's queries).
//! dP = dO·vᵀ, dS = P ⊙ (dP − Σ_u dP⊙P), dq = dS·k·scale, dk = dSᵀ·q·scale, dv = Pᵀ·dO.
template <class T>
void attention_backward(const attention_shape& s, const T* q, const T* k, const T* v, const T* probs, const T* dout,
                        T* dq, T* dk, T* dv) {
  const std::size_t qw = s.heads * s.hd, kw = s.kv_heads * s.hd, n = s.n;
  const T scale = T(1) / std::sqrt(static_cast<T>(s.hd));
  std::fill(dk, dk + n * kw, T(0));
  std::fill(dv, dv + n * kw, T(0));
  std::vector<T> dS(n * n);
  for (std::size_t h = 0; h < s.heads; ++h) {
    const std::size_t g = h / s.group();
    const T* P = probs + h * n * n;
    detail::blas_gemm(false, true, n, n, s.hd, T(1), dout + h * s.hd, qw, v + g * s.hd, kw, T(0), dS.data(), n);
    for (std::size_t t = 0; t < n; ++t) {
      const T* p = P + t * n;
      T* ds = dS.data() + t * n;
      T row = 0;
      for (std::size_t u = 0; u <= t; ++u) row += ds[u] * p[u];
      for (std::size_t u = 0; u <= t; ++u) ds[u] = p[u] * (ds[u] - row) * scale;
      std::fill(ds + t + 1, ds + n, T(0));
    }
    detail::blas_gemm(false, false, n, s.hd, n, T(1), dS.data(), n, k + g * s.hd, kw, T(0), dq + h * s.hd, qw);
    detail::blas_gemm(true, false, n, s.hd, n, T(1), dS.data(), n, q + h * s.hd, qw, T(1), dk + g * s.hd, kw);
    detail::blas_gemm(true, false, n, s.hd, n, T(1), P, n, dout + h * s.hd, qw, T(1), dv + g * s.hd, kw);
  }
}

// ---------------------------------------------------------------------------------------------
// SwiGLU

//! h = silu(a) ⊙ b, element-wise over `count` values (a = x W1ᵀ, b = x W3ᵀ).
template <class T>
void swiglu_forward(std::size_t count, const T* a, const T* b, T* h) {
  for (std::size_t i = 0; i < count; ++i) h[i] = a[i] * detail::sigmoid(a[i]) * b[i];
}

//! da = dh ⊙ b ⊙ silu'(a), db = dh ⊙ silu(a), silu'(a) = σ(a)·(1 + a·(1 − σ(a))).
template <class T>
void swiglu_backward(std::size_t count, const T* a, const T* b, const T* dh, T* da, T* db) {
  for (std::size_t i = 0; i < count; ++i) {
    const T sg = detail::sigmoid(a[i]);
    da[i] = dh[i] * b[i] * sg * (T(1) + a[i] * (T(1) - sg));
    db[i] = dh[i] * a[i] * sg;
  }
}

// ---------------------------------------------------------------------------------------------
// Linear layers with LoRA

//! A frozen `[out][in]` weight W with an optional LoRA adapter `A [r][in]`, `B [out][r]`, scaled
//! by α/r. `A == nullptr` means no adapter.
template <class T>
struct lora_linear {
  std::size_t in = 0, out = 0, rank = 0;
  const T* W = nullptr;
  const T* A = nullptr;
  const T* B = nullptr;
  T scaling = 0;  //!< α / r
};

//! y = x Wᵀ + s·(drop(x) Aᵀ) Bᵀ over n rows. `keep` (`[n][in]`, values 0 or 1/(1−p)) is the
//! dropout of the adapter's input, null for none; `xa` (`[n][r]`) receives drop(x) Aᵀ for the
//! backward.
template <class T>
void linear_forward(const lora_linear<T>& l, std::size_t n, const T* x, std::type_identity_t<const T*> keep,
                    std::type_identity_t<T*> y, std::type_identity_t<T*> xa) {
  detail::blas_gemm(false, true, n, l.out, l.in, T(1), x, l.in, l.W, l.in, T(0), y, l.out);
  if (!l.A) return;
  std::vector<T> xd;
  const T* src = detail::dropped(x, keep, n * l.in, xd);
  detail::blas_gemm(false, true, n, l.rank, l.in, T(1), src, l.in, l.A, l.in, T(0), xa, l.rank);
  detail::blas_gemm(false, true, n, l.out, l.rank, l.scaling, xa, l.rank, l.B, l.rank, T(1), y, l.out);
}

//! dx = dy W + s·((dy B) A) ⊙ keep (written; null when not needed); dA += s·(dy B)ᵀ drop(x),
//! dB += s·dyᵀ xa (null when the layer has no adapter).
template <class T>
void linear_backward(const lora_linear<T>& l, std::size_t n, const T* x, std::type_identity_t<const T*> keep,
                     std::type_identity_t<const T*> xa, std::type_identity_t<const T*> dy, std::type_identity_t<T*> dx,
                     std::type_identity_t<T*> dA, std::type_identity_t<T*> dB) {
  if (dx) detail::blas_gemm(false, false, n, l.in, l.out, T(1), dy, l.out, l.W, l.in, T(0), dx, l.in);
  if (!l.A) return;
  std::vector<T> dyb(n * l.rank), xd;
  detail::blas_gemm(false, false, n, l.rank, l.out, l.scaling, dy, l.out, l.B, l.rank, T(0), dyb.data(), l.rank);
  const T* src = detail::dropped(x, keep, n * l.in, xd);
  detail::blas_gemm(true, false, l.rank, l.in, n, T(1), dyb.data(), l.rank, src, l.in, T(1), dA, l.in);
  detail::blas_gemm(true, false, l.out, l.rank, n, l.scaling, dy, l.out, xa, l.rank, T(1), dB, l.rank);
  if (dx) {
    std::vector<T> back(n * l.in);
    detail::blas_gemm(false, false, n, l.in, l.rank, T(1), dyb.data(), l.rank, l.A, l.in, T(0), back.data(), l.in);
    for (std::size_t i = 0; i < back.size(); ++i) dx[i] += keep ? back[i] * keep[i] : back[i];
  }
}

//! W + s·B A, the adapter merged into the weight (`[out][in]`).
template <class T>
std::vector<T> merged_weight(const lora_linear<T>& l) {
  std::vector<T> w(l.W, l.W + l.out * l.in);
  if (l.A) detail::blas_gemm(false, false, l.out, l.in, l.rank, l.scaling, l.B, l.rank, l.A, l.in, T(1), w.data(), l.in);
  return w;
}

// ---------------------------------------------------------------------------------------------
// The self-distillation loss

//! The original model's distribution at one position, kept as its top-k: token ids, their logits
//! and the log-normaliser of the whole row. The rest of the vocabulary is one bucket holding the
//! remaining probability; without the normaliser (NaN) the k are renormalised and the bucket is empty.
struct teacher_row {
  std::span<const std::int32_t> ids;
  std::span<const float> logits;
  float log_norm = std::numeric_limits<float>::quiet_NaN();  //!< log Σ_v exp(logit_v) over the vocabulary
};

//! KL(teacher ‖ softmax(z)) of one row of V logits, over the teacher's k tokens plus the bucket of
//! the others (p_rest log p_rest/q_rest); z becomes its gradient × `weight`: q_v − p_v on the k
//! tokens, q_v·(1 − p_rest/q_rest) elsewhere (the student keeps its own shape inside the bucket and
//! matches its mass). Returns the KL in nats. The teacher's ids are distinct and below V.
template <class T>
double kl_row(T* z, std::size_t V, const teacher_row& teacher, T weight) {
  const std::size_t k = teacher.ids.size();
  T mx = z[0];
  for (std::size_t v = 1; v < V; ++v) mx = std::max(mx, z[v]);
  double sum = 0;
  for (std::size_t v = 0; v < V; ++v) sum += std::exp(static_cast<double>(z[v] - mx));
  const double log_norm = static_cast<double>(mx) + std::log(sum);
  // Teacher probabilities of its k tokens and of the rest.
  std::vector<double> log_pt(k);
  if (std::isnan(teacher.log_norm)) {
    float tmx = teacher.logits[0];
    for (float l : teacher.logits) tmx = std::max(tmx, l);
    double tsum = 0;
    for (float l : teacher.logits) tsum += std::exp(static_cast<double>(l - tmx));
    for (std::size_t i = 0; i < k; ++i) log_pt[i] = static_cast<double>(teacher.logits[i] - tmx) - std::log(tsum);
  } else {
    for (std::size_t i = 0; i < k; ++i) log_pt[i] = static_cast<double>(teacher.logits[i]) - static_cast<double>(teacher.log_norm);
  }
  double p_top = 0, q_top = 0, kl = 0;
  std::vector<double> log_q(k);
  for (std::size_t i = 0; i < k; ++i) {
    log_q[i] = static_cast<double>(z[static_cast<std::size_t>(teacher.ids[i])]) - log_norm;
    const double pt = std::exp(log_pt[i]);
    p_top += pt;
    q_top += std::exp(log_q[i]);
    kl += pt * (log_pt[i] - log_q[i]);
  }
  const double p_rest = std::isnan(teacher.log_norm) ? 0.0 : std::max(0.0, 1.0 - p_top);
  const double q_rest = std::max(1e-30, 1.0 - q_top);
  if (p_rest > 0) kl += p_rest * (std::log(p_rest) - std::log(q_rest));
  const double rest_scale = 1.0 - p_rest / q_rest;
  for (std::size_t v = 0; v < V; ++v)
    z[v] = static_cast<T>(std::exp(static_cast<double>(z[v]) - log_norm) * rest_scale) * weight;
  for (std::size_t i = 0; i < k; ++i)
    z[static_cast<std::size_t>(teacher.ids[i])] = static_cast<T>(std::exp(log_q[i]) - std::exp(log_pt[i])) * weight;
  return kl;
}

}  // namespace medusa_train::backbone
