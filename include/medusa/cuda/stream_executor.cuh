// SPDX-License-Identifier: Apache-2.0
//! @file cuda/stream_executor.cuh
//! The `device_step` executor on a CUDA device: device memory, one non-blocking stream, kernel
//! bodies as `__global__` functions, the step's kernels through `step_kernels<runtime_tree, float>`
//! (compiled in `medusa::cuda_kernels`), the heads through `device_heads` and cuBLAS (or the skinny
//! GEMM, also compiled there: `set_skinny_gemm_heads`), and CUDA graphs. Nothing here allocates or
//! synchronises once a step is captured: the `make_*` calls make the plans and workspaces
//! beforehand. Failures throw `cuda_error`, `cublas_error` or `launch_error`. An engine derives
//! from it to add its forward's GEMMs and attention.
//!
//! @code
//! medusa::cuda::stream_executor ex(0);                      // device 0
//! medusa::cuda::device_step<medusa::cuda::stream_executor, medusa::bfloat16> step(ex, tree, heads);
//! @endcode
#pragma once

#include <medusa/config.hpp>
#include <medusa/cuda/common.cuh>
#include <medusa/cuda/executor.hpp>
#include <medusa/cuda/heads.cuh>
#include <medusa/cuda/kernel_context.hpp>
#include <medusa/cuda/kv_commit.cuh>
#include <medusa/cuda/skinny_gemm_instances.cuh>
#include <medusa/cuda/step.cuh>
#include <medusa/cuda/step_instances.cuh>
#include <medusa/heads.hpp>
#include <medusa/tree.hpp>

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

MEDUSA_NAMESPACE_BEGIN
namespace cuda {

namespace detail {
template <class Body>
__global__ void __launch_bounds__(Body::max_threads) body_kernel(const Body body) {
  device_context ctx;
  body(ctx);
}
}  // namespace detail

//! Runs a device step on one stream of a CUDA device (see the file comment).
class stream_executor {
 public:
  //! Sets `device` current; creates the stream and the cuBLAS handle of the heads.
  explicit stream_executor(int device) {
    check(cudaSetDevice(device), "cudaSetDevice");
    cudaDeviceProp prop{};
    check(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
    name_ = prop.name;
    sms_ = prop.multiProcessorCount;
    check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    const cublasStatus_t s = cublasCreate(&blas_);
    if (s != CUBLAS_STATUS_SUCCESS) {
      (void)cudaStreamDestroy(stream_);
      throw cublas_error(s, "cublasCreate");
    }
    (void)cublasSetStream(blas_, stream_);  // cannot fail for a valid handle and stream
  }
  stream_executor(const stream_executor&) = delete;
  stream_executor& operator=(const stream_executor&) = delete;
  ~stream_executor() {
    if (blas_ != nullptr) (void)cublasDestroy(blas_);
    if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
  }

  [[nodiscard]] cudaStream_t stream() const noexcept { return stream_; }          //!< the one stream
  [[nodiscard]] cublasHandle_t cublas() const noexcept { return blas_; }          //!< bound to the stream
  [[nodiscard]] const std::string& device_name() const noexcept { return name_; }  //!< e.g. "NVIDIA H100 80GB HBM3"
  [[nodiscard]] int multiprocessors() const noexcept { return sms_; }             //!< SMs of the device

  // --- memory ---------------------------------------------------------------------------------
  void* alloc(std::size_t bytes) {
    void* p = nullptr;
    check(cudaMalloc(&p, bytes), ("cudaMalloc of " + std::to_string(bytes) + " bytes").c_str());
    return p;
  }
  void release(void* p) noexcept { (void)cudaFree(p); }
  void upload(void* dst, const void* src, std::size_t bytes) {
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_), "upload");
  }
  void download(void* dst, const void* src, std::size_t bytes) {
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_), "download");
  }
  void fill_zero(void* dst, std::size_t bytes) { check(cudaMemsetAsync(dst, 0, bytes, stream_), "cudaMemset"); }
  void sync() { check(cudaStreamSynchronize(stream_), "the stream"); }

  //! Launches `body(ctx)` over `shape` on the stream.
  template <class Body>
  void launch(const launch_shape& s, const Body& body) {
    detail::body_kernel<Body><<<dim3(static_cast<unsigned>(s.grid_x), static_cast<unsigned>(s.grid_y)),
                                static_cast<unsigned>(s.threads), s.shared_bytes, stream_>>>(body);
    check(cudaGetLastError(), "kernel launch");
  }

  // --- the step's kernels -----------------------------------------------------------------------
  using step_kernels = medusa::cuda::step_kernels<runtime_tree, float>;
  //! Candidates and greedy verification of `batch` requests over one tree.
  struct step_op {
    step_kernels::plan_type plan;
    std::shared_ptr<void> tree_ints, workspace;
    tree_arrays tree;
  };
  step_op make_step_op(const medusa::tree& t, int heads, int batch, int vocab) {
    step_op op;
    op.plan = step_kernels::plan(batch, heads, vocab, kernels::verify_kind::greedy, t, 0.0f, 0, 1.0f, 4 * sms_);
    const std::vector<int> packed = pack_tree(t);
    op.tree_ints = owned(packed.size() * sizeof(int));
    upload(op.tree_ints.get(), packed.data(), packed.size() * sizeof(int));
    op.workspace = owned(std::max<std::size_t>(op.plan.workspace_bytes, 1));
    op.tree = tree_arrays::over(t, static_cast<const int*>(op.tree_ints.get()));
    sync();
    return op;
  }
  void candidates(step_op& op, const float* head_logits, const std::int32_t* roots, const std::int32_t* lengths,
                  std::int32_t* node_tokens, std::int32_t* positions, std::int32_t* status) {
    check(step_kernels::candidates(op.plan, op.tree, head_logits, op.plan.vocab, roots, lengths, node_tokens, positions,
                                   status, op.workspace.get(), op.plan.workspace_bytes, stream_),
          "candidates");
  }
  void verify(step_op& op, const kernels::verify_args<float>& a) {
    check(step_kernels::verify(op.plan, op.tree, a, op.workspace.get(), op.plan.workspace_bytes, stream_), "verify");
  }

  //! Argmax of rows (top-k with k = 1).
  struct argmax_op {
    kernels::top_k_plan plan;
    std::shared_ptr<void> workspace;
  };
  argmax_op make_argmax_op(int rows, int vocab) {
    argmax_op op;
    op.plan = kernels::plan_top_k(rows, vocab, 1, 4 * sms_);
    op.workspace = owned(std::max<std::size_t>(op.plan.workspace_bytes, 1));
    return op;
  }
  void argmax(argmax_op& op, const float* logits, std::int32_t* ids, std::int32_t* status) {
    kernels::top_k_args<float> a = detail::argmax_args(op.plan.vocab, logits, ids, status);
    check(run_top_k(op.plan, a, op.workspace.get(), op.plan.workspace_bytes, stream_), "argmax");
  }

  //! The heads (`device_heads`, weights in T) over `rows` hidden states.
  template <class T>
  struct heads_op {
    std::shared_ptr<device_heads<T>> heads;
    device_heads_plan plan;
    std::shared_ptr<void> workspace;
  };
  template <class T>
  heads_op<T> make_heads_op(const medusa::head_stack<>& stack, int rows) {
    heads_op<T> op;
    op.heads = std::make_shared<device_heads<T>>(stack);
    op.plan = op.heads->plan(static_cast<std::size_t>(rows));
    op.workspace = owned(std::max<std::size_t>(op.plan.workspace_bytes, 1));
    return op;
  }
  template <class T>
  void heads(heads_op<T>& op, const T* hidden, float* logits) {
    if constexpr (!std::is_same_v<T, float>) {
      if (skinny_heads_) {
        check(op.heads->run_skinny_gemm(op.plan, hidden, logits, op.workspace.get(), op.plan.workspace_bytes, stream_),
              "heads (skinny GEMM)");
        return;
      }
    }
    check(op.heads->run(op.plan, hidden, logits, op.workspace.get(), op.plan.workspace_bytes, blas_, stream_), "heads");
  }
  //! Runs f16/bf16 heads on the library's skinny GEMM (`device_heads::run_skinny_gemm`) instead of
  //! cuBLAS (f32 heads stay on cuBLAS). Off by default.
  void set_skinny_gemm_heads(bool on) noexcept { skinny_heads_ = on; }

  void kv_commit(const kernels::kv_commit_params& params) {
    check(run(kernels::plan_kv_commit(params), params, stream_), "kv commit");
  }

  // --- graphs -----------------------------------------------------------------------------------
  //! An instantiated CUDA graph.
  struct graph {
    std::shared_ptr<CUgraphExec_st> exec;
  };
  //! The launches `f` makes on the stream, captured and instantiated.
  template <class F>
  graph capture(F&& f) {
    check(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
    try {
      f();
    } catch (...) {
      cudaGraph_t broken = nullptr;
      (void)cudaStreamEndCapture(stream_, &broken);
      if (broken != nullptr) (void)cudaGraphDestroy(broken);
      throw;
    }
    cudaGraph_t g = nullptr;
    check(cudaStreamEndCapture(stream_, &g), "cudaStreamEndCapture");
    cudaGraphExec_t exec = nullptr;
    const cudaError_t e = cudaGraphInstantiate(&exec, g, 0);
    (void)cudaGraphDestroy(g);
    check(e, "cudaGraphInstantiate");
    return {std::shared_ptr<CUgraphExec_st>(exec, [](cudaGraphExec_t x) { (void)cudaGraphExecDestroy(x); })};
  }
  void replay(const graph& g) { check(cudaGraphLaunch(g.exec.get(), stream_), "cudaGraphLaunch"); }
  //! Mean seconds of `n` back-to-back replays of `g`, by CUDA events on the stream.
  double time_replays(const graph& g, int n) {
    cudaEvent_t start = nullptr, stop = nullptr;
    check(cudaEventCreate(&start), "cudaEventCreate");
    check(cudaEventCreate(&stop), "cudaEventCreate");
    cudaError_t e = cudaEventRecord(start, stream_);
    for (int i = 0; i < n && e == cudaSuccess; ++i) e = cudaGraphLaunch(g.exec.get(), stream_);
    if (e == cudaSuccess) e = cudaEventRecord(stop, stream_);
    if (e == cudaSuccess) e = cudaEventSynchronize(stop);
    float ms = 0.0f;
    if (e == cudaSuccess) e = cudaEventElapsedTime(&ms, start, stop);
    (void)cudaEventDestroy(start);
    (void)cudaEventDestroy(stop);
    check(e, "timing replays");
    return static_cast<double>(ms) * 1e-3 / n;
  }

 protected:
  //! Device memory freed with its last owner.
  std::shared_ptr<void> owned(std::size_t bytes) {
    return std::shared_ptr<void>(alloc(bytes), [](void* p) { (void)cudaFree(p); });
  }

 private:
  cudaStream_t stream_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  bool skinny_heads_ = false;
  std::string name_;
  int sms_ = 132;
};

}  // namespace cuda
MEDUSA_NAMESPACE_END
