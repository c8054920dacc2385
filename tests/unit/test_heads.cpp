// SPDX-License-Identifier: Apache-2.0
// head_stack forward with the portable GEMM: float64 reference, static/dynamic counts, fusion,
// parallel-for, errors.
#include "test_heads_common.hpp"

#include <medusa/gemm.hpp>
#include <medusa/heads.hpp>

#include <doctest/doctest.h>

#include <atomic>
#include <thread>

namespace {

// A two-thread parallel-for, as an engine would provide one.
struct two_thread_for {
  std::atomic<int>* calls;
  template <class F>
  void operator()(std::size_t n, F&& body) const {
    calls->fetch_add(1);
    std::thread t([&] {
      for (std::size_t i = 1; i < n; i += 2) body(i);
    });
    for (std::size_t i = 0; i < n; i += 2) body(i);
    t.join();
  }
};

}  // namespace

TEST_CASE("portable gemm: all op combinations, alpha/beta, f32/bf16/f16") {
  medusa::portable_gemm<> g;
  heads_test::check_gemm_ops(g);
}

TEST_CASE("portable gemm: larger shapes cross the K and N blocks (f32, bf16, f16)") {
  medusa::portable_gemm<> g;
  const std::size_t M = 5, N = 200, K = 2100;  // K > kc and N > nc
  auto A = heads_test::random_hidden(M * K, 1), B = heads_test::random_hidden(N * K, 2);
  std::vector<std::uint16_t> B16(B.size());
  for (auto dtype : {medusa::weight_dtype::f32, medusa::weight_dtype::bf16, medusa::weight_dtype::f16}) {
    CAPTURE(static_cast<int>(dtype));
    for (std::size_t i = 0; i < B.size(); ++i) {
      if (dtype == medusa::weight_dtype::bf16) B16[i] = medusa::bfloat16(B[i]).bits(), B[i] = medusa::bfloat16::from_bits(B16[i]);
      if (dtype == medusa::weight_dtype::f16) B16[i] = medusa::half(B[i]).bits(), B[i] = medusa::half::from_bits(B16[i]);
    }
    const auto bp = dtype == medusa::weight_dtype::f32 ? medusa::weight_ptr::of(B.data()) : medusa::weight_ptr::of(B16.data(), dtype);
    std::vector<float> C(M * N);
    g.gemm(medusa::gemm_op::none, medusa::gemm_op::transpose, M, N, K, 1.0f, A.data(), K, bp, K, 0.0f, C.data(), N);
    double err = 0, mx = 0;
    for (std::size_t i = 0; i < M; ++i)
      for (std::size_t j = 0; j < N; ++j) {
        double s = 0;
        for (std::size_t k = 0; k < K; ++k) s += static_cast<double>(A[i * K + k]) * B[j * K + k];
        err = std::max(err, std::abs(s - C[i * N + j]));
        mx = std::max(mx, std::abs(s));
      }
    CHECK(err / mx < 1e-5);
  }
}

TEST_CASE("head_stack forward matches the float64 reference (portable gemm)") {
  medusa::portable_gemm<> g;
  heads_test::check_forward_against_reference(g);
}

TEST_CASE("head_stack forward with a caller-provided parallel-for gives the same result") {
  std::atomic<int> calls{0};
  medusa::portable_gemm<two_thread_for> g{two_thread_for{&calls}};
  heads_test::check_forward_against_reference(g);
  CHECK(calls.load() > 0);
}

TEST_CASE("fused first layer: detected for packed weights, same logits as unfused") {
  const std::size_t d = 24, V = 40, K = 3, L = 2, M = 2;
  heads_test::random_heads rh(d, V, K, L, medusa::projection_kind::per_head, medusa::weight_dtype::f32, 7);
  auto s = rh.make<medusa::head_stack<>>();
  CHECK(s.first_layer_contiguous());  // random_heads packs [L][K][d][d]
  const auto hidden = heads_test::random_hidden(M * d, 8);
  std::vector<float> a(M * K * V), b(M * K * V);
  medusa::portable_gemm<> g;
  s.forward(g, hidden, M, a, medusa::head_forward_options{true});
  s.forward(g, hidden, M, b, medusa::head_forward_options{false});
  for (std::size_t i = 0; i < a.size(); ++i) CHECK(a[i] == doctest::Approx(b[i]).epsilon(1e-5));
  // Separate buffers per head: not fusable, still correct.
  std::vector<float> w1(d * d);
  s.set_resblock(1, 0, medusa::weight_ptr::of(w1.data()), rh.b(1, 0));
  CHECK_FALSE(s.first_layer_contiguous());
}

TEST_CASE("head_stack: static counts, accessors and errors") {
  medusa::head_stack<3, 2> s(8, 16, medusa::projection_kind::per_head);
  static_assert(decltype(s)::static_heads == 3 && decltype(s)::static_layers == 2);
  CHECK(s.num_heads() == 3);
  CHECK(s.num_layers() == 2);
  CHECK(s.workspace_size(4) == 2 * 4 * 3 * 8);
  CHECK_THROWS_AS((medusa::head_stack<3, 2>(8, 16, 4, 2, medusa::projection_kind::per_head)), medusa::invalid_input);
  CHECK_THROWS_AS((medusa::head_stack<>(0, 16, 4, 2, medusa::projection_kind::per_head)), medusa::invalid_input);
  CHECK_THROWS_AS(s.set_resblock(3, 0, {}, {}), medusa::invalid_input);
  CHECK_THROWS_AS(s.set_lm_head({}), medusa::invalid_input);
  // Unset weights are reported, never used.
  std::vector<float> h(8), out(3 * 16);
  medusa::portable_gemm<> g;
  CHECK_THROWS_WITH_AS(s.forward(g, h, 1, out), doctest::Contains("head 0 layer 0 has no weights set"), medusa::invalid_input);
  heads_test::random_heads rh(8, 16, 3, 2, medusa::projection_kind::per_head, medusa::weight_dtype::f32, 3);
  auto full = rh.make<medusa::head_stack<3, 2>>();
  CHECK_NOTHROW(full.validate());
  std::vector<float> small(3 * 16 - 1);
  CHECK_THROWS_AS(full.forward(g, h, 1, small), medusa::invalid_input);
  std::vector<float> ws(full.workspace_size(1) - 1);
  CHECK_THROWS_AS(full.forward(g, h, 1, out, ws), medusa::invalid_input);
}

TEST_CASE("shared lm_head heads with L = 0 are all lm_head(h)") {
  const std::size_t d = 16, V = 32, K = 3;
  heads_test::random_heads rh(d, V, K, 0, medusa::projection_kind::shared_lm_head, medusa::weight_dtype::f32, 11);
  auto s = rh.make<medusa::head_stack<>>();
  const auto hidden = heads_test::random_hidden(2 * d, 12);
  std::vector<float> out(2 * K * V);
  medusa::portable_gemm<> g;
  s.forward(g, hidden, 2, out);
  for (std::size_t m = 0; m < 2; ++m)
    for (std::size_t k = 1; k < K; ++k)
      for (std::size_t v = 0; v < V; ++v) CHECK(out[(m * K + k) * V + v] == out[(m * K) * V + v]);
}
