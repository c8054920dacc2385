// SPDX-License-Identifier: Apache-2.0
// The engine's element-wise kernels (see kernels.hpp): dot products, RMSNorm, SwiGLU and the
// heads' SiLU residual, RoPE, and the row-major fallback GEMM. Compiled for every instruction set
// Highway targets and chosen at run time. Each works on one row at a time, so a row's result does
// not depend on the other rows of a pass.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "simd/vector_ops.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/highway.h>

#include "simd/ops-inl.h"

#include "kernels.hpp"

#include <cmath>

HWY_BEFORE_NAMESPACE();
namespace medusa_llama::detail::HWY_NAMESPACE {

// Σ a[i]·b[i]: four vector accumulators, summed pairwise, then the lanes; the tail in order.
float Dot(const float* a, const float* b, int n) {
  const DF d;
  VF s0 = hn::Zero(d), s1 = hn::Zero(d), s2 = hn::Zero(d), s3 = hn::Zero(d);
  int i = 0;
  for (; i + 4 * kLanes <= n; i += 4 * kLanes) {
    s0 = hn::MulAdd(hn::LoadU(d, a + i), hn::LoadU(d, b + i), s0);
    s1 = hn::MulAdd(hn::LoadU(d, a + i + kLanes), hn::LoadU(d, b + i + kLanes), s1);
    s2 = hn::MulAdd(hn::LoadU(d, a + i + 2 * kLanes), hn::LoadU(d, b + i + 2 * kLanes), s2);
    s3 = hn::MulAdd(hn::LoadU(d, a + i + 3 * kLanes), hn::LoadU(d, b + i + 3 * kLanes), s3);
  }
  for (; i + kLanes <= n; i += kLanes) s0 = hn::MulAdd(hn::LoadU(d, a + i), hn::LoadU(d, b + i), s0);
  float s = hn::GetLane(hn::SumOfLanes(d, hn::Add(hn::Add(s0, s1), hn::Add(s2, s3))));
  for (; i < n; ++i) s = std::fma(a[i], b[i], s);
  return s;
}

// out = w ⊙ x / sqrt(mean(x²) + eps).
void RmsNorm(float* out, const float* x, const float* w, int n, float eps) {
  const DF d;
  float ss = Dot(x, x, n);
  ss /= static_cast<float>(n);
  ss += eps;
  ss = 1.0f / std::sqrt(ss);
  const VF vs = hn::Set(d, ss);
  int i = 0;
  for (; i + kLanes <= n; i += kLanes) hn::StoreU(hn::Mul(hn::LoadU(d, w + i), hn::Mul(vs, hn::LoadU(d, x + i))), d, out + i);
  for (; i < n; ++i) out[i] = w[i] * (ss * x[i]);
}

// The tail of the lane loops below, through a zero-padded buffer so that it takes the same
// vector arithmetic as the body.
template <class F>
HWY_INLINE void Tail(int i, int n, F&& f) {
  if (i >= n) return;
  f(i, n - i);
}

// g[i] = silu(g[i]) · u[i].
void SiluMul(float* g, const float* u, int n) {
  const DF d;
  int i = 0;
  for (; i + kLanes <= n; i += kLanes) hn::StoreU(hn::Mul(Silu(d, hn::LoadU(d, g + i)), hn::LoadU(d, u + i)), d, g + i);
  Tail(i, n, [&](int at, int m) {
    const VF r = hn::Mul(Silu(d, LoadColumns(d, g + at, m)), LoadColumns(d, u + at, m));
    StoreColumns(d, r, g + at, m);
  });
}

// out[i] = in[i] + silu(t[i] + b[i]).
void SiluResidual(float* out, const float* in, const float* t, const float* b, int n) {
  const DF d;
  int i = 0;
  for (; i + kLanes <= n; i += kLanes)
    hn::StoreU(hn::Add(hn::LoadU(d, in + i), Silu(d, hn::Add(hn::LoadU(d, t + i), hn::LoadU(d, b + i)))), d, out + i);
  Tail(i, n, [&](int at, int m) {
    const VF r = hn::Add(LoadColumns(d, in + at, m), Silu(d, hn::Add(LoadColumns(d, t + at, m), LoadColumns(d, b + at, m))));
    StoreColumns(d, r, out + at, m);
  });
}

// RoPE over `heads` heads of `hd` floats: pairs (2i, 2i+1) (llama2.c, GGUF) or (i, i + hd/2)
// (Hugging Face) rotated by cos/sin[i].
void Rope(float* vec, int heads, int hd, const float* cs, const float* sn, bool adjacent) {
  const DF d;
  const int half = hd / 2;
  for (int h = 0; h < heads; ++h) {
    float* v = vec + sz(h) * sz(hd);
    int i = 0;
    if (adjacent) {
      for (; i + kLanes <= half; i += kLanes) {
        VF a, b;
        hn::LoadInterleaved2(d, v + 2 * i, a, b);
        const VF c = hn::LoadU(d, cs + i), s = hn::LoadU(d, sn + i);
        hn::StoreInterleaved2(hn::Sub(hn::Mul(a, c), hn::Mul(b, s)), hn::Add(hn::Mul(a, s), hn::Mul(b, c)), d, v + 2 * i);
      }
      for (; i < half; ++i) {
        const float v0 = v[2 * i], v1 = v[2 * i + 1];
        v[2 * i] = v0 * cs[i] - v1 * sn[i];
        v[2 * i + 1] = v0 * sn[i] + v1 * cs[i];
      }
    } else {
      for (; i + kLanes <= half; i += kLanes) {
        const VF a = hn::LoadU(d, v + i), b = hn::LoadU(d, v + i + half);
        const VF c = hn::LoadU(d, cs + i), s = hn::LoadU(d, sn + i);
        hn::StoreU(hn::Sub(hn::Mul(a, c), hn::Mul(b, s)), d, v + i);
        hn::StoreU(hn::Add(hn::Mul(a, s), hn::Mul(b, c)), d, v + i + half);
      }
      for (; i < half; ++i) {
        const float v0 = v[i], v1 = v[i + half];
        v[i] = v0 * cs[i] - v1 * sn[i];
        v[i + half] = v0 * sn[i] + v1 * cs[i];
      }
    }
  }
}

// Y[t·ldy + r] (= or +=) W[r] · X[t] over row-major W (the fallback of the OpenBLAS path).
void LinearRows(const float* W, const float* X, float* Y, int T, int in, int ldy, int r0, int r1, bool accumulate) {
  const std::size_t ld = sz(in);
  for (int r = r0; r < r1; ++r)
    for (int t = 0; t < T; ++t) {
      const float s = Dot(W + sz(r) * ld, X + sz(t) * ld, in);
      float* y = Y + sz(t) * sz(ldy) + sz(r);
      *y = accumulate ? *y + s : s;
    }
}

}  // namespace medusa_llama::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace medusa_llama::detail {
HWY_EXPORT(Dot);
HWY_EXPORT(RmsNorm);
HWY_EXPORT(SiluMul);
HWY_EXPORT(SiluResidual);
HWY_EXPORT(Rope);
HWY_EXPORT(LinearRows);

float dot(const float* a, const float* b, int n) { return HWY_DYNAMIC_DISPATCH(Dot)(a, b, n); }
void rmsnorm(float* out, const float* x, const float* w, int n, float eps) {
  HWY_DYNAMIC_DISPATCH(RmsNorm)(out, x, w, n, eps);
}
void silu_mul(float* g, const float* u, int n) { HWY_DYNAMIC_DISPATCH(SiluMul)(g, u, n); }
void silu_residual(float* out, const float* in, const float* t, const float* b, int n) {
  HWY_DYNAMIC_DISPATCH(SiluResidual)(out, in, t, b, n);
}
void rope(float* vec, int heads, int head_dim, const float* cos, const float* sin, bool adjacent_pairs) {
  HWY_DYNAMIC_DISPATCH(Rope)(vec, heads, head_dim, cos, sin, adjacent_pairs);
}
void linear_rows(const float* W, const float* X, float* Y, int T, int in, int ldy, int r0, int r1, bool accumulate) {
  HWY_DYNAMIC_DISPATCH(LinearRows)(W, X, Y, T, in, ldy, r0, r1, accumulate);
}
}  // namespace medusa_llama::detail
#endif
