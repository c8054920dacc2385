// SPDX-License-Identifier: Apache-2.0
//! @file cuda/step_instances.cuh
//! The explicit instantiation list of `step_kernels` compiled into the library target
//! `medusa::cuda_kernels`: the 9 presets and `runtime_tree`, 1–5 heads, f32/bf16/f16 logits
//! (150 launcher classes; the device code is shared across head counts, so the kernels are
//! the 10 tree shapes × 3 logit types × the verification policies, plus top-k per logit type).
//!
//! Including this header declares those instantiations `extern`: a translation unit that uses one
//! of them links it from `medusa::cuda_kernels` instead of compiling the kernels again. Shapes
//! outside the list still work through the templates in `step.cuh`, compiled where they are used.
//! A preset with fewer heads than its depth is in the list but its `plan` refuses it.
#pragma once

#include <medusa/cuda/step.cuh>
#include <medusa/tree/presets.hpp>

//! The instantiations of one tree tag and logit type, for heads 1–5.
#define MEDUSA_CUDA_STEP_HEADS(PREFIX, TAG, T)                  \
  PREFIX template class ::medusa::cuda::step_kernels<TAG, 1, T>; \
  PREFIX template class ::medusa::cuda::step_kernels<TAG, 2, T>; \
  PREFIX template class ::medusa::cuda::step_kernels<TAG, 3, T>; \
  PREFIX template class ::medusa::cuda::step_kernels<TAG, 4, T>; \
  PREFIX template class ::medusa::cuda::step_kernels<TAG, 5, T>;

//! Every instantiation of logit type `T` (`PREFIX` is `extern` for declarations, empty in the
//! library's sources).
#define MEDUSA_CUDA_STEP_INSTANCES(PREFIX, T)                           \
  MEDUSA_CUDA_STEP_HEADS(PREFIX, ::medusa::presets::tag<0>, T)           \
  MEDUSA_CUDA_STEP_HEADS(PREFIX, ::medusa::presets::tag<1>, T)           \
  MEDUSA_CUDA_STEP_HEADS(PREFIX, ::medusa::presets::tag<2>, T)           \
  MEDUSA_CUDA_STEP_HEADS(PREFIX, ::medusa::presets::tag<3>, T)           \
  MEDUSA_CUDA_STEP_HEADS(PREFIX, ::medusa::presets::tag<4>, T)           \
  MEDUSA_CUDA_STEP_HEADS(PREFIX, ::medusa::presets::tag<5>, T)           \
  MEDUSA_CUDA_STEP_HEADS(PREFIX, ::medusa::presets::tag<6>, T)           \
  MEDUSA_CUDA_STEP_HEADS(PREFIX, ::medusa::presets::tag<7>, T)           \
  MEDUSA_CUDA_STEP_HEADS(PREFIX, ::medusa::presets::tag<8>, T)           \
  MEDUSA_CUDA_STEP_HEADS(PREFIX, ::medusa::cuda::runtime_tree, T)

static_assert(::medusa::preset_table.size() == 9, "step_instances.cuh lists 9 presets: update the list");

#if !defined(MEDUSA_CUDA_KERNELS_BUILD)
MEDUSA_CUDA_STEP_INSTANCES(extern, float)
MEDUSA_CUDA_STEP_INSTANCES(extern, ::medusa::bfloat16)
MEDUSA_CUDA_STEP_INSTANCES(extern, ::medusa::half)
#endif
