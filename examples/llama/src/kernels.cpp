// SPDX-License-Identifier: Apache-2.0
#include "kernels.hpp"

#include <cmath>

#if defined(__AVX512F__)
#include <immintrin.h>
// GCC 12's lane-extract intrinsics pass _mm256_undefined_*() and trip -Wuninitialized at -O3.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#if defined(MEDUSA_LLAMA_HAVE_OPENBLAS)
#include <cblas.h>
#endif

namespace medusa_llama::detail {

#if defined(__AVX512F__)
namespace {

inline __mmask16 tail_mask(int n) { return static_cast<__mmask16>((1u << n) - 1u); }

// Horizontal sum (GCC 12's _mm512_reduce_add_ps trips -Wuninitialized inside its own header).
inline float hsum(__m512 v) {
  const __m256 lo = _mm512_castps512_ps256(v);
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  const __m256 s8 = _mm256_add_ps(lo, hi);
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  s4 = _mm_add_ss(s4, _mm_shuffle_ps(s4, s4, 1));
  return _mm_cvtss_f32(s4);
}

// R weight rows × C tokens, accumulators in registers, one pass over the `in` dimension.
template <int R, int C>
inline void block(const float* W, const float* X, float* Y, int in, int ldy, bool accumulate) {
  __m512 acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const std::size_t ld = static_cast<std::size_t>(in);
  int i = 0;
  for (; i + 16 <= in; i += 16) {
    __m512 x[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) x[c] = _mm512_loadu_ps(X + c * ld + i);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 w = _mm512_loadu_ps(W + r * ld + i);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(w, x[c], acc[r][c]);
    }
  }
  if (i < in) {
    const __mmask16 m = tail_mask(in - i);
    __m512 x[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) x[c] = _mm512_maskz_loadu_ps(m, X + c * ld + i);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 w = _mm512_maskz_loadu_ps(m, W + r * ld + i);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(w, x[c], acc[r][c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const float s = hsum(acc[r][c]);
      float* y = Y + static_cast<std::size_t>(c) * static_cast<std::size_t>(ldy) + r;
      *y = accumulate ? *y + s : s;
    }
}

template <int R>
inline void row_block(const float* W, const float* X, float* Y, int T, int in, int ldy, bool acc) {
  int t = 0;
  const std::size_t ld = static_cast<std::size_t>(in);
  for (; t + 4 <= T; t += 4) block<R, 4>(W, X + t * ld, Y + static_cast<std::size_t>(t) * static_cast<std::size_t>(ldy), in, ldy, acc);
  const float* Xt = X + t * ld;
  float* Yt = Y + static_cast<std::size_t>(t) * static_cast<std::size_t>(ldy);
  switch (T - t) {
    case 3: block<R, 3>(W, Xt, Yt, in, ldy, acc); break;
    case 2: block<R, 2>(W, Xt, Yt, in, ldy, acc); break;
    case 1: block<R, 1>(W, Xt, Yt, in, ldy, acc); break;
    default: break;
  }
}

}  // namespace

void linear_rows(const float* W, const float* X, float* Y, int T, int in, int ldy, int r0, int r1, bool accumulate) {
  const std::size_t ld = static_cast<std::size_t>(in);
  int r = r0;
  if (T == 1) {
    // GEMV: 8 independent rows hide the FMA latency; the loop is bound by weight streaming.
    for (; r + 8 <= r1; r += 8) block<8, 1>(W + r * ld, X, Y + r, in, ldy, accumulate);
    for (; r < r1; ++r) block<1, 1>(W + r * ld, X, Y + r, in, ldy, accumulate);
    return;
  }
  for (; r + 4 <= r1; r += 4) row_block<4>(W + r * ld, X, Y + r, T, in, ldy, accumulate);
  for (; r < r1; ++r) row_block<1>(W + r * ld, X, Y + r, T, in, ldy, accumulate);
}

float dot(const float* a, const float* b, int n) {
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  int i = 0;
  for (; i + 32 <= n; i += 32) {
    s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
    s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), s1);
  }
  for (; i + 16 <= n; i += 16) s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
  if (i < n) {
    const __mmask16 m = tail_mask(n - i);
    s1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), s1);
  }
  return hsum(_mm512_add_ps(s0, s1));
}

void axpy(float a, const float* x, float* y, int n) {
  const __m512 va = _mm512_set1_ps(a);
  int i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
  if (i < n) {
    const __mmask16 m = tail_mask(n - i);
    _mm512_mask_storeu_ps(y + i, m, _mm512_fmadd_ps(va, _mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i)));
  }
}

#else  // portable fallback

void linear_rows(const float* W, const float* X, float* Y, int T, int in, int ldy, int r0, int r1, bool accumulate) {
  const std::size_t ld = static_cast<std::size_t>(in);
  for (int r = r0; r < r1; ++r) {
    for (int t = 0; t < T; ++t) {
      const float s = dot(W + r * ld, X + t * ld, in);
      float* y = Y + static_cast<std::size_t>(t) * static_cast<std::size_t>(ldy) + r;
      *y = accumulate ? *y + s : s;
    }
  }
}

float dot(const float* a, const float* b, int n) {
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) s[k] += a[i + k] * b[i + k];
  float r = 0;
  for (; i < n; ++i) r += a[i] * b[i];
  return r + ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

void axpy(float a, const float* x, float* y, int n) {
  for (int i = 0; i < n; ++i) y[i] += a * x[i];
}

#endif

bool have_blas() noexcept {
#if defined(MEDUSA_LLAMA_HAVE_OPENBLAS)
  return true;
#else
  return false;
#endif
}

bool linear_rows_blas(const float* W, const float* X, float* Y, int T, int in, int ldy, int r0, int r1, bool accumulate) {
#if defined(MEDUSA_LLAMA_HAVE_OPENBLAS)
  if (r1 <= r0) return true;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, r1 - r0, in, 1.0f, X, in,
              W + static_cast<std::size_t>(r0) * static_cast<std::size_t>(in), in, accumulate ? 1.0f : 0.0f, Y + r0, ldy);
  return true;
#else
  (void)W, (void)X, (void)Y, (void)T, (void)in, (void)ldy, (void)r0, (void)r1, (void)accumulate;
  return false;
#endif
}

void rmsnorm(float* out, const float* x, const float* w, int n, float eps) {
  float ss = dot(x, x, n);
  ss /= static_cast<float>(n);
  ss += eps;
  ss = 1.0f / std::sqrt(ss);
  for (int i = 0; i < n; ++i) out[i] = w[i] * (ss * x[i]);
}

}  // namespace medusa_llama::detail
