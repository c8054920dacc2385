// SPDX-License-Identifier: Apache-2.0
//! @file cuda/skinny_gemm_instances.cuh
//! The explicit instantiations of the skinny GEMM's launcher (`cuda/skinny_gemm.cuh`) compiled
//! into the library target `medusa::cuda_kernels`: bf16 and f16 weights (2 launchers; each holds
//! the row-tile × epilogue variants of its kernel).
//!
//! Including this header declares those instantiations `extern`: a translation unit that uses one
//! of them links it from `medusa::cuda_kernels` instead of compiling the kernels again.
#pragma once

#include <medusa/cuda/skinny_gemm.cuh>
#include <medusa/half.hpp>

//! The instantiation of the launcher for weights `T` (`PREFIX` is `extern` for declarations,
//! empty in the library's sources).
#define MEDUSA_CUDA_SKINNY_GEMM_INSTANCE(PREFIX, T)     \
  PREFIX template cudaError_t medusa::cuda::run<T>(     \
      const ::medusa::cuda::kernels::skinny_gemm_plan&, \
      const ::medusa::cuda::kernels::skinny_gemm_params<T>&, cudaStream_t);

#if !defined(MEDUSA_CUDA_KERNELS_BUILD)
MEDUSA_CUDA_SKINNY_GEMM_INSTANCE(extern, ::medusa::bfloat16)
MEDUSA_CUDA_SKINNY_GEMM_INSTANCE(extern, ::medusa::half)
#endif
