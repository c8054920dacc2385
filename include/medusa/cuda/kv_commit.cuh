// SPDX-License-Identifier: Apache-2.0
//! @file cuda/kv_commit.cuh
//! The device KV-cache commit of a batch: the `__global__` wrapper of the body in
//! `cuda/kernels/kv_commit.hpp` and its launcher.
//!
//! `run` picks the move width on the host (`kv_commit_vector_bytes`) and launches the kernel
//! instance for it, so the device code has no width dispatch. It never allocates or synchronises,
//! so a step's commit can be captured in a CUDA graph; the arrays of `params` are read when the
//! kernel runs, so a graph replays with whatever the engine wrote there since.
//!
//! @code
//! namespace mk = medusa::cuda::kernels;
//! const mk::kv_commit_params params = mk::make_kv_commit_params(device_view, batch, d_slot_bases, capacity);
//! const mk::kv_commit_plan plan = mk::plan_kv_commit(params);    // once per geometry; throws launch_error
//! medusa::cuda::check(medusa::cuda::run(plan, params, stream), "kv commit");
//! @endcode
#pragma once

#include <medusa/config.hpp>
#include <medusa/cuda/common.cuh>
#include <medusa/cuda/kernel_context.hpp>
#include <medusa/cuda/kernels/kv_commit.hpp>

#include <cuda_runtime.h>

MEDUSA_NAMESPACE_BEGIN
namespace cuda {

namespace detail {

// One instance per move width; a template, so that every translation unit may include it.
template <int VecBytes>
__global__ void __launch_bounds__(kernels::kv_commit_max_threads)
    kv_commit_kernel(const kernels::kv_commit_params params) {
  device_context ctx;
  kernels::kv_commit_with_width<VecBytes>(ctx, params);
}

}  // namespace detail

//! Launches the commit of `params` on `stream` with the shape of `plan` (from `plan_kv_commit`
//! on the same geometry). Returns `cudaErrorInvalidValue` without launching when a pointer the
//! commit needs is null, `new_lengths` aliases `committed_lengths`, `k`/`v` are not aligned to
//! the element size, or the plan's block is not a multiple of 32 in [32, `kv_commit_max_threads`];
//! otherwise the launch status. Never allocates nor synchronises.
inline cudaError_t run(const kernels::kv_commit_plan& plan, const kernels::kv_commit_params& params,
                       cudaStream_t stream) {
  const kernels::kv_commit_batch& batch = params.batch;
  if (batch.size < 1 || batch.committed_lengths == nullptr || batch.paths == nullptr || params.k == nullptr ||
      params.v == nullptr || batch.path_stride < 0)
    return cudaErrorInvalidValue;
  if (batch.path_stride > 0 ? batch.accept_lengths == nullptr : batch.path_offsets == nullptr)
    return cudaErrorInvalidValue;
  if (batch.new_lengths != nullptr && batch.new_lengths == batch.committed_lengths) return cudaErrorInvalidValue;
  if (params.layout == kernels::kv_commit_layout::paged && params.block_tables == nullptr)
    return cudaErrorInvalidValue;
  if (params.element_bytes != 2 && params.element_bytes != 4) return cudaErrorInvalidValue;
  const auto element_mask = static_cast<std::uintptr_t>(params.element_bytes - 1);
  if ((reinterpret_cast<std::uintptr_t>(params.k) & element_mask) != 0 ||
      (reinterpret_cast<std::uintptr_t>(params.v) & element_mask) != 0)
    return cudaErrorInvalidValue;
  const launch_shape& s = plan.shape;
  if (s.threads < warp_size || s.threads > kernels::kv_commit_max_threads || s.threads % warp_size != 0 ||
      s.grid_x < 1 || s.grid_y < 1 || s.grid_y > 65535)
    return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(s.grid_x), static_cast<unsigned>(s.grid_y));
  const dim3 block(static_cast<unsigned>(s.threads));
  switch (kernels::kv_commit_vector_bytes(params)) {
    case 16: detail::kv_commit_kernel<16><<<grid, block, s.shared_bytes, stream>>>(params); break;
    case 8: detail::kv_commit_kernel<8><<<grid, block, s.shared_bytes, stream>>>(params); break;
    case 4: detail::kv_commit_kernel<4><<<grid, block, s.shared_bytes, stream>>>(params); break;
    default: detail::kv_commit_kernel<2><<<grid, block, s.shared_bytes, stream>>>(params); break;
  }
  return cudaGetLastError();
}

}  // namespace cuda
MEDUSA_NAMESPACE_END
