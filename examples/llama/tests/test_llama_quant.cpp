// SPDX-License-Identifier: Apache-2.0
// The block weight formats q8_0 and q4_0: GGUF's reference quantizers, dequantize-requantize
// round trips (a Q8_0/Q4_0 file packs without loss), and the engine on them: batched equals
// sequential, Medusa equals plain greedy decoding of the same quantized model. (The kernels
// themselves on every instruction set: test_llama_kernels.cpp.)
#include <medusa_llama/llama.hpp>
#include <medusa_llama/load.hpp>

#include "../src/gemm.hpp"  // private kernels

#include <medusa/decoder.hpp>
#include <medusa/half.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

using namespace medusa_llama;

namespace {

std::size_t sz(int v) { return static_cast<std::size_t>(v); }

std::vector<float> random_floats(std::size_t n, std::uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

float half_of(std::uint16_t h) { return medusa::detail::half_bits_to_float(h); }

model_config tiny_config() {
  model_config c;
  c.dim = 64;
  c.hidden_dim = 96;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.vocab_size = 97;
  c.seq_len = 128;
  return c;
}

}  // namespace

TEST_CASE("q8_0 and q4_0 quantizers follow GGUF's reference rules") {
  float w[32];
  for (int i = 0; i < 32; ++i) w[i] = static_cast<float>(i - 16) * 0.25f;  // -4 .. 3.75
  std::int8_t q[32];
  // q8_0: d = max |w| / 127 (stored as binary16), q = round(w / d), half away from zero.
  const std::uint16_t d8 = detail::quantize_block_q8_0(w, 32, q);
  CHECK(d8 == medusa::detail::float_to_half_bits(4.0f / 127.0f));
  CHECK(q[0] == -127);
  CHECK(q[16] == 0);
  CHECK(q[17] == 8);  // 0.25 · 31.75 = 7.9375
  // q4_0: d = w_max / -8, w_max the signed weight of largest magnitude; q = min(15, ⌊w/d + 8.5⌋) − 8.
  const std::uint16_t d4 = detail::quantize_block_q4_0(w, 32, q);
  CHECK(half_of(d4) == 0.5f);  // w_max = -4
  CHECK(q[0] == -8);
  CHECK(q[16] == 0);
  CHECK(q[17] == 1);   // 0.5 + 8.5 = 9
  CHECK(q[31] == 7);   // 7.5 + 8.5 = 16, clamped to 15
  CHECK(q[30] == 7);   // 7 + 8.5 = 15.5 → 15
  CHECK(q[28] == 6);   // 6 + 8.5 = 14.5 → 14
  // A short block: the missing weights are zeros.
  const std::uint16_t ds = detail::quantize_block_q8_0(w + 30, 2, q);
  CHECK(half_of(ds) == doctest::Approx(3.75 / 127).epsilon(1e-3));
  CHECK(q[1] == 127);
  CHECK(std::all_of(q + 2, q + 32, [](std::int8_t v) { return v == 0; }));
  // All zeros: scale (−)0, q 0.
  const float z[32] = {};
  CHECK(half_of(detail::quantize_block_q4_0(z, 32, q)) == 0.0f);
  CHECK(std::all_of(q, q + 32, [](std::int8_t v) { return v == 0; }));
}

TEST_CASE("a dequantized q8_0 or q4_0 block quantizes back to the same numbers") {
  // What makes a GGUF Q8_0 / Q4_0 file (dequantized into the model) pack without loss.
  int blocks = 0;
  for (auto fmt : {weight_format::q8_0, weight_format::q4_0})
    for (std::uint32_t seed = 0; seed < 400; ++seed) {
      const auto w = random_floats(32, seed, seed % 7 == 0 ? 1e-3f : 1.0f);
      std::int8_t q[32], q2[32];
      auto quantize = [&](const float* x, std::int8_t (&out)[32]) {
        return fmt == weight_format::q8_0 ? detail::quantize_block_q8_0(x, 32, out) : detail::quantize_block_q4_0(x, 32, out);
      };
      const std::uint16_t d = quantize(w.data(), q);
      float deq[32];
      for (int i = 0; i < 32; ++i) deq[i] = half_of(d) * static_cast<float>(q[i]);
      const std::uint16_t d2 = quantize(deq, q2);
      CAPTURE(seed);
      CHECK(d2 == d);
      CHECK(std::equal(q, q + 32, q2));
      ++blocks;
    }
  CHECK(blocks == 800);
}

TEST_CASE("engine on q8_0 and q4_0 weights: near float32, batched equals sequential, Medusa equals plain greedy") {
  const auto m = model::random(tiny_config(), 21, 0.2f);
  engine e32(m, {.max_batch = 64, .threads = 2});
  const std::vector<std::int32_t> prompt{1, 7, 40, 3, 88, 12};
  std::mt19937 rng(5);
  std::vector<int> batch(13);
  for (auto& t : batch) t = static_cast<int>(rng() % 97);
  const auto V = sz(e32.config().vocab_size);
  auto logits_of = [&](engine& e) {
    std::vector<float> last(V), all(batch.size() * V);
    std::vector<int> pre(prompt.begin(), prompt.end());
    e.prefill(pre, 0, last, {});
    std::vector<int> pos(batch.size());
    for (std::size_t i = 0; i < pos.size(); ++i) pos[i] = static_cast<int>(prompt.size() + i);
    medusa::forward_batch b;
    b.tokens = batch;
    b.positions = pos;
    b.cache_length = static_cast<int>(prompt.size());
    b.logits = all;
    e.forward(b);
    return all;
  };
  const auto ref = logits_of(e32);
  double scale = 0;
  for (float x : ref) scale = std::max(scale, static_cast<double>(std::abs(x)));
  for (auto fmt : {weight_format::q8_0, weight_format::q4_0}) {
    const std::string fmt_name = to_string(fmt);
    CAPTURE(fmt_name);
    engine eq(m, {.max_batch = 64, .threads = 2, .weights = fmt});
    CHECK(eq.options().weights == fmt);
    const auto batched = logits_of(eq);
    double d = 0;
    for (std::size_t i = 0; i < ref.size(); ++i) d = std::max(d, static_cast<double>(std::abs(ref[i] - batched[i])));
    MESSAGE(fmt_name << " vs f32: max |logit diff| " << d << " (max |logit| " << scale << ")");
    CHECK(d > 0);
    CHECK(d < (fmt == weight_format::q8_0 ? 0.03 : 0.25) * scale);
    // One token at a time: each row is quantized on its own and attention takes the keys in the
    // same position blocks, so the same bits.
    std::vector<float> one(V);
    std::vector<int> pre(prompt.begin(), prompt.end());
    std::vector<float> last(V);
    eq.prefill(pre, 0, last, {});
    double ds = 0;
    for (std::size_t i = 0; i < batch.size(); ++i) {
      eq.decode(batch[i], static_cast<int>(prompt.size() + i), one);
      for (std::size_t v = 0; v < V; ++v) ds = std::max(ds, static_cast<double>(std::abs(one[v] - batched[i * V + v])));
    }
    CHECK(ds == 0.0);
    // Lossless relative to the quantized model, heads in every format.
    medusa::decode_options opt;
    opt.max_new_tokens = 48;
    const auto plain = medusa::generate_vanilla(eq, prompt, medusa::greedy_policy{}, opt);
    const auto hw = random_heads(eq.weights(), 4, 3);
    for (auto head_fmt : {weight_format::f32, weight_format::int8, weight_format::q8_0, weight_format::q4_0}) {
      const std::string head_name = to_string(head_fmt);
      CAPTURE(head_name);
      packed_heads heads(eq, hw.view(), head_fmt);
      medusa::decoder dec(eq, heads, medusa::tree::preset("mc_sim_7b_63"), medusa::greedy_policy{});
      const auto out = dec.generate(prompt, opt);
      CHECK(out.tokens == plain.tokens);
      CHECK(out.stats.tree_steps > 0);
    }
  }
}

TEST_CASE("the classifier's format: q8_0 under q4_0 weights unless asked otherwise") {
  const auto m = model::random(tiny_config(), 22, 0.2f);
  const std::vector<int> prompt{1, 2, 3, 4};
  const auto V = sz(m.config().vocab_size);
  auto last_logits = [&](engine_options o) {
    o.threads = 1;
    engine e(m, o);
    std::vector<float> out(V);
    e.prefill(prompt, 0, out, {});
    return out;
  };
  const auto by_default = last_logits({.weights = weight_format::q4_0});
  const auto q8_cls = last_logits({.weights = weight_format::q4_0, .classifier_weights = weight_format::q8_0});
  const auto q4_cls = last_logits({.weights = weight_format::q4_0, .classifier_weights = weight_format::q4_0});
  CHECK(by_default == q8_cls);
  CHECK(by_default != q4_cls);
  CHECK_THROWS_AS(engine(m, {.classifier_weights = weight_format::int8}), engine_error);
}
