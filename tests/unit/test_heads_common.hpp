// SPDX-License-Identifier: Apache-2.0
// Shared by test_heads*.cpp: random heads, a float64 reference forward, and the checks that run
// one head stack through any GEMM policy.
#pragma once

#include <medusa/gemm.hpp>
#include <medusa/half.hpp>
#include <medusa/heads.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <span>
#include <vector>

namespace heads_test {

// Weights of K heads in one dtype, each tensor its own buffer (so the first layer is NOT
// contiguous) or packed [L][K][d][d] (contiguous, fusable).
struct random_heads {
  std::size_t d, V, K, L;
  medusa::projection_kind kind;
  medusa::weight_dtype dtype;
  std::vector<float> wf, bf, uf;                 // float values actually represented (after rounding)
  std::vector<std::uint16_t> w16, b16, u16;      // 16-bit storage when dtype != f32

  random_heads(std::size_t d_, std::size_t V_, std::size_t K_, std::size_t L_, medusa::projection_kind k,
               medusa::weight_dtype t, std::uint64_t seed)
      : d(d_), V(V_), K(K_), L(L_), kind(k), dtype(t) {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    const float sw = 1.0f / std::sqrt(static_cast<float>(d));
    wf.resize(L * K * d * d);
    bf.resize(L * K * d);
    uf.resize((k == medusa::projection_kind::per_head ? K : 1) * V * d);
    for (auto& x : wf) x = u(rng) * sw;
    for (auto& x : bf) x = u(rng) * 0.5f;
    for (auto& x : uf) x = u(rng) * sw;
    if (t != medusa::weight_dtype::f32) {
      auto round = [&](std::vector<float>& f, std::vector<std::uint16_t>& b) {
        b.resize(f.size());
        for (std::size_t i = 0; i < f.size(); ++i) {
          b[i] = t == medusa::weight_dtype::bf16 ? medusa::bfloat16(f[i]).bits() : medusa::half(f[i]).bits();
          f[i] = t == medusa::weight_dtype::bf16 ? static_cast<float>(medusa::bfloat16::from_bits(b[i]))
                                                 : static_cast<float>(medusa::half::from_bits(b[i]));
        }
      };
      round(wf, w16);
      round(bf, b16);
      round(uf, u16);
    }
  }
  medusa::weight_ptr ptr(const std::vector<float>& f, const std::vector<std::uint16_t>& b, std::size_t off) const {
    return dtype == medusa::weight_dtype::f32 ? medusa::weight_ptr::of(f.data() + off) : medusa::weight_ptr::of(b.data() + off, dtype);
  }
  medusa::weight_ptr w(std::size_t h, std::size_t l) const { return ptr(wf, w16, (l * K + h) * d * d); }
  medusa::weight_ptr b(std::size_t h, std::size_t l) const { return ptr(bf, b16, (l * K + h) * d); }
  medusa::weight_ptr u(std::size_t h) const { return ptr(uf, u16, kind == medusa::projection_kind::per_head ? h * V * d : 0); }

  template <class Stack>
  Stack make() const {
    Stack s(d, V, K, L, kind);
    for (std::size_t h = 0; h < K; ++h) {
      for (std::size_t l = 0; l < L; ++l) s.set_resblock(h, l, w(h, l), b(h, l));
      if (kind == medusa::projection_kind::per_head) s.set_projection(h, u(h));
    }
    if (kind == medusa::projection_kind::shared_lm_head) s.set_lm_head(u(0));
    return s;
  }

  // float64 reference: logits [M][K][V].
  std::vector<double> reference(const std::vector<float>& hidden, std::size_t M) const {
    std::vector<double> out(M * K * V);
    std::vector<double> x(d), t(d);
    for (std::size_t m = 0; m < M; ++m)
      for (std::size_t h = 0; h < K; ++h) {
        for (std::size_t i = 0; i < d; ++i) x[i] = hidden[m * d + i];
        for (std::size_t l = 0; l < L; ++l) {
          const float* W = wf.data() + (l * K + h) * d * d;
          const float* B = bf.data() + (l * K + h) * d;
          for (std::size_t o = 0; o < d; ++o) {
            double s = B[o];
            for (std::size_t i = 0; i < d; ++i) s += static_cast<double>(W[o * d + i]) * x[i];
            t[o] = s / (1.0 + std::exp(-s));
          }
          for (std::size_t i = 0; i < d; ++i) x[i] += t[i];
        }
        const float* U = uf.data() + (kind == medusa::projection_kind::per_head ? h * V * d : 0);
        for (std::size_t v = 0; v < V; ++v) {
          double s = 0;
          for (std::size_t i = 0; i < d; ++i) s += static_cast<double>(U[v * d + i]) * x[i];
          out[(m * K + h) * V + v] = s;
        }
      }
    return out;
  }
};

// max |got - ref| / max |ref|: a norm-wise relative error (element-wise blows up near zero).
inline double rel_error(std::span<const float> got, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    num = std::max(num, std::abs(static_cast<double>(got[i]) - ref[i]));
    den = std::max(den, std::abs(ref[i]));
  }
  return den == 0 ? num : num / den;
}

inline std::vector<float> random_hidden(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::vector<float> h(n);
  for (auto& x : h) x = g(rng);
  return h;
}

// Runs random shapes for K in 1..5, L in 0..2, both variants, f32/bf16/f16, several batch sizes,
// dynamic and static stacks, fused and unfused first layers, and checks against the reference.
template <class Gemm>
void check_forward_against_reference(Gemm& gemm) {
  using medusa::projection_kind;
  using medusa::weight_dtype;
  std::mt19937_64 rng(1234);
  int cases = 0;
  for (std::size_t K = 1; K <= 5; ++K)
    for (std::size_t L = 0; L <= 2; ++L)
      for (auto kind : {projection_kind::per_head, projection_kind::shared_lm_head})
        for (auto dtype : {weight_dtype::f32, weight_dtype::bf16, weight_dtype::f16}) {
          const std::size_t d = 8 + rng() % 70, V = 16 + rng() % 150, M = 1 + rng() % 6;
          CAPTURE(K);
          CAPTURE(L);
          CAPTURE(d);
          CAPTURE(V);
          CAPTURE(M);
          CAPTURE(static_cast<int>(kind));
          CAPTURE(static_cast<int>(dtype));
          random_heads rh(d, V, K, L, kind, dtype, rng());
          const auto hidden = random_hidden(M * d, rng());
          const auto ref = rh.reference(hidden, M);
          // The reference uses the rounded weights, so the remaining error is float accumulation
          // (activations stay f32): 1e-5 suffices for every dtype; bf16 keeps a looser 1e-2 anyway.
          const double tol = dtype == weight_dtype::bf16 ? 1e-2 : 1e-5;
          auto dyn = rh.template make<medusa::head_stack<>>();
          std::vector<float> logits(M * K * V, std::nanf(""));
          for (bool fuse : {true, false}) {
            std::fill(logits.begin(), logits.end(), std::nanf(""));
            dyn.forward(gemm, hidden, M, logits, medusa::head_forward_options{fuse});
            CHECK(rel_error(logits, ref) <= tol);
          }
          if (K == 4 && L == 1) {  // a statically sized stack gives the same numbers
            auto st = rh.template make<medusa::head_stack<4, 1>>();
            std::vector<float> ls(M * K * V);
            st.forward(gemm, hidden, M, ls);
            CHECK(rel_error(ls, ref) <= tol);
          }
          ++cases;
        }
  CHECK(cases == 90);
}

// All four op combinations and alpha/beta against a double reference.
template <class Gemm>
void check_gemm_ops(Gemm& gemm) {
  std::mt19937_64 rng(99);
  std::uniform_real_distribution<float> u(-1, 1);
  for (auto dtype : {medusa::weight_dtype::f32, medusa::weight_dtype::bf16, medusa::weight_dtype::f16})
    for (auto op_a : {medusa::gemm_op::none, medusa::gemm_op::transpose})
      for (auto op_b : {medusa::gemm_op::none, medusa::gemm_op::transpose}) {
        const std::size_t M = 1 + rng() % 9, N = 1 + rng() % 150, K = 1 + rng() % 70;
        const std::size_t lda = (op_a == medusa::gemm_op::none ? K : M) + 3;
        const std::size_t ldb = (op_b == medusa::gemm_op::transpose ? K : N) + 2;
        const std::size_t ldc = N + 5;
        const std::size_t arows = op_a == medusa::gemm_op::none ? M : K;
        const std::size_t brows = op_b == medusa::gemm_op::transpose ? N : K;
        std::vector<float> A(arows * lda), Bf(brows * ldb), C(M * ldc);
        for (auto& x : A) x = u(rng);
        for (auto& x : Bf) x = u(rng);
        for (auto& x : C) x = u(rng);
        std::vector<std::uint16_t> B16(Bf.size());
        for (std::size_t i = 0; i < Bf.size(); ++i) {
          if (dtype == medusa::weight_dtype::bf16) {
            B16[i] = medusa::bfloat16(Bf[i]).bits();
            Bf[i] = medusa::bfloat16::from_bits(B16[i]);
          } else if (dtype == medusa::weight_dtype::f16) {
            B16[i] = medusa::half(Bf[i]).bits();
            Bf[i] = medusa::half::from_bits(B16[i]);
          }
        }
        const auto bp = dtype == medusa::weight_dtype::f32 ? medusa::weight_ptr::of(Bf.data()) : medusa::weight_ptr::of(B16.data(), dtype);
        const float alpha = 0.75f, beta = -0.5f;
        std::vector<double> ref(M * N);
        for (std::size_t i = 0; i < M; ++i)
          for (std::size_t j = 0; j < N; ++j) {
            double s = 0;
            for (std::size_t k = 0; k < K; ++k) {
              const double a = op_a == medusa::gemm_op::none ? A[i * lda + k] : A[k * lda + i];
              const double b = op_b == medusa::gemm_op::transpose ? Bf[j * ldb + k] : Bf[k * ldb + j];
              s += a * b;
            }
            ref[i * N + j] = alpha * s + beta * C[i * ldc + j];
          }
        gemm.gemm(op_a, op_b, M, N, K, alpha, A.data(), lda, bp, ldb, beta, C.data(), ldc);
        double err = 0;
        for (std::size_t i = 0; i < M; ++i)
          for (std::size_t j = 0; j < N; ++j) err = std::max(err, std::abs(C[i * ldc + j] - ref[i * N + j]));
        CAPTURE(M);
        CAPTURE(N);
        CAPTURE(K);
        CHECK(err < 1e-4);
        // beta = 0 ignores NaNs already in C.
        std::vector<float> C2(M * ldc, std::nanf(""));
        gemm.gemm(op_a, op_b, M, N, K, 1.0f, A.data(), lda, bp, ldb, 0.0f, C2.data(), ldc);
        CHECK(std::isfinite(C2[0]));
        CHECK(std::isfinite(C2[(M - 1) * ldc + N - 1]));
      }
}

}  // namespace heads_test
