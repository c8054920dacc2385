// SPDX-License-Identifier: Apache-2.0
// An engine-side program as a package user writes it: the umbrella header, a toy model of its own
// (a bigram chain with a KV cache) and its own draft heads, decoded plainly and with Medusa. With
// greedy acceptance both must give the same tokens, and heads that guess right must save forwards.
#include <medusa/medusa.hpp>

#include <cstdint>
#include <cstdio>
#include <span>
#include <vector>

namespace {

constexpr int vocab = 32, dim = 4, capacity = 256;
constexpr std::int32_t next_of(std::int32_t t) { return (t * 5 + 3) % vocab; }

// Logits peak at next_of(token); hidden = the token (the heads read it back).
struct bigram_model {
  std::vector<float> k = std::vector<float>(capacity * dim), v = std::vector<float>(capacity * dim);
  int forwards = 0;
  int vocab_size() const { return vocab; }
  int hidden_size() const { return dim; }
  medusa::kv_cache_view<float> kv_cache() { return medusa::make_kv_view<float>(k, v, medusa::kv_extents{1, 1, dim}, capacity); }
  void forward(const medusa::forward_batch& b) {
    ++forwards;
    auto cache = kv_cache();
    for (std::size_t i = 0; i < b.tokens.size(); ++i) {
      const int slot = b.cache_length + static_cast<int>(i);
      for (int c = 0; c < dim; ++c) cache.k_row(0, slot, 0)[c] = cache.v_row(0, slot, 0)[c] = static_cast<float>(b.tokens[i]);
      if (static_cast<int>(i) < b.first_output_row) continue;
      const auto row = i - static_cast<std::size_t>(b.first_output_row);
      for (int w = 0; w < vocab; ++w) b.logits[row * vocab + static_cast<std::size_t>(w)] = w == next_of(b.tokens[i]) ? 1.0f : 0.0f;
      for (int c = 0; c < dim; ++c) b.hidden[row * dim + static_cast<std::size_t>(c)] = static_cast<float>(b.tokens[i]);
    }
  }
};

// Head h guesses the token h + 2 steps ahead of the hidden state's token: always right here.
struct chain_heads {
  int num_heads() const { return 4; }
  void forward(std::span<const float> hidden, std::span<float> logits) const {
    auto t = static_cast<std::int32_t>(hidden[0]);
    t = next_of(t);
    for (int h = 0; h < num_heads(); ++h) {
      t = next_of(t);
      for (int w = 0; w < vocab; ++w) logits[static_cast<std::size_t>(h * vocab + w)] = w == t ? 1.0f : 0.0f;
    }
  }
};

}  // namespace

int main() {
  constexpr auto v = medusa::version();
  static_assert(v.major == MEDUSA_VERSION_MAJOR);
  const std::vector<std::int32_t> prompt{1, 7, 2};
  medusa::decode_options opt;
  opt.max_new_tokens = 48;

  bigram_model model;
  const auto plain = medusa::generate_vanilla(model, prompt, medusa::greedy_policy{}, opt);
  const int plain_forwards = model.forwards;
  chain_heads heads;
  medusa::decoder dec(model, heads, medusa::tree::preset("mc_sim_7b_63"), medusa::greedy_policy{});
  const auto fast = dec.generate(prompt, opt);
  const int medusa_forwards = model.forwards - plain_forwards;

  const bool same = fast.tokens == plain.tokens && fast.tokens.size() == 48;
  std::printf("medusa %d.%d.%d: %zu tokens, identical to plain greedy: %s, forwards %d (plain %d)\n", v.major, v.minor,
              v.patch, fast.tokens.size(), same ? "yes" : "no", medusa_forwards, plain_forwards);
  return same && medusa_forwards < plain_forwards ? 0 : 1;
}
