// SPDX-License-Identifier: Apache-2.0
//! @file openblas_gemm.hpp
//! A `medusa::gemm_policy` backed by OpenBLAS (`cblas_sgemm` / `cblas_sgemv`). Outside the core:
//! link with `-lopenblas` (CMake: `target_link_libraries(t PRIVATE openblas)`).
//!
//! f32 weights go straight to BLAS (`sgemv` for a single row, which is what a decode step is).
//! f16/bf16 weights are converted on the fly in row panels of at most `panel_bytes` into a scratch
//! buffer owned by the policy, then multiplied with `sgemm`; for repeated use, converting the
//! weights once (`head_weights::to_dtype(weight_dtype::f32)`) is faster at twice the memory.
//! Debian's OpenBLAS 0.3.21 declares `cblas_sbgemm` in cblas.h but is built without BFLOAT16, so
//! the symbol is not exported: this policy does not use it.
//!
//! @code
//! medusa_blas::openblas_gemm gemm;
//! heads.forward(gemm, hidden, 1, logits);
//! @endcode
#pragma once

#include <medusa/gemm.hpp>

#include <cblas.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace medusa_blas {

//! OpenBLAS-backed GEMM policy. Not thread-safe (one scratch buffer per object): use one object
//! per calling thread; OpenBLAS parallelises each call internally.
struct openblas_gemm {
  //! Largest f32 panel converted at a time for 16-bit weights.
  std::size_t panel_bytes = std::size_t{4} << 20;

  //! `C = alpha·op(A)·op(B) + beta·C` (row-major; see medusa/gemm.hpp).
  void gemm(medusa::gemm_op op_a, medusa::gemm_op op_b, std::size_t m, std::size_t n, std::size_t k, float alpha,
            const float* a, std::size_t lda, medusa::weight_ptr b, std::size_t ldb, float beta, float* c, std::size_t ldc) {
    if (m == 0 || n == 0) return;
    const auto ta = op_a == medusa::gemm_op::transpose ? CblasTrans : CblasNoTrans;
    const auto tb = op_b == medusa::gemm_op::transpose ? CblasTrans : CblasNoTrans;
    if (k == 0) {  // BLAS leaves C untouched for K = 0 only when beta = 1: make beta explicit
      for (std::size_t i = 0; i < m; ++i)
        for (std::size_t j = 0; j < n; ++j) c[i * ldc + j] = beta == 0.0f ? 0.0f : beta * c[i * ldc + j];
      return;
    }
    if (b.dtype == medusa::weight_dtype::f32) {
      call(ta, tb, m, n, k, alpha, a, lda, static_cast<const float*>(b.data), ldb, beta, c, ldc);
      return;
    }
    // 16-bit weights: convert panels of B's stored rows to f32, then multiply panel by panel.
    const std::size_t rows = tb == CblasTrans ? n : k;  // stored rows of B
    const std::size_t cols = tb == CblasTrans ? k : n;
    const std::size_t panel = std::max<std::size_t>(1, std::min(rows, panel_bytes / (4 * cols)));
    scratch_.resize(panel * cols);
    for (std::size_t r0 = 0; r0 < rows; r0 += panel) {
      const std::size_t pr = std::min(panel, rows - r0);
      const auto* bits = static_cast<const std::uint16_t*>(b.data);
      for (std::size_t r = 0; r < pr; ++r) {
        const std::uint16_t* src = bits + (r0 + r) * ldb;
        float* dst = scratch_.data() + r * cols;
        if (b.dtype == medusa::weight_dtype::bf16)
          for (std::size_t j = 0; j < cols; ++j) dst[j] = medusa::detail::bfloat16_bits_to_float(src[j]);
        else
          for (std::size_t j = 0; j < cols; ++j) dst[j] = medusa::detail::half_bits_to_float(src[j]);
      }
      if (tb == CblasTrans) {  // panel = columns [r0, r0+pr) of C
        call(ta, tb, m, pr, k, alpha, a, lda, scratch_.data(), cols, beta, c + r0, ldc);
      } else {  // panel = K slice [r0, r0+pr): accumulate
        const float* ap = ta == CblasTrans ? a + r0 * lda : a + r0;
        call(ta, tb, m, n, pr, alpha, ap, lda, scratch_.data(), cols, r0 == 0 ? beta : 1.0f, c, ldc);
      }
    }
  }

 private:
  static void call(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, std::size_t m, std::size_t n, std::size_t k, float alpha,
                   const float* a, std::size_t lda, const float* b, std::size_t ldb, float beta, float* c, std::size_t ldc) {
    const auto i = [](std::size_t v) { return static_cast<blasint>(v); };
    if (m == 1 && ta == CblasNoTrans && tb == CblasTrans) {
      // y = W x: a GEMV over W's rows. OpenBLAS may scale y by beta = 0 (NaN · 0): clear it first.
      if (beta == 0.0f) std::fill(c, c + n, 0.0f);
      cblas_sgemv(CblasRowMajor, CblasNoTrans, i(n), i(k), alpha, b, i(ldb), a, 1, beta, c, 1);
      return;
    }
    cblas_sgemm(CblasRowMajor, ta, tb, i(m), i(n), i(k), alpha, a, i(lda), b, i(ldb), beta, c, i(ldc));
  }

  std::vector<float> scratch_;
};

static_assert(medusa::gemm_policy<openblas_gemm>);

}  // namespace medusa_blas
