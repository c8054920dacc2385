// SPDX-License-Identifier: Apache-2.0
//! @file attention.hpp
//! CPU reference of tree attention (and plain causal attention) over a `kv_cache_view`.
//!
//! One forward pass of the `N` tree nodes: query `i` attends to every committed slot
//! `[0, L)`, and to tree slots `L + j` for the nodes `j` its packed ancestor mask allows (its
//! ancestors, the root and itself). The caller has already written the K/V of node `j` at slot
//! `L + j` and applied RoPE. Grouped-query attention: `num_q_heads` is a multiple of the KV
//! heads, query head `h` reads KV head `h / (num_q_heads / num_kv_heads)`. The same routine with
//! `causal_mask{}` is plain causal attention over a chunk (prefill, or single-token decode with
//! one query).
//!
//! Each query row takes the keys it sees in position order (the committed slots, then the tree or
//! chunk keys it sees: its ancestors and itself, at L, L+1, ...) in blocks cut at multiples of 64
//! positions, with an online softmax across the blocks. A row so meets the same blocks whether it
//! is computed alone (plain decoding: one causal query after its ancestors were committed), in a
//! tree or in a causal chunk, whatever the other rows of the call: its output has the same bits in
//! every case, for every head dimension and instruction set. That keeps greedy Medusa decoding
//! token-for-token identical to plain decoding, even where quantized activations would turn a
//! last-bit difference into another token. Blocks wholly inside what several rows see (the
//! committed prefix, and for a causal chunk the complete blocks below each row) are read and
//! converted once for those rows; the rest is gathered per row.
//!
//! The arithmetic inside a block (scores, exponentials, P·V, rescale) goes through an
//! `attention_kernels` set: by default `builtin_attention_kernels()`, the bodies of the instruction
//! set the translation unit is compiled for (AVX-512, AVX2 with FMA, or a portable auto-vectorised
//! form; `MEDUSA_PORTABLE_KERNELS` forces the portable one, and the functions live in the
//! instruction-set namespace of config.hpp); an engine may pass its own, chosen at run time for the
//! CPU (`attention_options::kernels`). No threads are created; pass a parallel-for (parallel.hpp) to
//! spread KV heads over the caller's threads: the results are the same bits.
//!
//! @code
//! #include <medusa/attention.hpp>
//! #include <cstdint>
//! #include <vector>
//! int main() {
//!   const medusa::kv_extents ext{1, 1, 8};                  // 1 layer, 1 KV head, head_dim 8
//!   std::vector<float> k(32 * 8, 0.5f), v(32 * 8, 1.0f);
//!   auto kv = medusa::make_kv_view<float>(k, v, ext, 32);
//!   // tree: root 0, children 1 and 2 -> rows 0b001, 0b011, 0b101
//!   const std::uint32_t mask[] = {0x1, 0x3, 0x5};
//!   std::vector<float> q(3 * 2 * 8, 0.1f), out(q.size());   // 3 nodes, 2 query heads
//!   medusa::tree_attention(kv, /*layer*/ 0, /*L*/ 10, q, 3, 2, medusa::tree_mask_view{mask, 1}, out);
//!   return out[0] == 1.0f ? 0 : 1;                          // every V row is 1
//! }
//! @endcode
#pragma once

#include <medusa/config.hpp>
#include <medusa/detail/exp2.hpp>
#include <medusa/detail/mul_add.hpp>
#include <medusa/error.hpp>
#include <medusa/half.hpp>
#include <medusa/kv_cache.hpp>
#include <medusa/parallel.hpp>
#include <medusa/tree/concepts.hpp>
#include <medusa/tree/mask.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#if MEDUSA_ISA_F16C
#include <immintrin.h>
#endif

MEDUSA_NAMESPACE_BEGIN

//! Causal visibility within the chunk: query `i` sees chunk rows `0..i` (and all of `[0, L)`).
struct causal_mask {};

//! The mask sources `tree_attention` accepts directly: a `tree_mask_view` or `causal_mask{}`.
template <class M>
concept attention_mask = std::same_as<M, tree_mask_view> || std::same_as<M, causal_mask>;

//! The arithmetic inside `tree_attention`, for one query row against one block of at most 64 keys
//! (the keys a row sees, in position order). `tree_attention` cuts each row's keys into the same
//! blocks whatever the other rows of its call, and calls these functions once per row and block,
//! so a row computed with a given set has the same bits alone (plain decoding) as in a tree or a
//! causal chunk, provided each function's result depends only on the values it reads (not on
//! addresses, alignment or earlier calls). An engine may supply its own set, for instance kernels
//! chosen at run time for the CPU it runs on (`attention_options::kernels`);
//! `builtin_attention_kernels()` is the library's. Blocks hold 1 to 64 keys and `head_dim` is the
//! cache's. Scores are in base-2 units: the library has already multiplied the query by
//! `scale · log2(e)`. The masked maximum, rows whose visible scores are all -inf or NaN, the
//! running maximum and sum and the final division stay in the library.
struct attention_kernels {
  //! s[j] = q · keys[j] for j < n; q and every key hold head_dim floats.
  void (*scores)(const float* q, const float* const* keys, int n, int head_dim, float* s) noexcept;
  //! s[j] = 2^(s[j] - m) for j < n (the library's exp2, see detail/exp2.hpp semantics: -inf gives
  //! 0); returns their sum.
  float (*exp2_sum)(float* s, int n, float m) noexcept;
  //! o[d] += Σ_{j<n} p[j] · values[j][d] for d < head_dim.
  void (*accumulate)(const float* p, const float* const* values, int n, int head_dim, float* o) noexcept;
  //! o[d] *= a for d < head_dim.
  void (*scale)(float* o, int head_dim, float a) noexcept;
};

//! Options of `tree_attention`.
struct attention_options {
  //! Multiplies `q · k`; 0 means `1 / sqrt(head_dim)`.
  float scale = 0.0f;
  //! The per-block arithmetic; null means `builtin_attention_kernels()`. A non-null set must have
  //! every member set, and must outlive the call.
  const attention_kernels* kernels = nullptr;
};

// Keep the next loop rolled, or unroll it completely: g++ vectorises some fixed-size lane loops only
// as loops (unrolled first, they go to the SLP vectoriser, which gives up on them), and keeps a
// local tile in registers only when every access to it has a constant index.
#if defined(__GNUC__) && !defined(__CUDACC__)  // nvcc's front end rejects GCC pragmas
#define MEDUSA_ATTN_ROLLED _Pragma("GCC unroll 1")
#define MEDUSA_ATTN_UNROLLED _Pragma("GCC unroll 64")
#else
#define MEDUSA_ATTN_ROLLED
#define MEDUSA_ATTN_UNROLLED
#endif

namespace detail {
MEDUSA_ISA_NAMESPACE_BEGIN

inline constexpr int attn_block = 64;  // keys per block: one 64-bit mask word per query row
inline constexpr int attn_rows = 4;    // tasks split the rows at multiples of this
inline constexpr int attn_group = 8;   // rows that run a shared block one step after the other
inline constexpr int attn_lanes = 8;   // partial sums of the portable dot product and exp2 sum
// A float cache's shared block is copied into contiguous rows when at least this many query rows
// read it: the rows of consecutive slots lie the slot stride apart (4 KiB for 8 heads of 128
// floats) and compete for the same L1 sets, the copies do not; for a few rows the copy costs more
// than it saves.
inline constexpr int attn_copy_rows = 8;

// --- element rows -> float ----------------------------------------------------------------------
inline void attn_load_row(const float* src, float* dst, int n) noexcept {
  std::memcpy(dst, src, static_cast<std::size_t>(n) * sizeof(float));
}
inline void attn_load_row(const bfloat16* src, float* dst, int n) noexcept {
  // bfloat16 -> float is a 16-bit shift; written on the raw bits so that it vectorises.
  std::uint16_t raw[256];
  for (int d0 = 0; d0 < n; d0 += 256) {
    const int m = std::min(256, n - d0);
    std::memcpy(raw, src + d0, static_cast<std::size_t>(m) * sizeof(std::uint16_t));
    for (int d = 0; d < m; ++d) dst[d0 + d] = bfloat16_bits_to_float(raw[d]);
  }
}
inline void attn_load_row(const half* src, float* dst, int n) noexcept {
  int d = 0;
#if MEDUSA_ISA_AVX512
  for (; d + 16 <= n; d += 16)
    _mm512_storeu_ps(dst + d, _mm512_mask_cvtph_ps(_mm512_setzero_ps(), static_cast<__mmask16>(0xFFFF),
                                                   _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + d))));
#elif MEDUSA_ISA_F16C
  for (; d + 8 <= n; d += 8)
    _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + d))));
#endif
  for (; d < n; ++d) dst[d] = static_cast<float>(src[d]);
}

// --- the built-in kernels, portable bodies --------------------------------------------------------
// Written for the auto-vectoriser (g++ -O3, no -ffast-math): sums are kept in 8 lanes (lane l takes
// the terms of index l mod 8) and the lanes are added in a fixed tree at the end, so that no
// reassociation is needed; fixed-size inner loops and local tiles that g++ keeps in registers.

// a[0] + ... + a[7]: (a[l] + a[l+4]), then +2, +1.
inline float attn_lane_sum(float* a) noexcept {
  for (int l = 0; l < 4; ++l) a[l] += a[l + 4];
  for (int l = 0; l < 2; ++l) a[l] += a[l + 2];
  return a[0] + a[1];
}

// Dot products of q with NK keys, sharing each load of q (for one key, the same arithmetic).
template <int NK>
inline void attn_scores_lanes(const float* q, const float* const* keys, int D, float* s) noexcept {
  constexpr int W = attn_lanes;
  const int Df = D / W * W;
  float acc[NK][W] = {};
  for (int d0 = 0; d0 < Df; d0 += W)
    for (int l = 0; l < W; ++l) {
      const float x = q[d0 + l];
      for (int k = 0; k < NK; ++k) acc[k][l] = mul_add(x, keys[k][d0 + l], acc[k][l]);
    }
  if (Df < D)
    for (int k = 0; k < NK; ++k)  // the last D mod W terms, into the first lanes
      for (int l = 0; l < D - Df; ++l) acc[k][l] = mul_add(q[Df + l], keys[k][Df + l], acc[k][l]);
  for (int k = 0; k < NK; ++k) s[k] = attn_lane_sum(acc[k]);
}

inline void attn_scores_portable(const float* q, const float* const* keys, int n, int D, float* s) noexcept {
  int j = 0;
  for (; j + 8 <= n; j += 8) attn_scores_lanes<8>(q, keys + j, D, s + j);
  for (; j < n; ++j) attn_scores_lanes<1>(q, keys + j, D, s + j);
}

inline float attn_exp2_sum_portable(float* s, int n, float m) noexcept {
  constexpr int W = attn_lanes;
  for (int j = 0; j < n; ++j) s[j] = exp2_approx(s[j] - m);
  float acc[W] = {};
  int j = 0;
  for (; j + W <= n; j += W)
    for (int l = 0; l < W; ++l) acc[l] += s[j + l];
  for (int l = 0; l < n - j; ++l) acc[l] += s[j + l];
  return attn_lane_sum(acc);
}

// Columns [d0, d0 + C) of NR rows of o (row r at o + r·ldo, its weights at p + r·ldp), held in a
// local tile while the keys are added in order: every column of every row gets the same sum, in
// the same order, whatever NR and C (so rows run together give the bits of rows run alone). The
// column loop is unrolled so that g++ keeps the tile in registers.
template <int NR, int C>
inline void attn_accumulate_tile(const float* p, std::size_t ldp, const float* const* values, int n, int d0, float* o,
                                 std::size_t ldo) noexcept {
  float acc[NR][C];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = o[r * ldo + static_cast<std::size_t>(d0 + c)];
  MEDUSA_ATTN_ROLLED
  for (int j = 0; j < n; ++j) {
    const float* v = values[j] + d0;
    MEDUSA_ATTN_UNROLLED
    for (int r = 0; r < NR; ++r) {
      const float w = p[r * ldp + static_cast<std::size_t>(j)];
      MEDUSA_ATTN_UNROLLED
      for (int c = 0; c < C; ++c) acc[r][c] = mul_add(w, v[c], acc[r][c]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < C; ++c) o[r * ldo + static_cast<std::size_t>(d0 + c)] = acc[r][c];
}

// Tiles of 64 floats at most (16 SSE or NEON registers, 8 AVX ones): 64, 32 or 16 columns of 1,
// 2 or 3 to 4 rows; the measured best for one and for four rows on SSE2 and AVX2.
template <int NR>
inline void attn_accumulate_portable_rows(const float* p, std::size_t ldp, const float* const* values, int n, int D,
                                          float* o, std::size_t ldo) noexcept {
  constexpr int C = NR == 1 ? 64 : NR == 2 ? 32 : 16;
  int d0 = 0;
  for (; d0 + C <= D; d0 += C) attn_accumulate_tile<NR, C>(p, ldp, values, n, d0, o, ldo);
  for (; d0 + 8 <= D; d0 += 8) attn_accumulate_tile<NR, 8>(p, ldp, values, n, d0, o, ldo);
  for (; d0 < D; ++d0) attn_accumulate_tile<NR, 1>(p, ldp, values, n, d0, o, ldo);
}

inline void attn_scale_portable(float* o, int D, float a) noexcept {
  for (int d = 0; d < D; ++d) o[d] *= a;
}

// --- the built-in kernels, AVX2 bodies (head_dim a multiple of 8) ---------------------------------
#if MEDUSA_ISA_AVX2
// The horizontal sums of v[0..7] as one vector (lane k = sum of v[k]): per 128-bit half,
// (e0 + e1) + (e2 + e3), then the halves added.
inline __m256 attn_hsum8(const __m256* v) noexcept {
  const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

// The sum of the lanes of v in attn_hsum8's order.
inline float attn_hsum_as8(__m256 v) noexcept {
  const __m256 h = _mm256_hadd_ps(v, v);
  const __m256 h2 = _mm256_hadd_ps(h, h);
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(h2), _mm256_extractf128_ps(h2, 1)));
}

inline __m256i attn_mask8(int count) noexcept {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(count), lane);
}

// Per key, the products are summed across the 8-float chunks of D, then its 8 lanes: 8 keys at a
// time (their lanes summed together by attn_hsum8), the last few one at a time in the same order.
inline void attn_scores_avx2(const float* q, const float* const* keys, int n, int D, float* s) noexcept {
  int k0 = 0;
  for (; n - k0 > 2; k0 += 8) {
    const int c = std::min(8, n - k0);
    const float* kr[8];
    for (int j = 0; j < 8; ++j) kr[j] = keys[k0 + (j < c ? j : 0)];  // padding: copies of the first key
    __m256 acc[8];
    const __m256 q0 = _mm256_loadu_ps(q);
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_mul_ps(q0, _mm256_loadu_ps(kr[j]));
    for (int d0 = 8; d0 < D; d0 += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d0);
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[j] + d0), acc[j]);
    }
    _mm256_maskstore_ps(s + k0, attn_mask8(c), attn_hsum8(acc));
  }
  for (; k0 < n; ++k0) {
    const float* k = keys[k0];
    __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(k));
    for (int d0 = 8; d0 < D; d0 += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d0), _mm256_loadu_ps(k + d0), acc);
    s[k0] = attn_hsum_as8(acc);
  }
}

inline float attn_exp2_sum_avx2(float* s, int n, float m) noexcept {
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (int j = 0; j < n; j += 8) {
    const __m256i mk = attn_mask8(n - j);
    const __m256 x = _mm256_blendv_ps(ninf, _mm256_maskload_ps(s + j, mk), _mm256_castsi256_ps(mk));
    const __m256 p = exp2_approx(_mm256_sub_ps(x, mv));  // lanes past n: 0
    acc = _mm256_add_ps(acc, p);
    _mm256_maskstore_ps(s + j, mk, p);
  }
  return attn_hsum_as8(acc);
}

// Columns [d0, d0 + 8·NC) of NR rows of o, the keys added in order (as the portable tile).
template <int NR, int NC>
inline void attn_accumulate_avx2_tile(const float* p, std::size_t ldp, const float* const* values, int n, int d0,
                                      float* o, std::size_t ldo) noexcept {
  __m256 acc[NR][NC];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_loadu_ps(o + r * ldo + static_cast<std::size_t>(d0 + 8 * c));
  for (int j = 0; j < n; ++j) {
    const float* v = values[j] + d0;
    __m256 vv[NC];
    for (int c = 0; c < NC; ++c) vv[c] = _mm256_loadu_ps(v + 8 * c);
    for (int r = 0; r < NR; ++r) {
      const __m256 w = _mm256_set1_ps(p[r * ldp + static_cast<std::size_t>(j)]);
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_fmadd_ps(w, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) _mm256_storeu_ps(o + r * ldo + static_cast<std::size_t>(d0 + 8 * c), acc[r][c]);
}

// 8 vectors of accumulators: one row and 64 columns at a time, or 4 rows and 16.
template <int NR>
inline void attn_accumulate_avx2_rows(const float* p, std::size_t ldp, const float* const* values, int n, int D,
                                      float* o, std::size_t ldo) noexcept {
  constexpr int NC = 8 / NR;
  int d0 = 0;
  for (; D - d0 >= 8 * NC; d0 += 8 * NC) attn_accumulate_avx2_tile<NR, NC>(p, ldp, values, n, d0, o, ldo);
  for (; d0 < D; d0 += 8) attn_accumulate_avx2_tile<NR, 1>(p, ldp, values, n, d0, o, ldo);
}
#endif

// --- the built-in kernels, AVX-512 bodies (head_dim a multiple of 16) -----------------------------
#if MEDUSA_ISA_AVX512
// Horizontal sum through memory: _mm512_reduce_add_ps trips g++ 12's -Wmaybe-uninitialized.
inline float attn_hsum(__m512 v) noexcept {
  alignas(64) float t[16];
  _mm512_store_ps(t, v);
  float s = 0.0f;
  for (float x : t) s += x;
  return s;
}

// The 16 horizontal sums of v[0..15] as one vector (lane j = sum of v[j]): pairs are added after
// unpacking, then quads, then 128-bit lanes twice; 30 shuffles where 16 reductions take 64.
inline __m512 attn_hsum16(const __m512* v) noexcept {
  constexpr auto kAll = static_cast<__mmask16>(0xFFFF);
  constexpr auto kAll8 = static_cast<__mmask8>(0xFF);
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3], x = v[2i], y = v[2i+1]
    a[i] = _mm512_add_ps(_mm512_mask_unpacklo_ps(v[2 * i], kAll, v[2 * i], v[2 * i + 1]),
                         _mm512_mask_unpackhi_ps(v[2 * i], kAll, v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the lane's sums of v[4i .. 4i+3]
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_mask_unpacklo_pd(x, kAll8, x, y)),
                         _mm512_castpd_ps(_mm512_mask_unpackhi_pd(x, kAll8, x, y)));
  }
  // 128-bit lanes: [b0: L0+L1, L2+L3, b1: L0+L1, L2+L3], then the two halves of each.
  const __m512 c0 = _mm512_add_ps(_mm512_mask_shuffle_f32x4(b[0], kAll, b[0], b[1], 0x88),
                                  _mm512_mask_shuffle_f32x4(b[0], kAll, b[0], b[1], 0xdd));
  const __m512 c1 = _mm512_add_ps(_mm512_mask_shuffle_f32x4(b[2], kAll, b[2], b[3], 0x88),
                                  _mm512_mask_shuffle_f32x4(b[2], kAll, b[2], b[3], 0xdd));
  return _mm512_add_ps(_mm512_mask_shuffle_f32x4(c0, kAll, c0, c1, 0x88),
                       _mm512_mask_shuffle_f32x4(c0, kAll, c0, c1, 0xdd));
}

inline __mmask16 attn_mask16(int count) noexcept {
  return static_cast<__mmask16>(count >= 16 ? 0xFFFFu : (1u << count) - 1u);
}

// The sum of the 16 lanes of v in the order attn_hsum16 adds each of its vectors: within each
// 128-bit lane (e0 + e2) + (e1 + e3), then those four as (L0 + L1) + (L2 + L3).
inline float attn_hsum_as16(__m512 v) noexcept {
  alignas(64) float t[16];
  _mm512_store_ps(t, v);
  float s[4];
  for (int i = 0; i < 4; ++i) s[i] = (t[4 * i] + t[4 * i + 2]) + (t[4 * i + 1] + t[4 * i + 3]);
  return (s[0] + s[1]) + (s[2] + s[3]);
}

// Per key, the products are summed across the 16-float chunks of D, then its 16 lanes: 16 keys at
// a time (their lanes summed together by attn_hsum16), the last few one at a time in the same
// order, so that a score does not depend on its key's place in the block.
inline void attn_scores_avx512(const float* q, const float* const* keys, int n, int D, float* s) noexcept {
  int k0 = 0;
  for (; n - k0 > 4; k0 += 16) {
    const int c = std::min(16, n - k0);
    const float* kr[16];
    for (int j = 0; j < 16; ++j) kr[j] = keys[k0 + (j < c ? j : 0)];  // padding: copies of the first key
    __m512 acc[16];
    const __m512 q0 = _mm512_loadu_ps(q);
    for (int j = 0; j < 16; ++j) acc[j] = _mm512_mul_ps(q0, _mm512_loadu_ps(kr[j]));
    for (int d0 = 16; d0 < D; d0 += 16) {
      const __m512 qv = _mm512_loadu_ps(q + d0);
      for (int j = 0; j < 16; ++j) acc[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kr[j] + d0), acc[j]);
    }
    _mm512_mask_storeu_ps(s + k0, attn_mask16(c), attn_hsum16(acc));
  }
  for (; k0 < n; ++k0) {
    const float* k = keys[k0];
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k));
    for (int d0 = 16; d0 < D; d0 += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d0), _mm512_loadu_ps(k + d0), acc);
    s[k0] = attn_hsum_as16(acc);
  }
}

inline float attn_exp2_sum_avx512(float* s, int n, float m) noexcept {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 mv = _mm512_set1_ps(m);
  __m512 acc = _mm512_setzero_ps();
  for (int j = 0; j < n; j += 16) {
    const __mmask16 mk = attn_mask16(n - j);
    const __m512 p = exp2_approx(_mm512_sub_ps(_mm512_mask_loadu_ps(ninf, mk, s + j), mv));  // lanes past n: 0
    acc = _mm512_add_ps(acc, p);
    _mm512_mask_storeu_ps(s + j, mk, p);
  }
  return attn_hsum(acc);
}

// Columns [d0, d0 + 16·NC) of NR rows of o, the keys added in order (as the portable tile).
template <int NR, int NC>
inline void attn_accumulate_avx512_tile(const float* p, std::size_t ldp, const float* const* values, int n, int d0,
                                        float* o, std::size_t ldo) noexcept {
  __m512 acc[NR][NC];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_loadu_ps(o + r * ldo + static_cast<std::size_t>(d0 + 16 * c));
  for (int j = 0; j < n; ++j) {
    const float* v = values[j] + d0;
    __m512 vv[NC];
    for (int c = 0; c < NC; ++c) vv[c] = _mm512_loadu_ps(v + 16 * c);
    for (int r = 0; r < NR; ++r) {
      const __m512 w = _mm512_set1_ps(p[r * ldp + static_cast<std::size_t>(j)]);
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_fmadd_ps(w, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(o + r * ldo + static_cast<std::size_t>(d0 + 16 * c), acc[r][c]);
}

// NR rows: 64 columns at a time (4 rows × 4 vectors of accumulators), one row: up to 128.
template <int NR>
inline void attn_accumulate_avx512_rows(const float* p, std::size_t ldp, const float* const* values, int n, int D,
                                        float* o, std::size_t ldo) noexcept {
  int d0 = 0;
  if constexpr (NR == 1)
    for (; D - d0 >= 128; d0 += 128) attn_accumulate_avx512_tile<1, 8>(p, ldp, values, n, d0, o, ldo);
  for (; D - d0 >= 64; d0 += 64) attn_accumulate_avx512_tile<NR, 4>(p, ldp, values, n, d0, o, ldo);
  for (; d0 < D; d0 += 16) attn_accumulate_avx512_tile<NR, 1>(p, ldp, values, n, d0, o, ldo);
}
#endif

// --- the built-in set: the bodies of this translation unit's instruction set ----------------------
inline void attn_scores(const float* q, const float* const* keys, int n, int D, float* s) noexcept {
#if MEDUSA_ISA_AVX512
  if (D % 16 == 0) return attn_scores_avx512(q, keys, n, D, s);
#endif
#if MEDUSA_ISA_AVX2
  if (D % 8 == 0) return attn_scores_avx2(q, keys, n, D, s);
#endif
  attn_scores_portable(q, keys, n, D, s);
}

inline float attn_exp2_sum(float* s, int n, float m) noexcept {
#if MEDUSA_ISA_AVX512
  return attn_exp2_sum_avx512(s, n, m);
#elif MEDUSA_ISA_AVX2
  return attn_exp2_sum_avx2(s, n, m);
#else
  return attn_exp2_sum_portable(s, n, m);
#endif
}

template <int NR>
inline void attn_accumulate_rows(const float* p, std::size_t ldp, const float* const* values, int n, int D, float* o,
                                 std::size_t ldo) noexcept {
#if MEDUSA_ISA_AVX512
  if (D % 16 == 0) return attn_accumulate_avx512_rows<NR>(p, ldp, values, n, D, o, ldo);
#endif
#if MEDUSA_ISA_AVX2
  if (D % 8 == 0) return attn_accumulate_avx2_rows<NR>(p, ldp, values, n, D, o, ldo);
#endif
  attn_accumulate_portable_rows<NR>(p, ldp, values, n, D, o, ldo);
}

inline void attn_accumulate(const float* p, const float* const* values, int n, int D, float* o) noexcept {
  attn_accumulate_rows<1>(p, 0, values, n, D, o, 0);
}

// The built-in accumulate for `rows` rows at once (weights of row r at p + r·ldp, output at
// o + r·ldo), so that each V row is read once for up to 4 of them: the bits of `attn_accumulate`
// row by row.
inline void attn_accumulate_many(const float* p, std::size_t ldp, const float* const* values, int n, int D, float* o,
                                 std::size_t ldo, int rows) noexcept {
  int r = 0;
  for (; r + 4 <= rows; r += 4) attn_accumulate_rows<4>(p + r * ldp, ldp, values, n, D, o + r * ldo, ldo);
  switch (rows - r) {
    case 3: attn_accumulate_rows<3>(p + r * ldp, ldp, values, n, D, o + r * ldo, ldo); break;
    case 2: attn_accumulate_rows<2>(p + r * ldp, ldp, values, n, D, o + r * ldo, ldo); break;
    case 1: attn_accumulate_rows<1>(p + r * ldp, ldp, values, n, D, o + r * ldo, ldo); break;
    default: break;
  }
}

inline void attn_scale(float* o, int D, float a) noexcept { attn_scale_portable(o, D, a); }

inline constexpr attention_kernels attn_builtin_kernels{&attn_scores, &attn_exp2_sum, &attn_accumulate, &attn_scale};

// One task: KV head `g`, query rows [r0, r1) of the node-major row list (row = node*G + h).
//
// Each row takes the keys it sees in position order (the committed slots, then the chunk or tree
// keys it sees: its ancestors and itself, at L, L+1, ...) and cuts them at multiples of 64. A row
// so meets the same blocks of the same keys whether it runs alone (plain decoding), in a tree or in
// a causal chunk, and every block goes through the same kernel calls: its output has the same bits
// in every case. That keeps greedy Medusa decoding identical to plain decoding, even where
// quantized activations would turn a last-bit difference into another token. The blocks that lie
// wholly in the keys several rows see (the committed prefix; for a causal chunk every complete
// block below a row's own position) are gathered once and run for those rows together; the rest
// is gathered per row.
template <class View, class Mask>
struct attn_task {
  const View& kv;
  int layer;
  int L;
  int nq;
  int hq;
  int G;
  int D;
  float qscale;  // scale * log2(e): scores are in base-2 units
  const Mask& mask;
  std::span<const float> q;
  std::span<float> out;
  const attention_kernels& kern;

  // Visibility bits of tree/chunk keys [j0, j0+64) for query node i.
  [[nodiscard]] std::uint64_t bits(int i, int j0) const noexcept {
    if constexpr (std::is_same_v<Mask, causal_mask>) {
      if (i < j0) return 0;
      const int n = i - j0 + 1;
      return n >= 64 ? ~std::uint64_t{0} : (std::uint64_t{1} << n) - 1;
    } else {
      return mask.bits64(i, j0);
    }
  }

  // The complete blocks at the start of node i's key sequence that other rows share: the whole
  // prefix blocks, and for a causal chunk every complete block up to the node's own slot.
  [[nodiscard]] int shared_blocks(int i) const noexcept {
    if constexpr (std::is_same_v<Mask, causal_mask>) {
      return (L + i + 1) / attn_block;
    } else {
      return L / attn_block;
    }
  }

  // A float cache with pointer handles is read in place (no row copies).
  static constexpr bool float_rows = std::is_same_v<typename View::data_handle_type, float*> ||
                                     std::is_same_v<typename View::data_handle_type, const float*>;

  // Keys j0 .. j0+count-1 of a block: cache slots slot0 .. slot0+count-1, read in place or
  // converted into rows of kbuf / vbuf. Runs of slots in one page (or in a contiguous cache) are
  // addressed from their first row, without a block-table lookup per slot.
  void gather(int g, int slot0, int count, int j0, const float** krows, const float** vrows, float* kbuf,
              float* vbuf, bool copy = false) const noexcept {
    using mapping = typename View::mapping_type;
    const auto Dz = static_cast<std::size_t>(D);
    for (int j = 0; j < count;) {
      const int slot = slot0 + j;
      int run = 1;
      std::size_t stride = 0;
      if constexpr (std::is_same_v<mapping, layout_kv_strided::mapping>) {
        run = count - j;
        stride = kv.mapping().slot_stride;
      } else if constexpr (std::is_same_v<mapping, layout_kv_paged::mapping>) {
        run = std::min(count - j, kv.mapping().page_size - slot % kv.mapping().page_size);
        stride = kv.mapping().token_stride;
      }
      const auto k = kv.k_row(layer, slot, g);
      const auto v = kv.v_row(layer, slot, g);
      for (int t = 0; t < run; ++t, ++j) {
        const auto off = static_cast<std::size_t>(t) * stride;
        if constexpr (float_rows) {
          if (!copy) {
            krows[j0 + j] = k + off;
            vrows[j0 + j] = v + off;
            continue;
          }
        }
        {
          float* kr = kbuf + static_cast<std::size_t>(j0 + j) * Dz;
          float* vr = vbuf + static_cast<std::size_t>(j0 + j) * Dz;
          attn_load_row(k + off, kr, D);
          attn_load_row(v + off, vr, D);
          krows[j0 + j] = kr;
          vrows[j0 + j] = vr;
        }
      }
    }
  }

  // One block of n keys for rows [ra, rb) (at most attn_group), each of which sees exactly these
  // keys. Per row the steps and their order are those of the row alone; the scores and softmax of
  // every row come first (the K rows stay in cache), then the rescale and P·V of every row (V).
  void block(int ra, int rb, int n, const float* const* krows, const float* const* vrows, const float* Q, float* O,
             float* S, float* m, float* l) const noexcept {
    constexpr int B = attn_block;
    constexpr float ninf = -std::numeric_limits<float>::infinity();
    const auto Dz = static_cast<std::size_t>(D);
    float alpha[attn_group];
    bool skip[attn_group];
    for (int r = ra; r < rb; ++r) {
      float* s = S + (r - ra) * B;
      kern.scores(Q + static_cast<std::size_t>(r) * Dz, krows, n, D, s);
      // The maximum without NaN; a NaN score makes the row's output NaN (as in the CUDA kernels).
      const float bmax = block_max(s, n, l[r]);
      skip[r - ra] = !(bmax > ninf);  // every score -inf (or NaN): the block adds nothing
      if (skip[r - ra]) continue;
      const float mold = m[r];
      const float mnew = std::max(mold, bmax);
      const float a = mold == ninf ? 0.0f : exp2_approx(mold - mnew);
      const float sum = kern.exp2_sum(s, n, mnew);
      l[r] = l[r] * a + sum;
      m[r] = mnew;
      alpha[r - ra] = mold == ninf ? 1.0f : a;  // o is still zero before the row's first block
    }
    bool all = true;
    for (int r = ra; r < rb; ++r) {
      if (skip[r - ra]) {
        all = false;
        continue;
      }
      if (alpha[r - ra] != 1.0f) kern.scale(O + static_cast<std::size_t>(r) * Dz, D, alpha[r - ra]);
    }
    // The built-in accumulate runs the rows together (same bits, each V row read once per 4 rows).
    if (all && rb - ra > 1 && kern.accumulate == &attn_accumulate) {
      attn_accumulate_many(S, B, vrows, n, D, O + static_cast<std::size_t>(ra) * Dz, Dz, rb - ra);
      return;
    }
    for (int r = ra; r < rb; ++r)
      if (!skip[r - ra]) kern.accumulate(S + (r - ra) * B, vrows, n, D, O + static_cast<std::size_t>(r) * Dz);
  }

  // The largest score of s[0, n) that is no NaN (-inf if none); a NaN sets l to NaN. Kept in
  // attn_lanes lanes, the lane loop left rolled so that g++ vectorises it (unrolled, it does not).
  static float block_max(const float* s, int n, float& l) noexcept {
    constexpr int W = attn_lanes;
    float mx[W];
    std::int32_t bad[W];
    for (int k = 0; k < W; ++k) {
      mx[k] = -std::numeric_limits<float>::infinity();
      bad[k] = 0;
    }
    for (int j = 0; j < n; j += W) {
      const int w = std::min(W, n - j);
      MEDUSA_ATTN_ROLLED
      for (int k = 0; k < w; ++k) {
        const float x = s[j + k];
        bad[k] |= x != x ? 1 : 0;
        mx[k] = x > mx[k] ? x : mx[k];
      }
    }
    for (int w = W / 2; w > 0; w /= 2)
      for (int k = 0; k < w; ++k) {
        bad[k] |= bad[k + w];
        mx[k] = mx[k + w] > mx[k] ? mx[k + w] : mx[k];
      }
    if (bad[0] != 0) l = std::numeric_limits<float>::quiet_NaN();
    return mx[0];
  }

  void run(int g, int r0, int r1) const {
    constexpr int B = attn_block;
    const int rows = r1 - r0;
    const auto Dz = static_cast<std::size_t>(D);
    // Per-thread scratch, grown on demand and reused across calls: no allocation and no zero fill
    // per task (every region is written before it is read).
    const std::size_t need = static_cast<std::size_t>(rows) * (Dz * 2 + 2) + Dz * B * 2 + attn_group * B;
    thread_local std::vector<float> scratch;
    thread_local std::vector<int> node_scratch;
    if (scratch.size() < need) scratch.resize(need);
    if (node_scratch.size() < static_cast<std::size_t>(rows)) node_scratch.resize(static_cast<std::size_t>(rows));
    float* Q = scratch.data();
    float* O = Q + static_cast<std::size_t>(rows) * Dz;
    float* Kbuf = O + static_cast<std::size_t>(rows) * Dz;  // [B][D] converted K rows (caches not float)
    float* Vbuf = Kbuf + Dz * B;                             // [B][D] converted V rows
    float* S = Vbuf + Dz * B;                                // [attn_group][B] scores, then weights
    float* m = S + attn_group * B;                           // [rows] running max
    float* l = m + rows;                                     // [rows] running sum
    int* node = node_scratch.data();                         // [rows] tree node of each row
    std::fill(O, O + static_cast<std::size_t>(rows) * Dz, 0.0f);
    std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
    std::fill(l, l + rows, 0.0f);
    const float* krows[B] = {};  // K row of each key of the current block
    const float* vrows[B] = {};  // V row of each key

    for (int r = 0; r < rows; ++r) {
      const int rr = r0 + r;
      node[r] = rr / G;
      const float* src = q.data() + (static_cast<std::size_t>(rr / G) * static_cast<std::size_t>(hq) +
                                     static_cast<std::size_t>(g * G + rr % G)) * Dz;
      for (int d = 0; d < D; ++d) Q[static_cast<std::size_t>(r) * Dz + static_cast<std::size_t>(d)] = src[d] * qscale;
    }

    // Shared blocks: block c is run by the rows whose shared_blocks exceed c, a suffix of the rows
    // (nodes grow along them).
    const int nshared = shared_blocks(node[rows - 1]);
    int ra = 0;
    for (int c = 0; c < nshared; ++c) {
      while (shared_blocks(node[ra]) <= c) ++ra;
      gather(g, c * B, B, 0, krows, vrows, Kbuf, Vbuf, rows - ra >= attn_copy_rows);
      for (int rg = ra; rg < rows; rg += attn_group)
        block(rg, std::min(rows, rg + attn_group), B, krows, vrows, Q, O, S, m, l);
    }

    // The rest of each row's keys: the prefix slots after its shared blocks, then the tree or
    // chunk keys it sees, cut at multiples of B.
    for (int r = 0; r < rows; ++r) {
      const int start = shared_blocks(node[r]) * B;
      int n = std::max(0, L - start);  // fewer than B
      gather(g, start, n, 0, krows, vrows, Kbuf, Vbuf);
      auto add = [&](int slot) {
        gather(g, slot, 1, n++, krows, vrows, Kbuf, Vbuf);
        if (n == B) {
          block(r, r + 1, n, krows, vrows, Q, O, S, m, l);
          n = 0;
        }
      };
      const int jfirst = std::max(0, start - L);
      for (int j0 = jfirst / 64 * 64; j0 < nq; j0 += 64) {
        std::uint64_t b = bits(node[r], j0);
        if (nq - j0 < 64) b &= (std::uint64_t{1} << (nq - j0)) - 1;
        if (j0 < jfirst) b &= ~((std::uint64_t{1} << (jfirst - j0)) - 1);
        for (; b != 0; b &= b - 1) add(L + j0 + std::countr_zero(b));
      }
      if (n > 0) block(r, r + 1, n, krows, vrows, Q, O, S, m, l);
    }

    for (int r = 0; r < rows; ++r) {
      const int rr = r0 + r;
      float* dst = out.data() + (static_cast<std::size_t>(rr / G) * static_cast<std::size_t>(hq) +
                                 static_cast<std::size_t>(g * G + rr % G)) * Dz;
      const float lr = l[r];
      const float inv = lr > 0.0f || lr != lr ? 1.0f / lr : 0.0f;  // a query that sees nothing gets 0
      const float* o = O + static_cast<std::size_t>(r) * Dz;
      for (int d = 0; d < D; ++d) dst[d] = o[d] * inv;
    }
  }
};

MEDUSA_ISA_NAMESPACE_END
}  // namespace detail

MEDUSA_ISA_NAMESPACE_BEGIN

//! The library's `attention_kernels` for the instruction set this translation unit is compiled for:
//! AVX-512 bodies when it targets AVX-512 (head_dim a multiple of 16; the portable bodies
//! otherwise), portable auto-vectorised bodies elsewhere (see `kernel_isa()`).
inline const attention_kernels& builtin_attention_kernels() noexcept { return detail::attn_builtin_kernels; }

//! Tree (or causal) attention of `num_queries` query rows against one layer of the cache.
//!
//! @param kv               the cache; query `i`'s own K/V row is at slot `committed_length + i`
//! @param layer            layer index in `kv`
//! @param committed_length `L`: slots `[0, L)` are visible to every query
//! @param queries          `[num_queries][num_q_heads][head_dim]` floats (RoPE already applied)
//! @param num_queries      `N`, the tree nodes (or chunk length)
//! @param num_q_heads      query heads, a multiple of `kv.num_kv_heads()`
//! @param mask             a `tree_mask_view` or `causal_mask{}`: which of the `N` new rows a query sees
//! @param out              `[num_queries][num_q_heads][head_dim]`; may alias `queries` exactly
//! @param opts             softmax scale (default `1/sqrt(head_dim)`) and kernels (default the built-in set)
//! @param pf               a parallel-for (parallel.hpp): `pf(count, body)` calls `body(i)` once for
//!                         each `i < count`, in any order and on any threads
//! @throws kv_cache_error on bad shapes, a layer out of range, `L + N` beyond the capacity, a
//!         block table that does not map `[0, L+N)`, a mask too small for `N`, or a kernel set with
//!         a null member.
//! A query that sees no key at all gets a zero output; a NaN score makes its row's output NaN.
template <kv_view View, attention_mask Mask, parallel_for ParallelFor = sequential_for>
void tree_attention(const View& kv, int layer, int committed_length, std::span<const float> queries, int num_queries,
                    int num_q_heads, const Mask& mask, std::span<float> out, const attention_options& opts = {},
                    ParallelFor&& pf = {}) {
  using detail::kv_fail;
  const int hkv = kv.num_kv_heads();
  const int D = kv.head_dim();
  if (layer < 0 || layer >= kv.num_layers())
    kv_fail(kv_errc::invalid_shape, "attention layer " + std::to_string(layer) + " outside [0, " +
                                        std::to_string(kv.num_layers()) + ")");
  if (committed_length < 0 || num_queries < 0)
    kv_fail(kv_errc::invalid_length, "attention with L = " + std::to_string(committed_length) + " and " +
                                         std::to_string(num_queries) + " queries");
  if (num_q_heads <= 0 || num_q_heads % hkv != 0)
    kv_fail(kv_errc::invalid_shape, "num_q_heads " + std::to_string(num_q_heads) + " is not a positive multiple of " +
                                        std::to_string(hkv) + " KV heads");
  if (committed_length > std::numeric_limits<int>::max() - num_queries)
    kv_fail(kv_errc::capacity_exceeded, "L + N overflows int");
  // capacity / block table first: it also bounds num_queries for the size arithmetic below
  detail::kv_check_range(kv, 0, committed_length + num_queries, -1);
  const std::size_t need = detail::kv_mul(
      detail::kv_mul(static_cast<std::size_t>(num_queries), static_cast<std::size_t>(num_q_heads)),
      static_cast<std::size_t>(D));
  if (queries.size() != need || out.size() != need)
    kv_fail(kv_errc::size_mismatch, "attention queries hold " + std::to_string(queries.size()) + " and output " +
                                        std::to_string(out.size()) + " floats, expected " + std::to_string(num_queries) +
                                        " x " + std::to_string(num_q_heads) + " x " + std::to_string(D) + " = " +
                                        std::to_string(need));
  if (out.data() != queries.data() && out.data() < queries.data() + queries.size() &&
      queries.data() < out.data() + out.size())
    kv_fail(kv_errc::size_mismatch, "attention output partially overlaps the queries");
  if constexpr (std::is_same_v<Mask, tree_mask_view>) {
    if (!mask.covers(num_queries))
      kv_fail(kv_errc::size_mismatch, "packed tree mask of " + std::to_string(mask.words.size()) + " words, " +
                                          std::to_string(mask.words_per_row) + " per row, is too small for " +
                                          std::to_string(num_queries) + " nodes (needs " +
                                          std::to_string((num_queries + 31) / 32) + " words per row)");
  }
  if (!(std::isfinite(opts.scale)))
    kv_fail(kv_errc::invalid_shape, "attention scale is not finite");
  if (const attention_kernels* k = opts.kernels) {
    const char* missing = k->scores == nullptr       ? "scores"
                          : k->exp2_sum == nullptr   ? "exp2_sum"
                          : k->accumulate == nullptr ? "accumulate"
                          : k->scale == nullptr      ? "scale"
                                                     : nullptr;
    if (missing != nullptr)
      kv_fail(kv_errc::invalid_shape, std::string("attention kernels: the ") + missing + " function is null");
  }
  if (num_queries == 0) return;

  const float scale = opts.scale != 0.0f ? opts.scale : 1.0f / std::sqrt(static_cast<float>(D));
  const int G = num_q_heads / hkv;
  if (static_cast<std::size_t>(num_queries) * static_cast<std::size_t>(G) >
      static_cast<std::size_t>(std::numeric_limits<int>::max() / 2))
    kv_fail(kv_errc::invalid_shape, "attention with " + std::to_string(num_queries) + " queries x " +
                                        std::to_string(G) + " heads per group is too large");
  const attention_kernels& kern = opts.kernels != nullptr ? *opts.kernels : builtin_attention_kernels();
  const detail::attn_task<View, Mask> task{kv,   layer,   committed_length, num_queries, num_q_heads, G, D,
                                           scale * detail::log2e, mask, queries, out, kern};
  // Tasks: every KV head, its rows split further when there are fewer than 4 KV heads so that a
  // caller's thread pool still has work to share.
  const int rows = num_queries * G;
  int chunks = 1;
  if (hkv < 4) chunks = std::max(1, std::min((4 + hkv - 1) / hkv, rows / 16));
  const int per = ((rows + chunks - 1) / chunks + detail::attn_rows - 1) / detail::attn_rows * detail::attn_rows;
  chunks = (rows + per - 1) / per;
  pf(static_cast<std::size_t>(hkv * chunks), [&task, chunks, per, rows](std::size_t i) {
    const int t = static_cast<int>(i);
    const int g = t / chunks;
    const int r0 = (t % chunks) * per;
    task.run(g, r0, std::min(rows, r0 + per));
  });
}

//! @overload for any `masked_tree` (e.g. `medusa::tree`, `medusa::static_tree<N>`):
//! `N = tree.num_nodes()`, the tree's own mask (copied once when the tree has no `mask_view()`).
template <kv_view View, masked_tree Tree, parallel_for ParallelFor = sequential_for>
void tree_attention(const View& kv, int layer, int committed_length, std::span<const float> queries, int num_q_heads,
                    const Tree& tree, std::span<float> out, const attention_options& opts = {},
                    ParallelFor&& pf = {}) {
  const int n = static_cast<int>(tree.num_nodes());
  if constexpr (requires { { tree.mask_view() } -> std::convertible_to<tree_mask_view>; }) {
    tree_attention(kv, layer, committed_length, queries, n, num_q_heads, tree_mask_view(tree.mask_view()), out, opts,
                   static_cast<ParallelFor&&>(pf));
  } else {
    const int wpr = static_cast<int>(tree.words_per_row());
    if (n < 0 || wpr < (n + 31) / 32)
      detail::kv_fail(kv_errc::size_mismatch, "tree with " + std::to_string(n) + " nodes reports " +
                                                  std::to_string(wpr) + " mask words per row");
    std::vector<std::uint32_t> words(static_cast<std::size_t>(n) * static_cast<std::size_t>(wpr));
    copy_packed_mask(tree, std::span<std::uint32_t>(words));
    tree_attention(kv, layer, committed_length, queries, n, num_q_heads, tree_mask_view{words, wpr}, out, opts,
                   static_cast<ParallelFor&&>(pf));
  }
}

//! Plain causal attention of a chunk of `num_queries` tokens at slots `[L, L+num_queries)`
//! (prefill, or decode with one query): `tree_attention` with `causal_mask{}`.
template <kv_view View, parallel_for ParallelFor = sequential_for>
void causal_attention(const View& kv, int layer, int committed_length, std::span<const float> queries,
                      int num_queries, int num_q_heads, std::span<float> out, const attention_options& opts = {},
                      ParallelFor&& pf = {}) {
  tree_attention(kv, layer, committed_length, queries, num_queries, num_q_heads, causal_mask{}, out, opts,
                 static_cast<ParallelFor&&>(pf));
}

MEDUSA_ISA_NAMESPACE_END

MEDUSA_NAMESPACE_END
