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

#include <cmath>

HWY_BEFORE_NAMESPACE();
namespace medusa_llama::detail::HWY_NAMESPACE {

// s[j] = q · keys[j]: four keys at a time (independent sums), each summed over the full vectors
// of head_dim in order, then across its lanes, then the remaining elements in order.
void AttnScores(const float* q, const float* const* keys, int n, int D, float* s) {
  const DF d;
  const int full = D / kLanes * kLanes;
  auto tail = [&](const float* k, float v) {
    for (int i = full; i < D; ++i) v = std::fma(q[i], k[i], v);
    return v;
  };
  int j = 0;
  for (; j + 4 <= n; j += 4) {
    const float *k0 = keys[j], *k1 = keys[j + 1], *k2 = keys[j + 2], *k3 = keys[j + 3];
    VF a0 = hn::Zero(d), a1 = hn::Zero(d), a2 = hn::Zero(d), a3 = hn::Zero(d);
    for (int i = 0; i < full; i += kLanes) {
      const VF qv = hn::LoadU(d, q + i);
      a0 = hn::MulAdd(qv, hn::LoadU(d, k0 + i), a0);
      a1 = hn::MulAdd(qv, hn::LoadU(d, k1 + i), a1);
      a2 = hn::MulAdd(qv, hn::LoadU(d, k2 + i), a2);
      a3 = hn::MulAdd(qv, hn::LoadU(d, k3 + i), a3);
    }
    s[j] = tail(k0, hn::GetLane(hn::SumOfLanes(d, a0)));
    s[j + 1] = tail(k1, hn::GetLane(hn::SumOfLanes(d, a1)));
    s[j + 2] = tail(k2, hn::GetLane(hn::SumOfLanes(d, a2)));
    s[j + 3] = tail(k3, hn::GetLane(hn::SumOfLanes(d, a3)));
  }
  for (; j < n; ++j) {
    VF a = hn::Zero(d);
    for (int i = 0; i < full; i += kLanes) a = hn::MulAdd(hn::LoadU(d, q + i), hn::LoadU(d, keys[j] + i), a);
    s[j] = tail(keys[j], hn::GetLane(hn::SumOfLanes(d, a)));
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
