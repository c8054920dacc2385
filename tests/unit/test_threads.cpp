// SPDX-License-Identifier: Apache-2.0
// Several decoders on several threads share one set of read-only weights, one head stack and one
// tree; each owns its KV cache, its GEMM workspace and its decoder. Every thread must get exactly
// the tokens the same requests get decoded one after another on one thread. The ThreadSanitizer
// preset (`cmake --preset tsan`) runs this test to show the sharing is free of data races.
#include "tiny_transformer.hpp"

#include <medusa/decoder.hpp>
#include <medusa/heads.hpp>
#include <medusa/tree.hpp>

#include <doctest/doctest.h>

#include <cstdint>
#include <random>
#include <span>
#include <thread>
#include <vector>

namespace {

using tiny::tiny_model;

// A request-per-cache model over shared const weights: the weights are only read (`run` is const).
class shared_weights_model {
 public:
  shared_weights_model(const tiny_model& weights, int capacity, int requests) : w_(weights), capacity_(capacity) {
    const std::size_t size = static_cast<std::size_t>(tiny_model::layers) * static_cast<std::size_t>(capacity) *
                             tiny_model::kv_heads * tiny_model::head_dim;
    k_.assign(static_cast<std::size_t>(requests), std::vector<float>(size));
    v_ = k_;
  }
  int vocab_size() const { return tiny_model::vocab; }
  int hidden_size() const { return tiny_model::dim; }
  medusa::kv_cache_view<float> kv_cache(int r) {
    return medusa::make_kv_view<float>(k_.at(static_cast<std::size_t>(r)), v_.at(static_cast<std::size_t>(r)),
                                       medusa::kv_extents{tiny_model::layers, tiny_model::kv_heads, tiny_model::head_dim},
                                       capacity_);
  }
  void forward(const medusa::ragged_batch& b) {
    for (int i = 0; i < b.size(); ++i) {
      const medusa::forward_batch f = tiny::request_slice(b, i);
      w_.run(kv_cache(b.requests[static_cast<std::size_t>(i)]), f);
    }
  }

 private:
  const tiny_model& w_;
  int capacity_;
  std::vector<std::vector<float>> k_, v_;
};
static_assert(medusa::batch_decoder_model<shared_weights_model>);

// Head weights (2 heads, 1 ResBlock, per-head projections), f32 and bf16 to cover both loaders' views.
struct head_weights {
  std::vector<float> w, b, u;
  std::vector<std::uint16_t> w16;
  head_weights() {
    std::mt19937 rng(5);
    std::normal_distribution<float> n(0.0f, 0.4f);
    const std::size_t d = tiny_model::dim, V = tiny_model::vocab;
    for (std::size_t i = 0; i < 3 * d * d; ++i) w.push_back(n(rng));
    for (std::size_t i = 0; i < 3 * d; ++i) b.push_back(n(rng));
    for (std::size_t i = 0; i < 3 * V * d; ++i) u.push_back(3.0f * n(rng));
    for (float x : w) w16.push_back(medusa::detail::float_to_bfloat16_bits(x));
  }
  medusa::head_stack<> stack(bool bf16) const {
    const std::size_t d = tiny_model::dim, V = tiny_model::vocab;
    medusa::head_stack<> s(d, V, 3, 1, medusa::projection_kind::per_head);
    for (std::size_t k = 0; k < 3; ++k) {
      const medusa::weight_ptr wk = bf16 ? medusa::weight_ptr::of(w16.data() + k * d * d, medusa::weight_dtype::bf16) : medusa::weight_ptr::of(w.data() + k * d * d);
      s.set_resblock(k, 0, wk, medusa::weight_ptr::of(b.data() + k * d));
      s.set_projection(k, medusa::weight_ptr::of(u.data() + k * V * d));
    }
    return s;
  }
};

std::vector<std::int32_t> prompt_of(int thread, int i) {
  std::vector<std::int32_t> p;
  const int len = 3 + (thread * 3 + i * 5) % 9;
  for (int t = 0; t < len; ++t) p.push_back((t * 7 + thread * 11 + i * 13 + 1) % tiny_model::vocab);
  return p;
}

// What one thread does: a few single requests through `decoder` (greedy and sampling), then a
// batch through `batch_decoder`. Returns every token it generated, in order.
std::vector<std::int32_t> work(int thread, const tiny_model& weights, const medusa::head_stack<>& heads,
                               const medusa::tree& tree) {
  constexpr int capacity = 96, batch = 3;
  std::vector<std::int32_t> out;
  medusa::portable_gemm<> gemm;
  medusa::head_stack_runner runner(heads, gemm);
  shared_weights_model model(weights, capacity, batch);
  medusa::decode_options opt;
  opt.max_new_tokens = 24;
  opt.seed = static_cast<std::uint64_t>(thread) + 1;
  {
    medusa::batch_decoder greedy(model, runner, tree, medusa::greedy_policy{}, batch);
    for (int r = 0; r < batch; ++r) greedy.join(r, prompt_of(thread, r), opt);
    while (!greedy.empty())
      for (const medusa::request_update& u : greedy.step()) {
        out.insert(out.end(), u.tokens.begin(), u.tokens.end());
        REQUIRE(u.reason != medusa::stop_reason::failed);
      }
  }
  {
    medusa::rejection_policy sampling;
    sampling.temperature = 0.8;
    medusa::batch_decoder sampled(model, runner, tree, sampling, batch);
    for (int r = 0; r < batch; ++r) sampled.join(r, prompt_of(thread, r + 3), opt);
    while (!sampled.empty())
      for (const medusa::request_update& u : sampled.step()) out.insert(out.end(), u.tokens.begin(), u.tokens.end());
  }
  return out;
}

}  // namespace

TEST_CASE("decoders on several threads share weights, heads and tree, and decode as they do alone") {
  const tiny_model weights(96);
  const head_weights hw;
  const medusa::tree tree = medusa::tree::from_text("[[0],[1],[2],[0,0],[0,1],[1,0],[0,0,0],[0,0,1]]");
  for (const bool bf16 : {false, true}) {
    CAPTURE(bf16);
    const medusa::head_stack<> heads = hw.stack(bf16);
    constexpr int threads = 4;
    std::vector<std::vector<std::int32_t>> alone(threads), shared(threads);
    for (int t = 0; t < threads; ++t) alone[static_cast<std::size_t>(t)] = work(t, weights, heads, tree);
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([&, t] { shared[static_cast<std::size_t>(t)] = work(t, weights, heads, tree); });
    for (std::thread& th : pool) th.join();
    for (int t = 0; t < threads; ++t) {
      CAPTURE(t);
      CHECK(alone[static_cast<std::size_t>(t)].size() >= 6u * 24u - 12u);  // nothing cut short
      CHECK(shared[static_cast<std::size_t>(t)] == alone[static_cast<std::size_t>(t)]);
    }
  }
}
