// SPDX-License-Identifier: Apache-2.0
//! @file cuda/attention_instances.cuh
//! The explicit instantiations of the attention launcher (`cuda/attention.cuh`) compiled into the
//! library target `medusa::cuda_kernels`: caches of f32, bf16 and f16 with outputs of their own
//! type, and 16-bit caches with f32 outputs (5 launchers; each holds the 9 head-dim-slice × mask
//! variants of its kernels).
//!
//! Including this header declares those instantiations `extern`: a translation unit that uses one
//! of them links it from `medusa::cuda_kernels` instead of compiling the kernels again. Other
//! element types still work through the template in `attention.cuh`, compiled where they are used.
#pragma once

#include <medusa/cuda/attention.cuh>
#include <medusa/half.hpp>

//! The instantiation of the launcher for cache elements `KV` and outputs `O` (`PREFIX` is
//! `extern` for declarations, empty in the library's sources).
#define MEDUSA_CUDA_ATTENTION_INSTANCE(PREFIX, KV, O)   \
  PREFIX template cudaError_t medusa::cuda::run<KV, O>( \
      const ::medusa::cuda::kernels::attention_plan&,   \
      ::medusa::cuda::kernels::attention_params<KV, O>, void*, std::size_t, cudaStream_t);

#if !defined(MEDUSA_CUDA_KERNELS_BUILD)
MEDUSA_CUDA_ATTENTION_INSTANCE(extern, float, float)
MEDUSA_CUDA_ATTENTION_INSTANCE(extern, ::medusa::bfloat16, ::medusa::bfloat16)
MEDUSA_CUDA_ATTENTION_INSTANCE(extern, ::medusa::bfloat16, float)
MEDUSA_CUDA_ATTENTION_INSTANCE(extern, ::medusa::half, ::medusa::half)
MEDUSA_CUDA_ATTENTION_INSTANCE(extern, ::medusa::half, float)
#endif
