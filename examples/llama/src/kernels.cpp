// SPDX-License-Identifier: Apache-2.0
// The OpenBLAS path of the row-major GEMMs (see kernels.hpp).
#include "kernels.hpp"

#if defined(MEDUSA_LLAMA_HAVE_OPENBLAS)
#include <cblas.h>
#endif

namespace medusa_llama::detail {

bool have_blas() noexcept {
#if defined(MEDUSA_LLAMA_HAVE_OPENBLAS)
  return true;
#else
  return false;
#endif
}

bool linear_rows_blas(const float* W, const float* X, float* Y, int T, int in, int ldy, int r0, int r1, bool accumulate) {
#if defined(MEDUSA_LLAMA_HAVE_OPENBLAS)
  if (r1 <= r0) return true;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, r1 - r0, in, 1.0f, X, in,
              W + static_cast<std::size_t>(r0) * static_cast<std::size_t>(in), in, accumulate ? 1.0f : 0.0f, Y + r0, ldy);
  return true;
#else
  (void)W, (void)X, (void)Y, (void)T, (void)in, (void)ldy, (void)r0, (void)r1, (void)accumulate;
  return false;
#endif
}

}  // namespace medusa_llama::detail
