// SPDX-License-Identifier: Apache-2.0
// Per-layer KV views (one view per layer, as engines that allocate layers separately keep them):
// the commit, the append check and the capacity over a range of views, and the decoder driving a
// model whose kv_cache() returns one view per layer.
#include <doctest/doctest.h>
#include <medusa/decoder.hpp>
#include <medusa/io/head_checkpoint.hpp>
#include <medusa/kv_cache.hpp>
#include <medusa/tree.hpp>

#include <numeric>
#include <random>
#include <vector>

namespace {

constexpr int layers = 3, heads = 2, dim = 4;

// `layers` separately allocated caches and, for comparison, one cache over all layers.
struct caches {
  int capacity;
  std::vector<std::vector<float>> k, v;  // per layer
  std::vector<float> all_k, all_v;       // [layers][capacity][heads][dim]
  explicit caches(int cap) : capacity(cap) {
    std::mt19937 rng(3);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    const auto per_layer = static_cast<std::size_t>(cap * heads * dim);
    for (int l = 0; l < layers; ++l) {
      k.emplace_back(per_layer);
      v.emplace_back(per_layer);
      for (auto& x : k.back()) x = u(rng);
      for (auto& x : v.back()) x = u(rng);
      all_k.insert(all_k.end(), k.back().begin(), k.back().end());
      all_v.insert(all_v.end(), v.back().begin(), v.back().end());
    }
  }
  std::vector<medusa::kv_cache_view<float>> per_layer_views() {
    std::vector<medusa::kv_cache_view<float>> out;
    for (int l = 0; l < layers; ++l)
      out.push_back(medusa::make_kv_view<float>(k[static_cast<std::size_t>(l)], v[static_cast<std::size_t>(l)],
                                                {1, heads, dim}, capacity));
    return out;
  }
  medusa::kv_cache_view<float> whole_view() {
    return medusa::make_kv_view<float>(all_k, all_v, {layers, heads, dim}, capacity);
  }
};

}  // namespace

static_assert(medusa::kv_layer_views<std::vector<medusa::kv_cache_view<float>>>);
static_assert(medusa::kv_layer_views<std::span<const medusa::kv_cache_view<float>>>);
static_assert(!medusa::kv_layer_views<std::vector<medusa::kv_cache_view<const float>>>);
static_assert(medusa::writable_kv_cache<medusa::kv_cache_view<float>>);

TEST_CASE("a commit over per-layer views moves the same rows as one view over all layers") {
  caches c(32);
  const auto views = c.per_layer_views();
  const std::vector<int> path{0, 2, 3, 7};
  CHECK(medusa::kv_commit(views, 10, 9, path) == 14);
  CHECK(medusa::kv_commit(c.whole_view(), 10, 9, path) == 14);
  for (int l = 0; l < layers; ++l) {
    const auto n = c.k[static_cast<std::size_t>(l)].size();
    CHECK(std::equal(c.k[static_cast<std::size_t>(l)].begin(), c.k[static_cast<std::size_t>(l)].end(),
                     c.all_k.begin() + static_cast<std::ptrdiff_t>(l * n)));
    CHECK(std::equal(c.v[static_cast<std::size_t>(l)].begin(), c.v[static_cast<std::size_t>(l)].end(),
                     c.all_v.begin() + static_cast<std::ptrdiff_t>(l * n)));
  }
  CHECK(medusa::kv_capacity(views) == 32);
}

TEST_CASE("per-layer views are all validated before any row moves") {
  caches c(32);
  auto views = c.per_layer_views();
  views[2] = medusa::make_kv_view<float>(c.k[2], c.v[2], {1, heads, dim}, 16);  // a shorter last layer
  const auto before = c.k;
  const std::vector<int> path{0, 5};
  CHECK_THROWS_AS(medusa::kv_commit(views, 10, 9, path), medusa::kv_cache_error);  // 10 + 9 > 16
  CHECK(c.k == before);
  CHECK(medusa::kv_capacity(views) == 16);
  CHECK_THROWS_AS(medusa::kv_check_append(views, 10, 9), medusa::kv_cache_error);
  CHECK_NOTHROW(medusa::kv_check_append(views, 5, 9));
  const std::vector<medusa::kv_cache_view<float>> none;
  CHECK_THROWS_WITH_AS(medusa::kv_commit(none, 0, 1, std::vector<int>{0}), doctest::Contains("no views"),
                       medusa::kv_cache_error);
}

namespace {

// A bigram model (logits depend on the token alone) that keeps one K/V buffer per layer and
// hands the decoder one view per layer.
struct layered_model {
  static constexpr int vocab = 48, hidden = 8, n_layers = 3, capacity = 256;
  std::vector<float> embed, lm_head;
  std::vector<std::vector<float>> k, v;
  explicit layered_model(std::uint32_t seed)
      : embed(vocab * hidden), lm_head(vocab * hidden), k(n_layers, std::vector<float>(capacity * hidden)),
        v(n_layers, std::vector<float>(capacity * hidden)) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> n(0.0f, 1.0f);
    for (auto& x : embed) x = n(rng);
    for (auto& x : lm_head) x = n(rng);
  }
  int vocab_size() const { return vocab; }
  int hidden_size() const { return hidden; }
  std::vector<medusa::kv_cache_view<float>> kv_cache() {
    std::vector<medusa::kv_cache_view<float>> out;
    for (int l = 0; l < n_layers; ++l)
      out.push_back(medusa::make_kv_view<float>(k[static_cast<std::size_t>(l)], v[static_cast<std::size_t>(l)],
                                                {1, 1, hidden}, capacity));
    return out;
  }
  void forward(const medusa::forward_batch& b) {
    const auto views = kv_cache();
    for (std::size_t i = 0; i < b.tokens.size(); ++i) {
      const float* e = embed.data() + static_cast<std::ptrdiff_t>(b.tokens[i] * hidden);
      for (int l = 0; l < n_layers; ++l) {  // layer l stores the embedding scaled by l + 1
        float* kr = views[static_cast<std::size_t>(l)].k_row(0, b.cache_length + static_cast<int>(i), 0);
        for (int j = 0; j < hidden; ++j) kr[j] = e[j] * static_cast<float>(l + 1);
      }
      if (static_cast<int>(i) < b.first_output_row) continue;
      const auto row = i - static_cast<std::size_t>(b.first_output_row);
      std::copy(e, e + hidden, b.hidden.begin() + static_cast<std::ptrdiff_t>(row * hidden));
      for (int w = 0; w < vocab; ++w) {
        float z = 0.0f;
        for (int j = 0; j < hidden; ++j) z += lm_head[static_cast<std::size_t>(w * hidden + j)] * e[j];
        b.logits[row * vocab + static_cast<std::size_t>(w)] = z;
      }
    }
  }
};
static_assert(medusa::decoder_model<layered_model>);

}  // namespace

TEST_CASE("the decoder drives a model with per-layer views: greedy equals plain, every layer committed") {
  layered_model model(9);
  const auto weights = medusa::head_weights::random(layered_model::hidden, layered_model::vocab, 4, 1,
                                                    medusa::weight_dtype::f32,
                                                    medusa::weight_ptr::of(model.lm_head.data()), 5);
  const auto stack = weights.view();
  medusa::portable_gemm<> gemm;
  medusa::head_stack_runner heads(stack, gemm);
  const std::vector<std::int32_t> prompt{1, 2, 3};
  medusa::decode_options opt;
  opt.max_new_tokens = 48;
  const auto plain = medusa::generate_vanilla(model, prompt, medusa::greedy_policy{}, opt);
  medusa::decoder dec(model, heads, medusa::tree::preset("mc_sim_7b_63"), medusa::greedy_policy{});
  const auto out = dec.generate(prompt, opt, [](std::int32_t) { return true; });
  CHECK(out.tokens == plain.tokens);
  // Slot s of layer l holds (l + 1) × the embedding of the s-th token of prompt + output.
  std::vector<std::int32_t> sequence = prompt;
  sequence.insert(sequence.end(), out.tokens.begin(), out.tokens.end() - 1);  // the last token is not yet in the cache
  for (int l = 0; l < layered_model::n_layers; ++l)
    for (std::size_t s = 0; s < sequence.size(); ++s)
      CHECK(model.k[static_cast<std::size_t>(l)][s * layered_model::hidden] ==
            model.embed[static_cast<std::size_t>(sequence[s] * layered_model::hidden)] * static_cast<float>(l + 1));
}
