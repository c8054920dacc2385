// SPDX-License-Identifier: Apache-2.0
// Private: vector helpers shared by the engine's Highway kernels (gemm_float.cpp, gemm_int.cpp,
// vector_ops.cpp, attention.cpp), compiled once per instruction set (Highway's per-target
// re-inclusion: the guard below toggles with HWY_TARGET_TOGGLE).
//
// Everything here works on float vectors of `kLanes` lanes (16 on AVX-512, 8 on AVX2, 4 on
// SSE4, NEON and the portable EMU128) and on the engine's 16-column weight panels, which take
// `kPanelVectors` = 16 / kLanes vectors per row of k.
#if defined(MEDUSA_LLAMA_SIMD_OPS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MEDUSA_LLAMA_SIMD_OPS_INL_H_
#undef MEDUSA_LLAMA_SIMD_OPS_INL_H_
#else
#define MEDUSA_LLAMA_SIMD_OPS_INL_H_
#endif

#include <hwy/highway.h>

#include <medusa/detail/exp2.hpp>

#include "../gemm.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>

HWY_BEFORE_NAMESPACE();
namespace medusa_llama::detail::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using DI = hn::RebindToSigned<DF>;
using DU = hn::RebindToUnsigned<DF>;
using VF = hn::Vec<DF>;
using VI = hn::Vec<DI>;
using VU = hn::Vec<DU>;

inline constexpr int kLanes = static_cast<int>(hn::MaxLanes(DF()));
static_assert(kLanes >= 4 && 16 % kLanes == 0, "the 16-column panels need 4, 8 or 16 float lanes");
inline constexpr int kPanelVectors = 16 / kLanes;

// Vector registers the micro-tiles may keep as accumulators: AVX-512 and NEON have 32 registers,
// SSE4 and AVX2 16 (EMU128 is taken like them).
inline constexpr int kAccumulators =
    (HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL || HWY_TARGET == HWY_NEON) ? 24 : 12;

inline std::size_t sz(int v) { return static_cast<std::size_t>(v); }

// 2^t, the polynomial of medusa::detail::exp2_approx lane by lane (t clamped to [-127, 127],
// NaN to -127, so results below 2^-126.5 are 0).
HWY_INLINE VF Exp2(DF d, VF t) {
  namespace md = medusa::detail;
  const VF lo = hn::Set(d, -127.0f);
  // Max(t, lo) puts lo in NaN lanes on x86 (maxps returns its second operand); elsewhere NaN
  // lanes become -127 through the comparison below.
  VF tc = hn::Min(hn::Max(t, lo), hn::Set(d, 127.0f));
  tc = hn::IfThenElse(hn::Eq(tc, tc), tc, lo);
  const VF n = hn::Round(tc);
  const VF f = hn::Sub(tc, n);
  VF p = hn::Set(d, md::exp2_c7);
  p = hn::MulAdd(p, f, hn::Set(d, md::exp2_c6));
  p = hn::MulAdd(p, f, hn::Set(d, md::exp2_c5));
  p = hn::MulAdd(p, f, hn::Set(d, md::exp2_c4));
  p = hn::MulAdd(p, f, hn::Set(d, md::exp2_c3));
  p = hn::MulAdd(p, f, hn::Set(d, md::exp2_c2));
  p = hn::MulAdd(p, f, hn::Set(d, md::exp2_c1));
  p = hn::MulAdd(p, f, hn::Set(d, 1.0f));
  const DI di;
  const VI e = hn::ShiftLeft<23>(hn::Add(hn::ConvertTo(di, n), hn::Set(di, 127)));
  return hn::Mul(p, hn::BitCast(d, e));
}

// silu(g) = g / (1 + e^-g), e^-g = 2^(-g · log2 e).
HWY_INLINE VF Silu(DF d, VF g) {
  const VF e = Exp2(d, hn::Mul(g, hn::Set(d, -medusa::detail::log2e)));
  return hn::Div(g, hn::Add(hn::Set(d, 1.0f), e));
}

// Columns of vector `v` of a panel with `cols` valid columns.
HWY_INLINE int VectorColumns(int cols, int v) {
  const int n = cols - v * kLanes;
  return n < 0 ? 0 : n > kLanes ? kLanes : n;
}

// The first n lanes of a vector to or from memory (n < kLanes only at the last panel's edge:
// through a small buffer, since masked loads read the whole vector on some targets).
HWY_INLINE void StoreColumns(DF d, VF v, float* p, int n) {
  if (n == kLanes) {
    hn::StoreU(v, d, p);
  } else if (n > 0) {
    alignas(64) float buf[kLanes];
    hn::Store(v, d, buf);
    for (int i = 0; i < n; ++i) p[i] = buf[i];
  }
}

HWY_INLINE VF LoadColumns(DF d, const float* p, int n) {
  if (n == kLanes) return hn::LoadU(d, p);
  alignas(64) float buf[kLanes] = {};
  for (int i = 0; i < n; ++i) buf[i] = p[i];
  return hn::Load(d, buf);
}

// Writes the MR × (NB panels) accumulators of one micro-tile: Y = r, Y += r, or for SwiGLU pairs
// (panels 2i and 2i + 1: gate and up of columns 16i ..) Y = silu(gate) · up. `cols[b]` = valid
// columns of panel b.
template <int MR, int NB>
HWY_INLINE void WriteTile(VF (&acc)[MR][NB * kPanelVectors], float* Y, std::size_t ldy, const int (&cols)[NB],
                          epilogue op) {
  const DF d;
  constexpr int V = kPanelVectors;
  if constexpr (NB % 2 == 0) {
    if (op == epilogue::swiglu) {
#pragma GCC unroll 8
      for (int t = 0; t < MR; ++t)
#pragma GCC unroll 4
        for (int i = 0; i < NB / 2; ++i)
#pragma GCC unroll 4
          for (int v = 0; v < V; ++v)
            StoreColumns(d, hn::Mul(Silu(d, acc[t][2 * i * V + v]), acc[t][(2 * i + 1) * V + v]),
                         Y + sz(t) * ldy + sz(i * 16 + v * kLanes), VectorColumns(cols[2 * i], v));
      return;
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < MR; ++t)
#pragma GCC unroll 8
    for (int b = 0; b < NB; ++b)
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) {
        float* y = Y + sz(t) * ldy + sz(b * 16 + v * kLanes);
        const int n = VectorColumns(cols[b], v);
        VF r = acc[t][b * V + v];
        if (op == epilogue::add) r = hn::Add(r, LoadColumns(d, y, n));
        StoreColumns(d, r, y, n);
      }
}

// Panels a micro-tile holds at most: 3 for three tokens or more; up to 8 for one or two (a
// single-token GEMV needs that many independent sums to stream the weights).
inline constexpr int kMaxTilePanels = 8;

// Bytes each of a tile's NB weight streams prefetches ahead: about 9 KiB in flight per tile
// whatever its shape. Measured on Zen 5 (AVX-512 and AVX2): a fixed 512 bytes a stream left the
// 1–3 panel tiles of several tokens waiting on memory (a 6-token step cost 1.6 single-token
// steps; with this, 1.2), and 3 KiB a stream for the 8 panels of one token (24 KiB) made it slower.
template <int NB>
inline constexpr int kPrefetchAhead = std::clamp(9216 / NB, 512, 4096);

// Whether a tile of MR tokens × NB panels, `per` accumulators per token and panel, fits the
// registers (one token always does, spilling where they are short).
template <int MR, int NB, int per, int max_tokens>
inline constexpr bool kTileFits =
    MR == 1 || (MR * NB * per <= kAccumulators && MR <= max_tokens && (NB <= 3 || MR <= 2));

// Cuts the column groups [g0, g1) of W into micro-tiles for T tokens and calls
// `run(mr, t0, p, nb, cols, c0)` for each: tokens [t0, t0 + mr), panels [p, p + nb) with `cols[b]`
// valid columns each, writing output columns from c0. `per` accumulators per token and panel,
// at most `max_tokens` tokens a tile, at most `max_panels` (≤ kMaxTilePanels) panels for one or
// two tokens. SwiGLU pairs stay whole (nb even, c0 = 16 · first pair).
// Token tiles are balanced (sizes differ by at most one); each reads its panels once. Neither
// the shapes nor their order change a column's arithmetic.
template <class Run>
HWY_INLINE void ForEachTile(const packed_matrix& W, int T, int g0, int g1, int per, int max_tokens, int max_panels,
                            Run&& run) {
  const int tokens = std::max(1, std::min(T, max_tokens));
  const int fit = std::clamp(kAccumulators / (tokens * per), 1, T <= 2 ? max_panels : 3);
  auto tiles_of = [&](int p, int nb, const int* cols, int c0) {
    const int max_mr = std::max(1, std::min(max_tokens, kAccumulators / (nb * per)));
    const int n = (T + max_mr - 1) / max_mr;
    for (int i = 0, t0 = 0; i < n; ++i) {
      const int mr = (T - t0) / (n - i);
      run(mr, t0, p, nb, cols, c0);
      t0 += mr;
    }
  };
  int cols[kMaxTilePanels];
  // Units (panels, or SwiGLU pairs) [u0, u1) in balanced runs of at most `per_tile`.
  auto runs = [](int u0, int u1, int per_tile, auto&& f) {
    const int n = (u1 - u0 + per_tile - 1) / per_tile;
    for (int i = 0, u = u0; i < n; ++i) {
      const int m = (u1 - u) / (n - i);
      f(u, m);
      u += m;
    }
  };
  if (W.pair()) {
    runs(g0, g1, std::max(1, fit / 2), [&](int g, int n) {
      for (int i = 0; i < n; ++i) {
        cols[2 * i] = std::min(16, W.rows() - (g + i) * 16);
        cols[2 * i + 1] = 16;
      }
      tiles_of(2 * g, 2 * n, cols, 16 * g);
    });
    return;
  }
  runs(g0 * W.group_panels(), std::min(g1 * W.group_panels(), W.panels()), fit, [&](int p, int n) {
    for (int b = 0; b < n; ++b) cols[b] = std::min(16, W.rows() - (p + b) * 16);
    tiles_of(p, n, cols, 16 * p);
  });
}

// Calls `f.template operator()<N>()` for the runtime `n` in [1, 8] (larger: 8).
template <class F>
HWY_INLINE void WithCount(int n, F&& f) {
  switch (n) {
    case 1: f.template operator()<1>(); break;
    case 2: f.template operator()<2>(); break;
    case 3: f.template operator()<3>(); break;
    case 4: f.template operator()<4>(); break;
    case 5: f.template operator()<5>(); break;
    case 6: f.template operator()<6>(); break;
    case 7: f.template operator()<7>(); break;
    default: f.template operator()<8>(); break;
  }
}

// Calls `body.template operator()<MR, NB>()` for runtime `mr` and `nb` in [1, 8], for the shapes
// `Fits<MR, NB>` admits (ForEachTile picks only those: anything else is a bug, stopped here).
template <template <int, int> class Fits, class Body>
HWY_INLINE void WithTile(int mr, int nb, Body&& body) {
  WithCount(nb, [&]<int NB>() {
    WithCount(mr, [&]<int MR>() {
      if constexpr (Fits<MR, NB>::value)
        body.template operator()<MR, NB>();
      else
        HWY_ABORT("kernel tile of %d tokens x %d panels does not fit the registers", MR, NB);
    });
  });
}

}  // namespace medusa_llama::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // MEDUSA_LLAMA_SIMD_OPS_INL_H_
