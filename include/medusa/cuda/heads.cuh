// SPDX-License-Identifier: Apache-2.0
//! @file cuda/heads.cuh
//! The Medusa heads on the GPU: ResBlocks and vocabulary projections as cuBLAS GEMMs on f16, bf16 or
//! f32 weights with f32 accumulation, and one fused bias + SiLU + residual epilogue per layer
//! (`cuda/kernels/head_epilogue.hpp`). Same maths and logits layout as `head_stack::forward`
//! (heads.hpp); link `medusa::cuda_blas` (cuBLAS).
//!
//! - `run(plan, params, stream)` launches the epilogue alone.
//! - `device_heads<T>` holds device copies of a `head_stack`'s weights in `T` (uploading is setup:
//!   it allocates and copies), `plan(batch)` sizes the workspace, and `run` computes the logits of
//!   a batch with no allocation and no synchronisation, so it can be captured in a CUDA graph;
//!   `run_skinny_gemm` does the same with the library's skinny GEMM (`cuda/skinny_gemm.cuh`) in
//!   place of cuBLAS (f16/bf16 heads, f32 logits).
//!
//! Per step, with M hidden states, K heads, L layers (activations [M][K][d] in the workspace):
//!
//!     layer 0:   Y = h · [W_{0,0}; …; W_{K-1,0}]ᵀ        one GEMM, N = K·d (all heads at once)
//!     layer l>0: Y_k = x_k · W_{k,l}ᵀ                     one strided-batched GEMM over the K heads
//!     each layer: x = x + SiLU(Y + b_l)                   one epilogue launch over the M·K rows
//!     logits_k = x_k · U_kᵀ                              one strided-batched GEMM over the K heads
//!              = x · lm_headᵀ                            (shared lm_head: one GEMM over M·K rows)
//!
//! Precision: weights and the residual stream are `T` (as PyTorch runs the heads in f16/bf16);
//! GEMMs accumulate in f32 and write f32, so bias, SiLU and the residual add see the unrounded
//! product and the stream is rounded once per layer. Biases are kept in f32 on the device.
//!
//! @code
//! medusa::cuda::device_heads<medusa::bfloat16> heads(cpu_heads);       // upload (setup)
//! const auto plan = heads.plan(batch);
//! void* ws = nullptr;
//! cudaMalloc(&ws, plan.workspace_bytes);                                // setup as well
//! medusa::cuda::check(heads.run(plan, d_hidden, d_logits, ws, plan.workspace_bytes, cublas, stream), "heads");
//! @endcode
#pragma once

#include <medusa/config.hpp>
#include <medusa/cuda/common.cuh>
#include <medusa/cuda/kernel_context.hpp>
#include <medusa/cuda/kernels/head_epilogue.hpp>
#include <medusa/cuda/launch.hpp>
#include <medusa/cuda/skinny_gemm.cuh>
#include <medusa/dtype.hpp>
#include <medusa/error.hpp>
#include <medusa/gemm.hpp>
#include <medusa/half.hpp>
#include <medusa/heads.hpp>

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

MEDUSA_NAMESPACE_BEGIN
namespace cuda {

namespace detail {
template <class Act, class Bias>
__global__ void __launch_bounds__(1024) head_epilogue_kernel(const kernels::head_epilogue_params<Act, Bias> p) {
  device_context ctx;
  kernels::head_epilogue(ctx, p);
}
}  // namespace detail

//! Launches the ResBlock epilogue `out = residual + SiLU(linear + bias)` planned by
//! `kernels::plan_head_epilogue<Act>(p.rows, p.hidden)`.
//! @return `cudaErrorInvalidValue`, with nothing launched, for null pointers, a params/plan
//!         mismatch, strides shorter than a row, or `out == residual` with shared residual rows;
//!         otherwise the launch status
template <class Act, class Bias>
cudaError_t run(const kernels::head_epilogue_plan& plan, const kernels::head_epilogue_params<Act, Bias>& p,
                cudaStream_t stream) noexcept {
  if (p.linear == nullptr || p.residual == nullptr || p.out == nullptr) return cudaErrorInvalidValue;
  if (p.rows != plan.rows || p.hidden != plan.hidden || p.rows < 1 || p.rows_per_residual < 1 || p.bias_rows < 1)
    return cudaErrorInvalidValue;
  if (p.ld_linear < p.hidden || p.ld_residual < p.hidden || p.ld_out < p.hidden) return cudaErrorInvalidValue;
  if (p.out == p.residual && p.rows_per_residual != 1) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(plan.shape.grid_x), static_cast<unsigned>(plan.shape.grid_y));
  detail::head_epilogue_kernel<Act, Bias><<<grid, static_cast<unsigned>(plan.shape.threads), plan.shape.shared_bytes, stream>>>(p);
  return cudaGetLastError();
}

//! The first failure of a call that uses both the CUDA runtime and cuBLAS.
struct blas_status {
  cudaError_t cuda = cudaSuccess;                 //!< runtime or launch status
  cublasStatus_t cublas = CUBLAS_STATUS_SUCCESS;  //!< cuBLAS status
  //! True when both succeeded.
  [[nodiscard]] constexpr bool ok() const noexcept { return cuda == cudaSuccess && cublas == CUBLAS_STATUS_SUCCESS; }
};

//! A cuBLAS call failed; carries the status.
class cublas_error : public std::runtime_error, public medusa::error {
 public:
  cublas_error(cublasStatus_t status, const std::string& what)
      : std::runtime_error("medusa: " + what + ": " + cublasGetStatusName(status) + " (" + cublasGetStatusString(status) + ")"),
        status_(status) {}
  [[nodiscard]] const char* message() const noexcept override { return what(); }
  [[nodiscard]] cublasStatus_t status() const noexcept { return status_; }  //!< the status

 private:
  cublasStatus_t status_;
};

//! Throws `cuda_error` or `cublas_error` naming `what` unless `status.ok()`.
inline void check(blas_status status, const char* what) {
  check(status.cuda, what);
  if (status.cublas != CUBLAS_STATUS_SUCCESS) throw cublas_error(status.cublas, what);
}

//! What `device_heads::run` needs for one batch size; made by `device_heads::plan`.
struct device_heads_plan {
  std::size_t batch = 0;                 //!< hidden states per run (M)
  std::size_t workspace_bytes = 0;       //!< caller-provided scratch (0 when the heads have no layers)
  kernels::head_epilogue_plan epilogue;  //!< the epilogue over M·K rows of d (unused when L = 0)
  std::size_t hidden = 0, vocab = 0, heads = 0, layers = 0;  //!< the heads it was made for
};

namespace detail {

struct cuda_free {
  void operator()(void* p) const noexcept { (void)cudaFree(p); }
};
using device_memory = std::unique_ptr<void, cuda_free>;

inline device_memory device_alloc(std::size_t bytes, const char* what) {
  void* p = nullptr;
  check(cudaMalloc(&p, std::max<std::size_t>(bytes, 1)), what);
  return device_memory(p);
}

template <class T>
inline constexpr cudaDataType_t cuda_data_type =
    std::is_same_v<T, float> ? CUDA_R_32F : std::is_same_v<T, half> ? CUDA_R_16F : CUDA_R_16BF;

// Copies n elements of `src` (any weight dtype) to device memory of type T: a plain copy when the
// types match, else converted (round to nearest even) through a bounded host staging buffer.
template <class T>
void upload_as(T* dst, weight_ptr src, std::size_t n, const char* what) {
  if (src.dtype == dtype_of<T>) {
    check(cudaMemcpy(dst, src.data, n * sizeof(T), cudaMemcpyHostToDevice), what);
    return;
  }
  constexpr std::size_t staging_elements = std::size_t{1} << 22;
  std::vector<T> staging(std::min(n, staging_elements));
  for (std::size_t first = 0; first < n; first += staging.size()) {
    const std::size_t count = std::min(staging.size(), n - first);
    for (std::size_t i = 0; i < count; ++i) staging[i] = from_float<T>(src.load(first + i));
    check(cudaMemcpy(dst + first, staging.data(), count * sizeof(T), cudaMemcpyHostToDevice), what);
  }
}

// Y[rows][n_out] (+ batch·stride_y) = X[rows][k] · W[n_out][k]ᵀ for `batch` problems, row-major,
// f32 accumulation: the column-major Yᵀ = W · Xᵀ of cuBLAS.
struct linear_gemm {
  int n_out, rows, k;
  const void* w;
  cudaDataType_t w_type;
  long long stride_w;
  const void* x;
  cudaDataType_t x_type;
  int ld_x;
  long long stride_x;
  void* y;
  cudaDataType_t y_type;
  int ld_y;
  long long stride_y;
  int batch;
};

inline cublasStatus_t run_linear(cublasHandle_t handle, const linear_gemm& g) noexcept {
  const float one = 1.0f, zero = 0.0f;
  if (g.batch == 1)
    return cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, g.n_out, g.rows, g.k, &one, g.w, g.w_type, g.k, g.x, g.x_type,
                        g.ld_x, &zero, g.y, g.y_type, g.ld_y, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  return cublasGemmStridedBatchedEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, g.n_out, g.rows, g.k, &one, g.w, g.w_type, g.k,
                                    g.stride_w, g.x, g.x_type, g.ld_x, g.stride_x, &zero, g.y, g.y_type, g.ld_y, g.stride_y,
                                    g.batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

// One `linear_gemm` with f32 output on the library's skinny GEMM (T = the weights' type).
template <class T>
cudaError_t run_linear_skinny(const linear_gemm& g, cudaStream_t stream) noexcept {
  kernels::skinny_gemm_problem p;
  p.n = g.n_out;
  p.k = g.k;
  p.rows = g.rows;
  p.batch = g.batch;
  kernels::skinny_gemm_plan plan;
  try {
    plan = kernels::plan_skinny_gemm(p);
  } catch (const launch_error&) {
    return cudaErrorInvalidValue;
  }
  kernels::skinny_gemm_params<T> a{static_cast<const T*>(g.w), static_cast<const T*>(g.x), static_cast<float*>(g.y)};
  a.ldx = g.ld_x;
  a.ldy = g.ld_y;
  a.stride_w = g.stride_w;
  a.stride_x = g.stride_x;
  a.stride_y = g.stride_y;
  return cuda::run(plan, a, stream);
}

// Host pointer mode (for the scalars 1 and 0) for the duration of a run; the caller's mode after.
class host_pointer_mode {
 public:
  explicit host_pointer_mode(cublasHandle_t handle) noexcept : handle_(handle) {
    status_ = cublasGetPointerMode(handle_, &saved_);
    if (status_ == CUBLAS_STATUS_SUCCESS && saved_ != CUBLAS_POINTER_MODE_HOST)
      status_ = cublasSetPointerMode(handle_, CUBLAS_POINTER_MODE_HOST);
  }
  host_pointer_mode(const host_pointer_mode&) = delete;
  host_pointer_mode& operator=(const host_pointer_mode&) = delete;
  ~host_pointer_mode() {
    if (status_ == CUBLAS_STATUS_SUCCESS && saved_ != CUBLAS_POINTER_MODE_HOST) (void)cublasSetPointerMode(handle_, saved_);
  }
  [[nodiscard]] cublasStatus_t status() const noexcept { return status_; }

 private:
  cublasHandle_t handle_;
  cublasPointerMode_t saved_ = CUBLAS_POINTER_MODE_HOST;
  cublasStatus_t status_;
};

}  // namespace detail

//! Device copies of a `head_stack`'s weights in `T` (f16, bf16, or f32 for engines that run in
//! f32: plain f32 GEMMs, no TF32) and the heads' forward on the GPU.
//!
//! Layout on the device: ResBlock matrices [L][K][d][d] (layer l of all heads is one [K·d, d]
//! matrix), biases [L][K][d] in f32, projections [K][V][d] (or the one lm_head [V][d]). Move-only;
//! the memory is freed with the object.
template <class T>
  requires(std::is_same_v<T, half> || std::is_same_v<T, bfloat16> || std::is_same_v<T, float>)
class device_heads {
 public:
  //! Uploads the weights of `heads` (any static/dynamic counts), converting them to `T` where their
  //! dtype differs (f32 or the other 16-bit type: rounded to nearest even). Synchronous setup.
  //! @throws invalid_input if a weight is unset or a size exceeds cuBLAS's int range;
  //!         cuda_error if allocation or copy fails
  template <std::size_t Heads, std::size_t Layers>
  explicit device_heads(const head_stack<Heads, Layers>& heads)
      : d_(heads.hidden_size()), v_(heads.vocab_size()), k_(heads.num_heads()), l_(heads.num_layers()), kind_(heads.kind()) {
    heads.validate();
    constexpr std::size_t int_max = static_cast<std::size_t>(std::numeric_limits<int>::max());
    if (k_ * d_ > int_max || k_ * v_ > int_max)
      throw invalid_input("device_heads: K·d = " + std::to_string(k_ * d_) + " and K·V = " + std::to_string(k_ * v_) +
                          " must fit cuBLAS's int dimensions");
    const std::size_t projections = kind_ == projection_kind::per_head ? k_ : 1;
    weights_ = detail::device_alloc(l_ * k_ * d_ * d_ * sizeof(T), "device_heads: cudaMalloc (ResBlock weights)");
    biases_ = detail::device_alloc(l_ * k_ * d_ * sizeof(float), "device_heads: cudaMalloc (ResBlock biases)");
    projections_ = detail::device_alloc(projections * v_ * d_ * sizeof(T), "device_heads: cudaMalloc (projections)");
    for (std::size_t l = 0; l < l_; ++l)
      for (std::size_t k = 0; k < k_; ++k) {
        const resblock_weights block = heads.resblock(k, l);
        detail::upload_as(weight(l) + k * d_ * d_, block.weight, d_ * d_, "device_heads: upload ResBlock weight");
        detail::upload_as(bias(l) + k * d_, block.bias, d_, "device_heads: upload ResBlock bias");
      }
    for (std::size_t k = 0; k < projections; ++k)
      detail::upload_as(projection() + k * v_ * d_, heads.projection(k), v_ * d_, "device_heads: upload projection");
  }

  [[nodiscard]] std::size_t hidden_size() const noexcept { return d_; }  //!< d
  [[nodiscard]] std::size_t vocab_size() const noexcept { return v_; }   //!< V
  [[nodiscard]] std::size_t num_heads() const noexcept { return k_; }    //!< K
  [[nodiscard]] std::size_t num_layers() const noexcept { return l_; }   //!< L
  [[nodiscard]] projection_kind kind() const noexcept { return kind_; }  //!< per-head or shared projection

  //! The workspace and launch shapes of a run over `batch` hidden states.
  //! @throws launch_error (`invalid_shape`) for `batch` 0 or `batch·K` (rows of the GEMMs) beyond
  //!         cuBLAS's int range
  [[nodiscard]] device_heads_plan plan(std::size_t batch) const {
    constexpr std::size_t int_max = static_cast<std::size_t>(std::numeric_limits<int>::max());
    if (batch == 0 || batch > int_max / k_)
      throw launch_error(launch_errc::invalid_shape, "device_heads: batch must be in [1, " + std::to_string(int_max / k_) +
                                                         "] for " + std::to_string(k_) + " heads, got " + std::to_string(batch));
    device_heads_plan p;
    p.batch = batch;
    p.hidden = d_, p.vocab = v_, p.heads = k_, p.layers = l_;
    if (l_ > 0) {
      const std::size_t elements = batch * k_ * d_;
      p.workspace_bytes = workspace_carver::round_up(elements * sizeof(T)) + workspace_carver::round_up(elements * sizeof(float));
      p.epilogue = kernels::plan_head_epilogue<T>(batch * k_, d_);
    }
    return p;
  }

  //! Logits of `plan.batch` hidden states, laid out as `head_stack::forward`'s.
  //! @param hidden    [M][d] device hidden states in `T` (the base model's final-normed output)
  //! @param logits    [M][K][V] device output, f32 or `T` (row `m·K + k` is head k of state m)
  //! @param workspace `plan.workspace_bytes` of device memory (may be null when that is 0)
  //! @param handle    the caller's cuBLAS handle: bound to `stream` unless it already is (note
  //!                  that `cublasSetStream` resets a workspace set by `cublasSetWorkspace`, so bind
  //!                  the stream first); its pointer mode is set to host for the call and restored
  //! @return the first failure; `cudaErrorInvalidValue` with nothing launched for null pointers, a
  //!         plan made for other heads, or a short workspace. No allocation, no synchronisation.
  template <class Logit>
    requires(std::is_same_v<Logit, float> || std::is_same_v<Logit, T>)
  blas_status run(const device_heads_plan& plan, const T* hidden, Logit* logits, void* workspace, std::size_t workspace_bytes,
                  cublasHandle_t handle, cudaStream_t stream) const noexcept {
    if (handle == nullptr) return {cudaErrorInvalidValue};
    cudaStream_t bound = nullptr;
    if (const cublasStatus_t s = cublasGetStream(handle, &bound); s != CUBLAS_STATUS_SUCCESS) return {cudaSuccess, s};
    if (bound != stream)
      if (const cublasStatus_t s = cublasSetStream(handle, stream); s != CUBLAS_STATUS_SUCCESS) return {cudaSuccess, s};
    const detail::host_pointer_mode mode(handle);
    if (mode.status() != CUBLAS_STATUS_SUCCESS) return {cudaSuccess, mode.status()};
    return forward(plan, hidden, logits, workspace, workspace_bytes, stream, [&](const detail::linear_gemm& g) -> blas_status {
      return {cudaSuccess, detail::run_linear(handle, g)};
    });
  }

  //! The same logits with every GEMM on the library's skinny GEMM (`cuda/skinny_gemm.cuh`) instead
  //! of cuBLAS: no handle, and a hidden state's logits do not depend on how many share the run.
  //! f16/bf16 heads and f32 logits only. Returns as `run`.
  template <class Logit>
    requires(!std::is_same_v<T, float> && std::is_same_v<Logit, float>)
  blas_status run_skinny_gemm(const device_heads_plan& plan, const T* hidden, Logit* logits, void* workspace,
                              std::size_t workspace_bytes, cudaStream_t stream) const noexcept {
    return forward(plan, hidden, logits, workspace, workspace_bytes, stream, [&](const detail::linear_gemm& g) -> blas_status {
      return {detail::run_linear_skinny<T>(g, stream)};
    });
  }

 private:
  // The ResBlocks and projections, each GEMM through `gemm(linear_gemm) -> blas_status`.
  template <class Logit, class Gemm>
  blas_status forward(const device_heads_plan& plan, const T* hidden, Logit* logits, void* workspace,
                      std::size_t workspace_bytes, cudaStream_t stream, Gemm&& gemm) const noexcept {
    if (hidden == nullptr || logits == nullptr || plan.batch == 0) return {cudaErrorInvalidValue};
    if (plan.hidden != d_ || plan.vocab != v_ || plan.heads != k_ || plan.layers != l_) return {cudaErrorInvalidValue};
    const std::size_t rows = plan.batch * k_;
    workspace_carver carve(workspace, workspace_bytes);
    T* x = nullptr;
    float* y = nullptr;
    if (l_ > 0) {
      x = carve.template take<T>(rows * d_);
      y = carve.template take<float>(rows * d_);
      if (!carve.ok() || plan.workspace_bytes > workspace_bytes) return {cudaErrorInvalidValue};
    }
    constexpr cudaDataType_t t_type = detail::cuda_data_type<T>;
    const int M = static_cast<int>(plan.batch), K = static_cast<int>(k_), d = static_cast<int>(d_), V = static_cast<int>(v_);
    const long long dd = static_cast<long long>(d_) * static_cast<long long>(d_);
    for (std::size_t l = 0; l < l_; ++l) {
      detail::linear_gemm g{};
      if (l == 0)  // all heads read h: one [K·d, d] GEMM
        g = detail::linear_gemm{K * d, M, d, weight(0), t_type, 0, hidden, t_type, d, 0, y, CUDA_R_32F, K * d, 0, 1};
      else  // head k reads its own x_k: K GEMMs batched
        g = detail::linear_gemm{d, M, d, weight(l), t_type, dd, x, t_type, K * d, d, y, CUDA_R_32F, K * d, d, K};
      if (const blas_status s = gemm(g); !s.ok()) return s;
      kernels::head_epilogue_params<T, float> e;
      e.linear = y;
      e.bias = bias(l);
      e.residual = l == 0 ? hidden : x;
      e.out = x;
      e.rows = static_cast<int>(rows);
      e.hidden = d;
      e.ld_linear = e.ld_residual = e.ld_out = d;
      e.rows_per_residual = l == 0 ? K : 1;
      e.bias_rows = K;
      if (const cudaError_t s = cuda::run(plan.epilogue, e, stream); s != cudaSuccess) return {s};
    }
    // Projections. Input rows: x [M][K][d] after the ResBlocks, else h [M][d] for every head.
    const void* in = l_ > 0 ? static_cast<const void*>(x) : static_cast<const void*>(hidden);
    constexpr cudaDataType_t logit_type = detail::cuda_data_type<Logit>;
    const long long vd = static_cast<long long>(v_) * static_cast<long long>(d_);
    detail::linear_gemm g{};
    if (kind_ == projection_kind::shared_lm_head && l_ > 0)  // one lm_head over all M·K rows
      g = detail::linear_gemm{V, M * K, d, projection(), t_type, 0, in, t_type, d, 0, logits, logit_type, V, 0, 1};
    else if (kind_ == projection_kind::shared_lm_head)  // every head is lm_head(h)
      g = detail::linear_gemm{V, M, d, projection(), t_type, 0, in, t_type, d, 0, logits, logit_type, K * V, V, K};
    else if (l_ > 0)
      g = detail::linear_gemm{V, M, d, projection(), t_type, vd, in, t_type, K * d, d, logits, logit_type, K * V, V, K};
    else
      g = detail::linear_gemm{V, M, d, projection(), t_type, vd, in, t_type, d, 0, logits, logit_type, K * V, V, K};
    return gemm(g);
  }

  T* weight(std::size_t l) const noexcept { return static_cast<T*>(weights_.get()) + l * k_ * d_ * d_; }
  float* bias(std::size_t l) const noexcept { return static_cast<float*>(biases_.get()) + l * k_ * d_; }
  T* projection() const noexcept { return static_cast<T*>(projections_.get()); }

  std::size_t d_, v_, k_, l_;
  projection_kind kind_;
  detail::device_memory weights_, biases_, projections_;
};

}  // namespace cuda
MEDUSA_NAMESPACE_END
