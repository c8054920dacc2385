// SPDX-License-Identifier: Apache-2.0
// Several engines on several threads, built from copies of one model (copies share its weight
// storage) and packing the heads of one shared head_stack, each decoding with its own worker
// threads: every thread gets exactly the tokens the same requests get one after another. The
// ThreadSanitizer preset (`cmake --preset tsan`) runs this test.
#include <medusa_llama/llama.hpp>
#include <medusa_llama/load.hpp>

#include <medusa/io/head_checkpoint.hpp>
#include <medusa/medusa.hpp>

#include <doctest/doctest.h>

#include <cstdint>
#include <random>
#include <span>
#include <thread>
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
  c.vocab_size = 97;
  c.seq_len = 128;
  return c;
}

medusa::head_weights random_heads(std::size_t K) {
  const auto d = static_cast<std::size_t>(tiny_config().dim), V = static_cast<std::size_t>(tiny_config().vocab_size);
  medusa::head_weights w(d, V, K, 1, medusa::projection_kind::per_head, medusa::weight_dtype::f32);
  std::mt19937 rng(9);
  std::normal_distribution<float> nd(0.0f, 0.3f);
  auto fill = [&](std::span<std::byte> bytes) {
    auto* f = reinterpret_cast<float*>(bytes.data());
    for (std::size_t i = 0; i < bytes.size() / sizeof(float); ++i) f[i] = nd(rng);
  };
  for (std::size_t h = 0; h < K; ++h) {
    fill(w.resblock_weight_bytes(h, 0));
    fill(w.resblock_bias_bytes(h, 0));
    fill(w.projection_bytes(h));
  }
  return w;
}

std::vector<std::int32_t> prompt_of(int thread, int i) {
  std::vector<std::int32_t> p{1};
  for (int t = 0; t < 4 + (thread + i) % 5; ++t) p.push_back((t * 13 + thread * 7 + i * 3 + 2) % 97);
  return p;
}

// One thread's work: its own engine over a copy of `m`, the shared heads packed for it, Medusa and
// plain decoding of a few prompts. Returns every token generated, in order.
std::vector<std::int32_t> work(int thread, const model& m, const medusa::head_stack<>& heads, const medusa::tree& tree,
                               weight_format format) {
  engine eng(m, engine_options{.threads = 2, .weights = format});
  packed_heads drafts(eng, heads, weight_format::f32);
  medusa::decoder dec(eng, drafts, tree, medusa::greedy_policy{});
  std::vector<std::int32_t> out;
  for (int i = 0; i < 3; ++i) {
    const auto prompt = prompt_of(thread, i);
    const auto medusa_out = dec.generate(prompt, {.max_new_tokens = 32});
    const auto plain_out = medusa::generate_vanilla(eng, prompt, medusa::greedy_policy{}, {.max_new_tokens = 32});
    CHECK(medusa_out.tokens == plain_out.tokens);  // lossless on every thread
    out.insert(out.end(), medusa_out.tokens.begin(), medusa_out.tokens.end());
  }
  return out;
}

}  // namespace

TEST_CASE("engines on several threads share one model's weights and one head stack") {
  const model m = model::random(tiny_config(), 4, 0.3f);
  const medusa::head_weights hw = random_heads(3);
  const medusa::head_stack<> heads = hw.view();
  const medusa::tree tree = medusa::tree::from_text("[[0],[1],[0,0],[0,1],[0,0,0]]");
  for (const weight_format format : {weight_format::f32, weight_format::q8_0}) {
    CAPTURE(to_string(format));
    constexpr int threads = 3;
    std::vector<std::vector<std::int32_t>> alone(threads), shared(threads);
    for (int t = 0; t < threads; ++t) alone[static_cast<std::size_t>(t)] = work(t, m, heads, tree, format);
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([&, t] { shared[static_cast<std::size_t>(t)] = work(t, m, heads, tree, format); });
    for (std::thread& th : pool) th.join();
    for (int t = 0; t < threads; ++t) {
      CAPTURE(t);
      CHECK(alone[static_cast<std::size_t>(t)].size() == 3u * 32u);
      CHECK(shared[static_cast<std::size_t>(t)] == alone[static_cast<std::size_t>(t)]);
    }
  }
}
