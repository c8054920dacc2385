// SPDX-License-Identifier: Apache-2.0
// The ResBlock epilogue of the device heads (cuda/kernels/head_epilogue.hpp) run through the host
// emulation: out = residual + SiLU(linear + bias) against a scalar reference built from the CPU
// heads' SiLU, for f32/f16/bf16 activations, vector and element paths, row mappings, and plans.
#include <doctest/doctest.h>
#include <medusa/cuda/emulation.hpp>
#include <medusa/cuda/kernels/head_epilogue.hpp>
#include <medusa/heads.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace mc = medusa::cuda;
namespace mk = medusa::cuda::kernels;

namespace {

template <class T>
std::uint32_t bits_of(T v) {
  if constexpr (std::is_same_v<T, float>) {
    std::uint32_t b;
    std::memcpy(&b, &v, sizeof b);
    return b;
  } else {
    return v.bits();
  }
}

template <class T>
const char* name_of() {
  return std::is_same_v<T, float> ? "f32" : std::is_same_v<T, medusa::half> ? "f16" : "bf16";
}

// One epilogue problem: buffers with padded row strides, element offsets from an aligned base
// (an offset that breaks 16-byte alignment forces the element path), and the emulated run.
struct layout {
  int rows = 3;
  int hidden = 8;
  int rows_per_residual = 1;
  int bias_rows = 1;
  bool with_bias = true;
  bool in_place = false;
  std::int64_t pad = 0;    // extra elements per row of every operand
  std::size_t offset = 0;  // elements every operand starts past its aligned base
};

template <class Act, class Bias>
struct problem {
  layout l;
  std::int64_t ld;
  std::vector<float> linear;
  std::vector<Bias> bias;
  std::vector<Act> residual, out;
  mk::head_epilogue_params<Act, Bias> params;

  problem(const layout& shape, std::uint64_t seed) : l(shape), ld(shape.hidden + shape.pad) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> g(0.0f, 2.0f);
    const auto n = [&](int rows) { return static_cast<std::size_t>(rows * ld) + l.offset; };
    linear.resize(n(l.rows));
    for (auto& v : linear) v = g(rng);
    bias.resize(static_cast<std::size_t>(l.bias_rows * l.hidden) + l.offset);
    for (auto& v : bias) v = Bias(g(rng));
    residual.resize(n(l.rows / l.rows_per_residual));
    for (auto& v : residual) v = Act(g(rng));
    out.assign(n(l.rows), Act(-1024.0f));  // sentinel: padding must stay untouched
    params.linear = linear.data() + l.offset;
    params.bias = l.with_bias ? bias.data() + l.offset : nullptr;
    params.residual = residual.data() + l.offset;
    params.out = l.in_place ? residual.data() + l.offset : out.data() + l.offset;
    params.rows = l.rows;
    params.hidden = l.hidden;
    params.ld_linear = params.ld_residual = params.ld_out = ld;
    params.rows_per_residual = l.rows_per_residual;
    params.bias_rows = l.bias_rows;
  }

  // The CPU heads' step (heads.hpp: out = in + SiLU(t + b) in float), rounded once to Act.
  std::vector<Act> reference() const {
    std::vector<Act> ref(static_cast<std::size_t>(l.rows * l.hidden));
    for (int r = 0; r < l.rows; ++r)
      for (int i = 0; i < l.hidden; ++i) {
        const float t = params.linear[r * ld + i];
        const float b = l.with_bias ? static_cast<float>(params.bias[(r % l.bias_rows) * l.hidden + i]) : 0.0f;
        const float x = static_cast<float>(params.residual[(r / l.rows_per_residual) * ld + i]);
        ref[static_cast<std::size_t>(r * l.hidden + i)] = Act(x + medusa::silu(t + b));
      }
    return ref;
  }

  void run(mc::launch_shape shape) {
    const auto p = params;
    mc::emulate(shape, [&](auto& ctx) { mk::head_epilogue(ctx, p); });
  }

  // Every element equals the reference bit for bit; the padding keeps its sentinel.
  void check(const std::vector<Act>& ref) const {
    const Act* got = params.out;
    int wrong = 0;
    for (int r = 0; r < l.rows; ++r) {
      for (int i = 0; i < l.hidden; ++i)
        wrong += bits_of(got[r * ld + i]) != bits_of(ref[static_cast<std::size_t>(r * l.hidden + i)]);
      if (!l.in_place)
        for (std::int64_t i = l.hidden; i < ld; ++i) wrong += static_cast<float>(got[r * ld + i]) != -1024.0f;
    }
    CHECK(wrong == 0);
  }
};

template <class Act, class Bias>
void check_case(const layout& l, std::uint64_t seed, bool expect_vector_path) {
  CAPTURE(name_of<Act>());
  CAPTURE(name_of<Bias>());
  CAPTURE(l.rows);
  CAPTURE(l.hidden);
  CAPTURE(l.rows_per_residual);
  CAPTURE(l.bias_rows);
  CAPTURE(l.with_bias);
  CAPTURE(l.in_place);
  CAPTURE(l.pad);
  CAPTURE(l.offset);
  problem<Act, Bias> pr(l, seed);
  CHECK(mk::detail::head_epilogue_vectorisable(pr.params) == expect_vector_path);
  const auto ref = pr.reference();
  pr.run(mk::plan_head_epilogue<Act>(static_cast<std::size_t>(l.rows), static_cast<std::size_t>(l.hidden)).shape);
  pr.check(ref);
}

template <class Act, class Bias>
void check_all_layouts() {
  constexpr int vec = mk::head_epilogue_vector<Act>;
  std::uint64_t seed = 1;
  for (int hidden : {vec, 8, 13, 64, 67, 200})
    for (bool with_bias : {true, false}) {
      // Dense rows: the vector path whenever a row is a whole number of 16-byte pieces (else the
      // second row starts misaligned), with an element tail for a partial last chunk.
      const bool rows_aligned = hidden % vec == 0 && (!with_bias || hidden * static_cast<int>(sizeof(Bias)) % 16 == 0);
      check_case<Act, Bias>({.rows = 3, .hidden = hidden, .bias_rows = 3, .with_bias = with_bias}, seed++, rows_aligned);
      // Padded rows that keep the alignment, one bias row: vector path with a tail.
      const std::int64_t pad = (vec - hidden % vec) % vec + vec;
      check_case<Act, Bias>({.rows = 2, .hidden = hidden, .with_bias = with_bias, .pad = pad}, seed++, true);
      // Misaligned bases: element path.
      check_case<Act, Bias>({.rows = 2, .hidden = hidden, .with_bias = with_bias, .pad = pad, .offset = 1}, seed++, false);
    }
  // Layer 0 of K = 3 heads: 2 hidden states broadcast over the heads, one bias row per head.
  check_case<Act, Bias>({.rows = 6, .hidden = 64, .rows_per_residual = 3, .bias_rows = 3}, seed++, true);
  check_case<Act, Bias>({.rows = 6, .hidden = 13, .rows_per_residual = 3, .bias_rows = 3}, seed++, false);
  // In place (out aliases residual), as the device heads run layers after the first.
  check_case<Act, Bias>({.rows = 4, .hidden = 64, .bias_rows = 2, .in_place = true}, seed++, true);
  check_case<Act, Bias>({.rows = 4, .hidden = 67, .bias_rows = 2, .in_place = true, .pad = 1}, seed++, false);
}

}  // namespace

TEST_CASE("head epilogue matches the CPU heads' residual step bit for bit (f32, f16, bf16)") {
  check_all_layouts<float, float>();
  check_all_layouts<medusa::half, float>();
  check_all_layouts<medusa::bfloat16, float>();
  check_all_layouts<medusa::half, medusa::half>();
  check_all_layouts<medusa::bfloat16, medusa::bfloat16>();
  check_all_layouts<float, medusa::bfloat16>();
}

TEST_CASE("head epilogue in f32 is the CPU heads' float formula; 16-bit rounds it once") {
  // f32 activations reproduce `in + silu(t + b)` exactly; f16/bf16 are within half an ulp of it
  // (one rounding at the store), and SiLU itself agrees with a float64 evaluation.
  problem<float, float> f({.rows = 2, .hidden = 67}, 7);
  problem<medusa::bfloat16, float> b({.rows = 2, .hidden = 67}, 7);
  // The same seed gives both the same linear outputs and biases; b's residuals are f's rounded to bf16.
  f.run(mk::plan_head_epilogue<float>(2, 67).shape);
  b.run(mk::plan_head_epilogue<medusa::bfloat16>(2, 67).shape);
  double worst_silu = 0, worst_bf16 = 0;
  for (int r = 0; r < 2; ++r)
    for (int i = 0; i < 67; ++i) {
      const std::size_t k = static_cast<std::size_t>(r * 67 + i);
      const float t = f.linear[k] + f.bias[static_cast<std::size_t>(i)];
      const double s = static_cast<double>(t) / (1.0 + std::exp(-static_cast<double>(t)));
      worst_silu = std::max(worst_silu, std::abs(static_cast<double>(medusa::silu(t)) - s) / std::max(1.0, std::abs(s)));
      CHECK(f.out[k] == f.residual[k] + medusa::silu(t));
      const double exact = static_cast<double>(static_cast<float>(b.residual[k])) + s;
      worst_bf16 = std::max(worst_bf16, std::abs(static_cast<float>(b.out[k]) - exact) / std::max(1e-3, std::abs(exact)));
    }
  CHECK(worst_silu < 1e-6);
  CHECK(worst_bf16 <= 1.0 / 256 + 1e-6);  // half an ulp of bf16 (2^-8) plus float error
}

TEST_CASE("head epilogue grid-stride loop covers rows longer than one block pass") {
  // 600 bf16 = 75 chunks: 32 threads and 3 blocks per row, or a single block along y that loops.
  const auto plan = mk::plan_head_epilogue<medusa::bfloat16>(2, 600, 32);
  CHECK(plan.shape.threads == 32);
  CHECK(plan.shape.grid_y == 3);
  for (int grid_y : {3, 1}) {
    problem<medusa::bfloat16, float> pr({.rows = 2, .hidden = 600, .bias_rows = 2}, 11);
    const auto ref = pr.reference();
    auto shape = plan.shape;
    shape.grid_y = grid_y;
    pr.run(shape);
    pr.check(ref);
  }
}

TEST_CASE("head epilogue plans: launch shapes and refused sizes") {
  const auto big = mk::plan_head_epilogue<medusa::bfloat16>(20, 4096);  // 512 chunks of 8
  CHECK(big.shape.grid_x == 20);
  CHECK(big.shape.threads == 256);
  CHECK(big.shape.grid_y == 2);
  CHECK(big.shape.shared_bytes == 0);
  CHECK(big.rows == 20);
  CHECK(big.hidden == 4096);
  const auto small = mk::plan_head_epilogue<float>(1, 13);  // 4 chunks of 4: one warp
  CHECK(small.shape.threads == 32);
  CHECK(small.shape.grid_y == 1);
  const auto capped = mk::plan_head_epilogue<float>(1, 4096, 128);
  CHECK(capped.shape.threads == 128);
  CHECK(capped.shape.grid_y == 8);

  const auto refused = [](auto&& make) {
    try {
      make();
    } catch (const mc::launch_error& e) {
      return e.code() == mc::launch_errc::invalid_shape;
    }
    return false;
  };
  CHECK(refused([] { (void)mk::plan_head_epilogue<float>(0, 64); }));
  CHECK(refused([] { (void)mk::plan_head_epilogue<float>(4, 0); }));
  CHECK(refused([] { (void)mk::plan_head_epilogue<medusa::half>(std::size_t{1} << 31, 64); }));
  CHECK(refused([] { (void)mk::plan_head_epilogue<medusa::half>(4, std::size_t{1} << 31); }));
  CHECK(refused([] { (void)mk::plan_head_epilogue<float>(4, 64, 48); }));
  CHECK(refused([] { (void)mk::plan_head_epilogue<float>(4, 64, 0); }));
  CHECK(refused([] { (void)mk::plan_head_epilogue<float>(4, 64, 2048); }));
  CHECK_THROWS_WITH_AS((void)mk::plan_head_epilogue<float>(0, 64), doctest::Contains("rows"), mc::launch_error);
}
