// SPDX-License-Identifier: Apache-2.0
// The float32 and bf16 projection kernels on packed panels (layouts in gemm.hpp), compiled for
// every instruction set Highway targets and chosen at run time.
//
// A micro-tile keeps MR tokens × NB panels of float32 accumulators in registers (one per token
// and vector of a panel's 16 columns): per k it loads the NB panels' weights and broadcasts MR
// activations. Every accumulator sums its products in order of k with one fused multiply-add
// each, whatever MR and NB are: a token's results have the same bits whether the pass holds one
// token or sixty-four, which keeps greedy Medusa decoding identical to plain decoding. MR and NB
// only change how many weight loads each product shares (one or two tokens take up to 8 panels,
// so that the single-token GEMV is bound by weight streaming, not by the FMA latency).
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "simd/gemm_float.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/cache_control.h>
#include <hwy/highway.h>

#include "simd/ops-inl.h"

#include "gemm.hpp"

#include <algorithm>

HWY_BEFORE_NAMESPACE();
namespace medusa_llama::detail::HWY_NAMESPACE {
namespace {

constexpr int kMaxTokens = std::min(8, kAccumulators / kPanelVectors);  // tokens per micro-tile, at most

template <int MR, int NB>
struct FloatTileFits {
  static constexpr bool value = kTileFits<MR, NB, kPanelVectors, kMaxTokens>;
};

template <int MR, int NB>
HWY_NOINLINE void TileF32(const float* HWY_RESTRICT P, std::size_t ps, const float* HWY_RESTRICT X, std::size_t ldx,
                          int K, float* Y, std::size_t ldy, const int (&cols)[NB], epilogue op) {
  const DF d;
  constexpr int V = kPanelVectors;
  VF acc[MR][NB * V];
#pragma GCC unroll 8
  for (int t = 0; t < MR; ++t)
#pragma GCC unroll 24
    for (int i = 0; i < NB * V; ++i) acc[t][i] = hn::Zero(d);
  for (int k = 0; k < K; ++k) {
    VF w[NB * V];
#pragma GCC unroll 8
    for (int b = 0; b < NB; ++b) {
      const float* src = P + sz(b) * ps + sz(k) * 16;
      // Past the panel's end this touches the next panel or the allocation's tail: prefetches
      // never fault.
      hwy::Prefetch(src + kPrefetchAhead<NB> / sizeof(float));
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) w[b * V + v] = hn::Load(d, src + v * kLanes);
    }
#pragma GCC unroll 8
    for (int t = 0; t < MR; ++t) {
      const VF x = hn::Set(d, X[sz(t) * ldx + sz(k)]);
#pragma GCC unroll 24
      for (int i = 0; i < NB * V; ++i) acc[t][i] = hn::MulAdd(w[i], x, acc[t][i]);
    }
  }
  WriteTile<MR, NB>(acc, Y, ldy, cols, op);
}

// bf16 panels: each uint32 holds the bf16 weights of k = 2kp (low half) and 2kp + 1 (high half)
// of one column; a shift and a mask widen them to float32 exactly, so only the weights are rounded.
template <int MR, int NB>
HWY_NOINLINE void TileBF16(const std::uint16_t* HWY_RESTRICT P, std::size_t ps, const float* HWY_RESTRICT X,
                           std::size_t ldx, int K, float* Y, std::size_t ldy, const int (&cols)[NB], epilogue op) {
  const DF d;
  const DU du;
  constexpr int V = kPanelVectors;
  VF acc[MR][NB * V];
#pragma GCC unroll 8
  for (int t = 0; t < MR; ++t)
#pragma GCC unroll 24
    for (int i = 0; i < NB * V; ++i) acc[t][i] = hn::Zero(d);
  const VU hi = hn::Set(du, 0xffff0000u);
  const int KP = K / 2;  // full pairs; an odd K leaves one even k (its odd partner is padding)
  for (int kp = 0; kp < KP; ++kp) {
    VF we[NB * V], wo[NB * V];
#pragma GCC unroll 8
    for (int b = 0; b < NB; ++b) {
      const auto* src = reinterpret_cast<const std::uint32_t*>(P + sz(b) * ps + sz(kp) * 32);
      hwy::Prefetch(src + kPrefetchAhead<NB> / sizeof(float));
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) {
        const VU u = hn::Load(du, src + v * kLanes);
        we[b * V + v] = hn::BitCast(d, hn::ShiftLeft<16>(u));
        wo[b * V + v] = hn::BitCast(d, hn::And(u, hi));
      }
    }
    const std::size_t k = 2 * sz(kp);
#pragma GCC unroll 8
    for (int t = 0; t < MR; ++t) {
      const VF xe = hn::Set(d, X[sz(t) * ldx + k]), xo = hn::Set(d, X[sz(t) * ldx + k + 1]);
#pragma GCC unroll 24
      for (int i = 0; i < NB * V; ++i) acc[t][i] = hn::MulAdd(wo[i], xo, hn::MulAdd(we[i], xe, acc[t][i]));
    }
  }
  if (K % 2 != 0) {
    const std::size_t k = sz(K - 1);
    VF we[NB * V];
#pragma GCC unroll 8
    for (int b = 0; b < NB; ++b) {
      const auto* src = reinterpret_cast<const std::uint32_t*>(P + sz(b) * ps + sz(KP) * 32);
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) we[b * V + v] = hn::BitCast(d, hn::ShiftLeft<16>(hn::Load(du, src + v * kLanes)));
    }
#pragma GCC unroll 8
    for (int t = 0; t < MR; ++t) {
      const VF xe = hn::Set(d, X[sz(t) * ldx + k]);
#pragma GCC unroll 24
      for (int i = 0; i < NB * V; ++i) acc[t][i] = hn::MulAdd(we[i], xe, acc[t][i]);
    }
  }
  WriteTile<MR, NB>(acc, Y, ldy, cols, op);
}

}  // namespace

void GemmFloat(const packed_matrix& W, const gemm_input& in, float* Y, std::size_t ldy, int g0, int g1, epilogue op) {
  const int K = W.in();
  const bool bf16 = W.format() == weight_format::bf16;
  const std::size_t ps = W.panel_stride();
  ForEachTile(W, in.T, g0, g1, kPanelVectors, kMaxTokens, kMaxTilePanels, [&](int mr, int t0, int p, int nb, const int* cols, int c0) {
    WithTile<FloatTileFits>(mr, nb, [&]<int MR, int NB>() {
      int c[NB];
      for (int b = 0; b < NB; ++b) c[b] = cols[b];
      const float* x = in.x + sz(t0) * in.ldx;
      float* y = Y + sz(t0) * ldy + sz(c0);
      if (bf16)
        TileBF16<MR, NB>(W.b16() + sz(p) * ps, ps, x, in.ldx, K, y, ldy, c, op);
      else
        TileF32<MR, NB>(W.f32() + sz(p) * ps, ps, x, in.ldx, K, y, ldy, c, op);
    });
  });
}

}  // namespace medusa_llama::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace medusa_llama::detail {
HWY_EXPORT(GemmFloat);

void gemm_float(const packed_matrix& W, const gemm_input& in, float* Y, std::size_t ldy, int g0, int g1, epilogue op) {
  HWY_DYNAMIC_DISPATCH(GemmFloat)(W, in, Y, ldy, g0, g1, op);
}
}  // namespace medusa_llama::detail
#endif
