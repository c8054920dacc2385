// SPDX-License-Identifier: Apache-2.0
// The arithmetic of the library's tree attention (medusa::attention_kernels) for the engine,
// compiled for every instruction set Highway targets and chosen at run time: the library keeps
// the algorithm (keys in position order, blocks of 64, the online softmax), these the inner
// loops. Each works on one query row and one block, so a row's output has the same bits alone
// as in a tree or a chunk.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "simd/attention.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/highway.h>

#include "simd/ops-inl.h"

#include <algorithm>
#include <cmath>

HWY_BEFORE_NAMESPACE();
namespace medusa_llama::detail::HWY_NAMESPACE {

// The lane sums of v[0 .. kLanes) as one vector (lane j = the sum of v[j]'s lanes), each vector's
// lanes added in the same order: pairs, then pairs of pairs, then 128-bit halves.
HWY_INLINE VF SumsOfLanes(const VF* v) {
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  // Masked forms with an explicit source: the plain ones trip g++ 12's -Wmaybe-uninitialized.
  constexpr auto all = static_cast<__mmask16>(0xFFFF);
  constexpr auto all8 = static_cast<__mmask8>(0xFF);
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_mask_unpacklo_ps(v[2 * i].raw, all, v[2 * i].raw, v[2 * i + 1].raw),
                         _mm512_mask_unpackhi_ps(v[2 * i].raw, all, v[2 * i].raw, v[2 * i + 1].raw));
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_mask_unpacklo_pd(x, all8, x, y)),
                         _mm512_castpd_ps(_mm512_mask_unpackhi_pd(x, all8, x, y)));
  }
  const __m512 c0 = _mm512_add_ps(_mm512_mask_shuffle_f32x4(b[0], all, b[0], b[1], 0x88),
                                  _mm512_mask_shuffle_f32x4(b[0], all, b[0], b[1], 0xdd));
  const __m512 c1 = _mm512_add_ps(_mm512_mask_shuffle_f32x4(b[2], all, b[2], b[3], 0x88),
                                  _mm512_mask_shuffle_f32x4(b[2], all, b[2], b[3], 0xdd));
  return VF{_mm512_add_ps(_mm512_mask_shuffle_f32x4(c0, all, c0, c1, 0x88), _mm512_mask_shuffle_f32x4(c0, all, c0, c1, 0xdd))};
#elif HWY_TARGET == HWY_AVX2
  const __m256 a0 = _mm256_hadd_ps(v[0].raw, v[1].raw), a1 = _mm256_hadd_ps(v[2].raw, v[3].raw);
  const __m256 a2 = _mm256_hadd_ps(v[4].raw, v[5].raw), a3 = _mm256_hadd_ps(v[6].raw, v[7].raw);
  const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);
  return VF{_mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31))};
#elif HWY_TARGET == HWY_SSE4
  return VF{_mm_hadd_ps(_mm_hadd_ps(v[0].raw, v[1].raw), _mm_hadd_ps(v[2].raw, v[3].raw))};
#elif HWY_TARGET == HWY_NEON
  return VF{vpaddq_f32(vpaddq_f32(v[0].raw, v[1].raw), vpaddq_f32(v[2].raw, v[3].raw))};
#else
  const DF d;
  alignas(64) float lanes[kLanes], out[kLanes];
  for (int j = 0; j < kLanes; ++j) {
    hn::Store(v[j], d, lanes);
    float t[kLanes];
    for (int i = 0; i < kLanes; ++i) t[i] = lanes[i];
    for (int w = 1; w < kLanes; w *= 2)
      for (int i = 0; i + w < kLanes; i += 2 * w) t[i] += t[i + w];
    out[j] = t[0];
  }
  return hn::Load(d, out);
#endif
}

// s[j] = q · keys[j]: kLanes keys at a time (a short last group padded with copies of its first
// key), each summed over the full vectors of head_dim in order, then across its lanes (all of
// them together, SumsOfLanes), then the remaining elements in order. A score does not depend on
// its key's place in the block.
void AttnScores(const float* q, const float* const* keys, int n, int D, float* s) {
  const DF d;
  const int full = D / kLanes * kLanes;
  for (int j0 = 0; j0 < n; j0 += kLanes) {
    const int c = std::min(kLanes, n - j0);
    const float* kr[kLanes];
    for (int i = 0; i < kLanes; ++i) kr[i] = keys[j0 + (i < c ? i : 0)];
    VF acc[kLanes];
    for (int i = 0; i < kLanes; ++i) acc[i] = hn::Zero(d);
    for (int x = 0; x < full; x += kLanes) {
      const VF qv = hn::LoadU(d, q + x);
#pragma GCC unroll 16
      for (int i = 0; i < kLanes; ++i) acc[i] = hn::MulAdd(qv, hn::LoadU(d, kr[i] + x), acc[i]);
    }
    StoreColumns(d, SumsOfLanes(acc), s + j0, c);
    if (full < D)
      for (int i = 0; i < c; ++i) {
        float v = s[j0 + i];
        for (int x = full; x < D; ++x) v = std::fma(q[x], kr[i][x], v);
        s[j0 + i] = v;
      }
  }
}

// s[j] = 2^(s[j] - m), returning Σ s[j]: lane sums over the vectors, then across lanes (a short
// last vector is padded with -inf, whose weight is exactly 0).
float AttnExp2Sum(float* s, int n, float m) {
  const DF d;
  const VF vm = hn::Set(d, m);
  VF sum = hn::Zero(d);
  int j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const VF p = Exp2(d, hn::Sub(hn::LoadU(d, s + j), vm));
    hn::StoreU(p, d, s + j);
    sum = hn::Add(sum, p);
  }
  if (j < n) {
    alignas(64) float buf[kLanes];
    for (int i = 0; i < kLanes; ++i) buf[i] = j + i < n ? s[j + i] : -INFINITY;
    const VF p = Exp2(d, hn::Sub(hn::Load(d, buf), vm));
    hn::Store(p, d, buf);
    for (int i = 0; j + i < n; ++i) s[j + i] = buf[i];
    sum = hn::Add(sum, p);
  }
  return hn::GetLane(hn::SumOfLanes(d, sum));
}

// o += Σ_j p[j] · values[j]: up to four vectors of o in registers per pass over the keys.
void AttnAccumulate(const float* p, const float* const* values, int n, int D, float* o) {
  const DF d;
  const int full = D / kLanes * kLanes;
  int i = 0;
  for (; i + 4 * kLanes <= full; i += 4 * kLanes) {
    VF a0 = hn::LoadU(d, o + i), a1 = hn::LoadU(d, o + i + kLanes), a2 = hn::LoadU(d, o + i + 2 * kLanes),
       a3 = hn::LoadU(d, o + i + 3 * kLanes);
    for (int j = 0; j < n; ++j) {
      const VF w = hn::Set(d, p[j]);
      const float* v = values[j] + i;
      a0 = hn::MulAdd(w, hn::LoadU(d, v), a0);
      a1 = hn::MulAdd(w, hn::LoadU(d, v + kLanes), a1);
      a2 = hn::MulAdd(w, hn::LoadU(d, v + 2 * kLanes), a2);
      a3 = hn::MulAdd(w, hn::LoadU(d, v + 3 * kLanes), a3);
    }
    hn::StoreU(a0, d, o + i);
    hn::StoreU(a1, d, o + i + kLanes);
    hn::StoreU(a2, d, o + i + 2 * kLanes);
    hn::StoreU(a3, d, o + i + 3 * kLanes);
  }
  for (; i < full; i += kLanes) {
    VF a = hn::LoadU(d, o + i);
    for (int j = 0; j < n; ++j) a = hn::MulAdd(hn::Set(d, p[j]), hn::LoadU(d, values[j] + i), a);
    hn::StoreU(a, d, o + i);
  }
  for (; i < D; ++i) {
    float a = o[i];
    for (int j = 0; j < n; ++j) a = std::fma(p[j], values[j][i], a);
    o[i] = a;
  }
}

void AttnScale(float* o, int D, float a) {
  const DF d;
  const VF va = hn::Set(d, a);
  int i = 0;
  for (; i + kLanes <= D; i += kLanes) hn::StoreU(hn::Mul(hn::LoadU(d, o + i), va), d, o + i);
  for (; i < D; ++i) o[i] *= a;
}

}  // namespace medusa_llama::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include "simd/attention.hpp"

namespace medusa_llama::detail {
HWY_EXPORT(AttnScores);
HWY_EXPORT(AttnExp2Sum);
HWY_EXPORT(AttnAccumulate);
HWY_EXPORT(AttnScale);

namespace {
void scores(const float* q, const float* const* keys, int n, int head_dim, float* s) noexcept {
  HWY_DYNAMIC_DISPATCH(AttnScores)(q, keys, n, head_dim, s);
}
float exp2_sum(float* s, int n, float m) noexcept { return HWY_DYNAMIC_DISPATCH(AttnExp2Sum)(s, n, m); }
void accumulate(const float* p, const float* const* values, int n, int head_dim, float* o) noexcept {
  HWY_DYNAMIC_DISPATCH(AttnAccumulate)(p, values, n, head_dim, o);
}
void scale(float* o, int head_dim, float a) noexcept { HWY_DYNAMIC_DISPATCH(AttnScale)(o, head_dim, a); }
}  // namespace

const medusa::attention_kernels& attention_kernels() noexcept {
  static const medusa::attention_kernels k{&scores, &exp2_sum, &accumulate, &scale};
  return k;
}
}  // namespace medusa_llama::detail
#endif
