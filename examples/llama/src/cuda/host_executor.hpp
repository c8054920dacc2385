// SPDX-License-Identifier: Apache-2.0
// Private: the executor of forward.hpp and the device decoder on the host, for CI: the library's
// emulated executor (host memory, kernel bodies under the emulation, the step's kernels, the CPU
// heads, replay by re-running) plus the forward's GEMMs as plain float loops and the library's
// attention under the emulation. It runs every line of the GPU engine's pass and step except the
// cuBLAS calls and the graph capture, which only a device can run. With `skinny_gemm`, the bf16
// GEMMs run the library's skinny GEMM under the emulation instead (the device executor's
// `library_gemm`; f16 keeps the float loops, which spares every build of the tests a second
// emulated instance set).
#pragma once

#include <medusa/cuda/emulated_executor.hpp>
#include <medusa/cuda/emulation.hpp>
#include <medusa/cuda/kernels/attention.hpp>
#include <medusa/cuda/kernels/skinny_gemm.hpp>

#include <chrono>
#include <cstddef>
#include <stdexcept>
#include <type_traits>

namespace medusa_llama::cuda_detail {

class host_executor : public medusa::cuda::emulated_executor {
 public:
  explicit host_executor(bool skinny_gemm = false) : skinny_(skinny_gemm) {}

  // Y[rows][n_out] (+)= X[rows][k] · W[n_out][k]ᵀ, float accumulation in order of k: every row is
  // computed the same way whatever the number of rows (as the device's pinned algorithms are).
  template <class T>
  void gemm(const T* w, const T* x, float* y, int n_out, int rows, int k, bool accumulate) {
    ++gemms_;
    if constexpr (std::is_same_v<T, medusa::bfloat16>) {
      if (skinny_) {
        namespace mk = medusa::cuda::kernels;
        const mk::skinny_gemm_plan plan = mk::plan_skinny_gemm({.n = n_out, .k = k, .rows = rows});
        const mk::skinny_gemm_params<T> a{w, x, y, accumulate};
        medusa::cuda::emulate(plan.launch, [&](auto& ctx) { mk::skinny_gemm(ctx, plan, a); });
        return;
      }
    }
    for (int r = 0; r < rows; ++r) {
      const T* xr = x + static_cast<std::size_t>(r) * static_cast<std::size_t>(k);
      float* yr = y + static_cast<std::size_t>(r) * static_cast<std::size_t>(n_out);
      for (int o = 0; o < n_out; ++o) {
        const T* wo = w + static_cast<std::size_t>(o) * static_cast<std::size_t>(k);
        float s = 0.0f;
        for (int i = 0; i < k; ++i) s += medusa::cuda::load_float(xr[i]) * medusa::cuda::load_float(wo[i]);
        yr[o] = accumulate ? yr[o] + s : s;
      }
    }
  }

  // Whether `gemm_swiglu` runs for T (as the device executor's, for the emulated GEMM's types).
  template <class T>
  [[nodiscard]] bool fused_swiglu() const noexcept {
    return skinny_ && std::is_same_v<T, medusa::bfloat16>;
  }

  // h = SiLU(gate) ⊙ up through the emulated skinny GEMM's SwiGLU epilogue (W interleaved).
  template <class T>
  void gemm_swiglu(const T* w, const T* x, T* h, int columns, int rows, int k) {
    if constexpr (std::is_same_v<T, medusa::bfloat16>) {
      ++gemms_;
      namespace mk = medusa::cuda::kernels;
      const mk::skinny_gemm_plan plan = mk::plan_skinny_gemm_swiglu(columns, k, rows);
      const mk::skinny_gemm_params<T> a = mk::skinny_gemm_swiglu_params(w, x, h, columns);
      if (!mk::skinny_gemm_args_ok(plan, a)) throw std::logic_error("host executor: SwiGLU GEMM arguments");
      medusa::cuda::emulate(plan.launch, [&](auto& ctx) { mk::skinny_gemm(ctx, plan, a); });
    } else {
      throw std::logic_error("host executor: the emulated SwiGLU GEMM is bf16 only (fused_swiglu)");
    }
  }

  template <class KV, class O>
  void attention(const medusa::cuda::kernels::attention_plan& plan, medusa::cuda::kernels::attention_params<KV, O> a,
                 void* workspace, std::size_t bytes) {
    namespace mk = medusa::cuda::kernels;
    mk::check_attention_args(plan, a);
    if (!mk::bind_attention_workspace(plan, a, workspace, bytes))
      throw std::logic_error("host executor: attention workspace too small");
    medusa::cuda::emulate(plan.main, [&](auto& ctx) { mk::attention_main(ctx, plan, a); });
    if (plan.splits > 1) medusa::cuda::emulate(plan.merge, [&](auto& ctx) { mk::attention_merge(ctx, plan, a); });
  }

  // Mean seconds of `n` replays of `g`.
  double time_replays(const graph& g, int n) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < n; ++i) g();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / n;
  }

  [[nodiscard]] long long gemms() const noexcept { return gemms_; }

 private:
  bool skinny_ = false;
  long long gemms_ = 0;
};

}  // namespace medusa_llama::cuda_detail
