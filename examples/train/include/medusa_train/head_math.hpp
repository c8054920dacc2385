// SPDX-License-Identifier: Apache-2.0
//! @file head_math.hpp
//! Forward and backward pass of K Medusa heads over a mini-batch (docs/heads.md, docs/training.md),
//! in float or double, on OpenBLAS GEMMs. The trainer runs it in float; the gradient-check test in
//! double.
//!
//! Parameters live in one flat array with the layout of `medusa::head_weights` (so the trained
//! arena is saved with `medusa::save_heads` as it is):
//!
//!     W [L][K][d][d]   (PyTorch Linear [out, in])   b [L][K][d]   U [K][V][d]
//!
//! Loss of a batch of B hidden states, targets y[B][K] (−100 = no target):
//!
//!     loss = Σ_k w_k · (1/n_k) Σ_{i: y[i][k] ≥ 0} CE(U_k x_L(k, h_i), y[i][k])
//!
//! with n_k the rows of the batch that have a target for head k (heads without any contribute 0).
//!
//! @code
//! medusa_train::head_shape s{384, 2048, 4, 1};
//! std::vector<float> params(s.num_params()), grads(s.num_params());
//! medusa_train::head_workspace<float> ws;
//! auto r = medusa_train::head_loss_grad<float>(s, params.data(), grads.data(), x.data(), batch,
//!                                              targets.data(), weights.data(), ws);
//! @endcode
#pragma once

#include <medusa/config.hpp>
#include <medusa/error.hpp>
#include <medusa/gemm.hpp>
#include <medusa/parallel.hpp>

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

namespace medusa_train {

//! Sizes of a head stack: hidden size d, vocabulary V, heads K, ResBlocks per head L.
struct head_shape {
  std::size_t d = 0;  //!< hidden size
  std::size_t V = 0;  //!< vocabulary size
  std::size_t K = 0;  //!< heads
  std::size_t L = 0;  //!< ResBlocks per head (0 allowed)

  //! Elements of all W.
  [[nodiscard]] std::size_t w_size() const noexcept { return L * K * d * d; }
  //! Elements of all b.
  [[nodiscard]] std::size_t b_size() const noexcept { return L * K * d; }
  //! Elements of all U.
  [[nodiscard]] std::size_t u_size() const noexcept { return K * V * d; }
  //! Total parameter count.
  [[nodiscard]] std::size_t num_params() const noexcept { return w_size() + b_size() + u_size(); }
  //! Offset of W_{k,l}.
  [[nodiscard]] std::size_t w_offset(std::size_t k, std::size_t l) const noexcept { return (l * K + k) * d * d; }
  //! Offset of b_{k,l}.
  [[nodiscard]] std::size_t b_offset(std::size_t k, std::size_t l) const noexcept { return w_size() + (l * K + k) * d; }
  //! Offset of U_k.
  [[nodiscard]] std::size_t u_offset(std::size_t k) const noexcept { return w_size() + b_size() + k * V * d; }
};

//! Target value meaning "no label" (PyTorch ignore_index).
inline constexpr std::int32_t ignore_index = -100;

//! Per-batch statistics of `head_loss_grad`.
struct head_batch_stats {
  double loss = 0;                  //!< weighted loss of the batch (the objective)
  std::vector<double> head_loss;    //!< mean CE per head (0 when n_k = 0)
  std::vector<std::size_t> counted; //!< n_k: rows with a target per head
  std::vector<std::size_t> top1;    //!< rows whose argmax equals the target, per head
};

//! Scratch buffers of `head_loss_grad` (grown on demand, reused across calls).
template <class T>
struct head_workspace {
  std::vector<T> xs;      //!< residual stream inputs per layer [L+1][B][d] (one head at a time)
  std::vector<T> ts;      //!< pre-activations W x + b [L][B][d]
  std::vector<T> z;       //!< logits / dlogits [B][V]
  std::vector<T> dx, dt;  //!< gradients wrt x and t [B][d]
};

namespace detail {

inline void blas_gemm(bool ta, bool tb, std::size_t m, std::size_t n, std::size_t k, float alpha, const float* a,
                      std::size_t lda, const float* b, std::size_t ldb, float beta, float* c, std::size_t ldc) {
  const auto i = [](std::size_t v) { return static_cast<blasint>(v); };
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, i(m), i(n), i(k), alpha, a,
              i(lda), b, i(ldb), beta, c, i(ldc));
}
inline void blas_gemm(bool ta, bool tb, std::size_t m, std::size_t n, std::size_t k, double alpha, const double* a,
                      std::size_t lda, const double* b, std::size_t ldb, double beta, double* c, std::size_t ldc) {
  const auto i = [](std::size_t v) { return static_cast<blasint>(v); };
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, i(m), i(n), i(k), alpha, a,
              i(lda), b, i(ldb), beta, c, i(ldc));
}

template <class T>
T sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}

// Softmax cross-entropy of one row in place: z becomes softmax(z) − onehot(y), scaled by `scale`.
// Returns the CE (natural log) and whether argmax(z) == y (ties → lowest id, as the decoder).
template <class T>
std::pair<double, bool> softmax_ce_row(T* z, std::size_t V, std::int32_t y, T scale) {
  std::size_t best = 0;
  T mx = z[0];
  for (std::size_t v = 1; v < V; ++v)
    if (z[v] > mx) mx = z[v], best = v;
  T sum = 0;
  for (std::size_t v = 0; v < V; ++v) {
    z[v] = std::exp(z[v] - mx);
    sum += z[v];
  }
  const T inv = T(1) / sum;
  const double ce = -(std::log(static_cast<double>(z[static_cast<std::size_t>(y)]) * static_cast<double>(inv)));
  for (std::size_t v = 0; v < V; ++v) z[v] *= inv * scale;
  z[static_cast<std::size_t>(y)] -= scale;
  return {ce, best == static_cast<std::size_t>(y)};
}

}  // namespace detail

//! Throws `medusa::invalid_input` unless `s` describes usable heads.
inline void check_shape(const head_shape& s) {
  if (s.d == 0 || s.V == 0 || s.K == 0)
    throw medusa::invalid_input("train: heads need d > 0, V > 0 and K > 0 (got d=" + std::to_string(s.d) +
                                " V=" + std::to_string(s.V) + " K=" + std::to_string(s.K) + ")");
  if (s.d > static_cast<std::size_t>(std::numeric_limits<blasint>::max() / 2) ||
      s.V > static_cast<std::size_t>(std::numeric_limits<blasint>::max() / 2))
    throw medusa::invalid_input("train: d or V too large for BLAS");
}

//! Head logits of a batch: `logits[i][k][v]` for B rows `x` [B][d] (request-major like
//! `medusa::head_stack::forward`).
template <class T>
void head_logits(const head_shape& s, const T* params, const T* x, std::size_t B, T* logits, head_workspace<T>& ws) {
  check_shape(s);
  const std::size_t d = s.d, V = s.V, L = s.L;
  ws.xs.resize((L + 1) * B * d);
  ws.ts.resize(std::max<std::size_t>(L, 1) * B * d);
  for (std::size_t k = 0; k < s.K; ++k) {
    std::copy_n(x, B * d, ws.xs.data());
    for (std::size_t l = 0; l < L; ++l) {
      const T* xl = ws.xs.data() + l * B * d;
      T* t = ws.ts.data();
      T* xn = ws.xs.data() + (l + 1) * B * d;
      detail::blas_gemm(false, true, B, d, d, T(1), xl, d, params + s.w_offset(k, l), d, T(0), t, d);
      const T* b = params + s.b_offset(k, l);
      for (std::size_t i = 0; i < B; ++i)
        for (std::size_t j = 0; j < d; ++j) {
          const T a = t[i * d + j] + b[j];
          xn[i * d + j] = xl[i * d + j] + a * detail::sigmoid(a);
        }
    }
    detail::blas_gemm(false, true, B, V, d, T(1), ws.xs.data() + L * B * d, d, params + s.u_offset(k), d, T(0),
                      logits + k * V, s.K * V);
  }
}

//! Loss of a batch and (when `grads` is not null) its gradient, *accumulated* into `grads`
//! (same layout as `params`).
//! @param x        [B][d] final-normed hidden states
//! @param targets  [B][K] token ids, `ignore_index` for none
//! @param weights  [K] loss weight per head (decay^k)
//! @param pf       a parallel-for (medusa/parallel.hpp) over the rows (rows are independent, so the
//!                 result does not depend on how it splits them)
//! @param dx_out   when not null, the gradient with respect to `x` is *added* to it ([B][d]): what
//!                 a trained backbone receives from the heads (Medusa-2)
//! @throws medusa::invalid_input for a target outside [0, V) other than `ignore_index`
template <class T, medusa::parallel_for ParallelFor = medusa::sequential_for>
head_batch_stats head_loss_grad(const head_shape& s, const T* params, T* grads, const T* x, std::size_t B,
                                const std::int32_t* targets, const T* weights, head_workspace<T>& ws,
                                ParallelFor&& pf = {}, T* dx_out = nullptr) {
  check_shape(s);
  const std::size_t d = s.d, V = s.V, K = s.K, L = s.L;
  for (std::size_t i = 0; i < B * K; ++i)
    if (targets[i] != ignore_index && (targets[i] < 0 || static_cast<std::size_t>(targets[i]) >= V))
      throw medusa::invalid_input("train: target " + std::to_string(targets[i]) + " of row " + std::to_string(i / K) +
                                  " head " + std::to_string(i % K) + " outside the vocabulary [0, " + std::to_string(V) + ")");
  head_batch_stats st;
  st.head_loss.assign(K, 0.0);
  st.counted.assign(K, 0);
  st.top1.assign(K, 0);
  ws.xs.resize((L + 1) * B * d);
  ws.ts.resize(std::max<std::size_t>(L, 1) * B * d);
  ws.z.resize(B * V);
  ws.dx.resize(B * d);
  ws.dt.resize(B * d);
  std::vector<double> row_ce(B);
  std::vector<char> row_hit(B);
  for (std::size_t k = 0; k < K; ++k) {
    std::size_t n = 0;
    for (std::size_t i = 0; i < B; ++i) n += targets[i * K + k] != ignore_index;
    st.counted[k] = n;
    if (n == 0) continue;
    // Forward, keeping every layer's input and pre-activation for the backward pass.
    std::copy_n(x, B * d, ws.xs.data());
    for (std::size_t l = 0; l < L; ++l) {
      const T* xl = ws.xs.data() + l * B * d;
      T* t = ws.ts.data() + l * B * d;
      T* xn = ws.xs.data() + (l + 1) * B * d;
      detail::blas_gemm(false, true, B, d, d, T(1), xl, d, params + s.w_offset(k, l), d, T(0), t, d);
      const T* b = params + s.b_offset(k, l);
      pf(B, [&](std::size_t i) {
        for (std::size_t j = 0; j < d; ++j) {
          const T a = t[i * d + j] + b[j];
          t[i * d + j] = a;
          xn[i * d + j] = xl[i * d + j] + a * detail::sigmoid(a);
        }
      });
    }
    const T* xL = ws.xs.data() + L * B * d;
    T* z = ws.z.data();
    detail::blas_gemm(false, true, B, V, d, T(1), xL, d, params + s.u_offset(k), d, T(0), z, V);
    const T scale = weights[k] / static_cast<T>(n);
    pf(B, [&](std::size_t i) {
      const std::int32_t y = targets[i * K + k];
      T* zi = z + i * V;
      if (y == ignore_index) {
        std::fill_n(zi, V, T(0));
        row_ce[i] = 0;
        row_hit[i] = 0;
        return;
      }
      const auto [ce, hit] = detail::softmax_ce_row(zi, V, y, scale);
      row_ce[i] = ce;
      row_hit[i] = hit;
    });
    double ce_sum = 0;
    for (std::size_t i = 0; i < B; ++i) {  // serial: the sum order never depends on threads
      ce_sum += row_ce[i];
      st.top1[k] += row_hit[i] != 0;
    }
    st.head_loss[k] = ce_sum / static_cast<double>(n);
    st.loss += static_cast<double>(weights[k]) * st.head_loss[k];
    if (grads == nullptr && dx_out == nullptr) continue;
    // dU_k += dZᵀ x_L ; dx = dZ U_k
    if (grads) detail::blas_gemm(true, false, V, d, B, T(1), z, V, xL, d, T(1), grads + s.u_offset(k), d);
    if (L == 0) {
      if (dx_out) detail::blas_gemm(false, false, B, d, V, T(1), z, V, params + s.u_offset(k), d, T(1), dx_out, d);
      continue;
    }
    T* dx = ws.dx.data();
    T* dt = ws.dt.data();
    detail::blas_gemm(false, false, B, d, V, T(1), z, V, params + s.u_offset(k), d, T(0), dx, d);
    for (std::size_t l = L; l-- > 0;) {
      const T* t = ws.ts.data() + l * B * d;
      const T* xl = ws.xs.data() + l * B * d;
      // x_{l+1} = x_l + SiLU(t): dt = dx · SiLU'(t), SiLU'(t) = σ(t)(1 + t(1 − σ(t))).
      pf(B, [&](std::size_t i) {
        for (std::size_t j = 0; j < d; ++j) {
          const T a = t[i * d + j];
          const T sg = detail::sigmoid(a);
          dt[i * d + j] = dx[i * d + j] * sg * (T(1) + a * (T(1) - sg));
        }
      });
      if (grads) {
        detail::blas_gemm(true, false, d, d, B, T(1), dt, d, xl, d, T(1), grads + s.w_offset(k, l), d);
        T* gb = grads + s.b_offset(k, l);
        for (std::size_t i = 0; i < B; ++i)
          for (std::size_t j = 0; j < d; ++j) gb[j] += dt[i * d + j];
      }
      if (l > 0) {
        detail::blas_gemm(false, false, B, d, d, T(1), dt, d, params + s.w_offset(k, l), d, T(1), dx, d);
      } else if (dx_out) {
        for (std::size_t i = 0; i < B * d; ++i) dx_out[i] += dx[i];
        detail::blas_gemm(false, false, B, d, d, T(1), dt, d, params + s.w_offset(k, 0), d, T(1), dx_out, d);
      }
    }
  }
  return st;
}

}  // namespace medusa_train
