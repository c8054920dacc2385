// SPDX-License-Identifier: Apache-2.0
// medusa::cuda_kernels: the step kernels with f32 logits (see include/medusa/cuda/step_instances.cuh).
#define MEDUSA_CUDA_KERNELS_BUILD
#include <medusa/cuda/step_instances.cuh>

MEDUSA_CUDA_STEP_INSTANCES(, float)
