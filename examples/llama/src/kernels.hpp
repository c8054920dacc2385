// SPDX-License-Identifier: Apache-2.0
// Private: the engine's element-wise kernels and the row-major GEMMs of the OpenBLAS path. The
// vector kernels are compiled for every instruction set Highway targets and chosen at run time
// (simd/vector_ops.cpp).
#pragma once

#include <cstddef>

namespace medusa_llama::detail {

//! Y[t*ldy + r] (= or +=) Σ_i X[t*in + i] · W[r*in + i] for rows r in [r0, r1) and t < T, over
//! row-major W (the fallback of the OpenBLAS path: a dot product per row and token).
void linear_rows(const float* W, const float* X, float* Y, int T, int in, int ldy, int r0, int r1, bool accumulate);

//! Same contract through OpenBLAS sgemm (one thread); false when OpenBLAS is not linked.
bool linear_rows_blas(const float* W, const float* X, float* Y, int T, int in, int ldy, int r0, int r1, bool accumulate);

//! True when linear_rows_blas is available.
bool have_blas() noexcept;

//! Σ a[i]·b[i].
float dot(const float* a, const float* b, int n);
//! out = w ⊙ x / sqrt(mean(x²) + eps) (llama2.c's rmsnorm).
void rmsnorm(float* out, const float* x, const float* w, int n, float eps);
//! g[i] = silu(g[i]) · u[i] (SwiGLU).
void silu_mul(float* g, const float* u, int n);
//! out[i] = in[i] + silu(t[i] + b[i]) (a Medusa head's residual block; out may be in).
void silu_residual(float* out, const float* in, const float* t, const float* b, int n);
//! RoPE of `heads` heads of `head_dim` floats by the angles of one position (cos/sin[head_dim / 2]):
//! pairs (2i, 2i + 1) when `adjacent_pairs`, else (i, i + head_dim / 2).
void rope(float* vec, int heads, int head_dim, const float* cos, const float* sin, bool adjacent_pairs);

}  // namespace medusa_llama::detail
