// SPDX-License-Identifier: Apache-2.0
// Kernels of the block formats q8_0 and q4_0 (layouts in gemm.hpp). The activations are quantized
// per row and block of 32 like the weights (int8, float32 scale s_x) and, per block, the exact
// int32 sum Σ_k (q_w + o) · q_x comes from vpdpbusd (unsigned weight bytes × signed activation
// bytes, 4 k × 16 columns an instruction); the offset o (128 for q8_0, 8 for q4_0) is removed
// with the block's activation sum, and the block adds (sum) · (d_w · s_x) to a float32
// accumulator. The portable kernel does the same operations in the same order, so both give the
// same bits (the SwiGLU epilogue aside: its exponential is approximated in AVX-512).
#include "gemm.hpp"
#include "gemm_tile.hpp"

#include <medusa/half.hpp>
#include <medusa/heads.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace medusa_llama::detail {

namespace {
constexpr int kPanel = 16;
constexpr int kBlock = 32;
constexpr int kMaxMR = 4;  // tokens per micro-tile: 2 × MR × NB accumulators (int32 and float32)
std::size_t sz(int v) { return static_cast<std::size_t>(v); }
}  // namespace

void quantize_blocks(const gemm_input& in, int K, block_rows& out) {
  const int nb = (K + kBlock - 1) / kBlock;
  out.blocks = nb;
  out.T = in.T;
  out.ld = sz(nb) * kBlock;
  out.q.assign(sz(in.T) * out.ld, 0);
  out.scale.assign(sz(in.T) * sz(nb), 0.0f);
  out.sum.assign(sz(in.T) * sz(nb), 0);
  for (int t = 0; t < in.T; ++t) {
    const float* x = in.x + sz(t) * in.ldx;
    float* scale = out.scale.data() + sz(t) * sz(nb);
    std::int32_t* sum = out.sum.data() + sz(t) * sz(nb);
    std::int8_t* row = out.q.data() + sz(t) * out.ld;
    bool finite = true;
    for (int b = 0; b < nb; ++b) {
      const int k0 = b * kBlock, n = std::min(kBlock, K - k0);
#if defined(__AVX512F__) && defined(__AVX512DQ__)
      // One block in two vectors; cvtps rounds to nearest even like the portable nearbyint.
      const __mmask16 m0 = n >= 16 ? 0xffff : static_cast<__mmask16>((1u << n) - 1u);
      const __mmask16 m1 = n >= 32 ? 0xffff : n <= 16 ? 0 : static_cast<__mmask16>((1u << (n - 16)) - 1u);
      const __m512 v0 = _mm512_maskz_loadu_ps(m0, x + k0), v1 = _mm512_maskz_loadu_ps(m1, x + k0 + 16);
      constexpr int non_finite = 0x01 | 0x08 | 0x10 | 0x80;  // QNaN, +Inf, -Inf, SNaN
      finite = finite && _mm512_fpclass_ps_mask(v0, non_finite) == 0 && _mm512_fpclass_ps_mask(v1, non_finite) == 0;
      // (masked max and reductions through memory: GCC 12's plain ones trip -Wmaybe-uninitialized)
      alignas(64) float lanes[16];
      _mm512_store_ps(lanes, _mm512_mask_max_ps(_mm512_setzero_ps(), 0xffff, _mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      float amax = 0.0f;
      for (float l : lanes) amax = std::max(amax, l);
      const float d = amax / 127.0f;
      scale[b] = d;
      if (d == 0.0f || !finite) continue;
      const __m512 id = _mm512_set1_ps(1.0f / d);
      const __m512i q0 = _mm512_mask_cvtps_epi32(_mm512_setzero_si512(), 0xffff, _mm512_mul_ps(v0, id));
      const __m512i q1 = _mm512_mask_cvtps_epi32(_mm512_setzero_si512(), 0xffff, _mm512_mul_ps(v1, id));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(row + k0), _mm512_mask_cvtepi32_epi8(_mm_setzero_si128(), 0xffff, q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(row + k0 + 16), _mm512_mask_cvtepi32_epi8(_mm_setzero_si128(), 0xffff, q1));
      alignas(64) std::int32_t qsum[16];
      _mm512_store_si512(qsum, _mm512_add_epi32(q0, q1));
      std::int32_t total = 0;
      for (std::int32_t v : qsum) total += v;
      sum[b] = total;
#else
      float amax = 0.0f;
      for (int i = 0; i < n; ++i) {
        finite = finite && std::isfinite(x[k0 + i]);
        amax = std::max(amax, std::abs(x[k0 + i]));
      }
      const float d = amax / 127.0f;
      scale[b] = d;
      if (d == 0.0f || !finite) continue;
      const float id = 1.0f / d;
      std::int32_t s = 0;
      for (int i = 0; i < n; ++i) {
        row[k0 + i] = static_cast<std::int8_t>(std::nearbyint(x[k0 + i] * id));
        s += row[k0 + i];
      }
      sum[b] = s;
#endif
    }
    if (!finite) std::fill(scale, scale + nb, std::numeric_limits<float>::quiet_NaN());
  }
}

namespace {

// Unsigned weight byte of (panel p, column j, k): q + 128 (q8_0) or q + 8 (q4_0).
int weight_byte(const packed_matrix& W, int p, int j, int k) {
  const block_slot at = block_slot_of(W.format(), j, k);
  const std::uint8_t byte = W.u8()[sz(p) * W.panel_bytes() + at.byte];
  if (W.format() == weight_format::q8_0) return byte;
  return at.nibble == 0 ? byte & 0x0f : byte >> 4;
}

int offset_shift(const packed_matrix& W) { return W.format() == weight_format::q8_0 ? 7 : 3; }  // o = 128 or 8

// Column (p, j) against quantized row t, block by block as the vector kernel does.
float block_column(const packed_matrix& W, const block_rows& x, int p, int j, int t) {
  const std::uint16_t* S = W.block_scales() + sz(p) * sz(x.blocks) * kPanel;
  const std::int8_t* xq = x.q.data() + sz(t) * x.ld;
  float acc = 0.0f;
  for (int b = 0; b < x.blocks; ++b) {
    std::int32_t dot = 0;
    for (int kk = 0; kk < kBlock; ++kk) dot += weight_byte(W, p, j, b * kBlock + kk) * xq[b * kBlock + kk];
    dot -= x.sum[sz(t) * sz(x.blocks) + sz(b)] << offset_shift(W);
    const float d = medusa::detail::half_bits_to_float(S[sz(b) * kPanel + sz(j)]);
    acc = std::fma(static_cast<float>(dot), d * x.scale[sz(t) * sz(x.blocks) + sz(b)], acc);
  }
  return acc;
}

void blocks_scalar(const packed_matrix& W, const gemm_input& in, const block_rows& x, float* Y, std::size_t ldy, int g0,
                   int g1, epilogue op) {
  for (int g = g0; g < g1; ++g) {
    const int p0 = W.group_panels() * g, np = std::min(W.group_panels(), W.panels() - p0);
    for (int t = 0; t < in.T; ++t) {
      float* y = Y + sz(t) * ldy;
      if (op == epilogue::swiglu) {
        const int c0 = g * kPanel, n = std::min(kPanel, W.rows() - c0);
        for (int j = 0; j < n; ++j) y[c0 + j] = medusa::silu(block_column(W, x, p0, j, t)) * block_column(W, x, p0 + 1, j, t);
        continue;
      }
      for (int b = 0; b < np; ++b) {
        const int c0 = (p0 + b) * kPanel, n = std::min(kPanel, W.rows() - c0);
        for (int j = 0; j < n; ++j) {
          const float v = block_column(W, x, p0 + b, j, t);
          y[c0 + j] = op == epilogue::add ? y[c0 + j] + v : v;
        }
      }
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
// One micro-tile: MR tokens × NB panels, all blocks of K.
template <int MR, int NB, bool Q4>
void tile_blocks(const std::uint8_t* P, std::size_t ps, const std::uint16_t* S, std::size_t ss, const block_rows& x, int t0,
                 float* Y, std::size_t ldy, const int (&cols)[NB], epilogue op) {
  constexpr int shift = Q4 ? 3 : 7;
  constexpr std::size_t block_bytes = Q4 ? 256 : 512;
  constexpr __mmask16 all = 0xffff;
  __m512 facc[MR][NB];
#pragma GCC unroll 4
  for (int t = 0; t < MR; ++t)
#pragma GCC unroll 2
    for (int b = 0; b < NB; ++b) facc[t][b] = _mm512_setzero_ps();
  const std::int8_t* xr[MR];
#pragma GCC unroll 4
  for (int t = 0; t < MR; ++t) xr[t] = x.q.data() + sz(t0 + t) * x.ld;
  auto quad = [&](int t, std::size_t kq) {
    std::int32_t v;
    std::memcpy(&v, xr[t] + kq * 4, sizeof v);
    return _mm512_set1_epi32(v);
  };
  for (int blk = 0; blk < x.blocks; ++blk) {
    __m512i acc[MR][NB];
#pragma GCC unroll 4
    for (int t = 0; t < MR; ++t)
#pragma GCC unroll 2
      for (int b = 0; b < NB; ++b) acc[t][b] = _mm512_setzero_si512();
    const std::size_t q0 = sz(blk) * 8;  // first k-quad of the block
    if constexpr (Q4) {
      const __m512i low = _mm512_set1_epi8(0x0f);
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        __m512i w0[NB], w1[NB];
#pragma GCC unroll 2
        for (int b = 0; b < NB; ++b) {
          const std::uint8_t* src = P + sz(b) * ps + sz(blk) * block_bytes + sz(i) * 64;
          _mm_prefetch(reinterpret_cast<const char*>(src + 512), _MM_HINT_T0);
          const __m512i v = _mm512_load_si512(src);
          w0[b] = _mm512_and_si512(v, low);
          w1[b] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
#pragma GCC unroll 4
        for (int t = 0; t < MR; ++t) {
          const __m512i xa = quad(t, q0 + 2 * sz(i)), xb = quad(t, q0 + 2 * sz(i) + 1);
#pragma GCC unroll 2
          for (int b = 0; b < NB; ++b) acc[t][b] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc[t][b], w0[b], xa), w1[b], xb);
        }
      }
    } else {
#pragma GCC unroll 8
      for (int kq = 0; kq < 8; ++kq) {
        __m512i w[NB];
#pragma GCC unroll 2
        for (int b = 0; b < NB; ++b) {
          const std::uint8_t* src = P + sz(b) * ps + sz(blk) * block_bytes + sz(kq) * 64;
          _mm_prefetch(reinterpret_cast<const char*>(src + 512), _MM_HINT_T0);
          w[b] = _mm512_load_si512(src);
        }
#pragma GCC unroll 4
        for (int t = 0; t < MR; ++t) {
          const __m512i xq = quad(t, q0 + sz(kq));
#pragma GCC unroll 2
          for (int b = 0; b < NB; ++b) acc[t][b] = _mm512_dpbusd_epi32(acc[t][b], w[b], xq);
        }
      }
    }
#pragma GCC unroll 2
    for (int b = 0; b < NB; ++b) {
      // (masked conversions: GCC 12's plain ones trip -Wmaybe-uninitialized)
      const __m512 d = _mm512_mask_cvtph_ps(_mm512_setzero_ps(), all, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(S + sz(b) * ss + sz(blk) * kPanel)));
#pragma GCC unroll 4
      for (int t = 0; t < MR; ++t) {
        const std::size_t tb = sz(t0 + t) * sz(x.blocks) + sz(blk);
        const __m512i corr = _mm512_set1_epi32(x.sum[tb] << shift);
        const __m512 v = _mm512_mask_cvtepi32_ps(_mm512_setzero_ps(), all, _mm512_sub_epi32(acc[t][b], corr));
        facc[t][b] = _mm512_fmadd_ps(v, _mm512_mul_ps(d, _mm512_set1_ps(x.scale[tb])), facc[t][b]);
      }
    }
  }
  write_tile<MR, NB>(facc, Y, ldy, cols, op);
}

template <int NB, bool Q4>
void tile_rows(int mr, const std::uint8_t* P, std::size_t ps, const std::uint16_t* S, std::size_t ss, const block_rows& x,
               int t0, float* Y, std::size_t ldy, const int (&cols)[NB], epilogue op) {
  switch (mr) {
    case 1: tile_blocks<1, NB, Q4>(P, ps, S, ss, x, t0, Y, ldy, cols, op); break;
    case 2: tile_blocks<2, NB, Q4>(P, ps, S, ss, x, t0, Y, ldy, cols, op); break;
    case 3: tile_blocks<3, NB, Q4>(P, ps, S, ss, x, t0, Y, ldy, cols, op); break;
    default: tile_blocks<4, NB, Q4>(P, ps, S, ss, x, t0, Y, ldy, cols, op); break;
  }
}

void blocks_avx512(const packed_matrix& W, const block_rows& x, int T, float* Y, std::size_t ldy, int g0, int g1,
                   epilogue op) {
  const bool q4 = W.format() == weight_format::q4_0;
  const int tiles = (T + kMaxMR - 1) / kMaxMR;
  const std::size_t ss = sz(x.blocks) * kPanel;
  for (int g = g0; g < g1; ++g) {
    const int p0 = 2 * g;
    const std::uint8_t* P = W.u8() + sz(p0) * W.panel_bytes();
    const std::uint16_t* S = W.block_scales() + sz(p0) * ss;
    auto run = [&]<int NB>(const int (&cols)[NB], int c0) {
      for (int i = 0, t0 = 0; i < tiles; ++i) {  // balanced token tiles, each reading the panels once
        const int mr = (T - t0) / (tiles - i);
        float* y = Y + c0 + sz(t0) * ldy;
        if (q4)
          tile_rows<NB, true>(mr, P, W.panel_bytes(), S, ss, x, t0, y, ldy, cols, op);
        else
          tile_rows<NB, false>(mr, P, W.panel_bytes(), S, ss, x, t0, y, ldy, cols, op);
        t0 += mr;
      }
    };
    if (W.pair()) {
      const int cols[2] = {std::min(kPanel, W.rows() - g * kPanel), kPanel};
      run(cols, g * kPanel);
    } else if (W.panels() - p0 >= 2) {
      const int cols[2] = {kPanel, std::min(kPanel, W.rows() - (p0 + 1) * kPanel)};
      run(cols, p0 * kPanel);
    } else {
      const int cols[1] = {std::min(kPanel, W.rows() - p0 * kPanel)};
      run(cols, p0 * kPanel);
    }
  }
}
#endif

}  // namespace

namespace {
// The input's quantized rows: given, or made here (per call: callers sharing an input quantize
// it once, see run_gemm_jobs).
const block_rows& quantized_input(const gemm_input& in, int K) {
  if (in.xq != nullptr) return *in.xq;
  thread_local block_rows rows;
  quantize_blocks(in, K, rows);
  return rows;
}
}  // namespace

void gemm_blocks_scalar(const packed_matrix& W, const gemm_input& in, float* Y, std::size_t ldy, int g0, int g1, epilogue op) {
  blocks_scalar(W, in, quantized_input(in, W.in()), Y, ldy, g0, g1, op);
}

void gemm_blocks(const packed_matrix& W, const gemm_input& in, float* Y, std::size_t ldy, int g0, int g1, epilogue op) {
  const block_rows& x = quantized_input(in, W.in());
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
  blocks_avx512(W, x, in.T, Y, ldy, g0, g1, op);
#else
  blocks_scalar(W, in, x, Y, ldy, g0, g1, op);
#endif
}

}  // namespace medusa_llama::detail
