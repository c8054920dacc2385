// SPDX-License-Identifier: Apache-2.0
//! @file cuda/kernels/head_epilogue.hpp
//! The ResBlock epilogue of the device Medusa heads: `out = residual + SiLU(linear + bias)`, the
//! step that follows each ResBlock GEMM (`heads.hpp`: `x_{l+1} = x_l + SiLU(W x_l + b)`).
//!
//! - `linear` is the GEMM output in f32 (cuBLAS writes C in f32 from 16-bit A and B with f32
//!   accumulation), so `W x + b` and SiLU are evaluated on the unrounded sum; only the new residual
//!   stream is rounded, once, to the activation type `Act` (f32, f16 or bf16) that the next GEMM
//!   reads.
//! - Layout: output row r is handled by the blocks with `block_x == r`; the row is cut into chunks
//!   of `head_epilogue_vector<Act>` elements (16 bytes of `Act`), one per thread, walked by a
//!   grid-stride loop over those blocks (`block_y`) and their threads. A chunk moves with 16-byte
//!   vector accesses when every base pointer is 16-byte aligned and every row stride keeps that
//!   alignment; otherwise, and for the tail of a row whose length is not a multiple of the chunk,
//!   element by element.
//! - Row mapping, so one launch serves a whole layer of K heads laid out [M][K][d]: output row `r`
//!   adds residual row `r / rows_per_residual` (layer 0 of K heads all start from the same hidden
//!   state: K) and bias row `r % bias_rows` (head k's bias: K).
//!
//! The plan (`plan_head_epilogue`) is plain C++; `cuda/heads.cuh` holds the `__global__` wrapper
//! and the launcher, and the host emulation runs the same body in CI.
#pragma once

#include <medusa/config.hpp>
#include <medusa/cuda/emulation.hpp>
#include <medusa/cuda/kernel_context.hpp>
#include <medusa/cuda/launch.hpp>
#include <medusa/half.hpp>
#include <medusa/heads.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>

MEDUSA_NAMESPACE_BEGIN
namespace cuda::kernels {

//! Elements of `T` per vector access: 16 bytes (8 for f16/bf16, 4 for f32).
template <class T>
inline constexpr int head_epilogue_vector = static_cast<int>(16 / sizeof(T));

//! Arguments of one epilogue launch. Strides are in elements; `out` may alias `residual` when
//! `rows_per_residual` is 1 (each element is read before it is written, by the same thread).
//! @tparam Act  activation type of the residual stream: `float`, `medusa::half` or `medusa::bfloat16`
//! @tparam Bias bias element type: `float`, `medusa::half` or `medusa::bfloat16`
template <class Act, class Bias = float>
struct head_epilogue_params {
  const float* linear = nullptr;     //!< [rows][ld_linear] GEMM output W x
  const Bias* bias = nullptr;        //!< [bias_rows][hidden], or nullptr for no bias
  const Act* residual = nullptr;     //!< [rows / rows_per_residual][ld_residual] residual stream x
  Act* out = nullptr;                //!< [rows][ld_out] x + SiLU(W x + b)
  int rows = 0;                      //!< output rows
  int hidden = 0;                    //!< elements per row (d)
  std::int64_t ld_linear = 0;        //!< row stride of `linear`
  std::int64_t ld_residual = 0;      //!< row stride of `residual`
  std::int64_t ld_out = 0;           //!< row stride of `out`
  int rows_per_residual = 1;         //!< consecutive output rows sharing one residual row
  int bias_rows = 1;                 //!< output row r uses bias row r % bias_rows
};

//! Launch shape of the epilogue for `rows` × `hidden` (see `plan_head_epilogue`).
struct head_epilogue_plan {
  launch_shape shape;  //!< grid_x = rows, grid_y = blocks per row, no shared memory
  int rows = 0;        //!< output rows
  int hidden = 0;      //!< elements per row
};

//! Validates an epilogue of `rows` × `hidden` with activations `Act` and picks its launch shape:
//! one block column per row, 32 to `max_threads` threads (a multiple of 32) covering the row's
//! 16-byte chunks, and as many blocks along y as the remaining chunks need.
//! @throws launch_error (`invalid_shape`) for zero or too large sizes, or `max_threads` not a
//!         multiple of 32 in [32, 1024]
template <class Act>
[[nodiscard]] head_epilogue_plan plan_head_epilogue(std::size_t rows, std::size_t hidden, int max_threads = 256) {
  static_assert(is_kv_element_v<Act>, "activations are float, medusa::half or medusa::bfloat16");
  constexpr std::size_t int_max = static_cast<std::size_t>(std::numeric_limits<int>::max());
  if (rows == 0 || rows > int_max)
    throw launch_error(launch_errc::invalid_shape,
                       "head epilogue: rows must be in [1, " + std::to_string(int_max) + "], got " + std::to_string(rows));
  if (hidden == 0 || hidden > int_max / 2)
    throw launch_error(launch_errc::invalid_shape,
                       "head epilogue: hidden size must be in [1, " + std::to_string(int_max / 2) + "], got " + std::to_string(hidden));
  if (max_threads < warp_size || max_threads > 1024 || max_threads % warp_size != 0)
    throw launch_error(launch_errc::invalid_shape,
                       "head epilogue: threads per block must be a multiple of 32 in [32, 1024], got " + std::to_string(max_threads));
  constexpr std::size_t vec = static_cast<std::size_t>(head_epilogue_vector<Act>);
  const std::size_t chunks = (hidden + vec - 1) / vec;
  const std::size_t warps = (chunks + warp_size - 1) / warp_size;
  const int threads = static_cast<int>(std::min<std::size_t>(warps * warp_size, static_cast<std::size_t>(max_threads)));
  const std::size_t per_row = (chunks + static_cast<std::size_t>(threads) - 1) / static_cast<std::size_t>(threads);
  head_epilogue_plan plan;
  plan.shape = {.grid_x = static_cast<int>(rows),
                .grid_y = static_cast<int>(std::min<std::size_t>(per_row, 65535)),
                .threads = threads,
                .shared_bytes = 0};
  plan.rows = static_cast<int>(rows);
  plan.hidden = static_cast<int>(hidden);
  return plan;
}

namespace detail {

// N elements moved as one access: aligned to their size, at most 16 bytes (the widest access).
template <class T, int N>
struct alignas(sizeof(T) * N < 16 ? sizeof(T) * N : 16) vector_of {
  T v[N];
};

// N consecutive elements from `p` (aligned as vector_of): vector loads on the device, memcpy on the host.
template <int N, class T>
MEDUSA_KERNEL_FN vector_of<T, N> load_vector(const T* p) noexcept {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const vector_of<T, N>*>(p);
#else
  vector_of<T, N> r;
  std::memcpy(r.v, p, sizeof r.v);
  return r;
#endif
}

template <int N, class T>
MEDUSA_KERNEL_FN void store_vector(T* p, const vector_of<T, N>& v) noexcept {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<vector_of<T, N>*>(p) = v;
#else
  std::memcpy(p, v.v, sizeof v.v);
#endif
}

MEDUSA_KERNEL_FN bool aligned_16(const void* p) noexcept {
  return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0;
}

// Whether every row of every operand starts 16-byte aligned, so whole chunks move as vectors.
template <class Act, class Bias>
MEDUSA_KERNEL_FN bool head_epilogue_vectorisable(const head_epilogue_params<Act, Bias>& p) noexcept {
  constexpr std::int64_t act_vec = head_epilogue_vector<Act>;
  const bool bias_ok = p.bias == nullptr || (aligned_16(p.bias) && (p.bias_rows == 1 || static_cast<std::size_t>(p.hidden) * sizeof(Bias) % 16 == 0));
  return aligned_16(p.linear) && aligned_16(p.residual) && aligned_16(p.out) && bias_ok &&
         p.ld_linear % head_epilogue_vector<float> == 0 && p.ld_residual % act_vec == 0 && p.ld_out % act_vec == 0;
}

// One element: residual + SiLU(linear + bias), rounded once to Act.
template <class Act>
MEDUSA_KERNEL_FN Act head_epilogue_element(float linear, float bias, Act residual) noexcept {
  return store_float<Act>(load_float(residual) + silu(linear + bias));
}

}  // namespace detail

//! The epilogue body: `out[r][i] = residual[r / rows_per_residual][i] + SiLU(linear[r][i] +
//! bias[r % bias_rows][i])` for every row `r = block_x` and every `i < hidden`.
//! Launch with the shape of `plan_head_epilogue<Act>(rows, hidden)`.
template <class Ctx, class Act, class Bias>
MEDUSA_KERNEL_FN void head_epilogue(Ctx& ctx, const head_epilogue_params<Act, Bias>& p) {
  constexpr int vec = head_epilogue_vector<Act>;
  const int row = ctx.block_x();
  const float* linear = p.linear + static_cast<std::int64_t>(row) * p.ld_linear;
  const Act* residual = p.residual + static_cast<std::int64_t>(row / p.rows_per_residual) * p.ld_residual;
  const Bias* bias = p.bias == nullptr ? nullptr : p.bias + static_cast<std::int64_t>(row % p.bias_rows) * p.hidden;
  Act* out = p.out + static_cast<std::int64_t>(row) * p.ld_out;
  const bool vectorised = detail::head_epilogue_vectorisable(p);  // the same for every thread
  const int chunks = (p.hidden + vec - 1) / vec;
  const int stride = ctx.grid_y() * ctx.threads();
  for (int c = ctx.block_y() * ctx.threads() + ctx.thread(); c < chunks; c += stride) {
    const int i0 = c * vec;
    if (vectorised && i0 + vec <= p.hidden) {
      const auto y = detail::load_vector<vec>(linear + i0);
      const auto x = detail::load_vector<vec>(residual + i0);
      float b[vec] = {};
      if (bias != nullptr) {
        const auto bv = detail::load_vector<vec>(bias + i0);
        for (int j = 0; j < vec; ++j) b[j] = load_float(bv.v[j]);
      }
      detail::vector_of<Act, vec> o;
      for (int j = 0; j < vec; ++j) o.v[j] = detail::head_epilogue_element(y.v[j], b[j], x.v[j]);
      detail::store_vector<vec>(out + i0, o);
    } else {
      const int end = i0 + vec < p.hidden ? i0 + vec : p.hidden;
      for (int i = i0; i < end; ++i)
        out[i] = detail::head_epilogue_element(linear[i], bias == nullptr ? 0.0f : load_float(bias[i]), residual[i]);
    }
  }
}

}  // namespace cuda::kernels
MEDUSA_NAMESPACE_END
