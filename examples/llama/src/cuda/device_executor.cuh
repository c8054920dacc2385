// SPDX-License-Identifier: Apache-2.0
// Private: the executor of forward.hpp, engine_state.hpp and device_decoder.hpp on a CUDA device:
// device memory, one stream, the kernel bodies of kernels.hpp as `__global__` functions, GEMMs
// through cuBLASLt, the library's attention, step, commit and heads launchers, and CUDA graphs.
// Nothing here allocates or synchronises once a step is captured: plans and workspaces are made
// by the `make_*` calls beforehand.
//
// GEMMs: with `batch_invariant` (the default) every weight shape gets one cuBLASLt algorithm,
// chosen once for the engine's largest pass, without split-K, and used for every pass size: a
// row's result then does not depend on how many rows share the pass, which greedy Medusa needs to
// reproduce plain decoding bit for bit. Without it, cuBLASLt's heuristic picks per pass size.
#pragma once

#include <medusa_llama/errors.hpp>

#include <medusa/cuda/attention.cuh>
#include <medusa/cuda/common.cuh>
#include <medusa/cuda/heads.cuh>
#include <medusa/cuda/kernel_context.hpp>
#include <medusa/cuda/kv_commit.cuh>
#include <medusa/cuda/step.cuh>
#include <medusa/cuda/step_instances.cuh>
#include <medusa/heads.hpp>
#include <medusa/tree.hpp>

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

template <class Body>
__global__ void __launch_bounds__(Body::max_threads) body_kernel(const Body body) {
  medusa::cuda::device_context ctx;
  body(ctx);
}

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

class device_executor {
 public:
  // Sets `device` current, and creates the stream, the cuBLAS handles and their workspace.
  // `max_rows`: the most rows a GEMM will have (the pinned algorithms are chosen for it).
  device_executor(int device, int max_rows, bool batch_invariant) : max_rows_(max_rows), invariant_(batch_invariant) {
    check_cuda(cudaSetDevice(device), "cudaSetDevice");
    check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    check_blas(cublasLtCreate(&lt_), "cublasLtCreate");
    check_blas(cublasCreate(&blas_), "cublasCreate");
    check_blas(cublasSetStream(blas_, stream_), "cublasSetStream");
    check_cuda(cudaMalloc(&lt_ws_, lt_ws_bytes), "cudaMalloc (cuBLASLt workspace)");
    check_cuda(cudaMalloc(&blas_ws_, blas_ws_bytes), "cudaMalloc (cuBLAS workspace)");
    check_blas(cublasSetWorkspace(blas_, blas_ws_, blas_ws_bytes), "cublasSetWorkspace");
    cudaDeviceProp prop{};
    check_cuda(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
    name_ = prop.name;
    sms_ = prop.multiProcessorCount;
  }
  device_executor(const device_executor&) = delete;
  device_executor& operator=(const device_executor&) = delete;
  ~device_executor() {
    for (auto& [key, g] : gemms_) g.destroy();
    if (blas_ != nullptr) (void)cublasDestroy(blas_);
    if (lt_ != nullptr) (void)cublasLtDestroy(lt_);
    if (lt_ws_ != nullptr) (void)cudaFree(lt_ws_);
    if (blas_ws_ != nullptr) (void)cudaFree(blas_ws_);
    if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
  }

  [[nodiscard]] cudaStream_t stream() const noexcept { return stream_; }
  [[nodiscard]] const std::string& device_name() const noexcept { return name_; }
  [[nodiscard]] bool batch_invariant() const noexcept { return invariant_; }

  // --- memory -----------------------------------------------------------------------------------
  void* alloc(std::size_t bytes) {
    void* p = nullptr;
    check_cuda(cudaMalloc(&p, bytes), ("cudaMalloc of " + std::to_string(bytes) + " bytes").c_str());
    return p;
  }
  void release(void* p) noexcept { (void)cudaFree(p); }
  void upload(void* dst, const void* src, std::size_t bytes) {
    check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_), "upload");
  }
  void download(void* dst, const void* src, std::size_t bytes) {
    check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_), "download");
  }
  void fill_zero(void* dst, std::size_t bytes) { check_cuda(cudaMemsetAsync(dst, 0, bytes, stream_), "cudaMemset"); }
  void sync() { check_cuda(cudaStreamSynchronize(stream_), "the stream"); }

  // --- kernels ----------------------------------------------------------------------------------
  template <class Body>
  void launch(const medusa::cuda::launch_shape& s, const Body& body) {
    body_kernel<Body><<<dim3(static_cast<unsigned>(s.grid_x), static_cast<unsigned>(s.grid_y)),
                        static_cast<unsigned>(s.threads), s.shared_bytes, stream_>>>(body);
    check_cuda(cudaGetLastError(), "kernel launch");
  }

  // Y[rows][n_out] (+)= X[rows][k] · W[n_out][k]ᵀ, T inputs, float output, float accumulation.
  template <class T>
  void gemm(const T* w, const T* x, float* y, int n_out, int rows, int k, bool accumulate) {
    const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    gemm_shape& g = shape_of<T>(n_out, k);
    const layouts& l = g.layouts_for(rows);
    const cublasLtMatmulAlgo_t* algo = invariant_ ? &g.pinned : &l.algo;
    check_blas(cublasLtMatmul(lt_, g.desc, &alpha, w, g.a, x, l.b, &beta, y, l.c, y, l.c, algo, lt_ws_, lt_ws_bytes, stream_),
               "cublasLtMatmul");
  }

  template <class KV, class O>
  void attention(const medusa::cuda::kernels::attention_plan& plan, const medusa::cuda::kernels::attention_params<KV, O>& a,
                 void* workspace, std::size_t bytes) {
    check_cuda(medusa::cuda::run(plan, a, workspace, bytes, stream_), "attention");
  }

  void kv_commit(const medusa::cuda::kernels::kv_commit_params& params) {
    const auto plan = medusa::cuda::kernels::plan_kv_commit(params);
    check_cuda(medusa::cuda::run(plan, params, stream_), "kv commit");
  }

  // --- the Medusa step's library kernels -------------------------------------------------------
  using step_kernels = medusa::cuda::step_kernels<medusa::cuda::runtime_tree, float>;
  struct step_op {
    step_kernels::plan_type plan;
    std::shared_ptr<void> tree_ints, workspace;
    medusa::cuda::tree_arrays tree;
  };
  step_op make_step_op(const medusa::tree& t, int heads, int batch, int vocab) {
    step_op op;
    op.plan = step_kernels::plan(batch, heads, vocab, medusa::cuda::kernels::verify_kind::greedy, t,
                                 0.0f, 0, 1.0f, 4 * sms_);
    const std::vector<int> packed = medusa::cuda::pack_tree(t);
    op.tree_ints = owned(packed.size() * sizeof(int));
    upload(op.tree_ints.get(), packed.data(), packed.size() * sizeof(int));
    op.workspace = owned(std::max<std::size_t>(op.plan.workspace_bytes, 1));
    op.tree = medusa::cuda::tree_arrays::over(t, static_cast<const int*>(op.tree_ints.get()));
    sync();
    return op;
  }
  void candidates(step_op& op, const float* head_logits, const std::int32_t* roots, const std::int32_t* lengths,
                  std::int32_t* node_tokens, std::int32_t* positions, std::int32_t* status) {
    check_cuda(step_kernels::candidates(op.plan, op.tree, head_logits, op.plan.vocab, roots,
                                        lengths, node_tokens, positions, status, op.workspace.get(),
                                        op.plan.workspace_bytes, stream_),
               "candidates");
  }
  void verify(step_op& op, const medusa::cuda::kernels::verify_args<float>& a) {
    check_cuda(step_kernels::verify(op.plan, op.tree, a, op.workspace.get(),
                                    op.plan.workspace_bytes, stream_),
               "verify");
  }

  struct argmax_op {
    medusa::cuda::kernels::top_k_plan plan;
    std::shared_ptr<void> workspace;
  };
  argmax_op make_argmax_op(int rows, int vocab) {
    argmax_op op;
    op.plan = medusa::cuda::kernels::plan_top_k(rows, vocab, 1, 4 * sms_);
    op.workspace = owned(std::max<std::size_t>(op.plan.workspace_bytes, 1));
    return op;
  }
  void argmax(argmax_op& op, const float* logits, std::int32_t* ids, std::int32_t* status) {
    medusa::cuda::kernels::top_k_args<float> a;
    a.logits = logits;
    a.row_stride = op.plan.vocab;
    a.out_ids = ids;
    a.status = status;
    a.rows_per_status = 1;
    check_cuda(medusa::cuda::run_top_k(op.plan, a, op.workspace.get(), op.plan.workspace_bytes, stream_), "argmax");
  }

  template <class T>
  struct heads_op {
    std::shared_ptr<medusa::cuda::device_heads<T>> heads;
    medusa::cuda::device_heads_plan plan;
    std::shared_ptr<void> workspace;
  };
  template <class T>
  heads_op<T> make_heads_op(const medusa::head_stack<>& stack, int rows) {
    heads_op<T> op;
    try {
      op.heads = std::make_shared<medusa::cuda::device_heads<T>>(stack);
      op.plan = op.heads->plan(static_cast<std::size_t>(rows));
    } catch (const medusa::cuda::cuda_error& e) {
      throw engine_error(engine_errc::device_failure, e.what());
    }
    op.workspace = owned(std::max<std::size_t>(op.plan.workspace_bytes, 1));
    return op;
  }
  template <class T>
  void heads(heads_op<T>& op, const T* hidden, float* logits) {
    const medusa::cuda::blas_status s =
        op.heads->run(op.plan, hidden, logits, op.workspace.get(), op.plan.workspace_bytes, blas_, stream_);
    check_cuda(s.cuda, "heads");
    check_blas(s.cublas, "heads");
  }

  // --- graphs -------------------------------------------------------------------------------------
  struct graph {
    std::shared_ptr<CUgraphExec_st> exec;
  };
  template <class F>
  graph capture(F&& f) {
    check_cuda(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
    try {
      f();
    } catch (...) {
      cudaGraph_t broken = nullptr;
      (void)cudaStreamEndCapture(stream_, &broken);
      if (broken != nullptr) (void)cudaGraphDestroy(broken);
      throw;
    }
    cudaGraph_t g = nullptr;
    check_cuda(cudaStreamEndCapture(stream_, &g), "cudaStreamEndCapture");
    cudaGraphExec_t exec = nullptr;
    const cudaError_t e = cudaGraphInstantiate(&exec, g, 0);
    (void)cudaGraphDestroy(g);
    check_cuda(e, "cudaGraphInstantiate");
    return {std::shared_ptr<CUgraphExec_st>(exec, [](cudaGraphExec_t x) { (void)cudaGraphExecDestroy(x); })};
  }
  void replay(const graph& g) { check_cuda(cudaGraphLaunch(g.exec.get(), stream_), "cudaGraphLaunch"); }
  // Mean seconds of `n` back-to-back replays of `g`, by CUDA events on the stream.
  double time_replays(const graph& g, int n) {
    cudaEvent_t start = nullptr, stop = nullptr;
    check_cuda(cudaEventCreate(&start), "cudaEventCreate");
    check_cuda(cudaEventCreate(&stop), "cudaEventCreate");
    cudaError_t e = cudaEventRecord(start, stream_);
    for (int i = 0; i < n && e == cudaSuccess; ++i) e = cudaGraphLaunch(g.exec.get(), stream_);
    if (e == cudaSuccess) e = cudaEventRecord(stop, stream_);
    if (e == cudaSuccess) e = cudaEventSynchronize(stop);
    float ms = 0.0f;
    if (e == cudaSuccess) e = cudaEventElapsedTime(&ms, start, stop);
    (void)cudaEventDestroy(start);
    (void)cudaEventDestroy(stop);
    check_cuda(e, "timing replays");
    return static_cast<double>(ms) * 1e-3 / n;
  }

 private:
  static constexpr std::size_t lt_ws_bytes = std::size_t{32} << 20;
  static constexpr std::size_t blas_ws_bytes = std::size_t{32} << 20;

  std::shared_ptr<void> owned(std::size_t bytes) {
    return std::shared_ptr<void>(alloc(bytes), [](void* p) { (void)cudaFree(p); });
  }

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
  cudaStream_t stream_ = nullptr;
  cublasLtHandle_t lt_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  void* lt_ws_ = nullptr;
  void* blas_ws_ = nullptr;
  std::string name_;
  int sms_ = 132;
  std::map<std::tuple<int, int, int>, gemm_shape> gemms_;
};

}  // namespace medusa_llama::cuda_detail
