// SPDX-License-Identifier: Apache-2.0
// The skinny GEMM on a device: every element within the stated tolerance of the exact product
// (bf16 and f16, partial tiles, k not a multiple of 32 or of 8, with and without the residual),
// and a row's bits identical in passes of 1, 2, 3, 8, 64, 128 rows (and the sizes between), at
// Llama-2-7B's shapes, checked with memcmp; the SwiGLU epilogue equal to the plain GEMM followed by
// SiLU(gate)·up on the device, bit for bit, in passes of every size.
#include "gpu_test.hpp"

#include <medusa/cuda/skinny_gemm_instances.cuh>
#include <medusa/half.hpp>

#include "../common_skinny_gemm_cases.hpp"

#include <cstdint>
#include <cstring>
#include <vector>

namespace mc = medusa::cuda;
namespace mk = medusa::cuda::kernels;
using namespace medusa_test;

namespace {

// The device GEMM over the first `rows` rows of `c` (X offset by `offset` elements), Y starting
// from the case's residual.
template <class T>
std::vector<float> on_device(const gemm_case<T>& c, int rows, bool accumulate, int offset = 0) {
  mk::skinny_gemm_problem problem;  // set field by field: nvcc's front end rejects designated
  problem.n = c.n;                  // initializers in a function template
  problem.k = c.k;
  problem.rows = rows;
  const mk::skinny_gemm_plan plan = mk::plan_skinny_gemm(problem);
  std::vector<T> xh(static_cast<std::size_t>(offset) + c.x.size());
  std::memcpy(xh.data() + offset, c.x.data(), c.x.size() * sizeof(T));
  const device_array<T> w(c.w), x(xh);
  const device_array<float> y(c.y0);
  mc::check(mc::run(plan, mk::skinny_gemm_params<T>{w.get(), x.get() + offset, y.get(), accumulate}, nullptr),
            "skinny gemm");
  mc::check(cudaDeviceSynchronize(), "skinny gemm");
  return y.download();
}

// The device SwiGLU GEMM over the first `rows` rows of the interleaved case `s` (`columns` outputs).
template <class T>
std::vector<T> on_device_swiglu(const gemm_case<T>& s, int rows, int columns) {
  const mk::skinny_gemm_plan plan = mk::plan_skinny_gemm_swiglu(columns, s.k, rows);
  REQUIRE(plan.problem.n == s.n);
  const device_array<T> w(s.w), x(s.x);
  const device_array<T> h(std::vector<T>(static_cast<std::size_t>(rows) * static_cast<std::size_t>(columns), T(0.0f)));
  mc::check(mc::run(plan, mk::skinny_gemm_swiglu_params(w.get(), x.get(), h.get(), columns), nullptr),
            "skinny gemm (SwiGLU)");
  mc::check(cudaDeviceSynchronize(), "skinny gemm (SwiGLU)");
  return h.download();
}

// SiLU(gate)·up of the plain GEMM's Y, one thread an element: the unfused path the epilogue replaces.
template <class T>
__global__ void swiglu_elementwise(const float* y, T* h, int rows, int n, int columns) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i >= rows * columns) return;
  const float* row = y + static_cast<std::size_t>(i / columns) * static_cast<std::size_t>(n);
  const int gate = swiglu_gate_feature(i % columns);
  h[i] = mc::store_float<T>(medusa::silu(row[gate]) * row[gate + 8]);
}

// The plain device GEMM over the first `rows` rows of the SwiGLU case `s`, then SiLU(gate)·up on the
// device.
template <class T>
std::vector<T> unfused_on_device(const gemm_case<T>& s, int rows, int columns) {
  const device_array<float> y(on_device(s, rows, false));
  const device_array<T> h(static_cast<std::size_t>(rows) * static_cast<std::size_t>(columns));
  const int elements = rows * columns;
  swiglu_elementwise<T><<<(elements + 255) / 256, 256>>>(y.get(), h.get(), rows, s.n, columns);
  mc::check(cudaGetLastError(), "SiLU(gate)·up");
  mc::check(cudaDeviceSynchronize(), "SiLU(gate)·up");
  return h.download();
}

}  // namespace

TEST_CASE_TEMPLATE("device skinny gemm: the SwiGLU epilogue has the bits of the plain GEMM and SiLU(gate)·up", T,
                   medusa::bfloat16, medusa::half) {
  std::vector<swiglu_shape> shapes = swiglu_shapes();
  shapes.push_back({11008, 4096, 64, 44});  // Llama-2-7B's gate/up
  for (const swiglu_shape& sh : shapes)
    check_swiglu_shape<T>([&](const gemm_case<T>& s, int rows) { return unfused_on_device(s, rows, sh.columns); },
                          [&](const gemm_case<T>& s, int rows) { return on_device_swiglu(s, rows, sh.columns); }, sh,
                          {1, 2, 3, 8, 9, 33});
}

TEST_CASE_TEMPLATE("device skinny gemm: every element within the tolerance of the exact product", T, medusa::bfloat16,
                   medusa::half) {
  const auto run = [](const gemm_case<T>& c, int rows, bool acc) { return on_device(c, rows, acc); };
  for (const gemm_shape& s : tolerance_shapes()) check_shape<T>(run, s);
  check_shape<T>(run, {4096, 4096, 8, 8}, 37);  // Llama-2-7B's o and down shapes, every 37th and 7th feature
  check_shape<T>(run, {512, 11008, 64, 9}, 7);
}

TEST_CASE_TEMPLATE("device skinny gemm: a row has the same bits in passes of 1 to 130 rows", T, medusa::bfloat16,
                   medusa::half) {
  struct size {
    int n, k;
  };
  for (const size s : {size{4096, 4096}, size{4096, 11008}, size{1000, 264}, size{40, 44}}) {
    CAPTURE(s.n);
    CAPTURE(s.k);
    const gemm_case<T> c(s.n, s.k, 130, 11);
    for (const bool accumulate : {false, true}) {
      CAPTURE(accumulate);
      const std::vector<float> all = on_device(c, 130, accumulate);
      for (const int rows : invariance_rows()) {
        CAPTURE(rows);
        CHECK(same_rows(on_device(c, rows, accumulate), all, rows, s.n));
      }
    }
  }
}

TEST_CASE("device skinny gemm: element-wise loads give the bits of 16-byte loads") {
  const gemm_case<medusa::bfloat16> c(300, 1024, 5, 21);
  CHECK(same_rows(on_device(c, 5, true, 1), on_device(c, 5, true, 0), 5, 300));
}

// Every instance asks for more than 48 KiB of shared memory, which a kernel is granted per device:
// a launch on a second device that had not asked would fail. Needs two devices.
TEST_CASE("device skinny gemm: each instance runs on every visible device" *
          doctest::skip(mc::device_count() < 2)) {
  const gemm_case<medusa::bfloat16> c(264, 1024, 40, 31);
  int current = 0;
  mc::check(cudaGetDevice(&current), "cudaGetDevice");
  for (int device = 0; device < mc::device_count(); ++device) {
    CAPTURE(device);
    mc::check(cudaSetDevice(device), "cudaSetDevice");
    for (const int rows : {1, 9, 40}) {  // the three instances
      CAPTURE(rows);
      check_against_exact(c, on_device(c, rows, true), rows, true);
    }
  }
  mc::check(cudaSetDevice(current), "cudaSetDevice");
}

TEST_CASE("device skinny gemm: null arrays are refused with nothing launched") {
  const mk::skinny_gemm_plan plan = mk::plan_skinny_gemm({.n = 16, .k = 32, .rows = 1});
  CHECK(mc::run(plan, mk::skinny_gemm_params<medusa::bfloat16>{}, nullptr) == cudaErrorInvalidValue);
}
