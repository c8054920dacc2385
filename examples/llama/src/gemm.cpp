// SPDX-License-Identifier: Apache-2.0
// Packed-panel projection kernels (see gemm.hpp). The AVX-512 micro-tile keeps MR tokens × NB
// panels (16 columns each) of float32 accumulators in registers: per k it loads NB weight vectors
// and broadcasts MR activations (24 FMAs for 11 loads at MR = 8, NB = 3). One or two tokens split
// k over 2-4 accumulator sets instead, so the single-token GEMV is bound by weight streaming, not
// FMA latency. Each panel stream is prefetched a few cache lines ahead: with 8 or more tokens the
// FMAs take as long as the loads, and the hardware prefetcher alone leaves the stream stalling.
#include "gemm.hpp"
#include "gemm_tile.hpp"

#include <medusa/detail/exp2.hpp>
#include <medusa/half.hpp>
#include <medusa/heads.hpp>

#include <medusa_llama/thread_pool.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <new>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace medusa_llama::detail {

namespace {
constexpr int kPanel = 16;  // output columns per panel
constexpr int kMaxMR = 8;   // tokens per micro-tile
constexpr int kPrefetch = 8;  // k steps (cache lines of a float32 panel) to prefetch ahead
std::size_t sz(int v) { return static_cast<std::size_t>(v); }
[[maybe_unused]] float silu_mul(float g, float u) { return medusa::silu(g) * u; }
}  // namespace

std::uint16_t bf16_round(float f) noexcept {
  const auto u = std::bit_cast<std::uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  return static_cast<std::uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

float bf16_to_float(std::uint16_t h) noexcept { return std::bit_cast<float>(static_cast<std::uint32_t>(h) << 16); }

void packed_matrix::free_aligned::operator()(std::byte* p) const noexcept { ::operator delete[](p, std::align_val_t{64}); }

void packed_matrix::allocate(int panels) {
  panels_ = panels;
  panel_stride_ = fmt_ == weight_format::bf16   ? bf16_stride(in_) * kPanel
                  : fmt_ == weight_format::int8 ? int8_stride(in_) * kPanel
                  : fmt_ == weight_format::q8_0 ? sz(blocks()) * 512
                  : fmt_ == weight_format::q4_0 ? sz(blocks()) * 256
                                                : sz(in_) * kPanel;
  const std::size_t elem = fmt_ == weight_format::f32 ? sizeof(float) : fmt_ == weight_format::bf16 ? sizeof(std::uint16_t) : 1;
  if (fmt_ == weight_format::int8) {
    scales_.assign(sz(panels) * kPanel, 0.0f);
    colsums_.assign(sz(panels) * kPanel, 0);
  }
  if (blocked()) block_scales_.assign(sz(panels) * sz(blocks()) * kPanel, 0);
  bytes_ = sz(panels) * panel_stride_ * elem;
  data_.reset(new (std::align_val_t{64}) std::byte[std::max<std::size_t>(bytes_, 64)]);
  // Zero weights: q = 0 is stored as 128 (q8_0) or 8 (q4_0: 0x88 holds two).
  std::memset(data_.get(), fmt_ == weight_format::q8_0 ? 0x80 : fmt_ == weight_format::q4_0 ? 0x88 : 0, bytes_);
}

std::uint16_t quantize_block_q8_0(const float* w, int n, std::int8_t (&q)[32]) noexcept {
  float amax = 0.0f;
  for (int i = 0; i < n; ++i) amax = std::max(amax, std::abs(w[i]));
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  for (int i = 0; i < 32; ++i) q[i] = static_cast<std::int8_t>(i < n ? std::round(w[i] * id) : 0.0f);
  return medusa::detail::float_to_half_bits(d);
}

std::uint16_t quantize_block_q4_0(const float* w, int n, std::int8_t (&q)[32]) noexcept {
  float amax = 0.0f, max = 0.0f;  // the weight of largest magnitude, its sign kept (first on ties)
  for (int i = 0; i < n; ++i)
    if (amax < std::abs(w[i])) {
      amax = std::abs(w[i]);
      max = w[i];
    }
  const float d = max / -8.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  for (int i = 0; i < 32; ++i) {
    const float x = i < n ? w[i] : 0.0f;
    q[i] = static_cast<std::int8_t>(std::min(15, static_cast<int>(static_cast<std::int8_t>(x * id + 8.5f))) - 8);
  }
  return medusa::detail::float_to_half_bits(d);
}

// Rows [first_row, first_row + n_rows) of W into panel `dst_panel` (n_rows ≤ 16; the rest stay 0).
void packed_matrix::pack_panel(int dst_panel, const float* W, int first_row, int n_rows) {
  const std::size_t K = sz(in_);
  if (fmt_ == weight_format::f32) {
    float* P = static_cast<float*>(static_cast<void*>(data_.get())) + sz(dst_panel) * panel_stride_;
    for (int j = 0; j < n_rows; ++j) {
      const float* w = W + sz(first_row + j) * K;
      for (std::size_t k = 0; k < K; ++k) P[k * kPanel + sz(j)] = w[k];
    }
  } else if (blocked()) {
    std::uint8_t* P = static_cast<std::uint8_t*>(static_cast<void*>(data_.get())) + sz(dst_panel) * panel_stride_;
    std::uint16_t* S = block_scales_.data() + sz(dst_panel) * sz(blocks()) * kPanel;
    const bool q4 = fmt_ == weight_format::q4_0;
    for (int j = 0; j < n_rows; ++j) {
      const float* w = W + sz(first_row + j) * K;
      for (int b = 0; b < blocks(); ++b) {
        std::int8_t q[32];
        const int k0 = 32 * b, n = std::min(32, in_ - k0);
        S[sz(b) * kPanel + sz(j)] = q4 ? quantize_block_q4_0(w + k0, n, q) : quantize_block_q8_0(w + k0, n, q);
        for (int kk = 0; kk < 32; ++kk) {
          const block_slot at = block_slot_of(fmt_, j, k0 + kk);
          std::uint8_t& byte = P[at.byte];
          if (q4) {
            const auto u = static_cast<std::uint8_t>(q[kk] + 8);
            byte = at.nibble == 0 ? static_cast<std::uint8_t>((byte & 0xf0) | u) : static_cast<std::uint8_t>((byte & 0x0f) | (u << 4));
          } else {
            byte = static_cast<std::uint8_t>(q[kk] + 128);
          }
        }
      }
    }
  } else if (fmt_ == weight_format::int8) {
    std::int8_t* P = static_cast<std::int8_t*>(static_cast<void*>(data_.get())) + sz(dst_panel) * panel_stride_;
    for (int j = 0; j < n_rows; ++j) {
      const float* w = W + sz(first_row + j) * K;
      float amax = 0.0f;
      for (std::size_t k = 0; k < K; ++k) amax = std::max(amax, std::abs(w[k]));
      const float scale = amax > 0.0f ? amax / 127.0f : 0.0f;
      scales_[sz(dst_panel) * kPanel + sz(j)] = scale;
      std::int32_t sum = 0;
      for (std::size_t k = 0; k < K; ++k) {
        const auto q = static_cast<std::int8_t>(scale > 0.0f ? std::clamp(std::nearbyint(w[k] / scale), -127.0f, 127.0f) : 0.0f);
        P[(k / 4) * 4 * kPanel + sz(j) * 4 + k % 4] = q;
        sum += q;
      }
      colsums_[sz(dst_panel) * kPanel + sz(j)] = 128 * sum;
    }
  } else {
    std::uint16_t* P = static_cast<std::uint16_t*>(static_cast<void*>(data_.get())) + sz(dst_panel) * panel_stride_;
    for (int j = 0; j < n_rows; ++j) {
      const float* w = W + sz(first_row + j) * K;
      for (std::size_t k = 0; k < K; ++k) P[(k / 2) * 2 * kPanel + sz(j) * 2 + k % 2] = bf16_round(w[k]);
    }
  }
}

packed_matrix::packed_matrix(const float* W, int rows, int in, weight_format fmt) : rows_(rows), in_(in), fmt_(fmt) {
  const int panels = (rows + kPanel - 1) / kPanel;
  allocate(panels);
  for (int p = 0; p < panels; ++p) pack_panel(p, W, p * kPanel, std::min(kPanel, rows - p * kPanel));
}

packed_matrix packed_matrix::swiglu_pair(const float* gate, const float* up, int rows, int in, weight_format fmt) {
  packed_matrix m;
  m.rows_ = rows;
  m.in_ = in;
  m.fmt_ = fmt;
  m.pair_ = true;
  const int panels = (rows + kPanel - 1) / kPanel;
  m.allocate(2 * panels);
  for (int p = 0; p < panels; ++p) {
    const int n = std::min(kPanel, rows - p * kPanel);
    m.pack_panel(2 * p, gate, p * kPanel, n);
    m.pack_panel(2 * p + 1, up, p * kPanel, n);
  }
  return m;
}

#if defined(__AVX512F__)
namespace {

// One micro-tile, float32 weights: MR tokens × NB panels, KS interleaved accumulator sets over k.
template <int MR, int NB, int KS>
void tile_f32(const float* P, std::size_t ps, const float* X, std::size_t ldx, int K, float* Y, std::size_t ldy,
              const int (&cols)[NB], epilogue op) {
  __m512 acc[KS][MR][NB];
#pragma GCC unroll 4
  for (int s = 0; s < KS; ++s)
#pragma GCC unroll 8
    for (int t = 0; t < MR; ++t)
#pragma GCC unroll 3
      for (int b = 0; b < NB; ++b) acc[s][t][b] = _mm512_setzero_ps();
  const float* xr[MR];
#pragma GCC unroll 8
  for (int t = 0; t < MR; ++t) xr[t] = X + sz(t) * ldx;
  int k = 0;
  for (; k + KS <= K; k += KS) {
#pragma GCC unroll 4
    for (int s = 0; s < KS; ++s) {
      __m512 w[NB];
#pragma GCC unroll 3
      for (int b = 0; b < NB; ++b) {
        const float* src = P + sz(b) * ps + sz(k + s) * kPanel;
        // Past the panel's end this touches the next panel or the allocation's tail: prefetches
        // never fault.
        _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetch * kPanel), _MM_HINT_T0);
        w[b] = _mm512_load_ps(src);
      }
#pragma GCC unroll 8
      for (int t = 0; t < MR; ++t) {
        const __m512 x = _mm512_set1_ps(xr[t][k + s]);
#pragma GCC unroll 3
        for (int b = 0; b < NB; ++b) acc[s][t][b] = _mm512_fmadd_ps(w[b], x, acc[s][t][b]);
      }
    }
  }
  for (; k < K; ++k) {
    __m512 w[NB];
#pragma GCC unroll 3
    for (int b = 0; b < NB; ++b) w[b] = _mm512_load_ps(P + sz(b) * ps + sz(k) * kPanel);
#pragma GCC unroll 8
    for (int t = 0; t < MR; ++t) {
      const __m512 x = _mm512_set1_ps(xr[t][k]);
#pragma GCC unroll 3
      for (int b = 0; b < NB; ++b) acc[0][t][b] = _mm512_fmadd_ps(w[b], x, acc[0][t][b]);
    }
  }
#pragma GCC unroll 4
  for (int s = 1; s < KS; ++s)
#pragma GCC unroll 8
    for (int t = 0; t < MR; ++t)
#pragma GCC unroll 3
      for (int b = 0; b < NB; ++b) acc[0][t][b] = _mm512_add_ps(acc[0][t][b], acc[s][t][b]);
  write_tile<MR, NB>(acc[0], Y, ldy, cols, op);
}

// One micro-tile, bf16 weights, float32 activations and arithmetic. Each uint32 of a panel holds
// the bf16 weights of k = 2kp (low half) and 2kp + 1 (high half) of one column; a shift and a mask
// widen them to float32 exactly. (On the machines measured, vdpbf16ps retires at a quarter of the
// vfmadd231ps rate, so widening and FMA beats it; and the activations need no rounding.)
template <int MR, int NB, int KS>
void tile_bf16(const std::uint16_t* P, std::size_t ps, const float* X, std::size_t ldx, int K, float* Y,
               std::size_t ldy, const int (&cols)[NB], epilogue op) {
  __m512 acc[KS][MR][NB];
#pragma GCC unroll 4
  for (int s = 0; s < KS; ++s)
#pragma GCC unroll 8
    for (int t = 0; t < MR; ++t)
#pragma GCC unroll 3
      for (int b = 0; b < NB; ++b) acc[s][t][b] = _mm512_setzero_ps();
  const float* xr[MR];
#pragma GCC unroll 8
  for (int t = 0; t < MR; ++t) xr[t] = X + sz(t) * ldx;
  const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  const __mmask16 all = 0xffff;  // masked shift: GCC 12's plain one trips -Wmaybe-uninitialized
  const int KP = K / 2;  // full pairs; an odd K leaves one even k (its odd partner is padding)
  int kp = 0;
  for (; kp + KS <= KP; kp += KS) {
#pragma GCC unroll 4
    for (int s = 0; s < KS; ++s) {
      __m512 we[NB], wo[NB];
#pragma GCC unroll 3
      for (int b = 0; b < NB; ++b) {
        const std::uint16_t* src = P + sz(b) * ps + sz(kp + s) * 2 * kPanel;
        _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetch * 2 * kPanel), _MM_HINT_T0);
        const __m512i v = _mm512_load_si512(src);
        we[b] = _mm512_castsi512_ps(_mm512_mask_slli_epi32(v, all, v, 16));
        wo[b] = _mm512_castsi512_ps(_mm512_and_si512(v, hi));
      }
      const std::size_t k = 2 * sz(kp + s);
#pragma GCC unroll 8
      for (int t = 0; t < MR; ++t) {
        const __m512 xe = _mm512_set1_ps(xr[t][k]), xo = _mm512_set1_ps(xr[t][k + 1]);
#pragma GCC unroll 3
        for (int b = 0; b < NB; ++b) acc[s][t][b] = _mm512_fmadd_ps(wo[b], xo, _mm512_fmadd_ps(we[b], xe, acc[s][t][b]));
      }
    }
  }
  for (; 2 * kp < K; ++kp) {
    const bool odd = 2 * kp + 1 < K;
    __m512 we[NB], wo[NB];
#pragma GCC unroll 3
    for (int b = 0; b < NB; ++b) {
      const __m512i v = _mm512_load_si512(P + sz(b) * ps + sz(kp) * 2 * kPanel);
      we[b] = _mm512_castsi512_ps(_mm512_mask_slli_epi32(v, all, v, 16));
      wo[b] = _mm512_castsi512_ps(_mm512_and_si512(v, hi));
    }
    const std::size_t k = 2 * sz(kp);
#pragma GCC unroll 8
    for (int t = 0; t < MR; ++t) {
      const __m512 xe = _mm512_set1_ps(xr[t][k]);
#pragma GCC unroll 3
      for (int b = 0; b < NB; ++b) acc[0][t][b] = _mm512_fmadd_ps(we[b], xe, acc[0][t][b]);
      if (odd) {
        const __m512 xo = _mm512_set1_ps(xr[t][k + 1]);
#pragma GCC unroll 3
        for (int b = 0; b < NB; ++b) acc[0][t][b] = _mm512_fmadd_ps(wo[b], xo, acc[0][t][b]);
      }
    }
  }
#pragma GCC unroll 4
  for (int s = 1; s < KS; ++s)
#pragma GCC unroll 8
    for (int t = 0; t < MR; ++t)
#pragma GCC unroll 3
      for (int b = 0; b < NB; ++b) acc[0][t][b] = _mm512_add_ps(acc[0][t][b], acc[s][t][b]);
  write_tile<MR, NB>(acc[0], Y, ldy, cols, op);
}

#if defined(__AVX512VNNI__)
// One int8 micro-tile: per 4 k, one 64-byte load per panel (4 k × 16 columns) and one vpdpbusd
// per token with its 4 activation bytes broadcast; int32 sums, then the column-sum offset
// removed and the two scales applied.
template <int MR, int NB, int KS>
void tile_i8(const std::int8_t* P, std::size_t ps, const float* S, const std::int32_t* C, const std::uint8_t* XQ,
             std::size_t ldq, const float* sx, float* Y, std::size_t ldy, const int (&cols)[NB], epilogue op) {
  __m512i acc[KS][MR][NB];
#pragma GCC unroll 4
  for (int s = 0; s < KS; ++s)
#pragma GCC unroll 8
    for (int t = 0; t < MR; ++t)
#pragma GCC unroll 3
      for (int b = 0; b < NB; ++b) acc[s][t][b] = _mm512_setzero_si512();
  const int KQ = static_cast<int>(ldq / 4);
  auto quad = [&](int t, int kq) {
    std::int32_t v;
    std::memcpy(&v, XQ + sz(t) * ldq + sz(kq) * 4, sizeof v);
    return _mm512_set1_epi32(v);
  };
  int kq = 0;
  for (; kq + KS <= KQ; kq += KS) {
#pragma GCC unroll 4
    for (int s = 0; s < KS; ++s) {
      __m512i w[NB];
#pragma GCC unroll 3
      for (int b = 0; b < NB; ++b) {
        const std::int8_t* src = P + sz(b) * ps + sz(kq + s) * 4 * kPanel;
        _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetch * 4 * kPanel), _MM_HINT_T0);
        w[b] = _mm512_load_si512(src);
      }
#pragma GCC unroll 8
      for (int t = 0; t < MR; ++t) {
        const __m512i x = quad(t, kq + s);
#pragma GCC unroll 3
        for (int b = 0; b < NB; ++b) acc[s][t][b] = _mm512_dpbusd_epi32(acc[s][t][b], x, w[b]);
      }
    }
  }
  for (; kq < KQ; ++kq) {
#pragma GCC unroll 8
    for (int t = 0; t < MR; ++t) {
      const __m512i x = quad(t, kq);
#pragma GCC unroll 3
      for (int b = 0; b < NB; ++b) acc[0][t][b] = _mm512_dpbusd_epi32(acc[0][t][b], x, _mm512_load_si512(P + sz(b) * ps + sz(kq) * 4 * kPanel));
    }
  }
  __m512 out[MR][NB];
#pragma GCC unroll 3
  for (int b = 0; b < NB; ++b) {
    const __m512 sc = _mm512_loadu_ps(S + sz(b) * kPanel);
    const __m512i cs = _mm512_loadu_si512(C + sz(b) * kPanel);
#pragma GCC unroll 8
    for (int t = 0; t < MR; ++t) {
      __m512i v = acc[0][t][b];
#pragma GCC unroll 4
      for (int s = 1; s < KS; ++s) v = _mm512_add_epi32(v, acc[s][t][b]);
      const __m512 f = _mm512_mask_cvtepi32_ps(_mm512_setzero_ps(), static_cast<__mmask16>(0xffff), _mm512_sub_epi32(v, cs));
      out[t][b] = _mm512_mul_ps(f, _mm512_mul_ps(sc, _mm512_set1_ps(sx[t])));
    }
  }
  write_tile<MR, NB>(out, Y, ldy, cols, op);
}
#endif

// k-split: one or two tokens leave too few independent accumulators to cover the FMA latency.
template <int MR>
constexpr int ksplit() {
  return MR == 1 ? 4 : MR == 2 ? 2 : 1;
}

template <int NB, int MR>
void tile(const packed_matrix& W, const float* P32, const std::uint16_t* P16, const gemm_input& in, int t0, float* Y,
          std::size_t ldy, const int (&cols)[NB], epilogue op) {
  float* y = Y + sz(t0) * ldy;
  if constexpr (NB == 3) {  // only float32 groups of these have 3 panels (packed_matrix::group_panels)
    (void)P16;
    tile_f32<MR, NB, ksplit<MR>()>(P32, W.panel_stride(), in.x + sz(t0) * in.ldx, in.ldx, W.in(), y, ldy, cols, op);
  } else if (W.format() == weight_format::bf16) {
    tile_bf16<MR, NB, ksplit<MR>()>(P16, W.panel_stride(), in.x + sz(t0) * in.ldx, in.ldx, W.in(), y, ldy, cols, op);
  } else {
    tile_f32<MR, NB, ksplit<MR>()>(P32, W.panel_stride(), in.x + sz(t0) * in.ldx, in.ldx, W.in(), y, ldy, cols, op);
  }
}

template <int NB>
void tile_rows(int mr, const packed_matrix& W, const float* P32, const std::uint16_t* P16, const gemm_input& in, int t0,
               float* Y, std::size_t ldy, const int (&cols)[NB], epilogue op) {
  switch (mr) {
    case 1: tile<NB, 1>(W, P32, P16, in, t0, Y, ldy, cols, op); break;
    case 2: tile<NB, 2>(W, P32, P16, in, t0, Y, ldy, cols, op); break;
    case 3: tile<NB, 3>(W, P32, P16, in, t0, Y, ldy, cols, op); break;
    case 4: tile<NB, 4>(W, P32, P16, in, t0, Y, ldy, cols, op); break;
    case 5: tile<NB, 5>(W, P32, P16, in, t0, Y, ldy, cols, op); break;
    case 6: tile<NB, 6>(W, P32, P16, in, t0, Y, ldy, cols, op); break;
    case 7: tile<NB, 7>(W, P32, P16, in, t0, Y, ldy, cols, op); break;
    default: tile<NB, 8>(W, P32, P16, in, t0, Y, ldy, cols, op); break;
  }
}

#if defined(__AVX512VNNI__)
template <int NB>
void tile_rows_i8(int mr, const std::int8_t* P, std::size_t ps, const float* S, const std::int32_t* C, const std::uint8_t* XQ,
                  std::size_t ldq, const float* sx, float* Y, std::size_t ldy, const int (&cols)[NB], epilogue op) {
  switch (mr) {
    case 1: tile_i8<1, NB, 4>(P, ps, S, C, XQ, ldq, sx, Y, ldy, cols, op); break;
    case 2: tile_i8<2, NB, 2>(P, ps, S, C, XQ, ldq, sx, Y, ldy, cols, op); break;
    case 3: tile_i8<3, NB, 1>(P, ps, S, C, XQ, ldq, sx, Y, ldy, cols, op); break;
    case 4: tile_i8<4, NB, 1>(P, ps, S, C, XQ, ldq, sx, Y, ldy, cols, op); break;
    case 5: tile_i8<5, NB, 1>(P, ps, S, C, XQ, ldq, sx, Y, ldy, cols, op); break;
    case 6: tile_i8<6, NB, 1>(P, ps, S, C, XQ, ldq, sx, Y, ldy, cols, op); break;
    case 7: tile_i8<7, NB, 1>(P, ps, S, C, XQ, ldq, sx, Y, ldy, cols, op); break;
    default: tile_i8<8, NB, 1>(P, ps, S, C, XQ, ldq, sx, Y, ldy, cols, op); break;
  }
}
#endif

}  // namespace
#endif  // __AVX512F__

namespace {

// The activation rows of an int8 GEMM, quantized like the weights: q + 128 as unsigned bytes
// (`int8_stride(K)` per row, padding 128 = zero) and one scale per row. A row with a non-finite
// value gets a NaN scale, so its outputs are NaN rather than garbage.
struct quantized_rows {
  const std::uint8_t* q;
  std::size_t ld;
  const float* scale;
};

quantized_rows quantize_rows(const gemm_input& in, int K) {
  thread_local std::vector<std::uint8_t> q;
  thread_local std::vector<float> scale;
  const std::size_t ld = int8_stride(K);
  q.assign(sz(in.T) * ld, 128);
  scale.assign(sz(in.T), 0.0f);
  for (int t = 0; t < in.T; ++t) {
    const float* x = in.x + sz(t) * in.ldx;
    float amax = 0.0f;
    bool finite = true;
    for (int k = 0; k < K; ++k) {
      finite = finite && std::isfinite(x[k]);
      amax = std::max(amax, std::abs(x[k]));
    }
    if (!finite) {
      scale[sz(t)] = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    const float s = amax / 127.0f;
    scale[sz(t)] = s;
    if (s == 0.0f) continue;
    std::uint8_t* row = q.data() + sz(t) * ld;
    for (int k = 0; k < K; ++k) row[k] = static_cast<std::uint8_t>(std::clamp(std::nearbyint(x[k] / s), -127.0f, 127.0f) + 128.0f);
  }
  return {q.data(), ld, scale.data()};
}

// Column (p, j) of an int8 matrix against quantized row t: the exact integer dot product, scaled.
float int8_column(const packed_matrix& W, const quantized_rows& xq, int p, int j, int t) {
  const std::int8_t* P = W.i8() + sz(p) * W.panel_stride();
  const std::uint8_t* x = xq.q + sz(t) * xq.ld;
  std::int32_t acc = 0;
  for (std::size_t k = 0; k < xq.ld; ++k) acc += (static_cast<std::int32_t>(x[k]) - 128) * P[(k / 4) * 4 * kPanel + sz(j) * 4 + k % 4];
  return static_cast<float>(acc) * (xq.scale[sz(t)] * W.scales()[sz(p) * kPanel + sz(j)]);
}

// Portable kernel (no AVX-512, or int8 without AVX512-VNNI): the same arithmetic, column by column.
[[maybe_unused]] void group_scalar(const packed_matrix& W, const gemm_input& in, const quantized_rows* xq, float* Y,
                                   std::size_t ldy, int g, epilogue op) {
  const int K = W.in();
  const int p0 = W.group_panels() * g, np = std::min(W.group_panels(), W.panels() - p0);
  auto weight = [&](int p, int j, int k) {
    if (W.format() == weight_format::f32) return W.f32()[sz(p) * W.panel_stride() + sz(k) * kPanel + sz(j)];
    return bf16_to_float(W.b16()[sz(p) * W.panel_stride() + sz(k / 2) * 2 * kPanel + sz(j) * 2 + sz(k % 2)]);
  };
  auto act = [&](int t, int k) {
    return in.x[sz(t) * in.ldx + sz(k)];
  };
  auto column = [&](int p, int j, int t) {
    if (xq != nullptr) return int8_column(W, *xq, p, j, t);
    float s = 0.0f;
    for (int k = 0; k < K; ++k) s += weight(p, j, k) * act(t, k);
    return s;
  };
  for (int t = 0; t < in.T; ++t) {
    float* y = Y + sz(t) * ldy;
    if (op == epilogue::swiglu) {
      const int c0 = g * kPanel, n = std::min(kPanel, W.rows() - c0);
      for (int j = 0; j < n; ++j) y[c0 + j] = silu_mul(column(p0, j, t), column(p0 + 1, j, t));
      continue;
    }
    for (int b = 0; b < np; ++b) {
      const int c0 = (p0 + b) * kPanel, n = std::min(kPanel, W.rows() - c0);
      for (int j = 0; j < n; ++j) {
        const float v = column(p0 + b, j, t);
        y[c0 + j] = op == epilogue::add ? y[c0 + j] + v : v;
      }
    }
  }
}

}  // namespace

void gemm_packed(const packed_matrix& W, const gemm_input& in, float* Y, std::size_t ldy, int g0, int g1, epilogue op) {
  if (W.blocked()) {
    gemm_blocks(W, in, Y, ldy, g0, g1, op);
    return;
  }
  const bool i8 = W.format() == weight_format::int8;
  quantized_rows xq{};
  if (i8) xq = quantize_rows(in, W.in());
#if defined(__AVX512F__)
#if !defined(__AVX512VNNI__)
  if (i8) {  // int8 needs vpdpbusd; without it, the portable kernel (same results)
    for (int g = g0; g < g1; ++g) group_scalar(W, in, &xq, Y, ldy, g, op);
    return;
  }
#endif
  const int T = in.T;
  const int tiles = (T + kMaxMR - 1) / kMaxMR;
  const int GP = W.group_panels();
  for (int g = g0; g < g1; ++g) {
    const int p0 = GP * g;
    const float* P32 = W.format() == weight_format::f32 ? W.f32() + sz(p0) * W.panel_stride() : nullptr;
    const std::uint16_t* P16 = W.format() == weight_format::bf16 ? W.b16() + sz(p0) * W.panel_stride() : nullptr;
    // Balanced token tiles (sizes differ by at most one): each reads the group's panels once.
    auto run = [&]<int NB>(const int (&cols)[NB], int c0) {
      for (int i = 0, t0 = 0; i < tiles; ++i) {
        const int mr = (T - t0) / (tiles - i);
#if defined(__AVX512VNNI__)
        if (i8) {
          tile_rows_i8<NB>(mr, W.i8() + sz(p0) * W.panel_stride(), W.panel_stride(), W.scales() + sz(p0) * kPanel,
                           W.colsums() + sz(p0) * kPanel, xq.q + sz(t0) * xq.ld, xq.ld, xq.scale + t0, Y + c0 + sz(t0) * ldy,
                           ldy, cols, op);
        } else
#endif
        {
          tile_rows<NB>(mr, W, P32, P16, in, t0, Y + c0, ldy, cols, op);
        }
        t0 += mr;
      }
    };
    if (W.pair()) {
      const int c0 = g * kPanel;
      const int cols[2] = {std::min(kPanel, W.rows() - c0), kPanel};
      run(cols, c0);
      continue;
    }
    const int c0 = p0 * kPanel;
    auto cols_of = [&](int b) { return std::min(kPanel, W.rows() - c0 - b * kPanel); };
    switch (std::min(GP, W.panels() - p0)) {
      case 3: {
        const int cols[3] = {kPanel, kPanel, cols_of(2)};
        run(cols, c0);
        break;
      }
      case 2: {
        const int cols[2] = {kPanel, cols_of(1)};
        run(cols, c0);
        break;
      }
      default: {
        const int cols[1] = {cols_of(0)};
        run(cols, c0);
      }
    }
  }
#else
  for (int g = g0; g < g1; ++g) group_scalar(W, in, i8 ? &xq : nullptr, Y, ldy, g, op);
#endif
}

void run_gemm_jobs(thread_pool& pool, std::span<const gemm_job> jobs) {
  // Block formats: each distinct input quantized once here, not in every chunk of every GEMM.
  thread_local std::vector<block_rows> quantized;
  thread_local std::vector<gemm_job> with_quantized;
  if (std::any_of(jobs.begin(), jobs.end(), [](const gemm_job& j) { return j.W->blocked() && j.in.xq == nullptr; })) {
    with_quantized.assign(jobs.begin(), jobs.end());
    if (quantized.size() < jobs.size()) quantized.resize(jobs.size());  // before taking pointers
    std::size_t used = 0;
    for (std::size_t i = 0; i < with_quantized.size(); ++i) {
      gemm_input& in = with_quantized[i].in;
      if (!with_quantized[i].W->blocked() || in.xq != nullptr) continue;
      const int K = with_quantized[i].W->in();
      for (std::size_t j = 0; j < i && in.xq == nullptr; ++j) {
        const gemm_job& o = with_quantized[j];
        if (o.W->blocked() && o.in.x == in.x && o.in.ldx == in.ldx && o.in.T == in.T && o.W->in() == K) in.xq = o.in.xq;
      }
      if (in.xq == nullptr) {
        quantize_blocks(in, K, quantized[used]);
        in.xq = &quantized[used++];
      }
    }
    jobs = with_quantized;
  }
  int total = 0;
  for (const auto& j : jobs) total += j.W->groups();
  const int n = std::max(1, std::min(total, pool.size() == 1 ? 1 : 4 * pool.size()));
  pool.run(n, [&](int chunk, int) {
    const int a = total * chunk / n, b = total * (chunk + 1) / n;
    int base = 0;
    for (const auto& j : jobs) {
      const int g0 = std::max(a - base, 0), g1 = std::min(b - base, j.W->groups());
      if (g0 < g1) gemm_packed(*j.W, j.in, j.Y, j.ldy, g0, g1, j.op);
      base += j.W->groups();
    }
  });
}

}  // namespace medusa_llama::detail
