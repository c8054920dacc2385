// SPDX-License-Identifier: Apache-2.0
// A CUDA engine's translation unit: it plans a step for a preset tree and takes the launchers that
// `medusa::cuda_kernels` holds (the *_instances.cuh headers declare them extern, so this unit
// compiles no kernel of them and the link must find the library's): the step's verification, the
// attention for bf16 caches and the skinny GEMM for bf16 weights. Runs without a device: nothing
// is launched.
#include <medusa/cuda/attention_instances.cuh>
#include <medusa/cuda/skinny_gemm_instances.cuh>
#include <medusa/cuda/step_instances.cuh>

#include <cstdio>

int main() {
  using kernels = medusa::cuda::step_kernels<medusa::presets::tag_of<"mc_sim_7b_63">, medusa::bfloat16>;
  const auto plan = kernels::plan(/*batch=*/2, /*heads=*/4, /*vocab=*/1000, medusa::cuda::kernels::verify_kind::greedy);
  // defined in medusa::cuda_kernels only
  const auto verify = &kernels::verify;
  const auto attention = &medusa::cuda::run<medusa::bfloat16, medusa::bfloat16>;
  const auto gemm = &medusa::cuda::run<medusa::bfloat16>;
  const bool linked = verify != nullptr && attention != nullptr && gemm != nullptr;
  std::printf("medusa::cuda_kernels: workspace %zu bytes, launchers %s\n", plan.workspace_bytes,
              linked ? "linked" : "missing");
  return plan.workspace_bytes > 0 && linked ? 0 : 1;
}
