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
//! The kernel is flash-attention style: each KV head's query rows (all nodes × the query heads
//! of the group) are processed together against blocks of 64 keys, so a K/V row is read and
//! converted once per group; scores and softmax are accumulated online. With AVX-512 and a head
//! dimension that is a multiple of 16, a row's keys are taken in position order (the committed
//! slots, then the tree keys it sees: its ancestors at L, L+1, ...), cut at multiples of 64, and
//! each score is a direct dot product with the K row: a row's output then has the same bits
//! whether it is computed alone (plain decoding), in a tree or in a causal chunk, which keeps
//! greedy Medusa decoding identical to plain decoding even on quantized weights. Blocks wholly
//! in the committed prefix are shared by all rows (4 at a time for the softmax and P·V); the
//! rest is gathered per row. Elsewhere a transposed K block serves 4 rows at a time.
//! The inner loops use AVX-512 when the compiler targets it (`-march=native` on an AVX-512
//! machine) and a portable auto-vectorisable path otherwise (define `MEDUSA_PORTABLE_KERNELS` to
//! force it); the functions live in the instruction-set namespace of config.hpp. No threads are
//! created; pass a parallel-for (parallel.hpp) to spread KV heads over the caller's threads.
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

//! Options of `tree_attention`.
struct attention_options {
  //! Multiplies `q · k`; 0 means `1 / sqrt(head_dim)`.
  float scale = 0.0f;
};

namespace detail {
MEDUSA_ISA_NAMESPACE_BEGIN

inline constexpr int attn_block = 64;  // keys per block: one 64-bit mask word per query row
inline constexpr int attn_rows = 4;    // query rows per micro-kernel, at most

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

#if MEDUSA_ISA_AVX512
// Horizontal reductions through memory: _mm512_reduce_*_ps trips g++ 12's -Wmaybe-uninitialized.
inline float attn_hmax(__m512 v) noexcept {
  alignas(64) float t[16];
  _mm512_store_ps(t, v);
  float m = t[0];
  for (int i = 1; i < 16; ++i) m = t[i] > m ? t[i] : m;
  return m;
}
inline float attn_hsum(__m512 v) noexcept {
  alignas(64) float t[16];
  _mm512_store_ps(t, v);
  float s = 0.0f;
  for (float x : t) s += x;
  return s;
}
#endif

#if MEDUSA_ISA_AVX512
// dst[d * ld + k] = src[k][d0 + d] for k, d < 16: a 16 × 16 transpose in registers (unpack pairs,
// then quads, then 128-bit lanes twice).
inline void attn_transpose16(const float* const* src, int d0, float* dst, int ld) noexcept {
  // Masked forms with an explicit source: the plain ones trip g++ 12's -Wmaybe-uninitialized.
  constexpr auto kAll = static_cast<__mmask16>(0xFFFF);
  constexpr auto kAll8 = static_cast<__mmask8>(0xFF);
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src[i] + d0);
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_mask_unpacklo_ps(r[2 * i], kAll, r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_mask_unpackhi_ps(r[2 * i], kAll, r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_mask_unpacklo_pd(a, kAll8, a, c));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_mask_unpackhi_pd(a, kAll8, a, c));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_mask_unpacklo_pd(b, kAll8, b, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_mask_unpackhi_pd(b, kAll8, b, d));
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_mask_shuffle_f32x4(r[i], kAll, r[i], r[4 + i], 0x88);
    t[4 + i] = _mm512_mask_shuffle_f32x4(r[i], kAll, r[i], r[4 + i], 0xdd);
    t[8 + i] = _mm512_mask_shuffle_f32x4(r[8 + i], kAll, r[8 + i], r[12 + i], 0x88);
    t[12 + i] = _mm512_mask_shuffle_f32x4(r[8 + i], kAll, r[8 + i], r[12 + i], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_mask_shuffle_f32x4(t[i], kAll, t[i], t[8 + i], 0x88);
    r[4 + i] = _mm512_mask_shuffle_f32x4(t[4 + i], kAll, t[4 + i], t[12 + i], 0x88);
    r[8 + i] = _mm512_mask_shuffle_f32x4(t[i], kAll, t[i], t[8 + i], 0xdd);
    r[12 + i] = _mm512_mask_shuffle_f32x4(t[4 + i], kAll, t[4 + i], t[12 + i], 0xdd);
  }
  for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst + static_cast<std::size_t>(i) * static_cast<std::size_t>(ld), r[i]);
}
#endif

#if MEDUSA_ISA_AVX512
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
#endif

// One task: KV head `g`, query rows [r0, r1) of the node-major row list (row = node*G + h).
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

  // A float cache with pointer handles is read in place (no row copies).
  static constexpr bool float_rows = std::is_same_v<typename View::data_handle_type, float*> ||
                                     std::is_same_v<typename View::data_handle_type, const float*>;

  void run(int g, int r0, int r1) const {
    constexpr int B = attn_block;
    constexpr int R = attn_rows;
    const int rows = r1 - r0;
    const auto Dz = static_cast<std::size_t>(D);
    // With AVX-512 (and D a multiple of 16) the keys are taken in position order, cut at multiples
    // of B, and every score is a direct dot product with the K row (`run_positional`): a row's
    // output then has the same bits alone (plain decoding) as in a tree or a chunk, so greedy
    // Medusa decoding repeats plain decoding exactly, even where quantized activations would turn
    // a last-bit difference into another token. The transposed form below serves the rest.
#if MEDUSA_ISA_AVX512
    const bool direct = D % 16 == 0;
#else
    constexpr bool direct = false;
#endif
    // Per-thread scratch, grown on demand and reused across calls: no allocation and no zero fill
    // per task (every region is written before it is read).
    const std::size_t need = static_cast<std::size_t>(rows) * (Dz * 2 + 2) + Dz * B * 2 + Dz + R * B;
    thread_local std::vector<float> scratch;
    thread_local std::vector<int> node_scratch;
    if (scratch.size() < need) scratch.resize(need);
    if (node_scratch.size() < static_cast<std::size_t>(rows)) node_scratch.resize(static_cast<std::size_t>(rows));
    float* Q = scratch.data();
    float* O = Q + static_cast<std::size_t>(rows) * Dz;
    float* Kt = O + static_cast<std::size_t>(rows) * Dz;  // [D][B], transposed ([B][D] K rows when direct)
    float* Vb = Kt + Dz * B;                                // [B][D]
    float* tmp = Vb + Dz * B;                               // [D]
    float* S = tmp + Dz;                                    // [R][B]
    float* m = S + R * B;                                   // [rows] running max
    float* l = m + rows;                                    // [rows] running sum
    int* node = node_scratch.data();                        // [rows] tree node of each row
    std::fill(O, O + static_cast<std::size_t>(rows) * Dz, 0.0f);
    std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
    std::fill(l, l + rows, 0.0f);
    const float* vrows[B] = {};  // V row of each key of the current block
    const float* krows[B] = {};  // K row of each key (float caches, or converted rows when direct)

    for (int r = 0; r < rows; ++r) {
      const int rr = r0 + r;
      node[r] = rr / G;
      const float* src = q.data() + (static_cast<std::size_t>(rr / G) * static_cast<std::size_t>(hq) +
                                     static_cast<std::size_t>(g * G + rr % G)) * Dz;
      for (int d = 0; d < D; ++d) Q[static_cast<std::size_t>(r) * Dz + static_cast<std::size_t>(d)] = src[d] * qscale;
    }
#if MEDUSA_ISA_AVX512
    if (direct) run_positional(g, rows, Q, O, Kt, Vb, S, m, l, node, krows, vrows);
#endif
    const int nblocks_p = direct ? 0 : (L + B - 1) / B;
    const int nblocks_t = direct ? 0 : (nq + B - 1) / B;
    for (int blk = 0; blk < nblocks_p + nblocks_t; ++blk) {
      const bool tree = blk >= nblocks_p;
      const int j0 = tree ? (blk - nblocks_p) * B : blk * B;
      const int cnt = std::min(B, (tree ? nq : L) - j0);
      const int slot0 = tree ? L + j0 : j0;
      const std::uint64_t valid = cnt >= 64 ? ~std::uint64_t{0} : (std::uint64_t{1} << cnt) - 1;
      bool any = !tree;
      if (tree)
        for (int r = 0; r < rows && !any; ++r) any = (bits(node[r], j0) & valid) != 0;
      if (!any) continue;
      // Gather the block: K transposed for the QK micro-kernel (padding columns zero), or K rows
      // as they are when direct; V rows are read in place from a float cache, converted into Vb
      // otherwise.
      int k = 0;
      if constexpr (float_rows) {
        for (int j = 0; j < cnt; ++j) {
          krows[j] = kv.k_row(layer, slot0 + j, g);
          vrows[j] = kv.v_row(layer, slot0 + j, g);
        }
#if MEDUSA_ISA_AVX512
        if (D % 16 == 0)
          for (; k + 16 <= cnt; k += 16)
            for (int d0 = 0; d0 < D; d0 += 16)
              attn_transpose16(krows + k, d0, Kt + static_cast<std::size_t>(d0) * B + k, B);
#endif
        for (; k < cnt; ++k)
          for (int d = 0; d < D; ++d) Kt[static_cast<std::size_t>(d) * B + static_cast<std::size_t>(k)] = krows[k][d];
      } else {
        for (; k < cnt; ++k) {
          float* vrow = Vb + static_cast<std::size_t>(k) * Dz;
          attn_load_row(kv.k_row(layer, slot0 + k, g), tmp, D);
          attn_load_row(kv.v_row(layer, slot0 + k, g), vrow, D);
          vrows[k] = vrow;
          for (int d = 0; d < D; ++d) Kt[static_cast<std::size_t>(d) * B + static_cast<std::size_t>(k)] = tmp[d];
        }
      }
      if (cnt < B)
        for (int d = 0; d < D; ++d) std::fill(Kt + static_cast<std::size_t>(d) * B + cnt, Kt + static_cast<std::size_t>(d + 1) * B, 0.0f);
      // Row blocks of R, the last one of the rows left (1 to R): no padded row is computed.
      for (int rb = 0; rb < rows; rb += R) {
        const int nr = std::min(R, rows - rb);
        std::uint64_t vis[R] = {};
        std::uint64_t any_row = 0;
        for (int r = 0; r < nr; ++r) {
          vis[r] = tree ? bits(node[rb + r], j0) & valid : valid;
          any_row |= vis[r];
        }
        if (any_row == 0) continue;
        const float* Qb = Q + static_cast<std::size_t>(rb) * Dz;
        float* Ob = O + static_cast<std::size_t>(rb) * Dz;
        switch (nr) {
          case 1: block<1>(Qb, Kt, S, vis, m + rb, l + rb, Ob, vrows, cnt); break;
          case 2: block<2>(Qb, Kt, S, vis, m + rb, l + rb, Ob, vrows, cnt); break;
          case 3: block<3>(Qb, Kt, S, vis, m + rb, l + rb, Ob, vrows, cnt); break;
          default: block<R>(Qb, Kt, S, vis, m + rb, l + rb, Ob, vrows, cnt); break;
        }
      }
    }
    for (int r = 0; r < rows; ++r) {
      const int rr = r0 + r;
      float* dst = out.data() + (static_cast<std::size_t>(rr / G) * static_cast<std::size_t>(hq) +
                                 static_cast<std::size_t>(g * G + rr % G)) * Dz;
      const float lr = l[r];
      const float inv = lr > 0.0f ? 1.0f / lr : 0.0f;  // a query that sees nothing gets 0
      const float* o = O + static_cast<std::size_t>(r) * Dz;
      for (int d = 0; d < D; ++d) dst[d] = o[d] * inv;
    }
  }

#if MEDUSA_ISA_AVX512
  // The direct path. Keys in position order, cut at multiples of B: the prefix holds positions
  // [0, L); the tree or chunk keys a row sees (its ancestors and itself, in node order) follow at
  // L, L+1, ... So a row meets the same blocks of the same keys whether it runs alone (plain
  // decoding), in a tree or in a causal chunk. The blocks wholly in the prefix are shared by all
  // rows (row blocks of R for the softmax and P·V); the rest is gathered per row. Kbuf and Vbuf
  // hold B converted rows for caches that are not float.
  void run_positional(int g, int rows, const float* Q, float* O, float* Kbuf, float* Vbuf, float* S, float* m, float* l,
                      const int* node, const float** krows, const float** vrows) const noexcept {
    constexpr int B = attn_block;
    constexpr int R = attn_rows;
    const auto Dz = static_cast<std::size_t>(D);
    int n = 0;  // keys gathered in the current block
    auto add = [&](int slot) {
      if constexpr (float_rows) {
        krows[n] = kv.k_row(layer, slot, g);
        vrows[n] = kv.v_row(layer, slot, g);
      } else {
        float* kr = Kbuf + static_cast<std::size_t>(n) * Dz;
        float* vr = Vbuf + static_cast<std::size_t>(n) * Dz;
        attn_load_row(kv.k_row(layer, slot, g), kr, D);
        attn_load_row(kv.v_row(layer, slot, g), vr, D);
        krows[n] = kr;
        vrows[n] = vr;
      }
      ++n;
    };
    const int full = L / B;
    for (int c = 0; c < full; ++c) {
      n = 0;
      for (int j = 0; j < B; ++j) add(c * B + j);
      for (int rb = 0; rb < rows; rb += R) {
        const int nr = std::min(R, rows - rb);
        std::uint64_t vis[R] = {};
        for (int r = 0; r < nr; ++r) {
          vis[r] = ~std::uint64_t{0};
          qk_direct(Q + static_cast<std::size_t>(rb + r) * Dz, krows, B, S + r * B);
        }
        float* Ob = O + static_cast<std::size_t>(rb) * Dz;
        switch (nr) {
          case 1: softmax_update<1>(S, vis, m + rb, l + rb, Ob); pv<1>(S, vrows, B, Ob); break;
          case 2: softmax_update<2>(S, vis, m + rb, l + rb, Ob); pv<2>(S, vrows, B, Ob); break;
          case 3: softmax_update<3>(S, vis, m + rb, l + rb, Ob); pv<3>(S, vrows, B, Ob); break;
          default: softmax_update<R>(S, vis, m + rb, l + rb, Ob); pv<R>(S, vrows, B, Ob); break;
        }
      }
    }
    for (int r = 0; r < rows; ++r) {
      const float* Qr = Q + static_cast<std::size_t>(r) * Dz;
      float* Or = O + static_cast<std::size_t>(r) * Dz;
      auto flush = [&] {
        if (n == 0) return;
        const std::uint64_t vis = n >= 64 ? ~std::uint64_t{0} : (std::uint64_t{1} << n) - 1;
        qk_direct(Qr, krows, n, S);
        softmax_update<1>(S, &vis, m + r, l + r, Or);
        pv<1>(S, vrows, n, Or);
        n = 0;
      };
      n = 0;
      for (int slot = full * B; slot < L; ++slot) add(slot);  // fewer than B
      for (int j0 = 0; j0 < nq; j0 += 64) {
        std::uint64_t b = bits(node[r], j0);
        if (nq - j0 < 64) b &= (std::uint64_t{1} << (nq - j0)) - 1;
        for (; b != 0; b &= b - 1) {
          add(L + j0 + std::countr_zero(b));
          if (n == B) flush();
        }
      }
      flush();
    }
  }
#endif

  // One key block for NR rows: scores, online softmax, weighted V.
  template <int NR>
  void block(const float* Qb, const float* Kt, float* S, const std::uint64_t* vis, float* m, float* l, float* O,
             const float* const* vrows, int cnt) const noexcept {
    qk<NR>(Qb, Kt, S);
    softmax_update<NR>(S, vis, m, l, O);
    pv<NR>(S, vrows, cnt, O);
  }

  // S[NR][B] = Q[NR][D] · Kt[D][B]; each score sums its products in order of d.
  template <int NR>
  void qk(const float* Qb, const float* Kt, float* S) const noexcept {
    constexpr int B = attn_block;
    const auto Dz = static_cast<std::size_t>(D);
#if MEDUSA_ISA_AVX512
    __m512 acc[NR][4];
    for (auto& row : acc)
      for (auto& a : row) a = _mm512_setzero_ps();
    for (std::size_t d = 0; d < Dz; ++d) {
      const float* kt = Kt + d * B;
      const __m512 k0 = _mm512_loadu_ps(kt), k1 = _mm512_loadu_ps(kt + 16), k2 = _mm512_loadu_ps(kt + 32),
                   k3 = _mm512_loadu_ps(kt + 48);
      for (int r = 0; r < NR; ++r) {
        const __m512 qv = _mm512_set1_ps(Qb[static_cast<std::size_t>(r) * Dz + d]);
        acc[r][0] = _mm512_fmadd_ps(qv, k0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(qv, k1, acc[r][1]);
        acc[r][2] = _mm512_fmadd_ps(qv, k2, acc[r][2]);
        acc[r][3] = _mm512_fmadd_ps(qv, k3, acc[r][3]);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(S + r * B + c * 16, acc[r][c]);
#else
    for (int i = 0; i < NR * B; ++i) S[i] = 0.0f;
    for (std::size_t d = 0; d < Dz; ++d) {
      const float* kt = Kt + d * B;
      float qd[NR];
      for (int r = 0; r < NR; ++r) qd[r] = Qb[static_cast<std::size_t>(r) * Dz + d];
      for (int k = 0; k < B; ++k)
        for (int r = 0; r < NR; ++r) S[r * B + k] += qd[r] * kt[k];
    }
#endif
  }

#if MEDUSA_ISA_AVX512
  // S[k] = Q · K[k] for one row and keys k < cnt (D a multiple of 16; lanes of S up to the next
  // multiple of 16 are written too, with scores of key 0). 16 keys at a time: per key, the
  // products are summed across the 16-float chunks of D, then its 16 lanes.
  void qk_direct(const float* Qr, const float* const* krows, int cnt, float* S) const noexcept {
    for (int k0 = 0; k0 < cnt; k0 += 16) {
      const int n = std::min(16, cnt - k0);
      const float* kr[16];
      for (int j = 0; j < 16; ++j) kr[j] = krows[k0 + (j < n ? j : 0)];
      __m512 acc[16];
      const __m512 q0 = _mm512_loadu_ps(Qr);
      for (int j = 0; j < 16; ++j) acc[j] = _mm512_mul_ps(q0, _mm512_loadu_ps(kr[j]));
      for (int d0 = 16; d0 < D; d0 += 16) {
        const __m512 qv = _mm512_loadu_ps(Qr + d0);
        for (int j = 0; j < 16; ++j) acc[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kr[j] + d0), acc[j]);
      }
      _mm512_storeu_ps(S + k0, attn_hsum16(acc));
    }
  }
#endif

  // Online softmax: masks S, turns it into weights P (in place), rescales O, updates m and l.
  template <int NR>
  void softmax_update(float* S, const std::uint64_t* vis, float* m, float* l, float* O) const noexcept {
    constexpr int B = attn_block;
    constexpr float ninf = -std::numeric_limits<float>::infinity();
    for (int r = 0; r < NR; ++r) {
      float* s = S + r * B;
      const std::uint64_t vb = vis[r];
      if (vb == 0) {
        std::fill(s, s + B, 0.0f);
        continue;
      }
#if MEDUSA_ISA_AVX512
      // Masked forms with an explicit source everywhere: the plain intrinsics pass
      // _mm512_undefined_ps() and trip g++ 12's -Wmaybe-uninitialized under -Werror.
      constexpr auto kAll = static_cast<__mmask16>(0xFFFF);
      __m512 sv[4];
      __m512 mx = _mm512_set1_ps(ninf);
      for (int c = 0; c < 4; ++c) {
        const auto mk = static_cast<__mmask16>((vb >> (16 * c)) & 0xFFFFu);
        sv[c] = _mm512_mask_blend_ps(mk, _mm512_set1_ps(ninf), _mm512_loadu_ps(s + 16 * c));
        mx = _mm512_mask_max_ps(mx, kAll, mx, sv[c]);
      }
      const float bmax = attn_hmax(mx);
#else
      float bmax = ninf;
      for (int k = 0; k < B; ++k) {
        s[k] = ((vb >> k) & 1u) ? s[k] : ninf;
        bmax = std::max(bmax, s[k]);
      }
#endif
      if (!(bmax > ninf)) {  // all visible scores are -inf or NaN: let NaN propagate, skip -inf
        if (std::isnan(bmax)) l[r] = bmax;
        std::fill(s, s + B, 0.0f);
        continue;
      }
      const float mnew = std::max(m[r], bmax);
      const float alpha = m[r] == ninf ? 0.0f : exp2_approx(m[r] - mnew);
      float sum = 0.0f;
#if MEDUSA_ISA_AVX512
      const __m512 mn = _mm512_set1_ps(mnew);
      __m512 acc = _mm512_setzero_ps();
      for (int c = 0; c < 4; ++c) {
        const __m512 p = exp2_approx(_mm512_sub_ps(sv[c], mn));  // masked keys: -inf -> exactly 0
        acc = _mm512_add_ps(acc, p);
        _mm512_storeu_ps(s + 16 * c, p);
      }
      sum = attn_hsum(acc);
#else
      for (int k = 0; k < B; ++k) {
        s[k] = exp2_approx(s[k] - mnew);
        sum += s[k];
      }
#endif
      l[r] = l[r] * alpha + sum;
      m[r] = mnew;
      if (alpha != 1.0f) {
        float* o = O + static_cast<std::size_t>(r) * static_cast<std::size_t>(D);
        for (int d = 0; d < D; ++d) o[d] *= alpha;
      }
    }
  }

  // O[NR][D] += P[NR][B] · V[B][D] over the first `cnt` keys (row k of V at vrows[k]).
  template <int NR>
  void pv(const float* P, const float* const* vrows, int cnt, float* O) const noexcept {
    constexpr int B = attn_block;
    const auto Dz = static_cast<std::size_t>(D);
#if MEDUSA_ISA_AVX512
    if (D % 16 == 0) {
      std::size_t d0 = 0;
      for (; d0 + 64 <= Dz; d0 += 64) pv_chunk<NR, 4>(P, vrows, cnt, O, d0);
      for (; d0 < Dz; d0 += 16) pv_chunk<NR, 1>(P, vrows, cnt, O, d0);
      return;
    }
#endif
    for (int r = 0; r < NR; ++r) {
      float* o = O + static_cast<std::size_t>(r) * Dz;
      const float* p = P + r * B;
      for (int k = 0; k < cnt; ++k) {
        const float w = p[k];
        if (w == 0.0f) continue;
        const float* v = vrows[k];
        for (std::size_t d = 0; d < Dz; ++d) o[d] += w * v[d];
      }
    }
  }

#if MEDUSA_ISA_AVX512
  template <int NR, int NC>
  void pv_chunk(const float* P, const float* const* vrows, int cnt, float* O, std::size_t d0) const noexcept {
    constexpr int B = attn_block;
    const auto Dz = static_cast<std::size_t>(D);
    __m512 acc[NR][NC];
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_loadu_ps(O + static_cast<std::size_t>(r) * Dz + d0 + 16 * c);
    for (int k = 0; k < cnt; ++k) {
      const float* v = vrows[k] + d0;
      __m512 vv[NC];
      for (int c = 0; c < NC; ++c) vv[c] = _mm512_loadu_ps(v + 16 * c);
      for (int r = 0; r < NR; ++r) {
        const __m512 w = _mm512_set1_ps(P[r * B + k]);
        for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_fmadd_ps(w, vv[c], acc[r][c]);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < NC; ++c) _mm512_storeu_ps(O + static_cast<std::size_t>(r) * Dz + d0 + 16 * c, acc[r][c]);
  }
#endif
};

MEDUSA_ISA_NAMESPACE_END
}  // namespace detail

MEDUSA_ISA_NAMESPACE_BEGIN

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
//! @param opts             softmax scale (default `1/sqrt(head_dim)`)
//! @param pf               a parallel-for (parallel.hpp): `pf(count, body)` calls `body(i)` once for
//!                         each `i < count`, in any order and on any threads
//! @throws kv_cache_error on bad shapes, a layer out of range, `L + N` beyond the capacity, a
//!         block table that does not map `[0, L+N)`, or a mask too small for `N`.
//! A query that sees no key at all gets a zero output.
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
  if (num_queries == 0) return;

  const float scale = opts.scale != 0.0f ? opts.scale : 1.0f / std::sqrt(static_cast<float>(D));
  const int G = num_q_heads / hkv;
  if (static_cast<std::size_t>(num_queries) * static_cast<std::size_t>(G) >
      static_cast<std::size_t>(std::numeric_limits<int>::max() / 2))
    kv_fail(kv_errc::invalid_shape, "attention with " + std::to_string(num_queries) + " queries x " +
                                        std::to_string(G) + " heads per group is too large");
  const detail::attn_task<View, Mask> task{kv, layer, committed_length, num_queries, num_q_heads, G, D,
                                           scale * detail::log2e, mask, queries, out};
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
