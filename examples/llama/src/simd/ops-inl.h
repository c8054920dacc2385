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

// Writes the MR × (NB panels) accumulators of one micro-tile: Y = r, Y += r, or for a SwiGLU pair
// (NB = 2: gate panel, then up panel) Y = silu(gate) · up. `cols[b]` = valid columns of panel b.
template <int MR, int NB>
HWY_INLINE void WriteTile(VF (&acc)[MR][NB * kPanelVectors], float* Y, std::size_t ldy, const int (&cols)[NB],
                          epilogue op) {
  const DF d;
  constexpr int V = kPanelVectors;
  if constexpr (NB == 2) {
    if (op == epilogue::swiglu) {
#pragma GCC unroll 8
      for (int t = 0; t < MR; ++t)
#pragma GCC unroll 4
        for (int v = 0; v < V; ++v)
          StoreColumns(d, hn::Mul(Silu(d, acc[t][v]), acc[t][V + v]), Y + sz(t) * ldy + sz(v * kLanes),
                       VectorColumns(cols[0], v));
      return;
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < MR; ++t)
#pragma GCC unroll 3
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

// Calls `body.template operator()<MR, NB>()` for runtime `mr` in [1, 8] and `nb` in [1, 3], for
// the shapes `Fits<MR, NB>` admits (one token always fits, with spills where the registers are
// short). The callers pick only those shapes: anything else is a bug, stopped here.
template <template <int, int> class Fits, class Body>
HWY_INLINE void WithTile(int mr, int nb, Body&& body) {
  auto with_nb = [&]<int NB>() {
    auto call = [&]<int MR>() {
      if constexpr (Fits<MR, NB>::value)
        body.template operator()<MR, NB>();
      else
        HWY_ABORT("kernel tile of %d tokens x %d panels does not fit the registers", MR, NB);
    };
    switch (mr) {
      case 1: call.template operator()<1>(); break;
      case 2: call.template operator()<2>(); break;
      case 3: call.template operator()<3>(); break;
      case 4: call.template operator()<4>(); break;
      case 5: call.template operator()<5>(); break;
      case 6: call.template operator()<6>(); break;
      case 7: call.template operator()<7>(); break;
      default: call.template operator()<8>(); break;
    }
  };
  switch (nb) {
    case 1: with_nb.template operator()<1>(); break;
    case 2: with_nb.template operator()<2>(); break;
    default: with_nb.template operator()<3>(); break;
  }
}

}  // namespace medusa_llama::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // MEDUSA_LLAMA_SIMD_OPS_INL_H_
