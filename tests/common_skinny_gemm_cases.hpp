// SPDX-License-Identifier: Apache-2.0
// What the skinny-GEMM tests share (the emulated unit test and the GPU test): random weights and
// activations, the exact product in double, and the tolerance the kernel is held to. The tensor
// cores multiply exactly and add in float, in an order the hardware fixes; the kernel adds 2·k/32
// such products per warp, then 8 warp sums and the residual. An element may therefore differ
// from the exact sum by at most (k/16 + 10) float roundings of Σ|x·w|; the tests allow twice that.
#pragma once

#include <doctest/doctest.h>
#include <medusa/cuda/kernel_context.hpp>
#include <medusa/cuda/kernels/skinny_gemm.hpp>
#include <medusa/half.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <random>
#include <vector>

namespace medusa_test {

// W [n][k], X [rows][k] of T, and the residual Y0 [rows][n].
template <class T>
struct gemm_case {
  int n = 0, k = 0, rows = 0;
  std::vector<T> w, x;
  std::vector<float> y0;

  gemm_case(int n_, int k_, int rows_, std::uint32_t seed) : n(n_), k(k_), rows(rows_) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    w.resize(static_cast<std::size_t>(n) * static_cast<std::size_t>(k));
    x.resize(static_cast<std::size_t>(rows) * static_cast<std::size_t>(k));
    y0.resize(static_cast<std::size_t>(rows) * static_cast<std::size_t>(n));
    for (auto& e : w) e = T(0.05f * nd(rng));
    for (auto& e : x) e = T(nd(rng));
    for (auto& e : y0) e = nd(rng);
  }

  // The exact Σ x·w (+ y0) of one element, and Σ|x·w| for the tolerance.
  void exact(int row, int feature, bool accumulate, double& sum, double& magnitude) const {
    sum = accumulate ? static_cast<double>(y0[static_cast<std::size_t>(row) * static_cast<std::size_t>(n) +
                                             static_cast<std::size_t>(feature)])
                     : 0.0;
    magnitude = std::fabs(sum);
    for (int i = 0; i < k; ++i) {
      const double p = static_cast<double>(static_cast<float>(x[static_cast<std::size_t>(row) * k + i])) *
                       static_cast<double>(static_cast<float>(w[static_cast<std::size_t>(feature) * k + i]));
      sum += p;
      magnitude += std::fabs(p);
    }
  }

  [[nodiscard]] double tolerance(double magnitude) const {
    return 2.0 * (k / 16.0 + 10.0) * std::ldexp(1.0, -24) * magnitude;
  }
};

// Checks `y` (the kernel's output for the first `rows` rows) against the exact product, every
// `stride`-th element; returns the number checked.
template <class T>
int check_against_exact(const gemm_case<T>& c, const std::vector<float>& y, int rows, bool accumulate, int stride = 1) {
  int checked = 0, bad = 0;
  for (int r = 0; r < rows; ++r)
    for (int f = 0; f < c.n; f += stride) {
      double sum = 0.0, magnitude = 0.0;
      c.exact(r, f, accumulate, sum, magnitude);
      const double got = y[static_cast<std::size_t>(r) * static_cast<std::size_t>(c.n) + static_cast<std::size_t>(f)];
      ++checked;
      if (!(std::fabs(got - sum) <= c.tolerance(magnitude)) && ++bad <= 5)
        FAIL_CHECK("row " << r << " feature " << f << ": " << got << " where the exact sum is " << sum
                          << " (tolerance " << c.tolerance(magnitude) << ")");
    }
  CHECK(bad == 0);
  return checked;
}

// True when rows [0, rows) of `a` and `b` (both [*][n]) hold the same bits.
inline bool same_rows(const std::vector<float>& a, const std::vector<float>& b, int rows, int n) {
  return std::memcmp(a.data(), b.data(), static_cast<std::size_t>(rows) * static_cast<std::size_t>(n) * sizeof(float)) == 0;
}

// The shapes both tests hold to the tolerance: one tile and one chunk; a partial feature tile; k a
// multiple of 8 but not of 32 (four row tiles); k not a multiple of 8 (element-wise loads); four
// row tiles and two feature tiles a block; sixteen row tiles with two chunks a warp; sixteen row
// tiles in two row groups. `large`: the last two, the emulation's slowest.
struct gemm_shape {
  int n, k, rows;
  std::uint32_t seed;
  bool large = false;
};
inline const std::vector<gemm_shape>& tolerance_shapes() {
  static const std::vector<gemm_shape> s{{16, 32, 1, 1},    {40, 64, 3, 2},          {24, 200, 9, 3},
                                         {33, 44, 20, 4},   {64, 96, 40, 5},         {48, 512, 70, 6, true},
                                         {17, 40, 150, 7, true}};
  return s;
}

// `run(c, rows, accumulate)` runs the kernel over the first `rows` rows of case `c`, Y starting
// from `c.y0`, and returns Y. Checks the shape `s` (every `stride`-th feature) with and without the
// residual: the pass's elements within the tolerance, the two rows after it untouched.
template <class T, class Run>
void check_shape(Run&& run, const gemm_shape& s, int stride = 1) {
  CAPTURE(s.n);
  CAPTURE(s.k);
  CAPTURE(s.rows);
  const gemm_case<T> c(s.n, s.k, s.rows + 2, s.seed);
  const std::size_t pass = static_cast<std::size_t>(s.rows) * static_cast<std::size_t>(s.n);
  for (const bool accumulate : {false, true}) {
    CAPTURE(accumulate);
    const std::vector<float> y = run(c, s.rows, accumulate);
    check_against_exact(c, y, s.rows, accumulate, stride);
    CHECK(std::memcmp(y.data() + pass, c.y0.data() + pass, (c.y0.size() - pass) * sizeof(float)) == 0);
  }
}

// A case for the SwiGLU epilogue: `c`'s W read as the stacked `[gate; up]` of `columns` outputs
// (c.n == 2·columns), interleaved as the epilogue wants (pad rows zero), Y starting at zero.
template <class T>
gemm_case<T> swiglu_case(const gemm_case<T>& c, int columns) {
  gemm_case<T> s = c;
  s.n = medusa::cuda::kernels::skinny_gemm_swiglu_features(columns);
  s.w.assign(static_cast<std::size_t>(s.n) * static_cast<std::size_t>(c.k), T(0.0f));
  for (int f = 0; f < s.n; ++f) {
    const int src = medusa::cuda::kernels::skinny_gemm_swiglu_source(f, columns);
    if (src >= 0)
      std::memcpy(&s.w[static_cast<std::size_t>(f) * c.k], &c.w[static_cast<std::size_t>(src) * c.k], c.k * sizeof(T));
  }
  s.y0.assign(static_cast<std::size_t>(c.rows) * static_cast<std::size_t>(s.n), 0.0f);
  return s;
}

// The feature of W (and column of the plain GEMM's Y) that holds output column `col`'s gate; its
// up is 8 features later.
MEDUSA_HOST_DEVICE inline int swiglu_gate_feature(int col) { return col / 8 * 16 + col % 8; }

// SiLU(gate) ⊙ up rounded to T from the plain GEMM's output `y` ([rows][n]) over a SwiGLU case's W,
// on the host.
template <class T>
std::vector<T> swiglu_of(const std::vector<float>& y, int rows, int n, int columns) {
  std::vector<T> h(static_cast<std::size_t>(rows) * static_cast<std::size_t>(columns));
  for (int r = 0; r < rows; ++r)
    for (int col = 0; col < columns; ++col) {
      const int gate = swiglu_gate_feature(col);
      const std::size_t at = static_cast<std::size_t>(r) * static_cast<std::size_t>(n);
      h[static_cast<std::size_t>(r) * columns + col] =
          medusa::cuda::store_float<T>(medusa::silu(y[at + gate]) * y[at + gate + 8]);
    }
  return h;
}

// True when `a` and `b` hold the same bits.
template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// The SwiGLU shapes: full and padded last groups, k a multiple of 8 or not, 1, 4 and 16 row tiles.
struct swiglu_shape {
  int columns, k, rows;
  std::uint32_t seed;
};
inline const std::vector<swiglu_shape>& swiglu_shapes() {
  static const std::vector<swiglu_shape> s{{24, 64, 1, 41}, {21, 40, 9, 42}, {37, 96, 40, 43}};
  return s;
}

// Checks the SwiGLU epilogue on `sh`: `fused(s, rows)` (h of the interleaved case s) has the bits
// of `unfused(s, rows)` (the plain GEMM followed by SiLU(gate)·up, computed where the epilogue runs:
// the device's expf is not the host's), and passes of `passes` rows (those below sh.rows) the bits
// of the whole pass's rows.
template <class T, class Unfused, class Fused>
void check_swiglu_shape(Unfused&& unfused, Fused&& fused, const swiglu_shape& sh, std::initializer_list<int> passes) {
  CAPTURE(sh.columns);
  CAPTURE(sh.k);
  CAPTURE(sh.rows);
  const gemm_case<T> c(2 * sh.columns, sh.k, sh.rows, sh.seed);
  const gemm_case<T> s = swiglu_case(c, sh.columns);
  const std::vector<T> whole = fused(s, sh.rows);
  CHECK(same_bits(whole, unfused(s, sh.rows)));
  for (const int rows : passes) {
    if (rows >= sh.rows) continue;
    CAPTURE(rows);
    const std::vector<T> part = fused(s, rows);
    CHECK(std::memcmp(part.data(), whole.data(), part.size() * sizeof(T)) == 0);
  }
}

// The pass sizes whose rows must equal the largest pass's, bit for bit.
inline const std::vector<int>& invariance_rows() {
  static const std::vector<int> r{1, 2, 3, 8, 9, 17, 33, 64, 65, 128, 130};
  return r;
}

}  // namespace medusa_test
