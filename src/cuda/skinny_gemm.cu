// SPDX-License-Identifier: Apache-2.0
// medusa::cuda_kernels: the skinny GEMM's launchers (see include/medusa/cuda/skinny_gemm_instances.cuh).
#define MEDUSA_CUDA_KERNELS_BUILD
#include <medusa/cuda/skinny_gemm_instances.cuh>

MEDUSA_CUDA_SKINNY_GEMM_INSTANCE(, ::medusa::bfloat16)
MEDUSA_CUDA_SKINNY_GEMM_INSTANCE(, ::medusa::half)
