// SPDX-License-Identifier: Apache-2.0
// The integer projection kernels (layouts in gemm.hpp), compiled for every instruction set Highway
// targets and chosen at run time:
//  * int8 (Medusa heads): per-column scales, activations quantized per row;
//  * q8_0 and q4_0 (GGUF's block formats): activations quantized per row and block of 32, the
//    block's products summed exactly in int32, then added to a float32 accumulator as
//    (sum) · (d_w · s_x).
// and the quantization of the activations for both.
//
// Every target computes the same exact int32 sums Σ q_w · q_x, by its own instructions:
//  * VNNI `vpdpbusd` (unsigned × signed bytes, 4 products per int32 lane: AVX512-VNNI on AVX3_DL,
//    and on AVX3 and AVX2 where the CPU has AVX512-VNNI or AVX-VNNI beside them): the unsigned side
//    carries an offset (weights + 128 or + 8, int8 activations + 128), removed afterwards with the
//    other side's sums;
//  * AVX-512BW, AVX2 and SSE4 `pmaddubsw` + `pmaddwd` (ggml's sequence): |a| × sign(b, a), pairs
//    of products summed in int16 (at most 2 · 128 · 127, no saturation), then in int32;
//  * NEON `smull` + pairwise adds; the portable EMU128 target lane by lane.
// So the float results differ between targets only where the float arithmetic does (fused or not),
// and a token's results never depend on how many tokens the pass holds.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "simd/gemm_int.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/cache_control.h>
#include <hwy/highway.h>

#include "simd/ops-inl.h"
#include "simd/targets.hpp"

#include "gemm.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

HWY_BEFORE_NAMESPACE();
namespace medusa_llama::detail::HWY_NAMESPACE {
namespace {

// Targets that may multiply the bytes with vpdpbusd (one operand unsigned, with an offset):
// AVX3_DL always, AVX3 and AVX2 where the CPU has AVX512-VNNI or AVX-VNNI beside them.
constexpr bool kMayVnni = HWY_TARGET == HWY_AVX3_DL || HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX2;

bool use_vnni() {
#if HWY_TARGET == HWY_AVX3_DL
  return true;
#elif HWY_TARGET == HWY_AVX3
  return vnni_extension_allowed() && cpu_has_avx512_vnni();
#elif HWY_TARGET == HWY_AVX2
  return vnni_extension_allowed() && cpu_has_avx_vnni();
#else
  return false;
#endif
}

// acc + Σ over each int32 lane's 4 bytes of u8(u) · s8(s) (vpdpbusd; written as assembly so that
// the AVX3 and AVX2 targets need not be compiled for the extension, which they check at run time).
[[maybe_unused]] HWY_INLINE VI DotUnsigned(VI acc, VI u, VI s) {
#if HWY_TARGET == HWY_AVX3_DL || HWY_TARGET == HWY_AVX3
  __m512i r = acc.raw;
  __asm__("vpdpbusd %2, %1, %0" : "+v"(r) : "v"(u.raw), "v"(s.raw));
  return VI{r};
#elif HWY_TARGET == HWY_AVX2
  __m256i r = acc.raw;
  __asm__("%{vex%} vpdpbusd %2, %1, %0" : "+x"(r) : "x"(u.raw), "x"(s.raw));
  return VI{r};
#else
  (void)u, (void)s;
  return acc;
#endif
}

// acc + Σ over each int32 lane's 4 bytes of s8(a) · s8(b), given abs_a = |a| (bytes; -128 may
// appear in a, not in b).
HWY_INLINE VI DotSigned(VI acc, VI abs_a, VI a, VI b) {
#if HWY_TARGET == HWY_AVX2
  const __m256i p = _mm256_maddubs_epi16(abs_a.raw, _mm256_sign_epi8(b.raw, a.raw));
  return hn::Add(acc, VI{_mm256_madd_epi16(p, _mm256_set1_epi16(1))});
#elif HWY_TARGET == HWY_SSE4
  const __m128i p = _mm_maddubs_epi16(abs_a.raw, _mm_sign_epi8(b.raw, a.raw));
  return hn::Add(acc, VI{_mm_madd_epi16(p, _mm_set1_epi16(1))});
#elif HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  // AVX-512 has no psignb: negate b where a < 0 (where a = 0, |a| = 0 zeroes the product).
  const __m512i sb = _mm512_mask_sub_epi8(b.raw, _mm512_movepi8_mask(a.raw), _mm512_setzero_si512(), b.raw);
  const __m512i p = _mm512_maddubs_epi16(abs_a.raw, sb);
  return hn::Add(acc, VI{_mm512_madd_epi16(p, _mm512_set1_epi16(1))});
#elif HWY_TARGET == HWY_NEON
  (void)abs_a;
  const int8x16_t a8 = vreinterpretq_s8_s32(a.raw), b8 = vreinterpretq_s8_s32(b.raw);
  const int16x8_t lo = vmull_s8(vget_low_s8(a8), vget_low_s8(b8));  // lanes of columns 0, 1
  const int16x8_t hi = vmull_high_s8(a8, b8);                       // columns 2, 3
  return VI{vpadalq_s16(acc.raw, vpaddq_s16(lo, hi))};
#else
  (void)abs_a;
  alignas(64) std::int8_t ab[kLanes * 4], bb[kLanes * 4];
  alignas(64) std::int32_t r[kLanes];
  hn::Store(a, DI(), reinterpret_cast<std::int32_t*>(ab));
  hn::Store(b, DI(), reinterpret_cast<std::int32_t*>(bb));
  hn::Store(acc, DI(), r);
  for (int l = 0; l < kLanes; ++l)
    for (int j = 0; j < 4; ++j) r[l] += static_cast<std::int32_t>(ab[4 * l + j]) * bb[4 * l + j];
  return hn::Load(DI(), r);
#endif
}

// |bytes| (abs of -128 is 128 as an unsigned byte).
HWY_INLINE VI AbsBytes(VI a) {
  const hn::Repartition<std::int8_t, DI> d8;
  return hn::BitCast(DI(), hn::Abs(hn::BitCast(d8, a)));
}

HWY_INLINE VI XorBytes(VI a, std::uint8_t m) {
  const hn::Repartition<std::uint8_t, DI> d8;
  return hn::BitCast(DI(), hn::Xor(hn::BitCast(d8, a), hn::Set(d8, m)));
}

HWY_INLINE VI QuadOf(const std::int8_t* p) {
  std::int32_t v;
  std::memcpy(&v, p, sizeof v);
  return hn::Set(DI(), v);
}

// --- int8 (per-column scales) -------------------------------------------------------------------

constexpr int kMaxTokensI8 = std::min(8, kAccumulators / kPanelVectors);

template <int MR, int NB>
struct Int8TileFits {
  static constexpr bool value = kTileFits<MR, NB, kPanelVectors, kMaxTokensI8>;
};

// One int8 micro-tile: per 4 k, one row of 64 bytes per panel (4 k × 16 columns) against each
// token's 4 activation bytes; then the scales. XQ holds q_x + 128 (`ldq` bytes a row, padding 128).
template <int MR, int NB, bool Vnni>
HWY_NOINLINE void TileI8(const std::int8_t* HWY_RESTRICT P, std::size_t ps, const float* S, const std::int32_t* C,
                         const std::uint8_t* XQ, std::size_t ldq, const float* sx, float* Y, std::size_t ldy,
                         const int (&cols)[NB], epilogue op) {
  const DI di;
  const DF df;
  constexpr int V = kPanelVectors;
  VI acc[MR][NB * V];
#pragma GCC unroll 8
  for (int t = 0; t < MR; ++t)
#pragma GCC unroll 24
    for (int i = 0; i < NB * V; ++i) acc[t][i] = hn::Zero(di);
  const auto* xq = reinterpret_cast<const std::int8_t*>(XQ);
  const int KQ = static_cast<int>(ldq / 4);
  for (int kq = 0; kq < KQ; ++kq) {
    VI w[NB * V], aw[NB * V];
#pragma GCC unroll 8
    for (int b = 0; b < NB; ++b) {
      const std::int8_t* src = P + sz(b) * ps + sz(kq) * 64;
      hwy::Prefetch(src + kPrefetchAhead<NB>);
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) {
        w[b * V + v] = hn::Load(di, reinterpret_cast<const std::int32_t*>(src) + v * kLanes);
        if constexpr (!Vnni) aw[b * V + v] = AbsBytes(w[b * V + v]);
      }
    }
#pragma GCC unroll 8
    for (int t = 0; t < MR; ++t) {
      const VI x = QuadOf(xq + sz(t) * ldq + sz(kq) * 4);  // q_x + 128
#pragma GCC unroll 24
      for (int i = 0; i < NB * V; ++i) {
        if constexpr (Vnni)
          acc[t][i] = DotUnsigned(acc[t][i], x, w[i]);  // Σ (q_x + 128) q_w
        else
          acc[t][i] = DotSigned(acc[t][i], aw[i], w[i], XorBytes(x, 0x80));  // Σ q_w q_x
      }
    }
  }
  VF out[MR][NB * V];
#pragma GCC unroll 8
  for (int b = 0; b < NB; ++b)
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) {
      const std::size_t c = sz(b) * 16 + sz(v * kLanes);
      const VF sc = hn::LoadU(df, S + c);
      const VI cs = Vnni ? hn::LoadU(di, C + c) : hn::Zero(di);  // 128 · Σ q_w
#pragma GCC unroll 8
      for (int t = 0; t < MR; ++t) {
        const VF f = hn::ConvertTo(df, hn::Sub(acc[t][b * V + v], cs));
        out[t][b * V + v] = hn::Mul(f, hn::Mul(sc, hn::Set(df, sx[t])));
      }
    }
  WriteTile<MR, NB>(out, Y, ldy, cols, op);
}

// --- q8_0 and q4_0 ------------------------------------------------------------------------------

// Tokens per micro-tile: int32 and float32 accumulators per token and vector.
constexpr int kMaxTokensBlocks = std::min(4, kAccumulators / (2 * kPanelVectors));

template <int MR, int NB>
struct BlockTileFits {
  static constexpr bool value = kTileFits<MR, NB, 2 * kPanelVectors, kMaxTokensBlocks>;
};

// One micro-tile: MR tokens × NB panels, all blocks of K. With VNNI the weight bytes are unsigned
// (q8_0: q + 128; q4_0: q + 8) and the block's offset · Σ q_x is subtracted; elsewhere q8_0 bytes
// are made signed (xor 128) and q4_0's 0..15 multiply as they are, so only q4_0 needs the offset.
template <int MR, int NB, bool Q4, bool Vnni>
HWY_NOINLINE void TileBlocks(const std::uint8_t* HWY_RESTRICT P, std::size_t ps, const std::uint16_t* S, std::size_t ss,
                             const block_rows& x, int t0, float* Y, std::size_t ldy, const int (&cols)[NB], epilogue op) {
  const DI di;
  const DF df;
  const hn::Rebind<hwy::float16_t, DF> dh;
  const hn::Repartition<std::uint8_t, DI> d8;
  const hn::Repartition<std::uint16_t, DI> d16;
  constexpr int V = kPanelVectors;
  constexpr std::size_t block_bytes = Q4 ? 256 : 512;
  // The offset removed per block: o · Σ q_x (as a shift).
  constexpr int shift = Q4 ? 3 : 7;
  constexpr bool offset = Q4 || Vnni;
  VF facc[MR][NB * V];
#pragma GCC unroll 4
  for (int t = 0; t < MR; ++t)
#pragma GCC unroll 16
    for (int i = 0; i < NB * V; ++i) facc[t][i] = hn::Zero(df);
  const std::int8_t* xr[MR];
#pragma GCC unroll 4
  for (int t = 0; t < MR; ++t) xr[t] = x.q.data() + sz(t0 + t) * x.ld;
  for (int blk = 0; blk < x.blocks; ++blk) {
    VI acc[MR][NB * V];
#pragma GCC unroll 4
    for (int t = 0; t < MR; ++t)
#pragma GCC unroll 16
      for (int i = 0; i < NB * V; ++i) acc[t][i] = hn::Zero(di);
    const std::size_t q0 = sz(blk) * 8;  // first k-quad of the block
    if constexpr (Q4) {
      const auto low = hn::Set(d8, 0x0f);
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        VI w0[NB * V], w1[NB * V];
#pragma GCC unroll 8
        for (int b = 0; b < NB; ++b) {
          const std::uint8_t* src = P + sz(b) * ps + sz(blk) * block_bytes + sz(i) * 64;
          hwy::Prefetch(src + kPrefetchAhead<NB>);
#pragma GCC unroll 4
          for (int v = 0; v < V; ++v) {
            const auto raw = hn::Load(d8, src + v * 4 * kLanes);
            w0[b * V + v] = hn::BitCast(di, hn::And(raw, low));
            w1[b * V + v] = hn::BitCast(di, hn::And(hn::BitCast(d8, hn::ShiftRight<4>(hn::BitCast(d16, raw))), low));
          }
        }
#pragma GCC unroll 4
        for (int t = 0; t < MR; ++t) {
          const VI xa = QuadOf(xr[t] + (q0 + 2 * sz(i)) * 4), xb = QuadOf(xr[t] + (q0 + 2 * sz(i) + 1) * 4);
#pragma GCC unroll 16
          for (int j = 0; j < NB * V; ++j) {
            if constexpr (Vnni)
              acc[t][j] = DotUnsigned(DotUnsigned(acc[t][j], w0[j], xa), w1[j], xb);
            else  // weights 0..15: their own absolute values
              acc[t][j] = DotSigned(DotSigned(acc[t][j], w0[j], w0[j], xa), w1[j], w1[j], xb);
          }
        }
      }
    } else {
#pragma GCC unroll 8
      for (int kq = 0; kq < 8; ++kq) {
        VI w[NB * V], aw[NB * V];
#pragma GCC unroll 8
        for (int b = 0; b < NB; ++b) {
          const std::uint8_t* src = P + sz(b) * ps + sz(blk) * block_bytes + sz(kq) * 64;
          hwy::Prefetch(src + kPrefetchAhead<NB>);
#pragma GCC unroll 4
          for (int v = 0; v < V; ++v) {
            w[b * V + v] = hn::BitCast(di, hn::Load(d8, src + v * 4 * kLanes));
            if constexpr (!Vnni) {
              w[b * V + v] = XorBytes(w[b * V + v], 0x80);  // q
              aw[b * V + v] = AbsBytes(w[b * V + v]);
            }
          }
        }
#pragma GCC unroll 4
        for (int t = 0; t < MR; ++t) {
          const VI xq = QuadOf(xr[t] + (q0 + sz(kq)) * 4);
#pragma GCC unroll 16
          for (int j = 0; j < NB * V; ++j) {
            if constexpr (Vnni)
              acc[t][j] = DotUnsigned(acc[t][j], w[j], xq);
            else
              acc[t][j] = DotSigned(acc[t][j], aw[j], w[j], xq);
          }
        }
      }
    }
#pragma GCC unroll 8
    for (int b = 0; b < NB; ++b)
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) {
        const VF d = hn::PromoteTo(df, hn::LoadU(dh, reinterpret_cast<const hwy::float16_t*>(S + sz(b) * ss + sz(blk) * 16 + sz(v * kLanes))));
#pragma GCC unroll 4
        for (int t = 0; t < MR; ++t) {
          const std::size_t tb = sz(t0 + t) * sz(x.blocks) + sz(blk);
          VI sum = acc[t][b * V + v];
          if constexpr (offset) sum = hn::Sub(sum, hn::Set(di, x.sum[tb] << shift));
          facc[t][b * V + v] = hn::MulAdd(hn::ConvertTo(df, sum), hn::Mul(d, hn::Set(df, x.scale[tb])), facc[t][b * V + v]);
        }
      }
  }
  WriteTile<MR, NB>(facc, Y, ldy, cols, op);
}

}  // namespace

void GemmInt8(const packed_matrix& W, const quantized_rows& xq, int T, float* Y, std::size_t ldy, int g0, int g1,
              epilogue op) {
  const std::size_t ps = W.panel_stride();
  const bool vnni = use_vnni();
  ForEachTile(W, T, g0, g1, kPanelVectors, kMaxTokensI8, kMaxTilePanels, [&](int mr, int t0, int p, int nb, const int* cols, int c0) {
    WithTile<Int8TileFits>(mr, nb, [&]<int MR, int NB>() {
      int c[NB];
      for (int b = 0; b < NB; ++b) c[b] = cols[b];
      auto run = [&]<bool Vnni>() {
        TileI8<MR, NB, Vnni>(W.i8() + sz(p) * ps, ps, W.scales() + sz(p) * 16, W.colsums() + sz(p) * 16,
                             xq.q + sz(t0) * xq.ld, xq.ld, xq.scale + t0, Y + sz(t0) * ldy + sz(c0), ldy, c, op);
      };
      if constexpr (HWY_TARGET == HWY_AVX3_DL)
        run.template operator()<true>();
      else if (kMayVnni && vnni)
        run.template operator()<kMayVnni>();
      else
        run.template operator()<false>();
    });
  });
}

void GemmBlocks(const packed_matrix& W, const block_rows& x, float* Y, std::size_t ldy, int g0, int g1, epilogue op) {
  const bool q4 = W.format() == weight_format::q4_0;
  const bool vnni = use_vnni();
  const std::size_t ss = sz(x.blocks) * 16;
  ForEachTile(W, x.T, g0, g1, 2 * kPanelVectors, kMaxTokensBlocks, 4,
                [&](int mr, int t0, int p, int nb, const int* cols, int c0) {
                  WithTile<BlockTileFits>(mr, nb, [&]<int MR, int NB>() {
                    int c[NB];
                    for (int b = 0; b < NB; ++b) c[b] = cols[b];
                    const std::uint8_t* P = W.u8() + sz(p) * W.panel_bytes();
                    const std::uint16_t* S = W.block_scales() + sz(p) * ss;
                    float* y = Y + sz(t0) * ldy + sz(c0);
                    auto run = [&]<bool Vnni>() {
                      if (q4)
                        TileBlocks<MR, NB, true, Vnni>(P, W.panel_bytes(), S, ss, x, t0, y, ldy, c, op);
                      else
                        TileBlocks<MR, NB, false, Vnni>(P, W.panel_bytes(), S, ss, x, t0, y, ldy, c, op);
                    };
                    if constexpr (HWY_TARGET == HWY_AVX3_DL)
                      run.template operator()<true>();
                    else if (kMayVnni && vnni)
                      run.template operator()<kMayVnni>();
                    else
                      run.template operator()<false>();
                  });
                });
}

// Activation rows per block of 32: d = max |x| / 127, q = round(x / d) (to nearest even, as
// nearbyint), Σ q; a row with a non-finite value gets NaN scales.
void QuantizeBlocks(const float* X, std::size_t ldx, int T, int K, block_rows& out) {
  const DF df;
  const DI di;
  const hn::Rebind<std::int8_t, DI> d8;
  const int nb = (K + 31) / 32;
  out.blocks = nb;
  out.T = T;
  out.ld = sz(nb) * 32;
  out.q.assign(sz(T) * out.ld, 0);
  out.scale.assign(sz(T) * sz(nb), 0.0f);
  out.sum.assign(sz(T) * sz(nb), 0);
  constexpr int VB = 32 / kLanes;  // vectors per block
  for (int t = 0; t < T; ++t) {
    const float* x = X + sz(t) * ldx;
    float* scale = out.scale.data() + sz(t) * sz(nb);
    std::int32_t* sum = out.sum.data() + sz(t) * sz(nb);
    std::int8_t* row = out.q.data() + sz(t) * out.ld;
    bool finite = true;
    for (int b = 0; b < nb; ++b) {
      const int k0 = b * 32, n = std::min(32, K - k0);
      // A short last block is read through a zero-padded copy (no read past the row).
      alignas(64) float tail[32] = {};
      const float* src = x + k0;
      if (n < 32) {
        std::copy(src, src + n, tail);
        src = tail;
      }
      VF v[VB];
      VF amax = hn::Zero(df);
      auto ok = hn::Eq(amax, amax);
#pragma GCC unroll 8
      for (int i = 0; i < VB; ++i) {
        v[i] = hn::LoadU(df, src + i * kLanes);
        ok = hn::And(ok, hn::IsFinite(v[i]));
        amax = hn::Max(amax, hn::Abs(v[i]));
      }
      finite = finite && hn::AllTrue(df, ok);
      const float d = hn::GetLane(hn::MaxOfLanes(df, amax)) / 127.0f;
      scale[b] = d;
      if (d == 0.0f || !finite) continue;
      const VF id = hn::Set(df, 1.0f / d);
      VI s = hn::Zero(di);
#pragma GCC unroll 8
      for (int i = 0; i < VB; ++i) {
        const VI q = hn::NearestInt(hn::Mul(v[i], id));
        s = hn::Add(s, q);
        hn::StoreU(hn::DemoteTo(d8, q), d8, row + k0 + i * kLanes);
      }
      sum[b] = hn::GetLane(hn::SumOfLanes(di, s));
    }
    if (!finite) std::fill(scale, scale + nb, std::numeric_limits<float>::quiet_NaN());
  }
}

// int8 activation rows: s = max |x| / 127, q = clamp(round(x / s), ±127) + 128 as unsigned bytes
// (`int8_stride(K)` a row, padding 128 = zero); a row with a non-finite value gets a NaN scale.
void QuantizeRows(const float* X, std::size_t ldx, int T, int K, std::vector<std::uint8_t>& q, std::vector<float>& scale) {
  const DF df;
  const hn::Rebind<std::uint8_t, DI> d8;
  const std::size_t ld = int8_stride(K);
  q.assign(sz(T) * ld, 128);
  scale.assign(sz(T), 0.0f);
  for (int t = 0; t < T; ++t) {
    const float* x = X + sz(t) * ldx;
    VF amax = hn::Zero(df);
    auto ok = hn::Eq(amax, amax);
    int k = 0;
    for (; k + kLanes <= K; k += kLanes) {
      const VF v = hn::LoadU(df, x + k);
      ok = hn::And(ok, hn::IsFinite(v));
      amax = hn::Max(amax, hn::Abs(v));
    }
    float am = hn::GetLane(hn::MaxOfLanes(df, amax));
    bool finite = hn::AllTrue(df, ok);
    for (int j = k; j < K; ++j) {
      finite = finite && std::isfinite(x[j]);
      am = std::max(am, std::abs(x[j]));
    }
    if (!finite) {
      scale[sz(t)] = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    const float s = am / 127.0f;
    scale[sz(t)] = s;
    if (s == 0.0f) continue;
    std::uint8_t* row = q.data() + sz(t) * ld;
    const VF vs = hn::Set(df, s), lo = hn::Set(df, -127.0f), hi = hn::Set(df, 127.0f);
    const DI di;
    for (k = 0; k + kLanes <= K; k += kLanes) {
      const VI qi = hn::NearestInt(hn::Min(hn::Max(hn::Div(hn::LoadU(df, x + k), vs), lo), hi));
      hn::StoreU(hn::DemoteTo(d8, hn::Add(qi, hn::Set(di, 128))), d8, row + k);
    }
    for (; k < K; ++k) row[k] = static_cast<std::uint8_t>(std::clamp(std::nearbyint(x[k] / s), -127.0f, 127.0f) + 128.0f);
  }
}

}  // namespace medusa_llama::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace medusa_llama::detail {
HWY_EXPORT(GemmInt8);
HWY_EXPORT(GemmBlocks);
HWY_EXPORT(QuantizeBlocks);
HWY_EXPORT(QuantizeRows);

void gemm_int8(const packed_matrix& W, const quantized_rows& xq, int T, float* Y, std::size_t ldy, int g0, int g1,
               epilogue op) {
  HWY_DYNAMIC_DISPATCH(GemmInt8)(W, xq, T, Y, ldy, g0, g1, op);
}

void gemm_blocks_simd(const packed_matrix& W, const block_rows& x, float* Y, std::size_t ldy, int g0, int g1,
                      epilogue op) {
  HWY_DYNAMIC_DISPATCH(GemmBlocks)(W, x, Y, ldy, g0, g1, op);
}

void quantize_blocks(const gemm_input& in, int K, block_rows& out) {
  HWY_DYNAMIC_DISPATCH(QuantizeBlocks)(in.x, in.ldx, in.T, K, out);
}

void quantize_rows(const gemm_input& in, int K, std::vector<std::uint8_t>& q, std::vector<float>& scale) {
  HWY_DYNAMIC_DISPATCH(QuantizeRows)(in.x, in.ldx, in.T, K, q, scale);
}
}  // namespace medusa_llama::detail
#endif
