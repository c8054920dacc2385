// SPDX-License-Identifier: Apache-2.0
//! @file cuda/attention.cuh
//! Tree attention of a batch on the GPU: the `__global__` wrappers of the bodies in
//! `cuda/kernels/attention.hpp` and their launcher. One launcher serves plain decoding, Medusa
//! tree steps and chunked prefill, over contiguous or paged caches (docs/cuda.md).
//!
//! `run` picks the kernel instance for the plan's head-dim slices and mask kind on the host, so
//! the device code has no such dispatch; it never allocates or synchronises, so a step's attention
//! can be captured in a CUDA graph, and the arrays of `params` (lengths, indptr, masks, block
//! tables) are read when the kernels run. `cuda/attention_instances.cuh` declares the launchers
//! that `medusa::cuda_kernels` compiles, so that an engine links them instead.
//!
//! @code
//! namespace mk = medusa::cuda::kernels;
//! const mk::attention_plan plan = mk::plan_attention(problem);   // once per shape; throws launch_error
//! mk::check_attention_args(plan, params);                        // host-side checks of the sizes
//! medusa::cuda::check(medusa::cuda::run(plan, params, workspace, plan.workspace_bytes, stream), "attention");
//! @endcode
#pragma once

#include <medusa/config.hpp>
#include <medusa/cuda/common.cuh>
#include <medusa/cuda/kernel_context.hpp>
#include <medusa/cuda/kernels/attention.hpp>

#include <cuda_runtime.h>

#include <cstddef>

MEDUSA_NAMESPACE_BEGIN
namespace cuda {

namespace detail {

template <int DC, class Mask, class KV, class O>
__global__ void __launch_bounds__(kernels::attention_threads, kernels::attention_min_blocks)
    attention_main_kernel(const kernels::attention_plan plan, const kernels::attention_params<KV, O> a) {
  device_context ctx;
  kernels::attention_main_with<DC, Mask>(ctx, plan, a);
}

template <int DC, class Mask, class KV, class O>
__global__ void __launch_bounds__(kernels::attention_threads, kernels::attention_min_blocks)
    attention_single_query_kernel(const kernels::attention_plan plan, const kernels::attention_params<KV, O> a) {
  device_context ctx;
  kernels::attention_single_query_with<DC, Mask>(ctx, plan, a);
}

template <int DC, class Mask, class KV, class O>
__global__ void __launch_bounds__(kernels::attention_threads)
    attention_merge_kernel(const kernels::attention_plan plan, const kernels::attention_params<KV, O> a) {
  device_context ctx;
  kernels::attention_merge_with<DC, Mask>(ctx, plan, a);
}

}  // namespace detail

//! Launches the attention of `params` with the shapes of `plan` on `stream`: the main kernel (the
//! single-query one for plans of one token per request), then the merge when some row may span
//! several key splits. The caller's `workspace` holds `plan.workspace_bytes` (0 allowed when the
//! plan needs none).
//! @return `cudaErrorInvalidValue`, with nothing launched, for null pointers the run needs, a
//!         short workspace, a batch outside [1, plan batch], a cache of another element size or
//!         shape, or row strides below heads × head_dim; otherwise the launch status. Never
//!         allocates nor synchronises.
template <class KV, class O>
cudaError_t run(const kernels::attention_plan& plan, kernels::attention_params<KV, O> params, void* workspace,
                std::size_t workspace_bytes, cudaStream_t stream) {
  using kernels::attention_mask_kind;
  const kernels::attention_problem& p = plan.problem;
  if (params.q == nullptr || params.out == nullptr || params.qo_indptr == nullptr || params.cache_lengths == nullptr ||
      params.kv.k == nullptr || params.kv.v == nullptr)
    return cudaErrorInvalidValue;
  if (params.batch < 1 || params.batch > p.batch || params.kv.element_bytes != static_cast<int>(sizeof(KV)) ||
      params.kv.shape.num_kv_heads != p.num_kv_heads || params.kv.shape.head_dim != p.head_dim || params.layer < 0 ||
      params.layer >= params.kv.shape.num_layers ||
      params.q_row_stride < static_cast<std::int64_t>(p.num_q_heads) * p.head_dim ||
      params.out_row_stride < static_cast<std::int64_t>(p.num_q_heads) * p.head_dim)
    return cudaErrorInvalidValue;
  if (params.kv.layout == kernels::batch_kv_layout::paged && params.kv.block_tables == nullptr)
    return cudaErrorInvalidValue;
  if (p.mask == attention_mask_kind::tree && (params.tree_mask == nullptr || params.words_per_row < 1))
    return cudaErrorInvalidValue;
  if (p.mask == attention_mask_kind::flashinfer && (params.custom_mask == nullptr || params.mask_indptr == nullptr))
    return cudaErrorInvalidValue;
  if (!kernels::bind_attention_workspace(plan, params, workspace, workspace_bytes)) return cudaErrorInvalidValue;
  const dim3 main_grid(static_cast<unsigned>(plan.main.grid_x), static_cast<unsigned>(plan.main.grid_y));
  const dim3 merge_grid(static_cast<unsigned>(plan.merge.grid_x), static_cast<unsigned>(plan.merge.grid_y));
  return kernels::with_attention_variant(plan, [&](auto dc, auto mask) -> cudaError_t {
    constexpr int DC = decltype(dc)::value;
    using Mask = decltype(mask);
    if (plan.single_query) {
      const auto kernel = detail::attention_single_query_kernel<DC, Mask, KV, O>;
      // Its stages take more than the default 48 KiB: ask per instance and device, for the most
      // any plan asks (a device without that much shared memory refuses here).
      static medusa::detail::cuda_shared_memory_grant grant;
      if (const cudaError_t status = grant.ensure(reinterpret_cast<const void*>(kernel),
                                                  static_cast<int>(kernels::attention_single_query_shared_max));
          status != cudaSuccess)
        return status;
      kernel<<<main_grid, plan.main.threads, plan.main.shared_bytes, stream>>>(plan, params);
    } else
      detail::attention_main_kernel<DC, Mask, KV, O>
          <<<main_grid, plan.main.threads, plan.main.shared_bytes, stream>>>(plan, params);
    if (plan.splits > 1)
      detail::attention_merge_kernel<DC, Mask, KV, O><<<merge_grid, plan.merge.threads, 0, stream>>>(plan, params);
    return cudaGetLastError();
  });
}

}  // namespace cuda
MEDUSA_NAMESPACE_END
