// SPDX-License-Identifier: Apache-2.0
//! @file gemm.hpp
//! The GEMM policy concept the CPU head forward is written against, and a portable default.
//!
//! Contract (row-major everywhere, BLAS conventions):
//!
//!     C[M,N] = alpha · op(A) · op(B) + beta · C
//!
//! `A` is float activations (`op(A)` is M×K), `B` is a weight matrix in f32, f16 or bf16 given as a
//! `weight_ptr` (`op(B)` is K×N), `C` float. `lda/ldb/ldc` are row strides in elements of the
//! stored matrices. `beta == 0` overwrites C (NaNs in C are ignored). The head forward only uses
//! `op(A) = A, op(B) = Bᵀ` (PyTorch `Linear`: `y = x Wᵀ`, W stored [out, in]); the other three
//! combinations exist for training (gradients) and must also be supported.
//!
//! `portable_gemm` is plain C++: cache-blocked over N and K, register-tiled, inner loops written
//! over 16 independent lanes so the compiler vectorises them without `-ffast-math`; f16/bf16
//! weights are converted on the fly inside the inner loop (bf16; no copy) or once per cache block
//! into a per-thread panel (f16, whose conversion does not vectorise in the tile). An optional caller-provided
//! parallel-for (parallel.hpp) splits the N blocks. A BLAS-backed policy lives outside the core
//! (`examples/blas/openblas_gemm.hpp`).
//!
//! @code
//! medusa::portable_gemm<> g;
//! std::vector<float> x(8), w(4 * 8), y(4);              // y[1,4] = x[1,8] · W[4,8]ᵀ
//! g.gemm(medusa::gemm_op::none, medusa::gemm_op::transpose, 1, 4, 8, 1.0f, x.data(), 8,
//!        medusa::weight_ptr::of(w.data()), 8, 0.0f, y.data(), 4);
//! @endcode
#pragma once

#include <medusa/config.hpp>
#include <medusa/dispatch/value.hpp>
#include <medusa/dtype.hpp>
#include <medusa/error.hpp>
#include <medusa/half.hpp>
#include <medusa/parallel.hpp>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

MEDUSA_NAMESPACE_BEGIN

//! A non-owning typed pointer to weights (f32 `float`, f16 `medusa::half`, bf16 `medusa::bfloat16`).
struct weight_ptr {
  const void* data = nullptr;           //!< first element
  weight_dtype dtype = weight_dtype::f32; //!< element type

  //! f32 weights.
  static constexpr weight_ptr of(const float* p) noexcept { return {p, weight_dtype::f32}; }
  //! f16 weights.
  static constexpr weight_ptr of(const half* p) noexcept { return {p, weight_dtype::f16}; }
  //! bf16 weights.
  static constexpr weight_ptr of(const bfloat16* p) noexcept { return {p, weight_dtype::bf16}; }
  //! 16-bit weights given as raw bit patterns; `t` must be `f16` or `bf16`.
  static constexpr weight_ptr of(const std::uint16_t* p, weight_dtype t) noexcept { return {p, t}; }
  //! The pointer advanced by `n` elements.
  [[nodiscard]] constexpr weight_ptr offset(std::size_t n) const noexcept {
    return {static_cast<const unsigned char*>(data) + n * dtype_size(dtype), dtype};
  }
  //! Element `i` as float.
  [[nodiscard]] float load(std::size_t i) const noexcept {
    switch (dtype) {
      case weight_dtype::f32: return static_cast<const float*>(data)[i];
      case weight_dtype::f16: return detail::half_bits_to_float(static_cast<const std::uint16_t*>(data)[i]);
      default: return detail::bfloat16_bits_to_float(static_cast<const std::uint16_t*>(data)[i]);
    }
  }
  friend constexpr bool operator==(const weight_ptr&, const weight_ptr&) = default;
};

//! Whether an operand is used as stored or transposed.
enum class gemm_op : std::uint8_t { none, transpose };

//! A GEMM backend: `g.gemm(op_a, op_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc)` computes
//! `C = alpha·op(A)·op(B) + beta·C` for every `weight_dtype` of B (see the file comment).
template <class G>
concept gemm_policy = requires(G& g, gemm_op op, std::size_t n, float s, const float* a, weight_ptr b, float* c) {
  g.gemm(op, op, n, n, n, s, a, n, b, n, s, c, n);
};

namespace detail::gemm_impl {

inline constexpr int lanes = 16;       // independent accumulators per dot product (one zmm)
inline constexpr std::size_t nc = 64;  // rows of B (columns of C) per task
inline constexpr std::size_t kc = 2048; // K block: nc×kc floats of B stay in L2

// binary16 -> binary32, exact like detail::half_bits_to_float but without its subnormal loop, so
// the inner GEMM loop over f16 weights vectorises (selects instead of branches).
MEDUSA_HOST_DEVICE constexpr float half_to_float_branchless(std::uint16_t bits) noexcept {
  // All three cases are computed and one is selected, so the compiler emits blends, not branches.
  const std::uint32_t o = static_cast<std::uint32_t>(bits & 0x7fffu) << 13;
  const std::uint32_t exp = o & 0x0f800000u;
  const std::uint32_t normal = o + ((127u - 15u) << 23);
  const std::uint32_t inf_nan = normal + ((128u - 16u) << 23);
  // zero/subnormal: renormalise through a float subtraction (exact)
  const std::uint32_t sub = float_to_bits(bits_to_float(normal + (1u << 23)) - bits_to_float(113u << 23));
  const std::uint32_t r = exp == 0x0f800000u ? inf_nan : (exp == 0 ? sub : normal);
  return bits_to_float(r | (static_cast<std::uint32_t>(bits & 0x8000u) << 16));
}

template <weight_dtype T>
struct elem;
template <>
struct elem<weight_dtype::f32> {
  using type = float;
  static float load(float v) noexcept { return v; }
};
template <>
struct elem<weight_dtype::bf16> {
  using type = std::uint16_t;
  static float load(std::uint16_t v) noexcept { return bfloat16_bits_to_float(v); }
};
template <>
struct elem<weight_dtype::f16> {
  using type = std::uint16_t;
  static float load(std::uint16_t v) noexcept { return half_to_float_branchless(v); }
};

// out[i][j] = Σ_k a[i*lda + k] · b[j*ldb + k] for k < kn: MR rows of A against NR rows of B.
template <int MR, int NR, weight_dtype T>
inline void dot_tile(std::size_t kn, const float* a, std::size_t lda, const typename elem<T>::type* b,
                     std::size_t ldb, float (&out)[MR][NR]) noexcept {
  float acc[MR][NR][lanes] = {};
  std::size_t k = 0;
  for (; k + lanes <= kn; k += lanes) {
    for (int j = 0; j < NR; ++j) {
      float bv[lanes];
      const auto* bj = b + static_cast<std::size_t>(j) * ldb + k;
      for (int l = 0; l < lanes; ++l) bv[l] = elem<T>::load(bj[l]);
      for (int i = 0; i < MR; ++i) {
        const float* ai = a + static_cast<std::size_t>(i) * lda + k;
        for (int l = 0; l < lanes; ++l) acc[i][j][l] += ai[l] * bv[l];
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float s = 0.0f;
      for (int l = 0; l < lanes; ++l) s += acc[i][j][l];
      for (std::size_t kk = k; kk < kn; ++kk)
        s += a[static_cast<std::size_t>(i) * lda + kk] * elem<T>::load(b[static_cast<std::size_t>(j) * ldb + kk]);
      out[i][j] = s;
    }
}

template <int MR, int NR, weight_dtype T>
inline void tile_accumulate(std::size_t kn, float alpha, const float* a, std::size_t lda,
                            const typename elem<T>::type* b, std::size_t ldb, float* c, std::size_t ldc) noexcept {
  float out[MR][NR];
  dot_tile<MR, NR, T>(kn, a, lda, b, ldb, out);
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) c[static_cast<std::size_t>(i) * ldc + static_cast<std::size_t>(j)] += alpha * out[i][j];
}

// One task: columns [n0, n1) of C for all M rows, C already scaled by beta.
template <int MR, weight_dtype T>
inline void rows_block(std::size_t m0, std::size_t n0, std::size_t n1, std::size_t k0, std::size_t kn, float alpha,
                       const float* a, std::size_t lda, const typename elem<T>::type* b, std::size_t ldb, float* c,
                       std::size_t ldc) noexcept {
  // Few A rows: stream more B rows at once (decode is a GEMV bound by weight bandwidth).
  constexpr int NR = MR <= 2 ? 8 : 4;
  const float* ap = a + m0 * lda + k0;
  std::size_t n = n0;
  for (; n + NR <= n1; n += NR)
    tile_accumulate<MR, NR, T>(kn, alpha, ap, lda, b + n * ldb + k0, ldb, c + m0 * ldc + n, ldc);
  for (; n < n1; ++n) tile_accumulate<MR, 1, T>(kn, alpha, ap, lda, b + n * ldb + k0, ldb, c + m0 * ldc + n, ldc);
}

template <weight_dtype T>
inline void nt_block(std::size_t m, std::size_t n0, std::size_t n1, std::size_t k, float alpha, const float* a,
                     std::size_t lda, const typename elem<T>::type* b, std::size_t ldb, float* c, std::size_t ldc) noexcept {
  for (std::size_t k0 = 0; k0 < k; k0 += kc) {
    const std::size_t kn = std::min(kc, k - k0);
    std::size_t m0 = 0;
    for (; m0 + 4 <= m; m0 += 4) rows_block<4, T>(m0, n0, n1, k0, kn, alpha, a, lda, b, ldb, c, ldc);
    switch (m - m0) {
      case 3: rows_block<3, T>(m0, n0, n1, k0, kn, alpha, a, lda, b, ldb, c, ldc); break;
      case 2: rows_block<2, T>(m0, n0, n1, k0, kn, alpha, a, lda, b, ldb, c, ldc); break;
      case 1: rows_block<1, T>(m0, n0, n1, k0, kn, alpha, a, lda, b, ldb, c, ldc); break;
      default: break;
    }
  }
}

// f16: the conversion does not vectorise inside the register tile (bf16's shift does), so each
// [nc, kc] block of B is converted once into `panel` with a plain loop, then runs as f32.
inline void nt_block_f16(std::size_t m, std::size_t n0, std::size_t n1, std::size_t k, float alpha, const float* a,
                         std::size_t lda, const std::uint16_t* b, std::size_t ldb, float* c, std::size_t ldc,
                         float* panel) noexcept {
  for (std::size_t k0 = 0; k0 < k; k0 += kc) {
    const std::size_t kn = std::min(kc, k - k0);
    for (std::size_t j = n0; j < n1; ++j) {
      const std::uint16_t* src = b + j * ldb + k0;
      float* dst = panel + (j - n0) * kn;
      for (std::size_t kk = 0; kk < kn; ++kk) dst[kk] = half_to_float_branchless(src[kk]);
    }
    // The panel is B rows [n0, n1) x K slice [k0, k0+kn): offset pointers so indices line up.
    nt_block<weight_dtype::f32>(m, 0, n1 - n0, kn, alpha, a + k0, lda, panel, kn, c + n0, ldc);
  }
}

}  // namespace detail::gemm_impl

//! Portable cache-blocked GEMM in plain C++ (see the file comment).
//! @tparam ParallelFor a parallel-for (parallel.hpp) over the column blocks of C (tasks write
//!         disjoint columns); `sequential_for` by default.
template <parallel_for ParallelFor = sequential_for>
struct portable_gemm {
  ParallelFor parallel{};  //!< how column blocks are distributed

  //! `C = alpha·op(A)·op(B) + beta·C`. Throws `invalid_input` on null pointers or strides
  //! smaller than the rows they describe.
  void gemm(gemm_op op_a, gemm_op op_b, std::size_t m, std::size_t n, std::size_t k, float alpha, const float* a,
            std::size_t lda, weight_ptr b, std::size_t ldb, float beta, float* c, std::size_t ldc) {
    if (m == 0 || n == 0) return;
    if (c == nullptr || ldc < n) throw invalid_input("gemm: C is null or ldc " + std::to_string(ldc) + " < N " + std::to_string(n));
    scale_c(m, n, beta, c, ldc);
    if (k == 0 || alpha == 0.0f) return;
    if (a == nullptr || b.data == nullptr) throw invalid_input("gemm: A or B is null");
    if (lda < (op_a == gemm_op::none ? k : m)) throw invalid_input("gemm: lda " + std::to_string(lda) + " too small");
    if (ldb < (op_b == gemm_op::transpose ? k : n)) throw invalid_input("gemm: ldb " + std::to_string(ldb) + " too small");
    // Reduce every case to A [M,K] · B[N,K]ᵀ, the layout the kernel streams.
    std::vector<float> a_packed;
    if (op_a == gemm_op::transpose) {
      a_packed.resize(m * k);
      for (std::size_t kk = 0; kk < k; ++kk)
        for (std::size_t i = 0; i < m; ++i) a_packed[i * k + kk] = a[kk * lda + i];
      a = a_packed.data();
      lda = k;
    }
    std::vector<float> b_packed;
    if (op_b == gemm_op::none) {
      b_packed.resize(n * k);
      for (std::size_t kk = 0; kk < k; ++kk)
        for (std::size_t j = 0; j < n; ++j) b_packed[j * k + kk] = b.load(kk * ldb + j);
      b = weight_ptr::of(b_packed.data());
      ldb = k;
    }
    dispatch_dtype(b.dtype, [&]<dtype T>() { run<T>(m, n, k, alpha, a, lda, b.data, ldb, c, ldc); });
  }

 private:
  static void scale_c(std::size_t m, std::size_t n, float beta, float* c, std::size_t ldc) noexcept {
    if (beta == 1.0f) return;
    for (std::size_t i = 0; i < m; ++i) {
      float* row = c + i * ldc;
      if (beta == 0.0f) std::fill(row, row + n, 0.0f);
      else for (std::size_t j = 0; j < n; ++j) row[j] *= beta;
    }
  }

  template <weight_dtype T>
  void run(std::size_t m, std::size_t n, std::size_t k, float alpha, const float* a, std::size_t lda, const void* bp,
           std::size_t ldb, float* c, std::size_t ldc) {
    using E = typename detail::gemm_impl::elem<T>::type;
    const E* b = static_cast<const E*>(bp);
    constexpr std::size_t nc = detail::gemm_impl::nc;
    const std::size_t tasks = (n + nc - 1) / nc;
    parallel(tasks, [&](std::size_t t) {
      const std::size_t n0 = t * nc;
      if constexpr (T == weight_dtype::f16) {
        thread_local std::vector<float> panel;  // one [nc, kc] panel per thread, reused
        panel.resize(nc * detail::gemm_impl::kc);
        detail::gemm_impl::nt_block_f16(m, n0, std::min(n, n0 + nc), k, alpha, a, lda, b, ldb, c, ldc, panel.data());
      } else {
        detail::gemm_impl::nt_block<T>(m, n0, std::min(n, n0 + nc), k, alpha, a, lda, b, ldb, c, ldc);
      }
    });
  }
};

static_assert(gemm_policy<portable_gemm<>>);

MEDUSA_NAMESPACE_END
