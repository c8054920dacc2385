// SPDX-License-Identifier: Apache-2.0
// Sampled draft trees (`tree_sampler`, draft_tree.hpp): each node's children are drawn without
// replacement from the drafter's warped row and verified with `speculative_policy` against the row
// each was drawn from. Through the decoder, the first three generated tokens follow the exact
// warped target (chi-square, several warps and tree shapes, a draft unlike the target and the
// target as its own draft); the test catches rows that claim independent draws or a hotter
// distribution. Each row is its parent's warped row without the earlier siblings; budgets, T = 0,
// greedy verification and the lookup's point masses behave as documented.
#include "sampled_chains.hpp"

#include <medusa/decoder.hpp>
#include <medusa/draft_model.hpp>
#include <medusa/draft_tree.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <set>
#include <span>
#include <string>
#include <vector>

namespace {

using sampled_chains::last_logits;
using sampled_chains::trials;
using stats::reference_warp;
using tiny::tiny_model;

constexpr int V = tiny_model::vocab;
const std::vector<std::int32_t> prompt = {1, 5, 9, 13};
using branch = medusa::draft_model_branch<tiny_model>;
using sampler = medusa::tree_sampler<branch>;

// A sampler whose rows are not what was drawn from: `independent` gives every later sibling its
// first sibling's row (the parent's own, as if siblings were drawn with replacement); otherwise
// each row is flattened halfway towards uniform.
struct biased_rows {
  sampler inner;
  bool independent = true;
  std::vector<float> rows;
  int max_nodes() const { return inner.max_nodes(); }
  int max_depth() const { return inner.max_depth(); }
  int heads_depth() const { return 0; }
  std::optional<medusa::tree> draft(int request, std::span<const std::int32_t> history, std::span<const float> hl, int vocab,
                                    std::span<std::int32_t> tokens, std::uint64_t seed, std::uint64_t step) {
    auto t = inner.draft(request, history, hl, vocab, tokens, seed, step);
    const auto drawn = inner.draft_probs(request);
    rows.assign(drawn.begin(), drawn.end());
    if (!t) return t;
    for (int u = 1; u < t->num_nodes(); ++u) {
      float* q = rows.data() + static_cast<std::size_t>(u) * V;
      if (independent) {
        const int first = t->child_begin(t->parent(u));
        std::copy_n(drawn.data() + static_cast<std::size_t>(first) * V, V, q);
      } else {
        for (int x = 0; x < V; ++x) q[x] = 0.5f * q[x] + 0.5f / V;
      }
    }
    return t;
  }
  std::span<const float> draft_probs(int) const { return rows; }
};

void report(const std::string& what, const sampled_chains::result& r) {
  MESSAGE(what << ": chi2(first two)=" << r.first_two.stat << "/" << r.first_two.dof << " p=" << r.first_two.p
               << ", chi2(second, third)=" << r.second_third.stat << "/" << r.second_third.dof << " p=" << r.second_third.p
               << ", tokens/step=" << r.per_step);
}

}  // namespace

TEST_CASE("sampled draft trees verified with their rows keep the target's distribution") {
  tiny_model target(64), unlike(64, 11), same(64);  // same seed as the target: the same model
  struct config {
    medusa::sampling_warp warp;
    medusa::draft_tree_options shape;
    tiny_model* draft;
  };
  const config configs[] = {
      {{.temperature = 1.0f}, {.max_nodes = 8, .max_depth = 3, .topk = 3, .expand = 2}, &unlike},
      {{.temperature = 0.7f, .top_p = 0.9f}, {.max_nodes = 6, .max_depth = 3, .topk = 2, .expand = 2}, &unlike},
      {{.temperature = 1.3f, .top_k = 6}, {.max_nodes = 10, .max_depth = 2, .topk = 4, .expand = 3}, &unlike},
      {{.temperature = 1.0f}, {.max_nodes = 8, .max_depth = 3, .topk = 3, .expand = 2}, &same},
  };
  for (const auto& c : configs) {
    const sampler drafts(branch(*c.draft, V), c.shape, c.warp);
    const auto r = sampled_chains::first_three(target, prompt, drafts, c.warp, trials);
    const std::string which = c.draft == &same ? "the target as draft" : "another model as draft";
    INFO("T=" << c.warp.temperature << " top_p=" << c.warp.top_p << " top_k=" << c.warp.top_k << ", " << which);
    report("T=" + std::to_string(c.warp.temperature) + ", " + which, r);
    CHECK(!r.first_two.impossible);
    CHECK(!r.second_third.impossible);
    CHECK(r.first_two.p > 0.001);
    CHECK(r.second_third.p > 0.001);
    if (c.draft == &same) CHECK(r.per_step > 2.0);  // q = p: every node's first draw is accepted
    else CHECK(r.per_step > 1.05);                  // drafts accepted, and siblings after rejections
  }
}

TEST_CASE("the chi-square check catches rows that are not the distributions drawn from") {
  tiny_model target(64), unlike(64, 11);
  const medusa::sampling_warp w{.temperature = 1.0f};
  const medusa::draft_tree_options shape{.max_nodes = 8, .max_depth = 3, .topk = 4, .expand = 2};
  for (const bool independent : {true, false}) {
    const biased_rows biased{sampler(branch(unlike, V), shape, w), independent, {}};
    const auto r = sampled_chains::first_three(target, prompt, biased, w, trials);
    report(independent ? "rows as if drawn with replacement" : "flattened rows", r);
    CHECK(std::min(r.first_two.p, r.second_third.p) < 1e-6);
  }
}

TEST_CASE("each node's row is its parent's warped row without its earlier siblings") {
  tiny_model draft(64, 11);
  const medusa::sampling_warp w{.temperature = 1.2f, .top_k = 8};
  sampler s(branch(draft, V), {.max_nodes = 9, .max_depth = 3, .topk = 3, .expand = 2}, w);
  CHECK(s.draft_probs(0).empty());
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(s.max_nodes()));
  const auto t = s.draft(0, prompt, {}, V, tokens, 5, 1);
  REQUIRE(t);
  CHECK(t->num_nodes() == 10);  // the budget is spent: every draw is a node
  CHECK(tokens[0] == prompt.back());
  const auto rows = s.draft_probs(0);
  REQUIRE(rows.size() == static_cast<std::size_t>(s.max_nodes()) * V);
  tiny_model fresh(64, 11);
  for (int u = 1; u < t->num_nodes(); ++u) {
    std::vector<std::int32_t> ctx = prompt;  // the node's parent's context
    std::vector<std::int32_t> path;
    for (int a = t->parent(u); a > 0; a = t->parent(a)) path.insert(path.begin(), tokens[static_cast<std::size_t>(a)]);
    ctx.insert(ctx.end(), path.begin(), path.end());
    auto expect = reference_warp(last_logits(fresh, ctx).data(), V, w.temperature, w.top_k, w.top_p);
    std::set<std::int32_t> siblings;
    for (int c = t->child_begin(t->parent(u)); c < u; ++c) siblings.insert(tokens[static_cast<std::size_t>(c)]);
    double rest = 0;
    for (int x = 0; x < V; ++x) rest += siblings.count(x) ? 0.0 : expect[static_cast<std::size_t>(x)];
    const float* row = rows.data() + static_cast<std::size_t>(u) * V;
    double sum = 0;
    for (int x = 0; x < V; ++x) {
      const double want = siblings.count(x) ? 0.0 : expect[static_cast<std::size_t>(x)] / rest;
      CHECK(row[x] == doctest::Approx(want).epsilon(1e-4));
      sum += row[x];
    }
    CHECK(sum == doctest::Approx(1.0).epsilon(1e-5));
    CHECK(row[tokens[static_cast<std::size_t>(u)]] > 0.0f);  // drawn from it, so never a sibling's token
    CHECK(t->child_count(u) <= 3);
  }
  // The same seed and step draw the same tree; other seeds draw others.
  std::vector<std::int32_t> again(tokens.size());
  s.release(0);
  const auto t2 = s.draft(0, prompt, {}, V, again, 5, 1);
  REQUIRE(t2);
  CHECK(t2->sorted_paths() == t->sorted_paths());
  CHECK(again == tokens);
  int differ = 0;
  for (std::uint64_t seed = 6; seed < 16; ++seed) {
    s.release(0);
    (void)s.draft(0, prompt, {}, V, again, seed, 1);
    differ += again != tokens;
  }
  CHECK(differ > 0);
  CHECK_THROWS_AS(sampler(branch(draft, V), {.topk = 0}, w), medusa::invalid_input);
  CHECK_THROWS_AS(sampler(branch(draft, V), {}, {.temperature = -1.0f}), medusa::acceptance_error);
}

TEST_CASE("min_prob leaves out draws that would carry less; T = 0 draws the greedy chain") {
  tiny_model draft(64, 11);
  std::vector<std::int32_t> tokens(16);
  sampler wide(branch(draft, V), {.max_nodes = 15, .max_depth = 4, .topk = 4, .expand = 4}, {.temperature = 1.0f});
  sampler sure(branch(draft, V), {.max_nodes = 15, .max_depth = 4, .topk = 4, .expand = 4, .min_prob = 0.3}, {.temperature = 1.0f});
  const auto all = wide.draft(0, prompt, {}, V, tokens, 3, 1);
  const auto few = sure.draft(0, prompt, {}, V, tokens, 3, 1);
  REQUIRE(all);
  CHECK(all->num_nodes() == 16);
  CHECK((!few || few->num_nodes() < all->num_nodes()));
  // T = 0: a one-hot warp; each node's only child is the drafter's argmax.
  sampler greedy(branch(draft, V), {.max_nodes = 4, .max_depth = 4, .topk = 3, .expand = 2}, {.temperature = 0.0f});
  const auto chain = greedy.draft(0, prompt, {}, V, tokens, 3, 1);
  REQUIRE(chain);
  CHECK(chain->num_leaves() == 1);
  CHECK(chain->num_nodes() == 5);
  tiny_model fresh(64, 11);
  auto ctx = prompt;
  for (int u = 1; u < 5; ++u) {
    const auto z = last_logits(fresh, ctx);
    CHECK(tokens[static_cast<std::size_t>(u)] == static_cast<std::int32_t>(std::max_element(z.begin(), z.end()) - z.begin()));
    ctx.push_back(tokens[static_cast<std::size_t>(u)]);
  }
}

TEST_CASE("each depth of a sampled tree leaves one draw for every depth below it") {
  tiny_model draft(64, 11);
  std::vector<std::int32_t> tokens(16);
  for (std::uint64_t seed = 0; seed < 8; ++seed) {
    CAPTURE(seed);
    sampler four(branch(draft, V), {.max_nodes = 4, .max_depth = 3, .topk = 2, .expand = 1}, {.temperature = 1.0f});
    const auto t = four.draft(0, prompt, {}, V, tokens, seed, 1);
    REQUIRE(t);
    CHECK(t->num_nodes() == 5);
    CHECK(t->depth() == 3);  // 2 draws at depth 1, then one a depth
    sampler few(branch(draft, V), {.max_nodes = 3, .max_depth = 8, .topk = 3, .expand = 2}, {.temperature = 1.0f});
    const auto c = few.draft(0, prompt, {}, V, tokens, seed, 1);
    REQUIRE(c);
    CHECK(c->num_leaves() == 1);  // fewer draws than depths: a chain
    CHECK(c->depth() == 3);
  }
}

TEST_CASE("sampled trees decode exactly as plain greedy decoding under greedy verification and at T = 0") {
  tiny_model target(128), unlike(128, 11);
  medusa::decode_options opt;
  opt.max_new_tokens = 60;
  const auto plain = medusa::generate_vanilla(target, prompt, medusa::greedy_policy{}, opt);
  medusa::no_heads heads;
  {  // any draws verified greedily
    medusa::decoder dec(target, heads, sampler(branch(unlike, V), {.max_nodes = 8, .max_depth = 4, .topk = 2, .expand = 2},
                                               {.temperature = 1.0f}),
                        medusa::greedy_policy{});
    CHECK(dec.generate(prompt, opt).tokens == plain.tokens);
  }
  {  // T = 0: greedy chains, speculative verification
    medusa::decoder dec(target, heads, sampler(branch(unlike, V), {.max_nodes = 4, .max_depth = 4, .topk = 2, .expand = 2},
                                               {.temperature = 0.0f}),
                        medusa::speculative_policy{{.temperature = 0.0f}});
    CHECK(dec.generate(prompt, opt).tokens == plain.tokens);
  }
}

TEST_CASE("a lookup's own nodes in a sampled tree carry a point mass") {
  tiny_model draft(64, 11);
  // The prompt repeats: the lookup continues it after its last token.
  const std::vector<std::int32_t> history = {3, 8, 21, 30, 3, 8, 21, 30, 3, 8};
  sampler s(branch(draft, V), {.max_nodes = 3, .max_depth = 2, .topk = 2, .expand = 1}, {.temperature = 1.0f},
            medusa::ngram_lookup{.min_ngram = 2, .max_ngram = 3, .max_tokens = 3});
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(s.max_nodes()));
  const auto t = s.draft(0, history, {}, V, tokens, 1, 1);
  REQUIRE(t);
  const auto rows = s.draft_probs(0);
  int lookup_nodes = 0;
  for (int u = 1; u < t->num_nodes(); ++u) {
    if (t->rank(u) != 2) continue;  // rank topk: the lookup's own nodes
    ++lookup_nodes;
    const float* row = rows.data() + static_cast<std::size_t>(u) * V;
    for (int x = 0; x < V; ++x) CHECK(row[x] == (x == tokens[static_cast<std::size_t>(u)] ? 1.0f : 0.0f));
  }
  CHECK(lookup_nodes >= 1);  // its third token is deeper than any draw: at least that node is its own
}

TEST_CASE("a batch keeps one draft cache and one set of rows per request under sampled trees") {
  tiny_model target(512), draft_w(512, /*seed=*/11);
  tiny::batch_engine engine(target, 512), draft(draft_w, 512);
  const std::vector<std::vector<std::int32_t>> prompts = {{1, 5, 9, 13}, {3, 3, 8}, {20, 1, 2, 30, 4, 11, 6}};
  medusa::draft_model_branch<tiny::batch_engine> b(draft, target.vocab_size());
  const medusa::draft_tree_options shape{.max_nodes = 8, .max_depth = 4, .topk = 2, .expand = 2};
  medusa::no_heads none;
  SUBCASE("T = 0 under speculative verification") {
    medusa::batch_decoder dec(engine, none, medusa::tree_sampler(b, shape, {.temperature = 0.0f}),
                              medusa::speculative_policy{{.temperature = 0.0f}}, 4);
    tiny::check_batch_lossless(dec, prompts, 512);
  }
  SUBCASE("draws at T = 1 verified greedily") {
    medusa::batch_decoder dec(engine, none, medusa::tree_sampler(b, shape, {.temperature = 1.0f}), medusa::greedy_policy{}, 4);
    tiny::check_batch_lossless(dec, prompts, 512);
  }
}
