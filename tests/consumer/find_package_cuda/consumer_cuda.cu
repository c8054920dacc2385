// SPDX-License-Identifier: Apache-2.0
// A CUDA engine's translation unit: it plans a step for a preset tree and takes the launcher that
// `medusa::cuda_kernels` holds (step_instances.cuh declares it extern, so this unit compiles no
// kernel of it and the link must find the library's). Runs without a device: nothing is launched.
#include <medusa/cuda/step_instances.cuh>

#include <cstdio>

int main() {
  using kernels = medusa::cuda::step_kernels<medusa::presets::tag_of<"mc_sim_7b_63">, medusa::bfloat16>;
  const auto plan = kernels::plan(/*batch=*/2, /*heads=*/4, /*vocab=*/1000, medusa::cuda::kernels::verify_kind::greedy);
  const auto verify = &kernels::verify;  // defined in medusa::cuda_kernels only
  std::printf("medusa::cuda_kernels: workspace %zu bytes, verify %s\n", plan.workspace_bytes,
              verify != nullptr ? "linked" : "missing");
  return plan.workspace_bytes > 0 && verify != nullptr ? 0 : 1;
}
