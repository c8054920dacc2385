// SPDX-License-Identifier: Apache-2.0
// Private: the executor of forward.hpp, engine_state.hpp and device_decoder.hpp on a CUDA device:
// the library's stream executor (device memory, one stream, kernel bodies as `__global__`
// functions, the step's kernels and heads, CUDA graphs) plus the forward's GEMMs through cuBLASLt
// and the library's attention. Nothing here allocates or synchronises once a step is captured.
//
// GEMMs: with `batch_invariant` (the default) every weight shape gets one cuBLASLt algorithm,
// chosen once for the engine's largest pass, without split-K, and used for every pass size: a
// row's result then does not depend on how many rows share the pass, which greedy Medusa needs to
// reproduce plain decoding bit for bit. Without it, cuBLASLt's heuristic picks per pass size.
// With `library_gemm` (the default) bf16/f16 GEMMs run the library's skinny GEMM instead
// (cuda/skinny_gemm.cuh), batch-invariant by construction, the FFN's W1/W3 GEMM with its SwiGLU
// epilogue, and so do the Medusa heads' (`device_heads::run_skinny_gemm`); f32 GEMMs stay on
// cuBLAS(Lt).
#pragma once

#include <medusa_llama/errors.hpp>

#include <medusa/cuda/attention_instances.cuh>
#include <medusa/cuda/common.cuh>
#include <medusa/cuda/skinny_gemm_instances.cuh>
#include <medusa/cuda/stream_executor.cuh>

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace medusa_llama::cuda_detail {

[[noreturn]] inline void device_fail(const std::string& what, cudaError_t e) {
  throw engine_error(engine_errc::device_failure, what + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}
inline void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) device_fail(what, e);
}
inline void check_blas(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw engine_error(engine_errc::device_failure, std::string(what) + ": " + cublasGetStatusName(s) + " (" +
                                                        cublasGetStatusString(s) + ")");
}

template <class T>
inline constexpr cudaDataType_t data_type_of = std::is_same_v<T, float>             ? CUDA_R_32F
                                               : std::is_same_v<T, medusa::half> ? CUDA_R_16F
                                                                                 : CUDA_R_16BF;

class device_executor : public medusa::cuda::stream_executor {
 public:
  // Sets `device` current, and creates the stream, the cuBLAS handles and their workspace.
  // `max_rows`: the most rows a GEMM will have (the pinned algorithms are chosen for it).
  device_executor(int device, int max_rows, bool batch_invariant, bool library_gemm)
      : stream_executor(device), max_rows_(max_rows), invariant_(batch_invariant), library_(library_gemm) {
    set_skinny_gemm_heads(library_gemm);  // the Medusa heads' GEMMs as well
    check_blas(cublasLtCreate(&lt_), "cublasLtCreate");
    check_cuda(cudaMalloc(&lt_ws_, lt_ws_bytes), "cudaMalloc (cuBLASLt workspace)");
    check_cuda(cudaMalloc(&blas_ws_, blas_ws_bytes), "cudaMalloc (cuBLAS workspace)");
    check_blas(cublasSetWorkspace(cublas(), blas_ws_, blas_ws_bytes), "cublasSetWorkspace");
  }
  device_executor(const device_executor&) = delete;
  device_executor& operator=(const device_executor&) = delete;
  ~device_executor() {
    for (auto& [key, g] : gemms_) g.destroy();
    if (lt_ != nullptr) (void)cublasLtDestroy(lt_);
    if (lt_ws_ != nullptr) (void)cudaFree(lt_ws_);
    if (blas_ws_ != nullptr) (void)cudaFree(blas_ws_);
  }

  [[nodiscard]] bool batch_invariant() const noexcept { return invariant_; }

  // Y[rows][n_out] (+)= X[rows][k] · W[n_out][k]ᵀ, T inputs, float output, float accumulation.
  template <class T>
  void gemm(const T* w, const T* x, float* y, int n_out, int rows, int k, bool accumulate) {
    if constexpr (!std::is_same_v<T, float>) {
      if (library_) {
        namespace mk = medusa::cuda::kernels;
        const mk::skinny_gemm_plan plan = mk::plan_skinny_gemm({.n = n_out, .k = k, .rows = rows});
        check_cuda(medusa::cuda::run(plan, mk::skinny_gemm_params<T>{w, x, y, accumulate}, stream()), "skinny gemm");
        return;
      }
    }
    const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    gemm_shape& g = shape_of<T>(n_out, k);
    const layouts& l = g.layouts_for(rows);
    const cublasLtMatmulAlgo_t* algo = invariant_ ? &g.pinned : &l.algo;
    check_blas(cublasLtMatmul(lt_, g.desc, &alpha, w, g.a, x, l.b, &beta, y, l.c, y, l.c, algo, lt_ws_, lt_ws_bytes, stream()),
               "cublasLtMatmul");
  }

  // Whether `gemm_swiglu` runs for T: the library GEMM's SwiGLU epilogue, over the W1/W3 rows
  // interleaved as `skinny_gemm_swiglu_source` says (the weights are uploaded so).
  template <class T>
  [[nodiscard]] bool fused_swiglu() const noexcept {
    return library_ && !std::is_same_v<T, float>;
  }

  // h[rows][columns] = SiLU(X·W_gateᵀ) ⊙ (X·W_upᵀ) rounded to T, W interleaved (`fused_swiglu`).
  template <class T>
  void gemm_swiglu(const T* w, const T* x, T* h, int columns, int rows, int k) {
    namespace mk = medusa::cuda::kernels;
    check_cuda(medusa::cuda::run(mk::plan_skinny_gemm_swiglu(columns, k, rows), mk::skinny_gemm_swiglu_params(w, x, h, columns),
                                 stream()),
               "skinny gemm (SwiGLU)");
  }

  template <class KV, class O>
  void attention(const medusa::cuda::kernels::attention_plan& plan, const medusa::cuda::kernels::attention_params<KV, O>& a,
                 void* workspace, std::size_t bytes) {
    check_cuda(medusa::cuda::run(plan, a, workspace, bytes, stream()), "attention");
  }

 private:
  static constexpr std::size_t lt_ws_bytes = std::size_t{32} << 20;
  static constexpr std::size_t blas_ws_bytes = std::size_t{32} << 20;

  // One weight shape's cuBLASLt objects: the operation and W's layout, X/Y layouts per row count,
  // and the pinned algorithm.
  struct layouts {
    cublasLtMatrixLayout_t b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  struct gemm_shape {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr;
    cudaDataType_t type = CUDA_R_32F;
    int n_out = 0, k = 0;
    cublasLtHandle_t lt = nullptr;
    cublasLtMatmulAlgo_t pinned{};
    std::map<int, layouts> per_rows;

    const layouts& layouts_for(int rows) {
      auto it = per_rows.find(rows);
      if (it != per_rows.end()) return it->second;
      layouts l;
      check_blas(cublasLtMatrixLayoutCreate(&l.b, type, static_cast<std::uint64_t>(k), static_cast<std::uint64_t>(rows), k),
                 "cublasLtMatrixLayoutCreate");
      check_blas(cublasLtMatrixLayoutCreate(&l.c, CUDA_R_32F, static_cast<std::uint64_t>(n_out),
                                            static_cast<std::uint64_t>(rows), n_out),
                 "cublasLtMatrixLayoutCreate");
      l.algo = best_algo(l, false);
      return per_rows.emplace(rows, l).first->second;
    }

    // The heuristic's first algorithm for these layouts; with `no_split`, the first whose split-K
    // can be set to 1 (no reduction) and that still runs.
    cublasLtMatmulAlgo_t best_algo(const layouts& l, bool no_split) const {
      cublasLtMatmulPreference_t pref = nullptr;
      check_blas(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
      const std::size_t ws = lt_ws_bytes;
      check_blas(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws),
                 "cublasLtMatmulPreferenceSetAttribute");
      std::array<cublasLtMatmulHeuristicResult_t, 16> results{};
      int found = 0;
      const cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(lt, desc, a, l.b, l.c, l.c, pref,
                                                              static_cast<int>(results.size()), results.data(), &found);
      (void)cublasLtMatmulPreferenceDestroy(pref);
      check_blas(s, "cublasLtMatmulAlgoGetHeuristic");
      for (int i = 0; i < found; ++i) {
        cublasLtMatmulAlgo_t algo = results[static_cast<std::size_t>(i)].algo;
        if (!no_split) return algo;
        const std::uint32_t one = 1;
        const std::uint32_t none = CUBLASLT_REDUCTION_SCHEME_NONE;
        if (cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &one, sizeof one) !=
                CUBLAS_STATUS_SUCCESS ||
            cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &none, sizeof none) !=
                CUBLAS_STATUS_SUCCESS)
          continue;
        cublasLtMatmulHeuristicResult_t check{};
        if (cublasLtMatmulAlgoCheck(lt, desc, a, l.b, l.c, l.c, &algo, &check) == CUBLAS_STATUS_SUCCESS &&
            check.workspaceSize <= lt_ws_bytes)
          return algo;
      }
      throw engine_error(engine_errc::device_failure, "cuBLASLt has no algorithm for a " + std::to_string(n_out) + " x " +
                                                          std::to_string(k) + " GEMM" +
                                                          (no_split ? " without split-K" : ""));
    }

    void destroy() noexcept {
      for (auto& [rows, l] : per_rows) {
        (void)cublasLtMatrixLayoutDestroy(l.b);
        (void)cublasLtMatrixLayoutDestroy(l.c);
      }
      if (a != nullptr) (void)cublasLtMatrixLayoutDestroy(a);
      if (desc != nullptr) (void)cublasLtMatmulDescDestroy(desc);
    }
  };

  template <class T>
  gemm_shape& shape_of(int n_out, int k) {
    const auto key = std::make_tuple(static_cast<int>(data_type_of<T>), n_out, k);
    auto it = gemms_.find(key);
    if (it != gemms_.end()) return it->second;
    gemm_shape g;
    g.type = data_type_of<T>;
    g.n_out = n_out;
    g.k = k;
    g.lt = lt_;
    check_blas(cublasLtMatmulDescCreate(&g.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
    const cublasOperation_t t = CUBLAS_OP_T, n = CUBLAS_OP_N;
    check_blas(cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t), "TRANSA");
    check_blas(cublasLtMatmulDescSetAttribute(g.desc, CUBLASLT_MATMUL_DESC_TRANSB, &n, sizeof n), "TRANSB");
    // W is [n_out][k] row-major: column-major k × n_out, used transposed.
    check_blas(cublasLtMatrixLayoutCreate(&g.a, g.type, static_cast<std::uint64_t>(k), static_cast<std::uint64_t>(n_out), k),
               "cublasLtMatrixLayoutCreate");
    gemm_shape& stored = gemms_.emplace(key, g).first->second;
    if (invariant_) {
      // One algorithm for every pass size: chosen for the largest, then checked at the smallest.
      const layouts& big = stored.layouts_for(max_rows_);
      stored.pinned = stored.best_algo(big, true);
      const layouts& one = stored.layouts_for(1);
      cublasLtMatmulHeuristicResult_t check{};
      check_blas(cublasLtMatmulAlgoCheck(lt_, stored.desc, stored.a, one.b, one.c, one.c, &stored.pinned, &check),
                 "cublasLtMatmulAlgoCheck (one row)");
    }
    return stored;
  }

  int max_rows_;
  bool invariant_;
  bool library_;
  cublasLtHandle_t lt_ = nullptr;
  void* lt_ws_ = nullptr;
  void* blas_ws_ = nullptr;
  std::map<std::tuple<int, int, int>, gemm_shape> gemms_;
};

}  // namespace medusa_llama::cuda_detail
