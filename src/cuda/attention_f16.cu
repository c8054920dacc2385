// SPDX-License-Identifier: Apache-2.0
// medusa::cuda_kernels: the attention launchers for f16 caches (see include/medusa/cuda/attention_instances.cuh).
#define MEDUSA_CUDA_KERNELS_BUILD
#include <medusa/cuda/attention_instances.cuh>

MEDUSA_CUDA_ATTENTION_INSTANCE(, ::medusa::half, ::medusa::half)
MEDUSA_CUDA_ATTENTION_INSTANCE(, ::medusa::half, float)
