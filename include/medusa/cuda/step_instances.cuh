// SPDX-License-Identifier: Apache-2.0
//! @file cuda/step_instances.cuh
//! The explicit instantiation list of `step_kernels` compiled into the library target
//! `medusa::cuda_kernels`: the 9 presets and `runtime_tree` × f32/bf16/f16 logits (30 launcher
//! classes; the kernels are the 10 tree shapes × 3 logit types × the verification policies, plus
//! top-k per logit type), and `run_top_k` per logit type (a plain step's argmax). The head count
//! is a field of the plan, so it adds no instantiation.
//!
//! Including this header declares those instantiations `extern`: a translation unit that uses one
//! of them links it from `medusa::cuda_kernels` instead of compiling the kernels again. Shapes
//! outside the list still work through the templates in `step.cuh`, compiled where they are used.
//! A plan with fewer heads than its tree's depth is refused at run time (`launch_error`).
#pragma once

#include <medusa/cuda/step.cuh>
#include <medusa/tree/presets.hpp>

//! Every instantiation of logit type `T` (`PREFIX` is `extern` for declarations, empty in the
//! library's sources).
#define MEDUSA_CUDA_STEP_INSTANCES(PREFIX, T)                                                    \
  PREFIX template class ::medusa::cuda::step_kernels<::medusa::presets::tag<0>, T>;              \
  PREFIX template class ::medusa::cuda::step_kernels<::medusa::presets::tag<1>, T>;              \
  PREFIX template class ::medusa::cuda::step_kernels<::medusa::presets::tag<2>, T>;              \
  PREFIX template class ::medusa::cuda::step_kernels<::medusa::presets::tag<3>, T>;              \
  PREFIX template class ::medusa::cuda::step_kernels<::medusa::presets::tag<4>, T>;              \
  PREFIX template class ::medusa::cuda::step_kernels<::medusa::presets::tag<5>, T>;              \
  PREFIX template class ::medusa::cuda::step_kernels<::medusa::presets::tag<6>, T>;              \
  PREFIX template class ::medusa::cuda::step_kernels<::medusa::presets::tag<7>, T>;              \
  PREFIX template class ::medusa::cuda::step_kernels<::medusa::presets::tag<8>, T>;              \
  PREFIX template class ::medusa::cuda::step_kernels<::medusa::cuda::runtime_tree, T>;           \
  PREFIX template cudaError_t medusa::cuda::run_top_k<T>(                                        \
      const ::medusa::cuda::kernels::top_k_plan&, ::medusa::cuda::kernels::top_k_args<T>, void*, \
      std::size_t, cudaStream_t);

static_assert(::medusa::preset_table.size() == 9, "step_instances.cuh lists 9 presets: update the list");

#if !defined(MEDUSA_CUDA_KERNELS_BUILD)
MEDUSA_CUDA_STEP_INSTANCES(extern, float)
MEDUSA_CUDA_STEP_INSTANCES(extern, ::medusa::bfloat16)
MEDUSA_CUDA_STEP_INSTANCES(extern, ::medusa::half)
#endif
