// SPDX-License-Identifier: Apache-2.0
// The backbone pieces of Medusa-2 training (medusa_train/backbone_math.hpp): every backward pass
// against central finite differences in double, through a loss L = Σ c ⊙ y with a random c.
#include <medusa_train/backbone_math.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <vector>

namespace bb = medusa_train::backbone;

namespace {

std::vector<double> random_vec(std::mt19937& rng, std::size_t n, double scale = 1.0) {
  std::uniform_real_distribution<double> u(-scale, scale);
  std::vector<double> v(n);
  for (double& x : v) x = u(rng);
  return v;
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// Central differences of `loss` with respect to every element of `x`, against `analytic`.
void check_gradient(const char* what, std::vector<double>& x, const std::vector<double>& analytic,
                    const std::function<double()>& loss) {
  REQUIRE(analytic.size() == x.size());
  double worst = 0, scale = 1e-12;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double keep = x[i], h = 1e-6;
    x[i] = keep + h;
    const double up = loss();
    x[i] = keep - h;
    const double down = loss();
    x[i] = keep;
    const double numeric = (up - down) / (2 * h);
    worst = std::max(worst, std::fabs(numeric - analytic[i]));
    scale = std::max(scale, std::fabs(numeric));
  }
  INFO(what << ": largest difference " << worst << " of the scale " << scale);
  CHECK(worst <= 1e-6 * scale);
}

}  // namespace

TEST_CASE("RMSNorm backward: dx and dw match finite differences") {
  std::mt19937 rng(1);
  const std::size_t n = 3, d = 8;
  auto x = random_vec(rng, n * d), w = random_vec(rng, d), c = random_vec(rng, n * d);
  std::vector<double> y(n * d), r(n);
  const auto loss = [&] {
    bb::rmsnorm_forward(n, d, x.data(), w.data(), 1e-5, y.data(), r.data());
    return dot(c, y);
  };
  loss();
  std::vector<double> dx(n * d), dw(d, 0.0);
  bb::rmsnorm_backward(n, d, x.data(), w.data(), r.data(), c.data(), dx.data(), dw.data());
  check_gradient("dx", x, dx, loss);
  check_gradient("dw", w, dw, loss);
}

TEST_CASE("RoPE backward is the inverse rotation, both pairings") {
  std::mt19937 rng(2);
  const std::size_t n = 4, heads = 2, hd = 8;
  const std::vector<std::int32_t> pos = {0, 3, 17, 250};
  for (const auto pairs : {bb::rope_pairs::adjacent, bb::rope_pairs::halves}) {
    auto x = random_vec(rng, n * heads * hd), c = random_vec(rng, x.size());
    const auto loss = [&] {
      auto y = x;
      bb::rope(n, heads, hd, y.data(), pos, 10000.0, pairs);
      return dot(c, y);
    };
    auto dx = c;
    bb::rope(n, heads, hd, dx.data(), pos, 10000.0, pairs, /*inverse*/ true);
    check_gradient("dx", x, dx, loss);
    // rotating there and back is the identity
    auto y = x;
    bb::rope(n, heads, hd, y.data(), pos, 10000.0, pairs);
    bb::rope(n, heads, hd, y.data(), pos, 10000.0, pairs, true);
    for (std::size_t i = 0; i < x.size(); ++i) CHECK(y[i] == doctest::Approx(x[i]).epsilon(1e-12));
  }
}

TEST_CASE("causal attention with grouped-query heads: forward is causal, backward matches finite differences") {
  std::mt19937 rng(3);
  const bb::attention_shape s{.n = 5, .heads = 4, .kv_heads = 2, .hd = 4};
  auto q = random_vec(rng, s.n * s.heads * s.hd), k = random_vec(rng, s.n * s.kv_heads * s.hd),
       v = random_vec(rng, k.size()), c = random_vec(rng, q.size());
  std::vector<double> out(q.size()), probs(s.heads * s.n * s.n);
  const auto loss = [&] {
    bb::attention_forward(s, q.data(), k.data(), v.data(), out.data(), probs.data());
    return dot(c, out);
  };
  loss();
  // the first token sees only itself: its output is its own value
  for (std::size_t h = 0; h < s.heads; ++h)
    for (std::size_t j = 0; j < s.hd; ++j) CHECK(out[h * s.hd + j] == doctest::Approx(v[(h / 2) * s.hd + j]));
  std::vector<double> dq(q.size()), dk(k.size()), dv(v.size());
  bb::attention_backward(s, q.data(), k.data(), v.data(), probs.data(), c.data(), dq.data(), dk.data(), dv.data());
  check_gradient("dq", q, dq, loss);
  check_gradient("dk", k, dk, loss);
  check_gradient("dv", v, dv, loss);
}

TEST_CASE("SwiGLU backward matches finite differences") {
  std::mt19937 rng(4);
  const std::size_t count = 24;
  auto a = random_vec(rng, count, 3.0), b = random_vec(rng, count), c = random_vec(rng, count);
  std::vector<double> h(count);
  const auto loss = [&] {
    bb::swiglu_forward(count, a.data(), b.data(), h.data());
    return dot(c, h);
  };
  std::vector<double> da(count), db(count);
  bb::swiglu_backward(count, a.data(), b.data(), c.data(), da.data(), db.data());
  check_gradient("da", a, da, loss);
  check_gradient("db", b, db, loss);
}

TEST_CASE("LoRA linear: backward of x, A and B with dropout; the merged weight gives the same forward") {
  std::mt19937 rng(5);
  const std::size_t n = 3, in = 6, out = 5, rank = 2;
  auto x = random_vec(rng, n * in), W = random_vec(rng, out * in), A = random_vec(rng, rank * in),
       B = random_vec(rng, out * rank), c = random_vec(rng, n * out);
  std::vector<double> keep(n * in);
  for (std::size_t i = 0; i < keep.size(); ++i) keep[i] = (i % 5 == 2) ? 0.0 : 1.0 / 0.95;
  bb::lora_linear<double> l{.in = in, .out = out, .rank = rank, .W = W.data(), .A = A.data(), .B = B.data(),
                            .scaling = 16.0 / 2.0};
  std::vector<double> y(n * out), xa(n * rank);
  const auto loss = [&] {
    bb::linear_forward(l, n, x.data(), keep.data(), y.data(), xa.data());
    return dot(c, y);
  };
  loss();
  std::vector<double> dx(n * in), dA(A.size(), 0.0), dB(B.size(), 0.0);
  bb::linear_backward(l, n, x.data(), keep.data(), xa.data(), c.data(), dx.data(), dA.data(), dB.data());
  check_gradient("dx", x, dx, loss);
  check_gradient("dA", A, dA, loss);
  check_gradient("dB", B, dB, loss);

  // Without dropout (inference), W + s·B A gives the adapter's output.
  bb::linear_forward(l, n, x.data(), nullptr, y.data(), xa.data());
  const auto merged = bb::merged_weight(l);
  const bb::lora_linear<double> plain{.in = in, .out = out, .W = merged.data()};
  std::vector<double> y2(n * out);
  bb::linear_forward(plain, n, x.data(), nullptr, y2.data(), nullptr);
  for (std::size_t i = 0; i < y.size(); ++i) CHECK(y2[i] == doctest::Approx(y[i]).epsilon(1e-12));
}

TEST_CASE("self-distillation KL: gradient, zero against itself, positive otherwise") {
  std::mt19937 rng(6);
  const std::size_t V = 11;
  const std::vector<std::int32_t> ids = {7, 2, 9};
  const std::vector<float> tl = {2.5f, 1.0f, -0.5f};
  const bb::teacher_row teacher{ids, tl};
  auto z = random_vec(rng, V, 2.0);
  const auto loss = [&] {
    auto row = z;
    return bb::kl_row(row.data(), V, teacher, 1.0);
  };
  auto grad = z;
  const double kl = bb::kl_row(grad.data(), V, teacher, 1.0);
  CHECK(kl > 0);
  check_gradient("dz", z, grad, loss);

  // A student that puts exactly the teacher's probabilities on its k tokens (and ~0 elsewhere).
  std::vector<double> same(V, -1e4);
  for (std::size_t i = 0; i < ids.size(); ++i) same[static_cast<std::size_t>(ids[i])] = tl[i] + 3.0;
  CHECK(bb::kl_row(same.data(), V, teacher, 1.0) == doctest::Approx(0.0).epsilon(1e-9));
  for (double g : same) CHECK(std::fabs(g) < 1e-9);
}

TEST_CASE("self-distillation KL with the teacher's normaliser: the rest of the vocabulary is one bucket") {
  std::mt19937 rng(7);
  const std::size_t V = 13;
  auto full = random_vec(rng, V, 2.0);  // the teacher's whole row
  double lse = 0;
  for (double l : full) lse += std::exp(l);
  lse = std::log(lse);
  std::vector<std::int32_t> ids = {4, 0, 11, 6};
  std::vector<float> tl;
  for (auto i : ids) tl.push_back(static_cast<float>(full[static_cast<std::size_t>(i)]));
  const bb::teacher_row teacher{ids, tl, static_cast<float>(lse)};
  auto z = random_vec(rng, V, 2.0);
  const auto loss = [&] {
    auto row = z;
    return bb::kl_row(row.data(), V, teacher, 1.0);
  };
  auto grad = z;
  CHECK(bb::kl_row(grad.data(), V, teacher, 1.0) > 0);
  check_gradient("dz with a bucket", z, grad, loss);
  // The teacher itself (same logits everywhere) has KL 0 and gradient 0; the bucket only fixes
  // the tail's mass, so a student with the teacher's k and another tail shape of the same mass
  // has KL 0 too.
  std::vector<double> same(full.begin(), full.end());
  for (std::size_t i = 0; i < tl.size(); ++i) same[static_cast<std::size_t>(ids[i])] = tl[i];
  CHECK(std::fabs(bb::kl_row(same.data(), V, teacher, 1.0)) < 1e-6);
  for (double g : same) CHECK(std::fabs(g) < 1e-6);
}

TEST_CASE("Medusa heads: the gradient with respect to their input (what the backbone receives)") {
  for (std::size_t L : {0u, 1u, 2u}) {
    std::mt19937 rng(static_cast<unsigned>(20 + L));
    const medusa_train::head_shape s{6, 11, 3, L};
    const std::size_t B = 4;
    auto params = random_vec(rng, s.num_params(), 0.5), x = random_vec(rng, B * s.d);
    std::vector<std::int32_t> targets{1, 5, medusa_train::ignore_index, 7, 2, 0, 10, medusa_train::ignore_index, 3, 4, 9, 6};
    const std::vector<double> weights{1.0, 0.8, 0.64};
    medusa_train::head_workspace<double> ws;
    const auto loss = [&] { return medusa_train::head_loss_grad<double>(s, params.data(), nullptr, x.data(), B, targets.data(), weights.data(), ws).loss; };
    std::vector<double> dx(B * s.d, 0.0), grads(s.num_params(), 0.0);
    medusa_train::head_loss_grad<double>(s, params.data(), grads.data(), x.data(), B, targets.data(), weights.data(), ws, medusa::sequential_for{},
                                         dx.data());
    check_gradient(L == 0 ? "heads dx, L = 0" : "heads dx, L > 0", x, dx, loss);
  }
}
