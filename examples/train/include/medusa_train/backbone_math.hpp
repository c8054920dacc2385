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
      // The engine's angles, computed in double (its tables are float).
      const double freq = 1.0 / std::pow(theta, static_cast<double>(2 * i) / static_cast<double>(hd));
      const double angle = static_cast<double>(positions[t]) * freq;
      const T c = static_cast<T>(std::cos(angle));
      const T s = static_cast<T>(inverse ? -std::sin(angle) : std::sin(angle));
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
//! diagonal) for the backward.
template <class T>
void attention_forward(const attention_shape& s, const T* q, const T* k, const T* v, T* out, T* probs) {
  const std::size_t qw = s.heads * s.hd, kw = s.kv_heads * s.hd;
  const T scale = T(1) / std::sqrt(static_cast<T>(s.hd));
  for (std::size_t h = 0; h < s.heads; ++h) {
    const std::size_t g = h / s.group();
    for (std::size_t t = 0; t < s.n; ++t) {
      T* p = probs + (h * s.n + t) * s.n;
      T mx = -std::numeric_limits<T>::infinity();
      for (std::size_t u = 0; u <= t; ++u) {
        T dot = 0;
        for (std::size_t j = 0; j < s.hd; ++j) dot += q[t * qw + h * s.hd + j] * k[u * kw + g * s.hd + j];
        p[u] = dot * scale;
        mx = std::max(mx, p[u]);
      }
      T sum = 0;
      for (std::size_t u = 0; u <= t; ++u) sum += (p[u] = std::exp(p[u] - mx));
      for (std::size_t u = 0; u <= t; ++u) p[u] /= sum;
      for (std::size_t u = t + 1; u < s.n; ++u) p[u] = 0;
      T* o = out + t * qw + h * s.hd;
      for (std::size_t j = 0; j < s.hd; ++j) o[j] = 0;
      for (std::size_t u = 0; u <= t; ++u)
        for (std::size_t j = 0; j < s.hd; ++j) o[j] += p[u] * v[u * kw + g * s.hd + j];
    }
  }
}

//! From dout: dq (written), dk and dv (written; each key/value head sums its group's queries).
//! dP = dO·vᵀ, dS = P ⊙ (dP − Σ_u dP⊙P), dq = dS·k·scale, dk = dSᵀ·q·scale, dv = Pᵀ·dO.
template <class T>
void attention_backward(const attention_shape& s, const T* q, const T* k, const T* v, const T* probs, const T* dout,
                        T* dq, T* dk, T* dv) {
  const std::size_t qw = s.heads * s.hd, kw = s.kv_heads * s.hd;
  const T scale = T(1) / std::sqrt(static_cast<T>(s.hd));
  std::fill(dq, dq + s.n * qw, T(0));
  std::fill(dk, dk + s.n * kw, T(0));
  std::fill(dv, dv + s.n * kw, T(0));
  std::vector<T> ds(s.n);
  for (std::size_t h = 0; h < s.heads; ++h) {
    const std::size_t g = h / s.group();
    for (std::size_t t = 0; t < s.n; ++t) {
      const T* p = probs + (h * s.n + t) * s.n;
      const T* dot = dout + t * qw + h * s.hd;
      T row = 0;
      for (std::size_t u = 0; u <= t; ++u) {
        T dp = 0;
        for (std::size_t j = 0; j < s.hd; ++j) dp += dot[j] * v[u * kw + g * s.hd + j];
        ds[u] = dp;
        row += dp * p[u];
      }
      for (std::size_t u = 0; u <= t; ++u) {
        const T dsu = p[u] * (ds[u] - row) * scale;
        for (std::size_t j = 0; j < s.hd; ++j) {
          dq[t * qw + h * s.hd + j] += dsu * k[u * kw + g * s.hd + j];
          dk[u * kw + g * s.hd + j] += dsu * q[t * qw + h * s.hd + j];
          dv[u * kw + g * s.hd + j] += p[u] * dot[j];
        }
      }
    }
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

//! The original model's distribution at one position, kept as its top-k: token ids and their
//! logits (the rest of the vocabulary is treated as probability 0 after renormalising the k).
struct teacher_row {
  std::span<const std::int32_t> ids;
  std::span<const float> logits;
};

//! KL(teacher ‖ softmax(z)) of one row of V logits; z becomes its gradient
//! (softmax(z) − teacher) · weight. Returns the KL in nats. The teacher's ids are distinct and
//! below V.
template <class T>
double kl_row(T* z, std::size_t V, const teacher_row& teacher, T weight) {
  const std::size_t k = teacher.ids.size();
  std::vector<double> zt(k);
  for (std::size_t i = 0; i < k; ++i) zt[i] = static_cast<double>(z[static_cast<std::size_t>(teacher.ids[i])]);
  T mx = z[0];
  for (std::size_t v = 1; v < V; ++v) mx = std::max(mx, z[v]);
  T sum = 0;
  for (std::size_t v = 0; v < V; ++v) sum += (z[v] = std::exp(z[v] - mx));
  for (std::size_t v = 0; v < V; ++v) z[v] = z[v] / sum * weight;
  const double log_norm = static_cast<double>(mx) + std::log(static_cast<double>(sum));
  float tmx = teacher.logits[0];
  for (float l : teacher.logits) tmx = std::max(tmx, l);
  double tsum = 0;
  for (float l : teacher.logits) tsum += std::exp(static_cast<double>(l - tmx));
  const double log_tsum = std::log(tsum);
  double kl = 0;
  for (std::size_t i = 0; i < k; ++i) {
    const double log_pt = static_cast<double>(teacher.logits[i] - tmx) - log_tsum;
    const double pt = std::exp(log_pt);
    kl += pt * (log_pt - (zt[i] - log_norm));
    z[static_cast<std::size_t>(teacher.ids[i])] -= static_cast<T>(pt) * weight;
  }
  return kl;
}

}  // namespace medusa_train::backbone
