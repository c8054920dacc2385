// SPDX-License-Identifier: Apache-2.0
// The device heads (cuda/heads.cuh) against the CPU heads (head_stack::forward, portable GEMM):
// per-head and shared projections, L = 0..2, f16 and bf16, aligned and odd hidden sizes, f32 and
// 16-bit logits, the epilogue kernel alone, argument errors, and a run captured in a CUDA graph.
// Exits 77 (ctest: skipped) on machines without a CUDA device.
//
// Error bound. The random heads' weights are exact in T and the hidden states are rounded to T
// before both sides see them, so the only differences are (a) the device rounds the residual
// stream to T once per ResBlock (relative error <= u, the unit roundoff: 2^-8 for bf16, 2^-11 for
// f16), (b) a 16-bit logit store (<= u), and (c) f32 accumulation order (~1e-6). A logit is a dot
// product of ~d terms of random sign, so (a) gives a norm-wise relative error
// max|gpu - cpu| / max|cpu| of about u/2 per layer (measured on an H100: 0.47·u for L = 1, 0.7·u
// for L = 2). The tests allow 2·u·(L + 1) for L > 0 and 1e-5 for L = 0 (no rounding at all), plus
// u for 16-bit logits; weights converted on upload add their own rounding (one more u·2).
#include "gpu_test.hpp"
#include <medusa/cuda/common.cuh>
#include <medusa/cuda/heads.cuh>
#include <medusa/cuda/skinny_gemm_instances.cuh>

#include "../unit/test_heads_common.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

namespace mc = medusa::cuda;
using medusa::projection_kind;

namespace {

using medusa_test::device_array;

struct cublas_handle {
  cublasHandle_t handle = nullptr;
  cublas_handle() { mc::check(mc::blas_status{cudaSuccess, cublasCreate(&handle)}, "cublasCreate"); }
  cublas_handle(const cublas_handle&) = delete;
  cublas_handle& operator=(const cublas_handle&) = delete;
  ~cublas_handle() { (void)cublasDestroy(handle); }
};

// A non-blocking stream, destroyed on scope exit (declare it before the handles bound to it).
struct stream_owner {
  cudaStream_t stream = nullptr;
  stream_owner() { mc::check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate"); }
  stream_owner(const stream_owner&) = delete;
  stream_owner& operator=(const stream_owner&) = delete;
  ~stream_owner() { (void)cudaStreamDestroy(stream); }
};

template <class T>
constexpr double unit_roundoff = std::is_same_v<T, medusa::bfloat16> ? 1.0 / 256 : 1.0 / 2048;

template <class T>
std::string name_of() {
  return std::is_same_v<T, float> ? "f32" : std::is_same_v<T, medusa::half> ? "f16" : "bf16";
}

// Hidden states drawn N(0, 1) and rounded to T: what both the CPU and the device heads read.
template <class T>
std::vector<T> random_hidden(std::size_t n, std::uint64_t seed) {
  const auto f = heads_test::random_hidden(n, seed);
  std::vector<T> h(n);
  for (std::size_t i = 0; i < n; ++i) h[i] = T(f[i]);
  return h;
}

template <class T>
std::vector<float> to_float(const std::vector<T>& v) {
  std::vector<float> f(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) f[i] = static_cast<float>(v[i]);
  return f;
}

// max|got - ref| / max|ref| over all logits, and top-1 agreement on the rows whose top-1 leads the
// runner-up by more than twice the largest logit difference seen (there, a differing top-1 would
// be a bug, not rounding).
struct comparison {
  double rel_error = 0;
  int rows_checked = 0;
  int top1_mismatches = 0;
};

comparison compare(const std::vector<float>& got, const std::vector<float>& ref, std::size_t vocab) {
  comparison c;
  double num = 0, den = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    num = std::max(num, std::abs(static_cast<double>(got[i]) - ref[i]));
    den = std::max(den, std::abs(static_cast<double>(ref[i])));
  }
  c.rel_error = den == 0 ? num : num / den;
  for (std::size_t r = 0; r < ref.size() / vocab; ++r) {
    const float* row = ref.data() + r * vocab;
    const std::size_t best = static_cast<std::size_t>(std::max_element(row, row + vocab) - row);
    float second = -INFINITY;
    for (std::size_t v = 0; v < vocab; ++v)
      if (v != best) second = std::max(second, row[v]);
    if (row[best] - second <= 2 * num) continue;
    ++c.rows_checked;
    const float* g = got.data() + r * vocab;
    c.top1_mismatches += static_cast<std::size_t>(std::max_element(g, g + vocab) - g) != best;
  }
  return c;
}

// The CPU heads' logits [M][K][V] for hidden states given in T.
template <class T>
std::vector<float> cpu_logits(const medusa::head_stack<>& heads, const std::vector<T>& hidden, std::size_t batch) {
  medusa::portable_gemm<> gemm;
  std::vector<float> logits(batch * heads.num_heads() * heads.vocab_size());
  heads.forward(gemm, to_float(hidden), batch, logits);
  return logits;
}

// One shape: random heads exact in `source` dtype, uploaded as T, logits as Logit; checks the
// device logits against the CPU's within `tol`. `Skinny`: through `run_skinny_gemm`.
template <class T, class Logit, bool Skinny = false>
void check_against_cpu(cublasHandle_t blas, std::size_t d, std::size_t V, std::size_t K, std::size_t L, projection_kind kind, std::size_t M,
                       medusa::weight_dtype source, double tol, std::uint64_t seed) {
  CAPTURE(name_of<T>());
  CAPTURE(name_of<Logit>());
  CAPTURE(d);
  CAPTURE(V);
  CAPTURE(K);
  CAPTURE(L);
  CAPTURE(medusa::to_string(kind));
  CAPTURE(M);
  CAPTURE(medusa::to_string(source));
  CAPTURE(Skinny);
  heads_test::random_heads rh(d, V, K, L, kind, source, seed);
  const auto cpu = rh.make<medusa::head_stack<>>();
  const auto hidden = random_hidden<T>(M * d, seed + 1);
  const auto ref = cpu_logits(cpu, hidden, M);

  const mc::device_heads<T> dev(cpu);
  const auto plan = dev.plan(M);
  device_array<T> d_hidden(M * d);
  device_array<Logit> d_logits(M * K * V);
  device_array<unsigned char> ws(plan.workspace_bytes);
  d_hidden.upload(hidden);
  mc::check(cudaMemset(d_logits.get(), 0xff, M * K * V * sizeof(Logit)), "cudaMemset");  // NaN until written
  if constexpr (Skinny)
    mc::check(dev.run_skinny_gemm(plan, d_hidden.get(), d_logits.get(), ws.get(), plan.workspace_bytes, nullptr),
              "device_heads::run_skinny_gemm");
  else
    mc::check(dev.run(plan, d_hidden.get(), d_logits.get(), ws.get(), plan.workspace_bytes, blas, nullptr), "device_heads::run");
  mc::check(cudaDeviceSynchronize(), "sync");
  const auto got = to_float(d_logits.download());
  const auto c = compare(got, ref, V);
  CAPTURE(c.rel_error);
  CAPTURE(tol);
  CHECK(std::all_of(got.begin(), got.end(), [](float x) { return std::isfinite(x); }));
  CHECK(c.rel_error <= tol);
  CHECK(c.rows_checked >= static_cast<int>(M * K) / 2);
  CHECK(c.top1_mismatches == 0);
  MESSAGE(name_of<T>() << " d=" << d << " V=" << V << " K=" << K << " L=" << L << " " << medusa::to_string(kind) << " M=" << M
                       << " logits " << name_of<Logit>() << ": rel error " << c.rel_error << " (bound " << tol << "), top-1 on "
                       << c.rows_checked << "/" << M * K << " rows");
}

// The allowed norm-wise relative error for L ResBlocks in T (see the file comment).
template <class T>
double bound(std::size_t L) {
  return L == 0 ? 1e-5 : 2 * unit_roundoff<T> * static_cast<double>(L + 1);
}

template <class T>
void check_shapes(cublasHandle_t blas) {
  const double u = unit_roundoff<T>;
  std::uint64_t seed = 100;
  for (std::size_t d : {256, 100})  // vector epilogue path; element path (100 is not a multiple of 8)
    for (std::size_t L : {0, 1, 2})
      for (auto kind : {projection_kind::per_head, projection_kind::shared_lm_head})
        for (std::size_t M : {1, 3, 8}) {
          const std::size_t K = M == 3 ? 5 : 4;
          check_against_cpu<T, float>(blas, d, 1000, K, L, kind, M, medusa::dtype_of<T>, bound<T>(L), seed);
          check_against_cpu<T, float, true>(blas, d, 1000, K, L, kind, M, medusa::dtype_of<T>, bound<T>(L), seed++);
        }
  // 16-bit logits: one more rounding.
  check_against_cpu<T, T>(blas, 256, 1000, 4, 1, projection_kind::per_head, 3, medusa::dtype_of<T>, bound<T>(1) + u, seed++);
  check_against_cpu<T, T>(blas, 100, 999, 3, 2, projection_kind::shared_lm_head, 2, medusa::dtype_of<T>, bound<T>(2) + u, seed++);
}

}  // namespace

TEST_CASE("device heads match the CPU heads (bf16)") {
  cublas_handle blas;
  check_shapes<medusa::bfloat16>(blas.handle);
}

TEST_CASE("device heads match the CPU heads (f16)") {
  cublas_handle blas;
  check_shapes<medusa::half>(blas.handle);
}

TEST_CASE("device heads on the skinny GEMM: a hidden state's logits have the same bits in runs of 1 to 9 states") {
  for (auto kind : {projection_kind::per_head, projection_kind::shared_lm_head})
    for (std::size_t L : {0, 1, 2}) {
      CAPTURE(medusa::to_string(kind));
      CAPTURE(L);
      const std::size_t d = 256, V = 1000, K = 4, most = 9;
      heads_test::random_heads rh(d, V, K, L, kind, medusa::weight_dtype::bf16, 300 + L);
      const mc::device_heads<medusa::bfloat16> dev(rh.make<medusa::head_stack<>>());
      device_array<medusa::bfloat16> hidden(most * d);
      hidden.upload(random_hidden<medusa::bfloat16>(most * d, 400 + L));
      std::vector<float> all;
      for (std::size_t M = most; M >= 1; --M) {
        CAPTURE(M);
        const auto plan = dev.plan(M);
        device_array<float> logits(M * K * V);
        device_array<unsigned char> ws(plan.workspace_bytes);
        mc::check(dev.run_skinny_gemm(plan, hidden.get(), logits.get(), ws.get(), plan.workspace_bytes, nullptr),
                  "run_skinny_gemm");
        mc::check(cudaDeviceSynchronize(), "sync");
        const std::vector<float> got = logits.download();
        if (M == most) all = got;
        else CHECK(std::memcmp(got.data(), all.data(), got.size() * sizeof(float)) == 0);
      }
    }
}

TEST_CASE("device heads convert f32 and other 16-bit checkpoints on upload") {
  // The weights are rounded to T on upload: the bound grows by the rounding of every weight.
  cublas_handle blas;
  check_against_cpu<medusa::bfloat16, float>(blas.handle, 128, 500, 3, 1, projection_kind::per_head, 4, medusa::weight_dtype::f32,
                                             bound<medusa::bfloat16>(1) + 2 * unit_roundoff<medusa::bfloat16>, 7);
  check_against_cpu<medusa::half, float>(blas.handle, 128, 500, 3, 1, projection_kind::per_head, 4, medusa::weight_dtype::bf16,
                                         bound<medusa::half>(1) + 2 * unit_roundoff<medusa::half>, 8);
}

TEST_CASE("head epilogue kernel on the device matches the host formula") {
  // Odd and aligned sizes, offset (element path) and aligned (vector path) pointers, K = 3 heads
  // broadcasting 2 residual rows. The device's expf may differ from the host's by an ulp, so the
  // check allows one ulp of the result type.
  for (int hidden : {64, 67, 4096})
    for (int offset : {0, 1}) {
      CAPTURE(hidden);
      CAPTURE(offset);
      const int rows = 6, per = 3, heads = 3;
      const std::size_t n = static_cast<std::size_t>(rows * hidden + offset);
      auto y = heads_test::random_hidden(n, 1), b = heads_test::random_hidden(static_cast<std::size_t>(heads * hidden + offset), 2);
      const auto xf = heads_test::random_hidden(static_cast<std::size_t>(rows / per * hidden + offset), 3);
      std::vector<medusa::bfloat16> x(xf.size());
      for (std::size_t i = 0; i < x.size(); ++i) x[i] = medusa::bfloat16(xf[i]);
      device_array<float> dy(n), db(b.size());
      device_array<medusa::bfloat16> dx(x.size()), dout(n);
      dy.upload(y);
      db.upload(b);
      dx.upload(x);
      mc::kernels::head_epilogue_params<medusa::bfloat16, float> p;
      p.linear = dy.get() + offset;
      p.bias = db.get() + offset;
      p.residual = dx.get() + offset;
      p.out = dout.get() + offset;
      p.rows = rows;
      p.hidden = hidden;
      p.ld_linear = p.ld_residual = p.ld_out = hidden;
      p.rows_per_residual = per;
      p.bias_rows = heads;
      const auto plan = mc::kernels::plan_head_epilogue<medusa::bfloat16>(rows, static_cast<std::size_t>(hidden));
      mc::check(mc::run(plan, p, nullptr), "head epilogue");
      mc::check(cudaDeviceSynchronize(), "sync");
      const auto out = dout.download();
      int wrong = 0;
      for (int r = 0; r < rows; ++r)
        for (int i = 0; i < hidden; ++i) {
          const std::size_t o = static_cast<std::size_t>(offset + r * hidden + i);
          const float expect = static_cast<float>(x[static_cast<std::size_t>(offset + r / per * hidden + i)]) +
                               medusa::silu(y[o] + b[static_cast<std::size_t>(offset + r % heads * hidden + i)]);
          const float got = static_cast<float>(out[o]);
          wrong += std::abs(got - expect) > std::abs(expect) / 128 + 1e-30f;  // one bf16 ulp
        }
      CHECK(wrong == 0);
    }
}

TEST_CASE("device heads refuse bad arguments without launching") {
  heads_test::random_heads rh(64, 100, 2, 1, projection_kind::per_head, medusa::weight_dtype::bf16, 3);
  const auto cpu = rh.make<medusa::head_stack<>>();
  const mc::device_heads<medusa::bfloat16> dev(cpu);
  CHECK(dev.hidden_size() == 64);
  CHECK(dev.vocab_size() == 100);
  CHECK(dev.num_heads() == 2);
  CHECK(dev.num_layers() == 1);
  CHECK_THROWS_AS((void)dev.plan(0), mc::launch_error);
  const auto plan = dev.plan(2);
  CHECK(plan.workspace_bytes >= 2 * 2 * 64 * (2 + 4));
  device_array<medusa::bfloat16> hidden(2 * 64);
  device_array<float> logits(2 * 2 * 100);
  device_array<unsigned char> ws(plan.workspace_bytes);
  cublas_handle blas;
  const auto invalid = [](mc::blas_status s) { return s.cuda == cudaErrorInvalidValue && s.cublas == CUBLAS_STATUS_SUCCESS; };
  CHECK(invalid(dev.run(plan, nullptr, logits.get(), ws.get(), plan.workspace_bytes, blas.handle, nullptr)));
  CHECK(invalid(dev.run(plan, hidden.get(), static_cast<float*>(nullptr), ws.get(), plan.workspace_bytes, blas.handle, nullptr)));
  CHECK(invalid(dev.run(plan, hidden.get(), logits.get(), nullptr, plan.workspace_bytes, blas.handle, nullptr)));
  CHECK(invalid(dev.run(plan, hidden.get(), logits.get(), ws.get(), plan.workspace_bytes - 1, blas.handle, nullptr)));
  CHECK(invalid(dev.run_skinny_gemm(plan, nullptr, logits.get(), ws.get(), plan.workspace_bytes, nullptr)));
  CHECK(invalid(dev.run_skinny_gemm(plan, hidden.get(), logits.get(), ws.get(), plan.workspace_bytes - 1, nullptr)));
  CHECK(invalid(dev.run(plan, hidden.get(), logits.get(), ws.get(), plan.workspace_bytes, nullptr, nullptr)));
  heads_test::random_heads other(64, 100, 3, 1, projection_kind::per_head, medusa::weight_dtype::bf16, 4);
  const mc::device_heads<medusa::bfloat16> three(other.make<medusa::head_stack<>>());
  CHECK(invalid(dev.run(three.plan(2), hidden.get(), logits.get(), ws.get(), plan.workspace_bytes, blas.handle, nullptr)));
  mc::kernels::head_epilogue_params<medusa::bfloat16, float> p;  // all null
  p.rows = 1;
  p.hidden = 8;
  CHECK(mc::run(mc::kernels::plan_head_epilogue<medusa::bfloat16>(1, 8), p, nullptr) == cudaErrorInvalidValue);
  CHECK(cudaGetLastError() == cudaSuccess);  // nothing was launched
  // Heads with a weight left unset are refused at upload.
  medusa::head_stack<> unset(64, 100, 2, 1, projection_kind::per_head);
  CHECK_THROWS_AS((void)mc::device_heads<medusa::bfloat16>(unset), medusa::invalid_input);
}

TEST_CASE("device heads restore the handle's pointer mode and use the caller's stream") {
  heads_test::random_heads rh(96, 300, 3, 2, projection_kind::per_head, medusa::weight_dtype::f16, 5);
  const auto cpu = rh.make<medusa::head_stack<>>();
  const auto hidden = random_hidden<medusa::half>(2 * 96, 6);
  const auto ref = cpu_logits(cpu, hidden, 2);
  const mc::device_heads<medusa::half> dev(cpu);
  const auto plan = dev.plan(2);
  device_array<medusa::half> d_hidden(hidden.size());
  device_array<float> d_logits(ref.size());
  device_array<unsigned char> ws(plan.workspace_bytes);
  d_hidden.upload(hidden);
  const stream_owner owner;
  const cudaStream_t stream = owner.stream;
  cublas_handle blas;
  REQUIRE(cublasSetPointerMode(blas.handle, CUBLAS_POINTER_MODE_DEVICE) == CUBLAS_STATUS_SUCCESS);
  mc::check(dev.run(plan, d_hidden.get(), d_logits.get(), ws.get(), plan.workspace_bytes, blas.handle, stream), "run");
  mc::check(cudaStreamSynchronize(stream), "sync");
  cublasPointerMode_t mode{};
  REQUIRE(cublasGetPointerMode(blas.handle, &mode) == CUBLAS_STATUS_SUCCESS);
  CHECK(mode == CUBLAS_POINTER_MODE_DEVICE);
  cudaStream_t bound_stream = nullptr;
  REQUIRE(cublasGetStream(blas.handle, &bound_stream) == CUBLAS_STATUS_SUCCESS);
  CHECK(bound_stream == stream);
  const double tol = bound<medusa::half>(2);
  CHECK(compare(d_logits.download(), ref, 300).rel_error <= tol);
}

TEST_CASE("device heads run captured in a CUDA graph and replayed") {
  const std::size_t d = 256, V = 2000, K = 4, L = 1, M = 4;
  heads_test::random_heads rh(d, V, K, L, projection_kind::per_head, medusa::weight_dtype::bf16, 21);
  const auto cpu = rh.make<medusa::head_stack<>>();
  const mc::device_heads<medusa::bfloat16> dev(cpu);
  const auto plan = dev.plan(M);
  device_array<medusa::bfloat16> d_hidden(M * d);
  device_array<float> d_logits(M * K * V), d_eager(M * K * V);
  device_array<unsigned char> ws(plan.workspace_bytes), blas_ws(32u << 20);
  const stream_owner owner;
  const cudaStream_t stream = owner.stream;
  cublas_handle blas;
  // Stream first, then the workspace: cublasSetStream resets a workspace set before it.
  REQUIRE(cublasSetStream(blas.handle, stream) == CUBLAS_STATUS_SUCCESS);
  REQUIRE(cublasSetWorkspace(blas.handle, blas_ws.get(), blas_ws.size()) == CUBLAS_STATUS_SUCCESS);

  const auto first = random_hidden<medusa::bfloat16>(M * d, 22);
  d_hidden.upload(first);
  mc::check(dev.run(plan, d_hidden.get(), d_eager.get(), ws.get(), plan.workspace_bytes, blas.handle, stream), "eager run");

  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  mc::check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "begin capture");
  const auto captured = dev.run(plan, d_hidden.get(), d_logits.get(), ws.get(), plan.workspace_bytes, blas.handle, stream);
  mc::check(cudaStreamEndCapture(stream, &graph), "end capture");
  mc::check(captured, "captured run");
  mc::check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  std::size_t nodes = 0;
  mc::check(cudaGraphGetNodes(graph, nullptr, &nodes), "graph nodes");
  CHECK(nodes >= 3);  // layer GEMM, epilogue, projection GEMM (cuBLAS may add more)

  const double tol = bound<medusa::bfloat16>(1);
  mc::check(cudaGraphLaunch(exec, stream), "replay 1");
  mc::check(cudaStreamSynchronize(stream), "sync");
  const auto eager = d_eager.download();
  const auto replay1 = d_logits.download();
  CHECK(replay1 == eager);  // same kernels on the same data
  const auto c1 = compare(replay1, cpu_logits(cpu, first, M), V);
  CHECK(c1.rel_error <= tol);
  CHECK(c1.top1_mismatches == 0);

  // New hidden states in the same buffer: the replay reads them.
  const auto second = random_hidden<medusa::bfloat16>(M * d, 23);
  d_hidden.upload(second);
  mc::check(cudaGraphLaunch(exec, stream), "replay 2");
  mc::check(cudaStreamSynchronize(stream), "sync");
  const auto c2 = compare(d_logits.download(), cpu_logits(cpu, second, M), V);
  CHECK(c2.rel_error <= tol);
  CHECK(c2.top1_mismatches == 0);
  CHECK(c2.rows_checked >= static_cast<int>(M * K) / 2);

  (void)cudaGraphExecDestroy(exec);
  (void)cudaGraphDestroy(graph);
}
