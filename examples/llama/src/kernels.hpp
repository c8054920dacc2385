// SPDX-License-Identifier: Apache-2.0
// Private: the engine's numeric kernels (AVX-512 when compiled for it, portable code otherwise).
#pragma once

#include <cstddef>

namespace medusa_llama::detail {

//! Y[t*ldy + r] (= or +=) Σ_i X[t*in + i] · W[r*in + i] for rows r in [r0, r1) and t < T: a small-M
//! GEMM that streams each weight row once for all T tokens (register-blocked 4 rows × 4 tokens).
void linear_rows(const float* W, const float* X, float* Y, int T, int in, int ldy, int r0, int r1, bool accumulate);

//! Same contract through OpenBLAS sgemm (one thread); false when OpenBLAS is not linked.
bool linear_rows_blas(const float* W, const float* X, float* Y, int T, int in, int ldy, int r0, int r1, bool accumulate);

//! True when linear_rows_blas is available.
bool have_blas() noexcept;

//! Σ a[i]·b[i].
float dot(const float* a, const float* b, int n);
//! y += a·x.
void axpy(float a, const float* x, float* y, int n);
//! out = w ⊙ x / sqrt(mean(x²) + eps) (llama2.c's rmsnorm).
void rmsnorm(float* out, const float* x, const float* w, int n, float eps);

}  // namespace medusa_llama::detail
