// SPDX-License-Identifier: Apache-2.0
// The skinny GEMM's kernel body, run by the host emulation (tensor-core products summed in double
// and rounded once per mma): every element within the stated tolerance of the exact product, for
// bf16 and f16, partial feature and row tiles, k not a multiple of 32 or of 8, with and without the
// residual; and the property it is built for: a row's bits are the same in passes of 1 to 130 rows.
#include <doctest/doctest.h>
#include <medusa/cuda/emulation.hpp>
#include <medusa/cuda/kernels/skinny_gemm.hpp>
#include <medusa/half.hpp>

#include "../common_skinny_gemm_cases.hpp"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace mc = medusa::cuda;
namespace mk = medusa::cuda::kernels;
using namespace medusa_test;

namespace {

// The emulated kernel over the first `rows` rows of `c`: X and Y offset by `offset` elements
// (a misaligned X takes the element-wise loads). `RT` > 0 runs another schedule of the body,
// `skinny_gemm_body<RT, F, S, CH>`, instead of the library's instance.
template <int RT = 0, int F = 0, int S = 0, int CH = 0, class T>
std::vector<float> emulated(const gemm_case<T>& c, int rows, bool accumulate, int offset = 0) {
  mk::skinny_gemm_plan plan = mk::plan_skinny_gemm({.n = c.n, .k = c.k, .rows = rows});
  if constexpr (RT > 0) plan = mk::detail::skinny_gemm_rescheduled<RT, F, S, CH>(plan);
  std::vector<T> x(static_cast<std::size_t>(offset) + c.x.size());
  std::memcpy(x.data() + offset, c.x.data(), c.x.size() * sizeof(T));
  std::vector<float> y = c.y0;
  const mk::skinny_gemm_params<T> a{c.w.data(), x.data() + offset, y.data(), accumulate};
  mc::emulate(plan.launch, [&](auto& ctx) {
    if constexpr (RT > 0) mk::skinny_gemm_body<RT, F, S, CH>(ctx, plan, a, mk::skinny_gemm_aligned(plan, a));
    else mk::skinny_gemm(ctx, plan, a);
  });
  return y;
}

// The emulated SwiGLU GEMM over the first `rows` rows of the interleaved case `s` (`columns`
// outputs), h starting at zero.
template <class T>
std::vector<T> emulated_swiglu(const gemm_case<T>& s, int rows, int columns) {
  const mk::skinny_gemm_plan plan = mk::plan_skinny_gemm_swiglu(columns, s.k, rows);
  REQUIRE(plan.problem.n == s.n);
  std::vector<T> h(static_cast<std::size_t>(rows) * static_cast<std::size_t>(columns), T(0.0f));
  const mk::skinny_gemm_params<T> a = mk::skinny_gemm_swiglu_params(s.w.data(), s.x.data(), h.data(), columns);
  REQUIRE(mk::skinny_gemm_args_ok(plan, a));
  mc::emulate(plan.launch, [&](auto& ctx) { mk::skinny_gemm(ctx, plan, a); });
  return h;
}

}  // namespace

TEST_CASE("skinny gemm: other schedules of the body give the library instance's bits") {
  // Row and feature tiles, ring stages and chunks a stage other than the library's (bench_gemm
  // times such schedules on a device): partial feature and row tiles, k not a multiple of 32 (a
  // warp's last stage half full at two or four chunks a stage), 16-byte and element-wise loads.
  const int n = 40, k = mc::emulation_sanitized ? 104 : 264;
  const gemm_case<medusa::bfloat16> c(n, k, 45, 41);
  for (const int offset : {0, 1})
    for (const int rows : {1, 13, 45}) {
      CAPTURE(offset);
      CAPTURE(rows);
      const std::vector<float> library = emulated(c, rows, true, offset);
      CHECK(same_rows(emulated<2, 1, 3, 1>(c, rows, true, offset), library, rows, n));
      CHECK(same_rows(emulated<2, 1, 2, 2>(c, rows, true, offset), library, rows, n));
      CHECK(same_rows(emulated<4, 2, 2, 1>(c, rows, true, offset), library, rows, n));
      CHECK(same_rows(emulated<4, 1, 4, 1>(c, rows, true, offset), library, rows, n));
      CHECK(same_rows(emulated<4, 4, 2, 1>(c, rows, true, offset), library, rows, n));
      CHECK(same_rows(emulated<8, 1, 3, 1>(c, rows, true, offset), library, rows, n));
      CHECK(same_rows(emulated<1, 1, 3, 4>(c, rows, true, offset), library, rows, n));
    }
}

TEST_CASE_TEMPLATE("skinny gemm: the SwiGLU epilogue has the bits of the plain GEMM and SiLU(gate)·up", T,
                   medusa::bfloat16, medusa::half) {
  for (const swiglu_shape& sh : swiglu_shapes())
    check_swiglu_shape<T>(
        [&](const gemm_case<T>& s, int rows) { return swiglu_of<T>(emulated(s, rows, false), rows, s.n, sh.columns); },
                          [&](const gemm_case<T>& s, int rows) { return emulated_swiglu(s, rows, sh.columns); }, sh,
                          {1, 3, 9});
}

TEST_CASE("skinny gemm: a batch of GEMMs over strided arrays has the bits of each GEMM alone") {
  // Three GEMMs of 40 features, k = 48, 11 rows: W per GEMM or shared by the batch, X and
  // Y rows with strides (X's an odd one: element-wise loads, the same bits).
  const int n = 40, k = 48, rows = 11, batch = 3;
  for (const bool shared_w : {false, true})
    for (const std::int64_t ldx : {std::int64_t{0}, std::int64_t{56}, std::int64_t{53}}) {
      CAPTURE(shared_w);
      CAPTURE(ldx);
      std::vector<gemm_case<medusa::bfloat16>> cases;
      for (int i = 0; i < batch; ++i) cases.emplace_back(n, k, rows, 60 + static_cast<std::uint32_t>(i));
      if (shared_w)
        for (auto& c : cases) c.w = cases[0].w;
      const std::int64_t lx = ldx == 0 ? k : ldx, ly = n + 3;
      std::vector<medusa::bfloat16> w, x(static_cast<std::size_t>(batch * rows * lx), medusa::bfloat16(0.0f));
      for (const auto& c : cases) w.insert(w.end(), c.w.begin(), c.w.end());
      for (int i = 0; i < batch; ++i)
        for (int r = 0; r < rows; ++r)
          std::memcpy(&x[static_cast<std::size_t>((i * rows + r) * lx)], &cases[i].x[static_cast<std::size_t>(r) * k],
                      k * sizeof(medusa::bfloat16));
      std::vector<float> y(static_cast<std::size_t>(batch * rows * ly), -7.0f);
      const mk::skinny_gemm_plan plan = mk::plan_skinny_gemm({.n = n, .k = k, .rows = rows, .batch = batch});
      mk::skinny_gemm_params<medusa::bfloat16> a{w.data(), x.data(), y.data()};
      a.ldx = ldx;
      a.ldy = ly;
      a.stride_w = shared_w ? 0 : std::int64_t{n} * k;
      a.stride_x = rows * lx;
      a.stride_y = rows * ly;
      REQUIRE(mk::skinny_gemm_args_ok(plan, a));
      CHECK(mk::skinny_gemm_aligned(plan, a) == (lx % 8 == 0));
      mc::emulate(plan.launch, [&](auto& ctx) { mk::skinny_gemm(ctx, plan, a); });
      for (int i = 0; i < batch; ++i) {
        CAPTURE(i);
        const std::vector<float> alone = emulated(cases[static_cast<std::size_t>(i)], rows, false);
        for (int r = 0; r < rows; ++r) {
          const float* got = &y[static_cast<std::size_t>((i * rows + r) * ly)];
          CHECK(std::memcmp(got, &alone[static_cast<std::size_t>(r) * n], n * sizeof(float)) == 0);
          CHECK(got[n] == -7.0f);  // the stride's gap is left alone
        }
      }
    }
  mk::skinny_gemm_params<medusa::bfloat16> bad{nullptr, nullptr, nullptr};
  medusa::bfloat16 e[1];
  float f[1];
  bad.w = e;
  bad.x = e;
  bad.y = f;
  const mk::skinny_gemm_plan plan = mk::plan_skinny_gemm({.n = 16, .k = 32, .rows = 2, .batch = 2});
  CHECK(mk::skinny_gemm_args_ok(plan, bad));
  bad.ldx = 31;  // shorter than a row
  CHECK_FALSE(mk::skinny_gemm_args_ok(plan, bad));
  bad.ldx = 0;
  bad.stride_y = -1;
  CHECK_FALSE(mk::skinny_gemm_args_ok(plan, bad));
  CHECK_THROWS_AS((void)mk::plan_skinny_gemm({.n = 16, .k = 32, .rows = 2, .batch = 0}), mc::launch_error);
  CHECK_THROWS_AS((void)mk::plan_skinny_gemm({.n = 32, .k = 32, .rows = 2, .batch = 2, .swiglu = true}), mc::launch_error);
}

TEST_CASE("skinny gemm: SwiGLU plans and arguments are checked") {
  CHECK_THROWS_AS((void)mk::plan_skinny_gemm({.n = 40, .k = 16, .rows = 1, .swiglu = true}), mc::launch_error);
  const mk::skinny_gemm_plan plan = mk::plan_skinny_gemm({.n = 48, .k = 16, .rows = 1, .swiglu = true});
  medusa::bfloat16 w[1], x[1], h[1];
  mk::skinny_gemm_params<medusa::bfloat16> a{w, x, nullptr};
  CHECK_FALSE(mk::skinny_gemm_args_ok(plan, a));  // no h
  a.gated = h;
  for (const int columns : {0, 16, 25}) {
    a.gated_columns = columns;
    CHECK_FALSE(mk::skinny_gemm_args_ok(plan, a));
  }
  for (const int columns : {17, 24}) {
    a.gated_columns = columns;
    CHECK(mk::skinny_gemm_args_ok(plan, a));
  }
  CHECK(mk::skinny_gemm_swiglu_features(17) == 48);
  CHECK(mk::skinny_gemm_swiglu_source(0, 17) == 0);
  CHECK(mk::skinny_gemm_swiglu_source(8, 17) == 17);
  CHECK(mk::skinny_gemm_swiglu_source(23, 17) == 15);
  CHECK(mk::skinny_gemm_swiglu_source(24, 17) == 17 + 8);
  CHECK(mk::skinny_gemm_swiglu_source(32, 17) == 16);
  CHECK(mk::skinny_gemm_swiglu_source(33, 17) == -1);
  CHECK(mk::skinny_gemm_swiglu_source(40, 17) == 17 + 16);
  CHECK(mk::skinny_gemm_swiglu_source(41, 17) == -1);
}

TEST_CASE_TEMPLATE("skinny gemm: every element within the tolerance of the exact product", T, medusa::bfloat16,
                   medusa::half) {
  for (const gemm_shape& s : tolerance_shapes())
    if (!(s.large && mc::emulation_sanitized))
      check_shape<T>([](const gemm_case<T>& c, int rows, bool acc) { return emulated(c, rows, acc); }, s);
}

TEST_CASE_TEMPLATE("skinny gemm: a row has the same bits in passes of 1 to 130 rows", T, medusa::bfloat16,
                   medusa::half) {
  const int n = 24, k = mc::emulation_sanitized ? 96 : 264;
  const gemm_case<T> c(n, k, 130, 11);
  for (const bool accumulate : {false, true}) {
    const std::vector<float> all = emulated(c, 130, accumulate);
    for (const int rows : invariance_rows()) {
      CAPTURE(rows);
      CHECK(same_rows(emulated(c, rows, accumulate), all, rows, n));
    }
  }
}

TEST_CASE("skinny gemm: element-wise loads give the bits of 16-byte loads") {
  const gemm_case<medusa::bfloat16> c(20, 64, 5, 21);
  const mk::skinny_gemm_plan plan = mk::plan_skinny_gemm({.n = 20, .k = 64, .rows = 5});
  CHECK(mk::skinny_gemm_aligned(plan, mk::skinny_gemm_params<medusa::bfloat16>{c.w.data(), c.x.data(), nullptr}));
  CHECK_FALSE(
      mk::skinny_gemm_aligned(plan, mk::skinny_gemm_params<medusa::bfloat16>{c.w.data(), c.x.data() + 1, nullptr}));
  CHECK(same_rows(emulated(c, 5, true, 1), emulated(c, 5, true, 0), 5, 20));
}

TEST_CASE("skinny gemm: a NaN in one row's activations stays in that row") {
  gemm_case<medusa::bfloat16> c(16, 64, 9, 31);
  const std::vector<float> clean = emulated(c, 9, false);
  c.x[static_cast<std::size_t>(4) * 64 + 10] = medusa::bfloat16(std::numeric_limits<float>::quiet_NaN());
  const std::vector<float> y = emulated(c, 9, false);
  for (int r = 0; r < 9; ++r) {
    CAPTURE(r);
    bool any_nan = false;
    for (int f = 0; f < 16; ++f) any_nan = any_nan || std::isnan(y[static_cast<std::size_t>(r) * 16 + f]);
    CHECK(any_nan == (r == 4));
    if (r != 4) CHECK(std::memcmp(&y[static_cast<std::size_t>(r) * 16], &clean[static_cast<std::size_t>(r) * 16], 64) == 0);
  }
}

TEST_CASE("skinny gemm: the plan's tiles follow the pass size and bad sizes are refused") {
  const auto plan = [](int rows) { return mk::plan_skinny_gemm({.n = 4096, .k = 4096, .rows = rows}); };
  CHECK(plan(1).row_tiles == 1);
  CHECK(plan(1).launch.grid_x == 256);
  CHECK(plan(8).row_tiles == 1);
  CHECK(plan(9).row_tiles == 4);
  CHECK(plan(32).feature_tiles == 1);
  CHECK(plan(33).row_tiles == 8);
  CHECK(plan(64).feature_tiles == 2);
  CHECK(plan(64).launch.grid_x == 128);
  CHECK(plan(128).row_tiles == 8);
  CHECK(plan(300).launch.grid_y == 5);
  // Each instance's ring fits the 99 KiB a block may have on sm_86 and sm_89 (sm_80: 163, sm_90: 227).
  for (const int rows : {1, 9, 33}) CHECK(plan(rows).launch.shared_bytes <= 99 * 1024);
  CHECK_THROWS_AS((void)mk::plan_skinny_gemm({.n = 0, .k = 16, .rows = 1}), mc::launch_error);
  CHECK_THROWS_AS((void)mk::plan_skinny_gemm({.n = 16, .k = 16, .rows = 0}), mc::launch_error);
  CHECK_THROWS_AS((void)mk::plan_skinny_gemm({.n = 16, .k = -1, .rows = 1}), mc::launch_error);
  CHECK_THROWS_AS((void)mk::plan_skinny_gemm({.n = 16, .k = 16, .rows = 65536 * 128 + 1}), mc::launch_error);
}
