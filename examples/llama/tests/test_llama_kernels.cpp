// SPDX-License-Identifier: Apache-2.0
// The engine's vector kernels on every instruction set this build and CPU support
// (medusa_llama/cpu.hpp): each weight format's GEMM against the column-at-a-time reference, and a
// token's results independent of how many tokens the pass holds; the element-wise kernels against
// plain loops; choosing and limiting the instruction set.
#include <medusa_llama/cpu.hpp>
#include <medusa_llama/errors.hpp>

#include "../src/gemm.hpp"            // private kernels
#include "../src/kernels.hpp"         // private kernels
#include "../src/simd/attention.hpp"  // private kernels
#include "cpu_targets.hpp"

#include <medusa/attention.hpp>
#include <medusa/heads.hpp>
#include <medusa/kv_cache.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

using namespace medusa_llama;
using medusa_llama_test::for_each_cpu_target;

namespace {

std::size_t sz(int v) { return static_cast<std::size_t>(v); }

std::vector<float> random_floats(std::size_t n, std::uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

constexpr weight_format kFormats[] = {weight_format::f32, weight_format::bf16, weight_format::int8, weight_format::q8_0,
                                      weight_format::q4_0};
constexpr detail::epilogue kOps[] = {detail::epilogue::store, detail::epilogue::add, detail::epilogue::swiglu};

detail::packed_matrix pack(weight_format fmt, detail::epilogue op, int rows, int in, std::uint32_t seed) {
  const auto W = random_floats(sz(rows) * sz(in), seed), W3 = random_floats(sz(rows) * sz(in), seed + 1);
  return op == detail::epilogue::swiglu ? detail::packed_matrix::swiglu_pair(W.data(), W3.data(), rows, in, fmt)
                                        : detail::packed_matrix(W.data(), rows, in, fmt);
}

}  // namespace

TEST_CASE("the instruction sets: listed best first, chosen, limited and restored; unknown names are rejected") {
  const auto targets = cpu_targets();
  REQUIRE(!targets.empty());
  MESSAGE("kernels compiled for this CPU: " << [&] {
    std::string s;
    for (const auto& t : targets) s += t + " ";
    return s;
  }());
  CHECK(cpu_target() == targets.front());
  set_cpu_target(targets.back());
  CHECK(cpu_target() == targets.back());
  set_cpu_target("best");
  CHECK(cpu_target() == targets.front());
  set_cpu_target(targets.front());  // names are case-insensitive
  CHECK(cpu_target() == targets.front());
  std::string lower = targets.back();
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  set_cpu_target(lower);
  CHECK(cpu_target() == targets.back());
  set_cpu_target("best");
  try {
    set_cpu_target("pentium");
    FAIL("an unknown instruction set was accepted");
  } catch (const engine_error& e) {
    CHECK(e.code() == engine_errc::bad_option);
    CHECK(std::string(e.what()).find("pentium") != std::string::npos);
    CHECK(std::string(e.what()).find(targets.front()) != std::string::npos);
  }
  CHECK(cpu_target() == targets.front());  // unchanged by the failed call
}

TEST_CASE("every instruction set: each weight format's GEMM equals the column-at-a-time reference") {
  const int shapes[][2] = {{1, 1}, {5, 3}, {16, 32}, {17, 31}, {33, 64}, {50, 100}, {96, 7}, {130, 45}, {40, 384}};
  for_each_cpu_target([&](const std::string& target) {
    for (auto fmt : kFormats)
      for (const auto& sh : shapes)
        for (int T : {1, 2, 3, 5, 8, 9, 13})
          for (auto op : kOps) {
            const int rows = sh[0], in = sh[1];
            const std::string fmt_name = to_string(fmt);
            CAPTURE(fmt_name);
            CAPTURE(rows);
            CAPTURE(in);
            CAPTURE(T);
            CAPTURE(static_cast<int>(op));
            const auto P = pack(fmt, op, rows, in, 11);
            const std::size_t ldx = sz(in) + 2, ldy = sz(rows) + 3;  // strides wider than the rows
            const auto X = random_floats(sz(T) * ldx, 3);
            auto Y = random_floats(sz(T) * ldy, 4);
            auto Yref = Y;
            const detail::gemm_input gi{X.data(), ldx, T};
            // The groups in two uneven calls, as two threads would run them.
            const int split = P.groups() / 3;
            detail::gemm_packed(P, gi, Y.data(), ldy, 0, split, op);
            detail::gemm_packed(P, gi, Y.data(), ldy, split, P.groups(), op);
            detail::gemm_reference(P, gi, Yref.data(), ldy, 0, P.groups(), op);
            // Fused multiply-adds in the reference's order give its bits (int8: the same exact
            // integer sums, then the same products); the SwiGLU epilogue approximates its
            // exponential, and SSE4 rounds products and sums apart.
            const bool exact = op != detail::epilogue::swiglu &&
                               (medusa_llama_test::fused_multiply_add(target) || fmt == weight_format::int8);
            double err = 0;
            for (std::size_t i = 0; i < Y.size(); ++i)
              err = std::max(err, std::abs(static_cast<double>(Y[i]) - Yref[i]) / (1.0 + std::abs(Yref[i])));
            if (exact)
              CHECK(std::memcmp(Y.data(), Yref.data(), Y.size() * sizeof(float)) == 0);
            else
              CHECK(err < 1e-4);
          }
  });
}

TEST_CASE("every instruction set: a token's GEMM results do not depend on the other tokens of the pass") {
  // What keeps greedy Medusa decoding identical to plain decoding: a tree step's rows against
  // the same row alone (a plain decoding step), bit for bit, in every format and epilogue.
  const int shapes[][2] = {{17, 31}, {50, 100}, {130, 45}, {64, 384}};
  for_each_cpu_target([&](const std::string&) {
    for (auto fmt : kFormats)
      for (const auto& sh : shapes)
        for (auto op : kOps) {
          const int rows = sh[0], in = sh[1], T = 64;
          const std::string fmt_name = to_string(fmt);
          CAPTURE(fmt_name);
          CAPTURE(rows);
          CAPTURE(in);
          CAPTURE(static_cast<int>(op));
          const auto P = pack(fmt, op, rows, in, 21);
          const auto X = random_floats(sz(T) * sz(in), 5);
          const auto Y0 = random_floats(sz(T) * sz(rows), 6);  // for the `add` epilogue
          auto all = Y0;
          detail::gemm_packed(P, {X.data(), sz(in), T}, all.data(), sz(rows), 0, P.groups(), op);
          for (int first : {0, 1, 7, 30, 63})
            for (int n : {1, 2, 3, 4, 5, 6, 9, 16}) {
              if (first + n > T) continue;
              CAPTURE(first);
              CAPTURE(n);
              std::vector<float> part(Y0.begin() + static_cast<std::ptrdiff_t>(sz(first) * sz(rows)),
                                      Y0.begin() + static_cast<std::ptrdiff_t>(sz(first + n) * sz(rows)));
              detail::gemm_packed(P, {X.data() + sz(first) * sz(in), sz(in), n}, part.data(), sz(rows), 0, P.groups(), op);
              CHECK(std::memcmp(part.data(), all.data() + sz(first) * sz(rows), part.size() * sizeof(float)) == 0);
            }
        }
  });
}

TEST_CASE("every instruction set: a row with a non-finite activation gives NaN outputs in that row only") {
  for_each_cpu_target([&](const std::string&) {
    for (auto fmt : {weight_format::int8, weight_format::q8_0, weight_format::q4_0}) {
      const int rows = 40, in = 70, T = 3;
      const auto W = random_floats(sz(rows) * sz(in), 5);
      auto X = random_floats(sz(T) * sz(in), 6);
      X[sz(in) + 65] = std::numeric_limits<float>::infinity();  // row 1, last block
      const detail::packed_matrix P(W.data(), rows, in, fmt);
      std::vector<float> Y(sz(T) * sz(rows));
      detail::gemm_packed(P, {X.data(), sz(in), T}, Y.data(), sz(rows), 0, P.groups(), detail::epilogue::store);
      for (int t = 0; t < T; ++t)
        for (int r = 0; r < rows; ++r) CHECK(std::isnan(Y[sz(t) * sz(rows) + sz(r)]) == (t == 1));
    }
  });
}

TEST_CASE("every instruction set: the element-wise kernels equal plain loops") {
  for_each_cpu_target([&](const std::string&) {
    for (int n : {1, 3, 8, 17, 64, 100, 384}) {
      CAPTURE(n);
      const auto x = random_floats(sz(n), 1), w = random_floats(sz(n), 2), u = random_floats(sz(n), 3);
      const auto t = random_floats(sz(n), 4, 4.0f), b = random_floats(sz(n), 5);
      auto near = [](double a, double r) { return std::abs(a - r) <= 1e-5 * (1.0 + std::abs(r)); };
      // dot, RMSNorm
      double dot = 0, ss = 0;
      for (int i = 0; i < n; ++i) {
        dot += static_cast<double>(x[sz(i)]) * w[sz(i)];
        ss += static_cast<double>(x[sz(i)]) * x[sz(i)];
      }
      CHECK(std::abs(detail::dot(x.data(), w.data(), n) - dot) < 1e-4 * (1.0 + std::sqrt(ss * n)));
      std::vector<float> out(sz(n));
      detail::rmsnorm(out.data(), x.data(), w.data(), n, 1e-5f);
      const double inv = 1.0 / std::sqrt(ss / n + 1e-5);
      for (int i = 0; i < n; ++i) CHECK(near(out[sz(i)], w[sz(i)] * inv * x[sz(i)]));
      // SwiGLU and the heads' residual block
      auto g = t;
      detail::silu_mul(g.data(), u.data(), n);
      for (int i = 0; i < n; ++i) CHECK(near(g[sz(i)], static_cast<double>(medusa::silu(t[sz(i)])) * u[sz(i)]));
      detail::silu_residual(out.data(), x.data(), t.data(), b.data(), n);
      for (int i = 0; i < n; ++i) CHECK(near(out[sz(i)], x[sz(i)] + static_cast<double>(medusa::silu(t[sz(i)] + b[sz(i)]))));
    }
    // RoPE, both pair layouts, heads of 8 to 128 floats
    for (int hd : {8, 16, 64, 72, 128})
      for (bool adjacent : {true, false}) {
        CAPTURE(hd);
        CAPTURE(adjacent);
        const int heads = 3, half = hd / 2;
        const auto v0 = random_floats(sz(heads * hd), 7), cs = random_floats(sz(half), 8), sn = random_floats(sz(half), 9);
        auto v = v0;
        detail::rope(v.data(), heads, hd, cs.data(), sn.data(), adjacent);
        for (int h = 0; h < heads; ++h)
          for (int i = 0; i < half; ++i) {
            const std::size_t a = sz(h * hd + (adjacent ? 2 * i : i)), c = sz(h * hd + (adjacent ? 2 * i + 1 : i + half));
            CHECK(std::abs(v[a] - (v0[a] * cs[sz(i)] - v0[c] * sn[sz(i)])) < 1e-5);
            CHECK(std::abs(v[c] - (v0[a] * sn[sz(i)] + v0[c] * cs[sz(i)])) < 1e-5);
          }
      }
  });
}

TEST_CASE("every instruction set: the attention kernels give the library's attention, and a tree node the bits of its row alone") {
  // A tree of n nodes (parents among the earlier nodes) over L committed slots; head dimensions
  // with and without a full last vector.
  for_each_cpu_target([&](const std::string&) {
    std::mt19937 rng(3);
    for (int D : {8, 20, 64, 72}) {
      for (int L : {0, 5, 63, 64, 130}) {
        CAPTURE(D);
        CAPTURE(L);
        const int hkv = 2, hq = 4, n = 21, cap = L + n;
        std::vector<int> parent(sz(n), -1);
        for (int i = 1; i < n; ++i) parent[sz(i)] = static_cast<int>(rng() % static_cast<unsigned>(i));
        std::vector<std::uint32_t> mask(sz(n), 0);
        for (int i = 0; i < n; ++i)
          for (int u = i; u >= 0; u = parent[sz(u)]) mask[sz(i)] |= 1u << u;
        auto k = random_floats(sz(cap * hkv * D), 7), v = random_floats(sz(cap * hkv * D), 8);
        const auto q = random_floats(sz(n * hq * D), 9);
        const auto kv = medusa::make_kv_view<float>(k, v, medusa::kv_extents{1, hkv, D}, cap);
        const medusa::attention_options mine{.kernels = &detail::attention_kernels()};
        std::vector<float> out(q.size()), ref(q.size());
        medusa::tree_attention(kv, 0, L, q, n, hq, medusa::tree_mask_view{mask, 1}, out, mine);
        medusa::tree_attention(kv, 0, L, q, n, hq, medusa::tree_mask_view{mask, 1}, ref);
        double err = 0;
        for (std::size_t i = 0; i < out.size(); ++i) err = std::max(err, static_cast<double>(std::abs(out[i] - ref[i])));
        CHECK(err < 1e-5);
        // Node i decoded alone: its ancestors committed in order after the prefix, then the
        // node as the single causal query.
        for (int node : {0, 1, n / 2, n - 1}) {
          std::vector<int> path;
          for (int u = node; u >= 0; u = parent[sz(u)]) path.insert(path.begin(), u);
          const int m = static_cast<int>(path.size());
          std::vector<float> pk(sz((L + m) * hkv * D)), pv(pk.size());
          std::copy_n(k.begin(), L * hkv * D, pk.begin());
          std::copy_n(v.begin(), L * hkv * D, pv.begin());
          for (int t = 0; t < m; ++t) {
            std::copy_n(k.begin() + (L + path[sz(t)]) * hkv * D, hkv * D, pk.begin() + (L + t) * hkv * D);
            std::copy_n(v.begin() + (L + path[sz(t)]) * hkv * D, hkv * D, pv.begin() + (L + t) * hkv * D);
          }
          const auto pkv = medusa::make_kv_view<float>(pk, pv, medusa::kv_extents{1, hkv, D}, L + m);
          std::vector<float> alone(sz(hq * D));
          medusa::causal_attention(pkv, 0, L + m - 1, std::span<const float>(q).subspan(sz(node * hq * D), alone.size()), 1, hq,
                                   alone, mine);
          CHECK(std::memcmp(alone.data(), out.data() + sz(node * hq * D), alone.size() * sizeof(float)) == 0);
        }
      }
    }
  });
}
