// SPDX-License-Identifier: Apache-2.0
// The model of docs/decoder.md, compiled and run: a model that owns its KV buffers and returns a
// writable view from a non-const kv_cache(), seeded random heads from the library, and greedy
// Medusa output equal to plain greedy decoding; the tree search, per-step drafts, a draft model, its
// trees and its sampled chains of docs/tree.md and docs/decoder.md on the same model.
#include <doctest/doctest.h>
#include <medusa/decoder.hpp>
#include <medusa/decoder/calibrate.hpp>
#include <medusa/decoder/step_cost.hpp>
#include <medusa/draft_model.hpp>
#include <medusa/draft_sampler.hpp>
#include <medusa/draft_tree.hpp>
#include <medusa/drafts.hpp>
#include <medusa/io/head_checkpoint.hpp>
#include <medusa/tree.hpp>

#include <cmath>
#include <random>
#include <span>
#include <vector>

namespace {

// --- docs/decoder.md, "What your model provides" --------------------------------------------
// A bigram model: the logits of a token depend on the token alone (hidden = its embedding,
// logits = lm_head · hidden). It still writes K/V for every token it runs, as a transformer does.
struct my_model {
  static constexpr int vocab = 64, dim = 16, capacity = 512;
  std::vector<float> embed, lm_head;  // [vocab][dim] each
  std::vector<float> k, v;            // the KV cache this model owns: 1 layer, 1 head, dim
  std::uint64_t forwards = 0;

  explicit my_model(std::uint32_t seed) : embed(vocab * dim), lm_head(vocab * dim), k(capacity * dim), v(capacity * dim) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> n(0.0f, 1.0f);
    for (auto& x : embed) x = n(rng);
    for (auto& x : lm_head) x = n(rng);
  }

  int vocab_size() const { return vocab; }
  int hidden_size() const { return dim; }
  // Non-const: the view over owned buffers is writable (the decoder commits accepted rows in it).
  medusa::kv_cache_view<float> kv_cache() {
    return medusa::make_kv_view<float>(k, v, medusa::kv_extents{1, 1, dim}, capacity);
  }
  void forward(const medusa::forward_batch& b) {
    ++forwards;
    auto cache = kv_cache();
    const int t_count = static_cast<int>(b.tokens.size());
    for (int i = 0; i < t_count; ++i) {
      const float* e = embed.data() + static_cast<std::ptrdiff_t>(b.tokens[static_cast<std::size_t>(i)] * dim);
      std::copy(e, e + dim, cache.k_row(0, b.cache_length + i, 0));
      std::copy(e, e + dim, cache.v_row(0, b.cache_length + i, 0));
      if (i < b.first_output_row) continue;
      // Outputs are packed from row first_output_row: logits [rows][vocab], hidden [rows][dim].
      const auto row = static_cast<std::size_t>(i - b.first_output_row);
      std::copy(e, e + dim, b.hidden.begin() + static_cast<std::ptrdiff_t>(row * dim));
      for (int w = 0; w < vocab; ++w) {
        float z = 0.0f;
        for (int j = 0; j < dim; ++j) z += lm_head[static_cast<std::size_t>(w * dim + j)] * e[j];
        b.logits[row * vocab + static_cast<std::size_t>(w)] = z;
      }
    }
  }
};
static_assert(medusa::decoder_model<my_model>);
// ---------------------------------------------------------------------------------------------

}  // namespace

TEST_CASE("docs/decoder.md: the documented model decodes, and greedy Medusa equals plain greedy") {
  my_model model(5);
  // Seeded random heads from the library; their projections start as copies of the lm_head.
  const medusa::head_weights weights = medusa::head_weights::random(
      my_model::dim, my_model::vocab, 4, 1, medusa::weight_dtype::f32,
      medusa::weight_ptr{model.lm_head.data(), medusa::weight_dtype::f32}, /*seed=*/17);
  const auto stack = weights.view();
  medusa::portable_gemm<> gemm;
  medusa::head_stack_runner heads(stack, gemm);

  const std::vector<std::int32_t> prompt{3, 14, 15, 9, 26};
  medusa::decode_options opt;
  opt.max_new_tokens = 64;
  const auto plain = medusa::generate_vanilla(model, prompt, medusa::greedy_policy{}, opt);
  const std::uint64_t plain_forwards = model.forwards;

  medusa::decoder dec(model, heads, medusa::tree::preset("mc_sim_7b_63"), medusa::greedy_policy{});
  std::vector<std::int32_t> streamed;
  const auto out = dec.generate(prompt, opt, [&](std::int32_t tok) {
    streamed.push_back(tok);
    return true;
  });
  CHECK(out.tokens.size() == 64);
  CHECK(out.tokens == plain.tokens);
  CHECK(streamed == out.tokens);
  CHECK(model.forwards - plain_forwards < plain_forwards);  // drafts were accepted: fewer forwards
}

TEST_CASE("docs/tree.md and docs/decoder.md: the best tree for the machine, then per-step drafts") {
  my_model model(5);
  const medusa::head_weights weights = medusa::head_weights::random(
      my_model::dim, my_model::vocab, 4, 1, medusa::weight_dtype::f32,
      medusa::weight_ptr{model.lm_head.data(), medusa::weight_dtype::f32}, /*seed=*/17);
  const auto stack = weights.view();
  medusa::portable_gemm<> gemm;
  medusa::head_stack_runner heads(stack, gemm);
  const std::vector<std::int32_t> prompt{3, 14, 15, 9, 26};
  medusa::decode_options opt;
  opt.max_new_tokens = 64;
  const auto plain = medusa::generate_vanilla(model, prompt, medusa::greedy_policy{}, opt);

  // --- docs/tree.md, "Choosing a tree" (a calibration counted on this model's own decoding) ---
  medusa::path_counter counts(4, 10);
  std::vector<std::int32_t> text = prompt;
  text.insert(text.end(), plain.tokens.begin(), plain.tokens.end());
  medusa::count_paths(model, heads, text, counts, static_cast<int>(prompt.size()) - 1);
  const auto cal = counts.calibration();
  auto cost = medusa::measure_step_cost(model, heads, {.rows = {1, 2, 4, 8, 16, 32}});  // before decoding in that cache
  auto plan = medusa::optimize_tree(cal, cost, {.max_nodes = 32});
  auto t = medusa::tree::from_paths(plan.paths);  // plan.predicted_speedup
  CHECK(plan.predicted_speedup > 0.0);

  // --- docs/decoder.md, "Dynamic and hybrid drafts" -------------------------------------------
  medusa::step_drafter drafter({.paths = plan.paths,
                                .dynamic_nodes = 0,
                                .lookup = medusa::ngram_lookup{.min_ngram = 2, .max_ngram = 4, .max_tokens = 8}},
                               /*heads=*/4);
  medusa::decoder dec(model, heads, drafter, medusa::greedy_policy{});
  CHECK(dec.generate(prompt, opt).tokens == plain.tokens);
  medusa::decoder fixed(model, heads, t, medusa::greedy_policy{});
  CHECK(fixed.generate(prompt, opt).tokens == plain.tokens);

  // --- docs/decoder.md, "Branch sources and request ids" --------------------------------------
  struct my_source {
    int max_tokens = 4;
    int* released = nullptr;  // here: a prompt lookup that counts the requests that left
    int find(int request, std::span<const std::int32_t> history, std::span<std::int32_t> out) {
      return medusa::ngram_lookup{.min_ngram = 1, .max_tokens = max_tokens}.find(request, history, out);
    }
    void release(int) { ++*released; }
  };
  int released = 0;
  medusa::basic_step_drafter<my_source> sourced({.paths = plan.paths, .lookup = my_source{.released = &released}}, /*heads=*/4);
  medusa::decoder with_source(model, heads, sourced, medusa::greedy_policy{});
  CHECK(with_source.generate(prompt, opt).tokens == plain.tokens);
  CHECK(released == 1);

  // --- docs/decoder.md, "A draft model" -------------------------------------------------------
  my_model small(6);  // the draft
  medusa::draft_model_branch<my_model> draft(small, model.vocab_size(), {.max_tokens = 4});
  medusa::basic_step_drafter<medusa::draft_model_branch<my_model>> drafted({.paths = plan.paths, .lookup = draft},
                                                                           /*heads=*/4);
  medusa::decoder dec_draft(model, heads, drafted, medusa::greedy_policy{});
  CHECK(dec_draft.generate(prompt, opt).tokens == plain.tokens);
  CHECK(draft.tokens_run() >= static_cast<std::int64_t>(prompt.size()));

  // --- docs/decoder.md, "Draft trees (EAGLE-2)" -----------------------------------------------
  medusa::tree_drafter trees(draft, {.max_nodes = 16, .max_depth = 6, .topk = 4, .expand = 4});
  medusa::no_heads none;
  medusa::decoder dec_trees(model, none, trees, medusa::greedy_policy{});
  CHECK(dec_trees.generate(prompt, opt).tokens == plain.tokens);
  draft.release(0);

  // --- docs/decoder.md, "Sampled draft trees" -------------------------------------------------
  {
    medusa::tree_sampler trees(draft, {.max_nodes = 8, .max_depth = 5, .topk = 2, .expand = 2},
                               medusa::sampling_warp{.temperature = 0.7f});
    medusa::decoder dec(model, none, trees, medusa::speculative_policy{{.temperature = 0.7f}});
    opt.seed = 5;
    const auto sampled_trees = dec.generate(prompt, opt);
    CHECK(sampled_trees.tokens.size() == plain.tokens.size());
    opt.seed = 0;
    draft.release(0);
  }

  // --- docs/decoder.md, "Sampling a draft model's chains" -------------------------------------
  medusa::draft_model_sampler<my_model> drafts(small, model.vocab_size(),
                                               {.max_tokens = 3, .warp = {.temperature = 0.7f}});
  medusa::decoder dec_sampled(model, heads, drafts, medusa::speculative_policy{{.temperature = 0.7f}});
  opt.seed = 3;
  const auto sampled = dec_sampled.generate(prompt, opt);
  CHECK(sampled.tokens.size() == plain.tokens.size());
  CHECK(drafts.passes() > 0);  // copies share the draft's counts
}

TEST_CASE("head_weights::random is seeded: same arguments, same weights; another seed, others") {
  std::vector<float> lm(8 * 4, 0.5f);
  const medusa::weight_ptr head{lm.data(), medusa::weight_dtype::f32};
  auto a = medusa::head_weights::random(4, 8, 2, 1, medusa::weight_dtype::f32, head, 3);
  auto b = medusa::head_weights::random(4, 8, 2, 1, medusa::weight_dtype::f32, head, 3);
  auto c = medusa::head_weights::random(4, 8, 2, 1, medusa::weight_dtype::f32, head, 4);
  auto bytes = [](medusa::head_weights& w) {
    const auto s = w.resblock_weight_bytes(1, 0);
    return std::vector<std::byte>(s.begin(), s.end());
  };
  CHECK(bytes(a) == bytes(b));
  CHECK(bytes(a) != bytes(c));
  const auto half = medusa::head_weights::random(4, 8, 2, 1, medusa::weight_dtype::bf16, head, 3);
  CHECK(half.dtype() == medusa::weight_dtype::bf16);
}
