// SPDX-License-Identifier: Apache-2.0
// medusa_llama::packed_heads (the heads on the engine's packed kernels) against the library's
// head_stack forward, for per-head and shared projections, 0-2 ResBlocks, every format, one row and
// a batch of rows; and the
// decoder with packed heads stays lossless.
#include <medusa_llama/llama.hpp>
#include <medusa_llama/load.hpp>

#include <medusa/medusa.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

using namespace medusa_llama;

namespace {

model_config tiny_config() {
  model_config c;
  c.dim = 64;
  c.hidden_dim = 96;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.vocab_size = 97;  // not a multiple of 16: ragged last panel
  c.seq_len = 96;
  return c;
}

// Heads with every weight random (so that each ResBlock matters).
medusa::head_weights random_stack(const model& m, std::size_t K, std::size_t L, medusa::projection_kind kind, unsigned seed) {
  const auto d = static_cast<std::size_t>(m.config().dim), V = static_cast<std::size_t>(m.config().vocab_size);
  medusa::head_weights w(d, V, K, L, kind, medusa::weight_dtype::f32);
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 0.3f);
  auto fill = [&](std::span<std::byte> bytes) {
    auto* f = reinterpret_cast<float*>(bytes.data());
    for (std::size_t i = 0; i < bytes.size() / sizeof(float); ++i) f[i] = nd(rng);
  };
  for (std::size_t h = 0; h < K; ++h) {
    for (std::size_t l = 0; l < L; ++l) {
      fill(w.resblock_weight_bytes(h, l));
      fill(w.resblock_bias_bytes(h, l));
    }
    if (kind == medusa::projection_kind::per_head) fill(w.projection_bytes(h));
  }
  return w;
}

// In place: every row of `rows` × `in` floats as the int8 packing stores it (per-row symmetric).
void round_rows_int8(float* w, std::size_t rows, std::size_t in) {
  for (std::size_t r = 0; r < rows; ++r) {
    float* row = w + r * in;
    float amax = 0.0f;
    for (std::size_t k = 0; k < in; ++k) amax = std::max(amax, std::abs(row[k]));
    const float s = amax / 127.0f;
    for (std::size_t k = 0; k < in; ++k) row[k] = s > 0.0f ? std::clamp(std::nearbyint(row[k] / s), -127.0f, 127.0f) * s : 0.0f;
  }
}

}  // namespace

TEST_CASE("packed heads equal the head_stack forward") {
  engine eng(model::random(tiny_config(), 3, 0.2f), engine_options{.threads = 2});
  const int d = eng.config().dim, V = eng.config().vocab_size;
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (auto kind : {medusa::projection_kind::per_head, medusa::projection_kind::shared_lm_head})
    for (std::size_t L : {0u, 1u, 2u})
      for (std::size_t K : {1u, 3u})
        for (auto fmt : {weight_format::f32, weight_format::bf16, weight_format::int8}) {
          CAPTURE(static_cast<int>(kind));
          CAPTURE(L);
          CAPTURE(K);
          CAPTURE(static_cast<int>(fmt));
          auto w = random_stack(eng.weights(), K, L, kind, static_cast<unsigned>(K * 10 + L));
          // The reference sees the weights the packed heads use: bf16-rounded for bf16.
          if (fmt == weight_format::bf16) w = w.to_dtype(medusa::weight_dtype::bf16);
          const auto dd = static_cast<std::size_t>(d), VV = static_cast<std::size_t>(V);
          if (fmt == weight_format::int8) {
            for (std::size_t k = 0; k < K; ++k) {
              for (std::size_t l = 0; l < L; ++l) round_rows_int8(reinterpret_cast<float*>(w.resblock_weight_bytes(k, l).data()), dd, dd);
              if (kind == medusa::projection_kind::per_head) round_rows_int8(reinterpret_cast<float*>(w.projection_bytes(k).data()), VV, dd);
            }
          }
          // A shared lm_head is packed in the heads' format too.
          std::vector<float> lm_head(eng.weights().classifier(), eng.weights().classifier() + static_cast<std::size_t>(V * d));
          if (fmt == weight_format::bf16)
            for (auto& x : lm_head) x = static_cast<float>(medusa::bfloat16(x));
          if (fmt == weight_format::int8) round_rows_int8(lm_head.data(), VV, dd);
          const auto stack = kind == medusa::projection_kind::per_head
                                 ? w.view()
                                 : w.view(medusa::weight_ptr::of(lm_head.data()), static_cast<std::size_t>(V));
          packed_heads heads(eng, stack, fmt);
          CHECK(heads.num_heads() == static_cast<int>(K));
          CHECK(heads.vocab_size() == V);
          std::vector<float> h(static_cast<std::size_t>(d)), got(K * static_cast<std::size_t>(V)), want(got.size());
          for (int rep = 0; rep < 3; ++rep) {
            for (auto& x : h) x = nd(rng);
            heads.forward(h, got);
            medusa::portable_gemm<> gemm;
            stack.forward(gemm, h, 1, want);
            double err = 0, scale = 0;
            for (std::size_t i = 0; i < got.size(); ++i) {
              err = std::max(err, static_cast<double>(std::abs(got[i] - want[i])));
              scale = std::max(scale, static_cast<double>(std::abs(want[i])));
            }
            CHECK(scale > 0.1);       // the check compares real values
            // f32 / bf16: only the summation order differs. int8 also quantizes each activation
            // row to 8 bits (the reference keeps float activations): < 1 % of the range here.
            CHECK(err <= (fmt == weight_format::int8 ? 2e-2 : 1e-4) * scale);
          }
          // A batch of rows (one per request of a batch) gives each row what it gives alone, up to
          // the summation order (the kernel splits the reduction of 1- and 2-row passes).
          const int M = 5;
          std::vector<float> hs(static_cast<std::size_t>(M) * dd), batch(static_cast<std::size_t>(M) * K * VV);
          for (auto& x : hs) x = nd(rng);
          heads.forward(hs, M, batch);
          for (int m = 0; m < M; ++m) {
            heads.forward(std::span<const float>(hs).subspan(static_cast<std::size_t>(m) * dd, dd), got);
            double err = 0, scale = 0;
            for (std::size_t i = 0; i < got.size(); ++i) {
              const float b = batch[static_cast<std::size_t>(m) * K * VV + i];
              err = std::max(err, static_cast<double>(std::abs(got[i] - b)));
              scale = std::max(scale, static_cast<double>(std::abs(b)));
            }
            CHECK(scale > 0.1);
            CHECK(err <= 1e-5 * scale);
          }
        }
}

TEST_CASE("packed heads can run the first heads of a stack only") {
  engine eng(model::random(tiny_config(), 3, 0.2f), engine_options{.threads = 1});
  const auto w = random_stack(eng.weights(), 3, 1, medusa::projection_kind::per_head, 4);
  packed_heads all(eng, w.view(), weight_format::f32), two(eng, w.view(), weight_format::f32, 2);
  CHECK(two.num_heads() == 2);
  std::vector<float> h(64, 0.5f), a(3 * 97), b(2 * 97);
  all.forward(h, a);
  two.forward(h, b);
  CHECK(std::equal(b.begin(), b.end(), a.begin()));
}

TEST_CASE("packed heads reject mismatched models and buffers") {
  engine eng(model::random(tiny_config(), 3, 0.2f), engine_options{.threads = 1});
  auto other = tiny_config();
  other.dim = 32;
  const auto wrong = model::random(other, 4, 0.2f);
  const auto w = random_stack(wrong, 2, 1, medusa::projection_kind::per_head, 1);
  CHECK_THROWS_AS(packed_heads(eng, w.view()), engine_error);
  const auto ok = random_stack(eng.weights(), 2, 1, medusa::projection_kind::per_head, 2);
  packed_heads heads(eng, ok.view());
  std::vector<float> h(64), logits(2 * 97);
  CHECK_NOTHROW(heads.forward(h, logits));
  std::vector<float> short_logits(97);
  CHECK_THROWS_AS(heads.forward(h, short_logits), engine_error);
  std::vector<float> short_h(63);
  CHECK_THROWS_AS(heads.forward(short_h, logits), engine_error);
  std::vector<float> two_h(128), two_logits(2 * 2 * 97);
  CHECK_NOTHROW(heads.forward(two_h, 2, two_logits));
  CHECK_THROWS_AS(heads.forward(two_h, 3, two_logits), engine_error);  // 3 rows need more of both
  CHECK_THROWS_AS(heads.forward(two_h, 0, two_logits), engine_error);
  CHECK_THROWS_AS(heads.forward(two_h, 2, logits), engine_error);
  CHECK_THROWS_AS(packed_heads(eng, ok.view(), weight_format::bf16, 3), engine_error);
  CHECK_THROWS_AS(packed_heads(eng, ok.view(), weight_format::bf16, -1), engine_error);
  medusa::head_weights unset;  // default-constructed: no heads
  CHECK_THROWS(packed_heads(eng, unset.view()));
}

TEST_CASE("decoder with packed heads equals plain greedy decoding") {
  engine model(model::random(tiny_config(), 9, 0.3f), engine_options{.max_batch = 64, .threads = 2});
  engine& eng = model;
  const auto w = random_heads(eng.weights(), 4, 17);
  packed_heads heads(eng, w.view());
  const std::vector<std::int32_t> prompt{1, 5, 9, 33, 12};
  medusa::decode_options opt;
  opt.max_new_tokens = 60;
  const auto plain = medusa::generate_vanilla(model, prompt, medusa::greedy_policy{}, opt);
  for (const char* preset : {"mc_sim_7b_63", "vicuna_7b_stage1"}) {
    CAPTURE(preset);
    const auto tree = medusa::tree::preset(preset);
    medusa::decoder dec(model, heads, tree, medusa::greedy_policy{});
    const auto out = dec.generate(prompt, opt);
    CHECK(out.tokens == plain.tokens);
    CHECK(out.tokens.size() == 60);
  }
}
