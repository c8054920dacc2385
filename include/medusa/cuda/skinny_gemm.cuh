// SPDX-License-Identifier: Apache-2.0
//! @file cuda/skinny_gemm.cuh
//! The batch-invariant GEMM of a decode or tree step on the GPU (`Y = X·Wᵀ`, `Y += X·Wᵀ`, or an
//! FFN's `SiLU(gate) ⊙ up`; W in bf16/f16, tensor cores, float accumulation): the `__global__`
//! wrapper of `cuda/kernels/skinny_gemm.hpp` and its launcher. A row's bits do not depend on the number of
//! rows in the pass (docs/cuda.md). `cuda/skinny_gemm_instances.cuh` declares the launchers that
//! `medusa::cuda_kernels` compiles, so that an engine links them instead.
//!
//! @code
//! namespace mk = medusa::cuda::kernels;
//! const mk::skinny_gemm_plan plan = mk::plan_skinny_gemm({.n = n, .k = k, .rows = rows});  // throws launch_error
//! medusa::cuda::check(medusa::cuda::run(plan, mk::skinny_gemm_params<medusa::bfloat16>{w, x, y, false}, stream),
//!                     "skinny gemm");
//! @endcode
#pragma once

#include <medusa/config.hpp>
#include <medusa/cuda/common.cuh>
#include <medusa/cuda/kernel_context.hpp>
#include <medusa/cuda/kernels/skinny_gemm.hpp>

#include <cuda_runtime.h>

MEDUSA_NAMESPACE_BEGIN
namespace cuda {

namespace detail {

template <int RT, int F, class T>
__global__ void __launch_bounds__(kernels::skinny_gemm_threads)
    skinny_gemm_kernel(const kernels::skinny_gemm_plan plan, const kernels::skinny_gemm_params<T> a, bool aligned) {
  device_context ctx;
  kernels::skinny_gemm_body<RT, F>(ctx, plan, a, aligned);
}

}  // namespace detail

//! Launches the GEMM of `params` with the shapes of `plan` on `stream`.
//! @return `cudaErrorInvalidValue`, with nothing launched, for arrays that do not suit the plan
//!         (`kernels::skinny_gemm_args_ok`: a null W or X, a null Y, a row stride shorter than a
//!         row, a negative batch stride, or for a SwiGLU plan a null `gated` or `gated_columns`
//!         outside `(n/2 - 8, n/2]`); otherwise the launch status. Never allocates nor
//!         synchronises (a step's GEMMs can be captured).
template <class T>
cudaError_t run(const kernels::skinny_gemm_plan& plan, const kernels::skinny_gemm_params<T>& params,
                cudaStream_t stream) {
  if (!kernels::skinny_gemm_args_ok(plan, params)) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(plan.launch.grid_x), static_cast<unsigned>(plan.launch.grid_y));
  const bool aligned = kernels::skinny_gemm_aligned(plan, params);
  return kernels::with_skinny_gemm_variant(plan, [&](auto rt, auto ft) -> cudaError_t {
    constexpr auto kernel = detail::skinny_gemm_kernel<decltype(rt)::value, decltype(ft)::value, T>;
    // The rings take more than the 48 KiB a block gets without asking (per instance and device).
    static medusa::detail::cuda_shared_memory_grant grant;
    if (const cudaError_t status = grant.ensure(reinterpret_cast<const void*>(kernel),
                                                static_cast<int>(plan.launch.shared_bytes));
        status != cudaSuccess)
      return status;
    kernel<<<grid, plan.launch.threads, plan.launch.shared_bytes, stream>>>(plan, params, aligned);
    return cudaGetLastError();
  });
}

}  // namespace cuda
MEDUSA_NAMESPACE_END
