// SPDX-License-Identifier: Apache-2.0
// Draft trees grown by a model-running drafter (draft_tree.hpp): the step's tree is the most
// probable nodes of the drafter's expansion (checked against a brute-force ranking); each pass
// runs the nodes to expand and their ancestors, root first, with the deepest last; growth stops
// once no node still to expand can enter the tree; a draft model identical to the target gets a
// whole path accepted every step; any draft model or feature drafter decodes exactly as plain
// greedy decoding, alone, with a lookup branch, and for a batch of requests with their own draft
// caches; bad options, a vocabulary mismatch and non-finite drafter rows are refused by name.
#include "tiny_transformer.hpp"

#include <medusa/decoder.hpp>
#include <medusa/draft_model.hpp>
#include <medusa/draft_tree.hpp>
#include <medusa/feature_draft.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <span>
#include <string>
#include <vector>

namespace {

using tiny::tiny_model;
using token_path = std::vector<std::int32_t>;

const std::vector<std::int32_t> prompt = {1, 5, 9, 13, 2, 7};

medusa::decode_options tokens(int n) {
  medusa::decode_options opt;
  opt.max_new_tokens = n;
  return opt;
}

// A drafter whose logit row after a node depends only on the node's token path (a hash of it),
// checking every pass's shape: the root first with the history's last token, the nodes' tokens
// those the drafter proposed along their paths, the rows wanted the pass's deepest nodes.
struct scripted_source {
  static constexpr int vocab = 12;
  float peak = 0.0f;  // added to token (path length mod vocab): > 0 makes the rows confident
  std::vector<float> rows;
  std::vector<std::vector<int>> pass_sizes;  // per pass: nodes, outputs, cached rows
  bool nan_after_root = false;

  int vocab_size() const { return vocab; }

  std::vector<float> row_of(const token_path& path) const {
    std::uint64_t h = 1469598103934665603ull;
    for (const std::int32_t t : path) h = (h ^ static_cast<std::uint64_t>(t + 1)) * 1099511628211ull;
    std::mt19937 rng(static_cast<std::uint32_t>(h ^ (h >> 32)));
    std::normal_distribution<float> n(0.0f, 1.5f);
    std::vector<float> row(vocab);
    for (float& z : row) z = n(rng);
    row[path.size() % vocab] += peak;
    return row;
  }

  std::span<const float> draft_root(int, std::span<const std::int32_t> history) {
    rows = row_of({});
    REQUIRE_FALSE(history.empty());
    return rows;
  }

  std::span<const float> draft_pass(int, std::span<const std::int32_t> history, const medusa::draft_tree_pass& pass) {
    const medusa::tree& t = pass.shape;
    REQUIRE(pass.tokens.size() >= static_cast<std::size_t>(t.num_nodes()));
    CHECK(pass.tokens[0] == history.back());
    CHECK(pass.ids[0] == 0);
    REQUIRE(pass.outputs >= 1);
    REQUIRE(pass.outputs < t.num_nodes());
    // The wanted rows are the pass's deepest nodes, all of them.
    CHECK(t.depth_begin(t.depth()) == t.num_nodes() - pass.outputs);
    pass_sizes.push_back({t.num_nodes(), pass.outputs, pass.cached});
    rows.clear();
    for (int i = t.num_nodes() - pass.outputs; i < t.num_nodes(); ++i) {
      // The node's token path; each token must be the rank-th best of its parent's row.
      token_path path;
      for (int u = i; u > 0; u = t.parent(u)) path.push_back(pass.tokens[static_cast<std::size_t>(u)]);
      std::reverse(path.begin(), path.end());
      for (std::size_t d = 0; d < path.size(); ++d) {
        const auto parent_row = row_of(token_path(path.begin(), path.begin() + static_cast<std::ptrdiff_t>(d)));
        const float z = parent_row[static_cast<std::size_t>(path[d])];
        int above = 0;
        for (const float y : parent_row) above += y > z ? 1 : 0;
        int u = i;
        for (std::size_t up = d + 1; up < path.size(); ++up) u = t.parent(u);
        CHECK(above == t.rank(u));
      }
      const auto row = row_of(path);
      rows.insert(rows.end(), row.begin(), row.end());
    }
    if (nan_after_root) rows[3] = std::numeric_limits<float>::quiet_NaN();
    return rows;
  }
};

// Joint log-probabilities of every token path of the full expansion (topk children a node, down to
// `depth`), in double.
void expand_all(const scripted_source& s, const token_path& at, double logp, int topk, int depth,
                std::vector<std::pair<double, token_path>>& out) {
  if (static_cast<int>(at.size()) == depth) return;
  const auto row = s.row_of(at);
  double m = row[0], sum = 0;
  for (const float z : row) m = std::max(m, static_cast<double>(z));
  for (const float z : row) sum += std::exp(z - m);
  std::vector<int> order(row.size());
  for (std::size_t i = 0; i < row.size(); ++i) order[i] = static_cast<int>(i);
  std::sort(order.begin(), order.end(), [&](int a, int b) { return row[a] > row[b] || (row[a] == row[b] && a < b); });
  for (int r = 0; r < topk; ++r) {
    token_path next = at;
    next.push_back(order[static_cast<std::size_t>(r)]);
    const double lp = logp + (row[static_cast<std::size_t>(order[static_cast<std::size_t>(r)])] - m) - std::log(sum);
    out.emplace_back(lp, next);
    expand_all(s, next, lp, topk, depth, out);
  }
}

// The token paths of a drafted tree's nodes (root excluded).
std::set<token_path> paths_of(const medusa::tree& t, std::span<const std::int32_t> node_tokens) {
  std::set<token_path> out;
  for (int i = 1; i < t.num_nodes(); ++i) {
    token_path p;
    for (int u = i; u > 0; u = t.parent(u)) p.push_back(node_tokens[static_cast<std::size_t>(u)]);
    std::reverse(p.begin(), p.end());
    out.insert(p);
  }
  return out;
}

// A feature drafter that honours a tree pass's mask: row i's state mixes its feature and token;
// its logits depend on the states of its cache slots and of the rows it sees, its predicted feature
// on its own row. Not the target: drafts are often rejected.
struct masked_feature_drafter {
  static constexpr int V = tiny_model::vocab, D = tiny_model::dim;
  std::map<int, std::vector<float>> caches;
  std::vector<float> a, bt;
  int tree_passes = 0;
  // Each request's features by position from its causal passes (its real ones where it caught up),
  // and the tree passes whose root row came with another feature than the request's own.
  std::map<int, std::map<int, std::vector<float>>> seen;
  int root_mismatches = 0;

  int vocab_size() const { return V; }
  int hidden_size() const { return D; }
  int max_context() const { return 511; }
  void release(int request) { caches.erase(request); }
  explicit masked_feature_drafter(std::uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> n(0.0f, 1.0f);
    a.resize(static_cast<std::size_t>(V) * D);
    for (float& x : a) x = n(rng) * 0.3f;
    bt.resize(static_cast<std::size_t>(V) * V);
    for (float& x : bt) x = n(rng);
  }
  void forward(const medusa::feature_batch& b) {
    auto& slots = caches[b.request];
    REQUIRE(b.cache_length <= static_cast<int>(slots.size()));
    slots.resize(static_cast<std::size_t>(b.cache_length));
    const int T = static_cast<int>(b.tokens.size());
    if (!b.tree_mask.empty()) ++tree_passes;
    if (b.tree_mask.empty()) {
      for (int i = 0; i < T; ++i)
        seen[b.request][b.positions[static_cast<std::size_t>(i)]].assign(b.features.begin() + static_cast<std::ptrdiff_t>(i) * D,
                                                                         b.features.begin() + static_cast<std::ptrdiff_t>(i + 1) * D);
    } else {
      const auto& known = seen[b.request][b.positions[0]];
      if (!std::equal(known.begin(), known.end(), b.features.begin()) || known.empty()) ++root_mismatches;
    }
    float prefix = 0;
    for (const float s : slots) prefix += s;
    std::vector<float> state(static_cast<std::size_t>(T));
    for (int i = 0; i < T; ++i) {
      float fs = 0;
      for (int k = 0; k < D; ++k) fs += b.features[static_cast<std::size_t>(i) * D + static_cast<std::size_t>(k)];
      state[static_cast<std::size_t>(i)] = 0.01f * fs + static_cast<float>(b.tokens[static_cast<std::size_t>(i)]);
    }
    for (int i = 0; i < T; ++i) {
      const int out = i - (T - b.outputs);
      if (out < 0) continue;
      float seen = prefix;
      for (int j = 0; j <= i; ++j)
        if (b.tree_mask.empty() ? true : b.tree_mask.visible(i, j)) seen += state[static_cast<std::size_t>(j)];
      const float* f = b.features.data() + static_cast<std::size_t>(i) * D;
      const auto tok = static_cast<std::size_t>(b.tokens[static_cast<std::size_t>(i)]);
      for (int v = 0; v < V; ++v) {
        float z = bt[tok * V + static_cast<std::size_t>(v)] + std::sin(0.01f * seen + static_cast<float>(v));
        for (int k = 0; k < D; ++k) z += a[static_cast<std::size_t>(v) * D + static_cast<std::size_t>(k)] * f[k];
        b.logits[static_cast<std::size_t>(out) * V + static_cast<std::size_t>(v)] = z;
      }
      for (int k = 0; k < D; ++k)
        b.hidden[static_cast<std::size_t>(out) * D + static_cast<std::size_t>(k)] = std::tanh(f[k] + 0.1f * static_cast<float>(tok));
    }
    slots.insert(slots.end(), state.begin(), state.end());
  }
};

// The same drafter with a batched forward (`feature_draft_batch_model`): each batch as `forward`
// runs it; the batched calls and the batches they held are counted.
struct masked_feature_batch_drafter : masked_feature_drafter {
  using masked_feature_drafter::masked_feature_drafter;
  int batched_calls = 0, batched_requests = 0;
  void forward_batch(std::span<const medusa::feature_batch> bs) {
    ++batched_calls;
    batched_requests += static_cast<int>(bs.size());
    for (const auto& b : bs) forward(b);
  }
};

}  // namespace

TEST_CASE("a draft tree holds the most probable nodes of the drafter's expansion") {
  constexpr int topk = 3, depth = 3;
  scripted_source src;
  std::vector<std::pair<double, token_path>> all;
  expand_all(src, {}, 0.0, topk, depth, all);  // 3 + 9 + 27 nodes
  std::stable_sort(all.begin(), all.end(), [](const auto& x, const auto& y) { return x.first > y.first; });
  const std::vector<std::int32_t> history = {4, 2, 7};
  for (const double min_prob : {0.0, 0.03, 0.12})
  for (const int n : {1, 2, 5, 12, 39}) {
    CAPTURE(n);
    CAPTURE(min_prob);
    medusa::tree_drafter<scripted_source> drafts(
        src, {.max_nodes = n, .max_depth = depth, .topk = topk, .expand = 9, .min_prob = min_prob});
    CHECK(drafts.max_nodes() == n + 1);
    CHECK(drafts.max_depth() == depth);
    std::vector<std::int32_t> node_tokens(static_cast<std::size_t>(drafts.max_nodes()));
    std::set<token_path> want;  // the n most probable, none below min_prob
    for (int i = 0; i < n; ++i)
      if (std::exp(all[static_cast<std::size_t>(i)].first) >= min_prob) want.insert(all[static_cast<std::size_t>(i)].second);
    const auto t = drafts.draft(0, history, {}, scripted_source::vocab, node_tokens);
    REQUIRE(t);
    CHECK(t->num_nodes() == static_cast<int>(want.size()) + 1);
    CHECK(node_tokens[0] == history.back());
    CHECK(paths_of(*t, node_tokens) == want);
    // Siblings are ranked by the drafter: rank r is its r-th most probable token.
    for (int u = 1; u < t->num_nodes(); ++u)
      if (t->rank(u) > 0) {
        const int prev = u - 1;
        REQUIRE(t->parent(prev) == t->parent(u));
      }
  }
}

TEST_CASE("each depth expands its most probable nodes, and growth stops once nothing can enter") {
  scripted_source src;
  src.peak = 6.0f;  // the path-length token is far ahead: a confident chain
  const std::vector<std::int32_t> history = {3};
  medusa::tree_drafter<scripted_source> drafts(src, {.max_nodes = 3, .max_depth = 8, .topk = 2, .expand = 1});
  std::vector<std::int32_t> node_tokens(static_cast<std::size_t>(drafts.max_nodes()));
  const auto t = drafts.draft(0, history, {}, scripted_source::vocab, node_tokens);
  REQUIRE(t);
  // The confident chain of three: its nodes beat every sibling.
  CHECK(t->num_nodes() == 4);
  CHECK(t->depth() == 3);
  CHECK(node_tokens[1] == 0);
  CHECK(node_tokens[2] == 1);
  CHECK(node_tokens[3] == 2);
  // The root's row, then the chain's nodes at depths 1, 2 and 3; depth 4 could not enter.
  const auto passes = drafts.source().pass_sizes;
  REQUIRE(passes.size() == 3);
  for (std::size_t d = 0; d < passes.size(); ++d) {
    CHECK(passes[d][1] == 1);                                // one node expanded a depth
    CHECK(passes[d][0] == static_cast<int>(d) + 2);          // the root and one node a depth
    CHECK(passes[d][2] == static_cast<int>(d) + 1);          // a chain: only its new row runs
  }
  CHECK(drafts.passes_by_depth().size() == 4);
}

TEST_CASE("a draft tree's options, its drafter's vocabulary and rows are checked") {
  scripted_source src;
  auto bad = [&](medusa::draft_tree_options o, const char* what) {
    CAPTURE(what);
    CHECK_THROWS_WITH_AS(medusa::tree_drafter<scripted_source>(src, o), doctest::Contains(what), medusa::invalid_input);
  };
  bad({.max_nodes = 0}, "max_nodes");
  bad({.max_depth = 0}, "max_depth");
  bad({.topk = 0}, "topk");
  bad({.topk = medusa::max_tree_topk}, "topk");
  bad({.expand = 0}, "expand");
  bad({.min_prob = -0.1}, "min_prob");
  bad({.min_prob = 1.0}, "min_prob");
  CHECK_THROWS_AS(medusa::tree_drafter<scripted_source>(src, {}, medusa::ngram_lookup{.max_tokens = 0}), medusa::invalid_input);

  medusa::tree_drafter<scripted_source> drafts(src, {.max_nodes = 8, .max_depth = 3});
  std::vector<std::int32_t> node_tokens(static_cast<std::size_t>(drafts.max_nodes()));
  const std::vector<std::int32_t> history = {1, 2};
  CHECK_THROWS_WITH_AS(drafts.draft(0, history, {}, scripted_source::vocab + 1, node_tokens),
                       doctest::Contains("vocabulary of 12, the target 13"), medusa::acceptance_error);
  std::vector<std::int32_t> short_tokens(3);
  CHECK_THROWS_AS(drafts.draft(0, history, {}, scripted_source::vocab, short_tokens), medusa::acceptance_error);
  drafts.source().nan_after_root = true;
  try {
    (void)drafts.draft(0, history, {}, scripted_source::vocab, node_tokens);
    FAIL("a NaN drafter row was accepted");
  } catch (const medusa::acceptance_error& e) {
    CHECK(e.code() == medusa::acceptance_errc::non_finite_logit);
    CHECK(std::string(e.what()).find("NaN") != std::string::npos);
  }
}

TEST_CASE("a draft model identical to the target: a whole path accepted every step, tokens equal plain decoding") {
  tiny_model target(512), draft(512);  // same seed: the same model
  const auto opt = tokens(90);
  const auto plain = medusa::generate_vanilla(target, prompt, medusa::greedy_policy{}, opt);
  using branch = medusa::draft_model_branch<tiny_model>;
  // expand 2: every pass runs its tree; expand 1: a chain and its siblings, each pass one new row.
  for (const int expand : {2, 1}) {
    CAPTURE(expand);
    branch b(draft, target.vocab_size());
    medusa::tree_drafter<branch> drafts(b, {.max_nodes = 10, .max_depth = 4, .topk = 2, .expand = expand});
    medusa::no_heads none;
    medusa::decoder dec(target, none, drafts, medusa::greedy_policy{});
    const auto r = dec.generate(prompt, opt);
    CHECK(r.tokens == plain.tokens);
    // Each step accepts a whole path of four and adds the bonus token.
    CHECK(r.stats.steps <= (r.stats.new_tokens + 4) / 5 + 1);
    if (expand == 1)  // the catch-up, then one row a depth: as a chain of four would run
      CHECK(b.tokens_run() <= static_cast<std::int64_t>(prompt.size()) + static_cast<std::int64_t>(r.stats.steps) * (5 + 3));
    MESSAGE("trees of 10, expand " << expand << ": " << r.stats.steps << " steps for " << r.stats.new_tokens
                                   << " tokens; the draft ran " << b.tokens_run() << " tokens in " << b.passes() << " passes");
    b.release(0);
  }
}

TEST_CASE("draft trees of another model are lossless, alone and with a lookup branch, to the context's end") {
  tiny_model target(512), draft(512, /*seed=*/11);
  using branch = medusa::draft_model_branch<tiny_model>;
  for (const bool lookup : {false, true}) {
    for (const int capacity : {512, 40}) {  // 40: the target's context ends inside the run
      CAPTURE(lookup);
      CAPTURE(capacity);
      tiny_model t(capacity);
      const auto opt = tokens(120);
      const auto plain = medusa::generate_vanilla(t, prompt, medusa::greedy_policy{}, opt);
      branch b(draft, t.vocab_size());
      std::optional<medusa::ngram_lookup> ng;
      if (lookup) ng = medusa::ngram_lookup{.max_tokens = 6};
      medusa::tree_drafter<branch> drafts(b, {.max_nodes = 12, .max_depth = 5, .topk = 3, .expand = 3}, ng);
      medusa::no_heads none;
      medusa::decoder dec(t, none, drafts, medusa::greedy_policy{});
      const auto r = dec.generate(prompt, opt);
      CHECK(r.tokens == plain.tokens);
      CHECK(r.reason == plain.reason);
      CHECK(r.stats.steps < r.stats.new_tokens);
      b.release(0);
    }
  }
}

TEST_CASE("a batch keeps one draft cache per request under draft trees, each decoding as plain greedy") {
  tiny_model target(512), draft_w(512, /*seed=*/11);
  tiny::batch_engine engine(target, 512), draft(draft_w, 512);
  const std::vector<std::vector<std::int32_t>> prompts = {{1, 5, 9, 13}, {3, 3, 8}, {20, 1, 2, 30, 4, 11, 6}};
  medusa::draft_model_branch<tiny::batch_engine> b(draft, target.vocab_size());
  medusa::no_heads none;
  medusa::batch_decoder dec(engine, none, medusa::tree_drafter(b, {.max_nodes = 8, .max_depth = 4, .topk = 2, .expand = 2}),
                            medusa::greedy_policy{}, 4);
  tiny::check_batch_lossless(dec, prompts, 512);
}

TEST_CASE("a feature drafter's trees are lossless: each node's row takes its parent's predicted feature") {
  tiny_model target(512);
  const auto opt = tokens(120);
  const auto plain = medusa::generate_vanilla(target, prompt, medusa::greedy_policy{}, opt);
  for (const int expand : {3, 1}) {
    CAPTURE(expand);
    masked_feature_drafter model(5);
    medusa::feature_draft_branch<masked_feature_drafter> b(model, tiny_model::vocab, tiny_model::dim);
    medusa::tree_drafter drafts(b, {.max_nodes = 12, .max_depth = 5, .topk = 3, .expand = expand});
    static_assert(medusa::feature_observing<decltype(drafts)>);
    CHECK(drafts.observes_features());
    medusa::no_heads none;
    medusa::decoder dec(target, none, drafts, medusa::greedy_policy{});
    const auto r = dec.generate(prompt, opt);
    CHECK(r.tokens == plain.tokens);
    CHECK((model.tree_passes > 0) == (expand > 1));  // expand 1: chains, each new row after the cached ones
    CHECK(model.root_mismatches == 0);               // a tree pass's root row: the real feature
    MESSAGE("feature trees, expand " << expand << ": " << r.stats.steps << " steps for " << r.stats.new_tokens << " tokens");
  }
}

TEST_CASE("a batch's trees grow together, one draft pass per depth, each the tree it gets alone") {
  tiny_model draft_w(512, /*seed=*/11);
  const std::vector<std::vector<std::int32_t>> histories = {{1, 5, 9, 13}, {3, 3, 8, 20, 4}, {7}};
  const std::vector<int> requests = {4, 9, 2};
  const medusa::draft_tree_options shape{.max_nodes = 8, .max_depth = 4, .topk = 2, .expand = 2};
  static_assert(medusa::tree_draft_batch_source<medusa::draft_model_branch<tiny::batch_engine>>);
  static_assert(!medusa::tree_draft_batch_source<medusa::draft_model_branch<tiny_model>>);
  constexpr int V = tiny_model::vocab;
  auto calls_for = [&](std::vector<std::vector<std::int32_t>>& tokens) {
    std::vector<medusa::step_draft_call> calls;
    for (std::size_t i = 0; i < histories.size(); ++i)
      calls.push_back({requests[i], histories[i], {}, tokens[i], 100 + i, 1, std::nullopt});
    return calls;
  };
  SUBCASE("top-k trees") {
    tiny::batch_engine together(draft_w, 512), alone(draft_w, 512);
    medusa::draft_model_branch<tiny::batch_engine> bt(together, V), ba(alone, V);
    medusa::tree_drafter<medusa::draft_model_branch<tiny::batch_engine>> dt(bt, shape), da(ba, shape);
    std::vector<std::vector<std::int32_t>> tokens(3, std::vector<std::int32_t>(static_cast<std::size_t>(dt.max_nodes())));
    auto calls = calls_for(tokens);
    dt.draft_batch(calls, V);
    for (std::size_t i = 0; i < calls.size(); ++i) {
      std::vector<std::int32_t> own(tokens[i].size());
      const auto t = da.draft(requests[i], histories[i], {}, V, own);
      REQUIRE(t);
      REQUIRE(calls[i].result);
      CHECK(calls[i].result->sorted_paths() == t->sorted_paths());
      CHECK(std::equal(own.begin(), own.begin() + t->num_nodes(), tokens[i].begin()));
    }
    MESSAGE("draft passes: " << bt.passes() << " together, " << ba.passes() << " one request at a time");
    calls[1].request = calls[0].request;
    CHECK_THROWS_WITH_AS(dt.draft_batch(calls, V), doctest::Contains("appears twice"), medusa::invalid_input);
    const std::vector<medusa::draft_root_call> twice = {{4, histories[0]}, {4, histories[1]}};
    std::vector<std::span<const float>> rows(2);
    CHECK_THROWS_WITH_AS(bt.draft_roots(twice, rows), doctest::Contains("appears twice"), medusa::invalid_input);
    CHECK(bt.passes() < ba.passes());
    CHECK(bt.passes() <= shape.max_depth);  // the roots, then one pass a depth
  }
  SUBCASE("sampled trees, with their rows") {
    tiny::batch_engine together(draft_w, 512), alone(draft_w, 512);
    medusa::draft_model_branch<tiny::batch_engine> bt(together, V), ba(alone, V);
    const medusa::sampling_warp warp{.temperature = 0.9f};
    medusa::tree_sampler<medusa::draft_model_branch<tiny::batch_engine>> st(bt, shape, warp), sa(ba, shape, warp);
    std::vector<std::vector<std::int32_t>> tokens(3, std::vector<std::int32_t>(static_cast<std::size_t>(st.max_nodes())));
    auto calls = calls_for(tokens);
    st.draft_batch(calls, V);
    for (std::size_t i = 0; i < calls.size(); ++i) {
      std::vector<std::int32_t> own(tokens[i].size());
      const auto t = sa.draft(requests[i], histories[i], {}, V, own, 100 + i, 1);
      REQUIRE(t);
      REQUIRE(calls[i].result);
      CHECK(calls[i].result->sorted_paths() == t->sorted_paths());
      CHECK(std::equal(own.begin(), own.begin() + t->num_nodes(), tokens[i].begin()));
      const auto a = st.draft_probs(requests[i]), b = sa.draft_probs(requests[i]);
      CHECK(std::equal(a.begin(), a.begin() + t->num_nodes() * V, b.begin()));
    }
    CHECK(bt.passes() < ba.passes());
  }
}

// A source whose batched members exist but are switched off at run time (`batches()`): the tree
// drafter must call it one request at a time.
struct unbatched_source {
  medusa::draft_model_branch<tiny::batch_engine> inner;
  int vocab_size() const { return inner.vocab_size(); }
  bool batches() const { return false; }
  std::span<const float> draft_root(int request, std::span<const std::int32_t> history) { return inner.draft_root(request, history); }
  std::span<const float> draft_pass(int request, std::span<const std::int32_t> history, const medusa::draft_tree_pass& p) {
    return inner.draft_pass(request, history, p);
  }
  void draft_roots(std::span<const medusa::draft_root_call>, std::span<std::span<const float>>) { FAIL("batched roots called"); }
  void draft_passes(std::span<const medusa::draft_pass_call>, std::span<std::span<const float>>) { FAIL("batched passes called"); }
};

TEST_CASE("a source that does not batch at run time is called one request at a time, with the same trees") {
  tiny_model draft_w(512, /*seed=*/11);
  constexpr int V = tiny_model::vocab;
  static_assert(medusa::tree_draft_batch_source<unbatched_source>);
  tiny::batch_engine one(draft_w, 512), alone(draft_w, 512);
  const medusa::draft_tree_options shape{.max_nodes = 8, .max_depth = 4, .topk = 2, .expand = 2};
  medusa::tree_drafter<unbatched_source> d(unbatched_source{medusa::draft_model_branch<tiny::batch_engine>(one, V)}, shape);
  medusa::tree_drafter<medusa::draft_model_branch<tiny::batch_engine>> a(medusa::draft_model_branch<tiny::batch_engine>(alone, V), shape);
  const std::vector<std::vector<std::int32_t>> histories = {{1, 5, 9, 13}, {3, 3, 8, 20, 4}};
  std::vector<std::vector<std::int32_t>> tokens(2, std::vector<std::int32_t>(static_cast<std::size_t>(d.max_nodes())));
  std::vector<medusa::step_draft_call> calls;
  for (std::size_t i = 0; i < 2; ++i) calls.push_back({static_cast<int>(i), histories[i], {}, tokens[i], 0, 0, std::nullopt});
  d.draft_batch(calls, V);
  for (std::size_t i = 0; i < 2; ++i) {
    std::vector<std::int32_t> own(tokens[i].size());
    const auto t = a.draft(static_cast<int>(i), histories[i], {}, V, own);
    REQUIRE(t);
    REQUIRE(calls[i].result);
    CHECK(calls[i].result->sorted_paths() == t->sorted_paths());
    CHECK(std::equal(own.begin(), own.begin() + t->num_nodes(), tokens[i].begin()));
  }
}

// A batched draft model whose root row for one request holds a NaN.
struct poisoned_source {
  medusa::draft_model_branch<tiny::batch_engine> inner;
  int bad = -1;
  std::vector<float> copy;
  int vocab_size() const { return inner.vocab_size(); }
  std::span<const float> poison(std::span<const float> row) {
    copy.assign(row.begin(), row.end());
    copy[0] = std::numeric_limits<float>::quiet_NaN();
    return copy;
  }
  std::span<const float> draft_root(int request, std::span<const std::int32_t> history) {
    const auto row = inner.draft_root(request, history);
    return request == bad && !row.empty() ? poison(row) : row;
  }
  std::span<const float> draft_pass(int request, std::span<const std::int32_t> history, const medusa::draft_tree_pass& p) {
    return inner.draft_pass(request, history, p);
  }
  void draft_roots(std::span<const medusa::draft_root_call> calls, std::span<std::span<const float>> rows) {
    inner.draft_roots(calls, rows);
    for (std::size_t i = 0; i < calls.size(); ++i)
      if (calls[i].request == bad && !rows[i].empty()) rows[i] = poison(rows[i]);
  }
  void draft_passes(std::span<const medusa::draft_pass_call> calls, std::span<std::span<const float>> rows) {
    inner.draft_passes(calls, rows);
  }
  void release(int request) { inner.release(request); }
};

TEST_CASE("a drafter row that fails one request of a batch's drafts fails that request alone") {
  tiny_model target(512), draft_w(512, /*seed=*/11);
  tiny::batch_engine engine(target, 512), draft(draft_w, 512);
  static_assert(medusa::tree_draft_batch_source<poisoned_source>);
  poisoned_source src{medusa::draft_model_branch<tiny::batch_engine>(draft, target.vocab_size()), 11, {}};
  medusa::no_heads none;
  medusa::batch_decoder dec(engine, none, medusa::tree_drafter(src, {.max_nodes = 8, .max_depth = 4, .topk = 2, .expand = 2}),
                            medusa::greedy_policy{}, 4);
  const std::vector<std::vector<std::int32_t>> prompts = {{1, 5, 9, 13}, {3, 3, 8}, {20, 1, 2, 30, 4, 11, 6}};
  medusa::decode_options opt;
  opt.max_new_tokens = 30;
  for (std::size_t r = 0; r < prompts.size(); ++r) dec.join(10 + static_cast<int>(r), prompts[r], opt);
  std::map<int, medusa::request_update> out;
  while (dec.size() > 0)
    for (auto& u : dec.step())
      if (u.finished) out[u.request] = u;
  REQUIRE(out.size() == 3);
  CHECK(out[11].reason == medusa::stop_reason::failed);
  CHECK(out[11].error_message().find("draft tree") != std::string::npos);
  for (const int r : {10, 12}) {
    INFO("request " << r << ": " << out[r].error_message());
    tiny_model alone(512);
    CHECK(out[r].result.tokens == medusa::generate_vanilla(alone, prompts[static_cast<std::size_t>(r - 10)], medusa::greedy_policy{}, opt).tokens);
  }
}

TEST_CASE("a feature drafter's trees in a batch are each request's own: the steps each takes alone") {
  tiny_model target(512);
  const std::vector<std::vector<std::int32_t>> prompts = {{1, 5, 9, 13}, {3, 3, 8}, {20, 1, 2, 30, 4, 11, 6}};
  const medusa::draft_tree_options shape{.max_nodes = 8, .max_depth = 4, .topk = 2, .expand = 2};
  medusa::decode_options opt;
  opt.max_new_tokens = 40;
  medusa::no_heads none;
  static_assert(!medusa::tree_draft_batch_source<medusa::feature_draft_branch<masked_feature_drafter>>);
  static_assert(medusa::tree_draft_batch_source<medusa::feature_draft_branch<masked_feature_batch_drafter>>);
  // Serves `which` prompts in one batch with a drafter of type Model; each request's (steps, tokens).
  int mismatches = 0, batched_calls = 0, batched_requests = 0;
  auto serve = [&]<class Model>(const std::vector<int>& which, Model*) {
    tiny::batch_engine engine(target, 512);
    Model model(5);
    medusa::feature_draft_branch<Model> b(model, tiny_model::vocab, tiny_model::dim);
    medusa::batch_decoder dec(engine, none, medusa::tree_drafter(b, shape), medusa::greedy_policy{}, 4);
    for (const int i : which) dec.join(i, prompts[static_cast<std::size_t>(i)], opt);
    std::map<int, std::pair<int, std::vector<std::int32_t>>> out;
    while (dec.size() > 0)
      for (auto& u : dec.step())
        if (u.finished) {
          REQUIRE_FALSE(u.error);
          out[u.request] = {u.result.stats.steps, u.result.tokens};
        }
    CHECK(model.tree_passes > 0);
    mismatches += model.root_mismatches;
    if constexpr (requires { model.batched_calls; }) {
      batched_calls += model.batched_calls;
      batched_requests += model.batched_requests;
    }
    return out;
  };
  // One drafter pass per request (a model without a batched forward), then one per depth for the
  // whole batch: each request's steps and tokens are those it takes alone.
  const auto one_by_one = serve({0, 1, 2}, static_cast<masked_feature_drafter*>(nullptr));
  const auto together = serve({0, 1, 2}, static_cast<masked_feature_batch_drafter*>(nullptr));
  CHECK(mismatches == 0);  // every tree pass's root row had its own request's real feature
  CHECK(batched_calls > 0);
  CHECK(batched_requests > batched_calls);  // passes that held several requests
  MESSAGE("batched drafter passes: " << batched_calls << " for " << batched_requests << " requests' rows");
  for (int i = 0; i < 3; ++i) {
    CAPTURE(i);
    const auto alone = serve({i}, static_cast<masked_feature_drafter*>(nullptr));
    for (const auto* served : {&one_by_one, &together}) {
      CHECK(served->at(i).first == alone.at(i).first);  // the same drafts accepted: the same steps
      CHECK(served->at(i).second == alone.at(i).second);
    }
    tiny_model plain(512);
    CHECK(alone.at(i).second == medusa::generate_vanilla(plain, prompts[static_cast<std::size_t>(i)], medusa::greedy_policy{}, opt).tokens);
  }
}

TEST_CASE("a feature drafter's batched passes refuse a request twice and leave the requests' state as it was") {
  masked_feature_batch_drafter model(5);
  medusa::feature_draft_branch<masked_feature_batch_drafter> b(model, tiny_model::vocab, tiny_model::dim);
  const std::vector<std::int32_t> h = {1, 5, 9, 13};
  const std::vector<float> f(static_cast<std::size_t>(3 * tiny_model::dim), 0.25f);
  b.observe(4, 0, f);
  std::vector<std::span<const float>> rows(2);
  const std::vector<medusa::draft_root_call> twice = {{4, h}, {4, h}};
  CHECK_THROWS_WITH_AS(b.draft_roots(twice, rows), doctest::Contains("request 4 appears twice"), medusa::invalid_input);
  // Request 7 has no features: the call throws before the pass, and request 4's catch-up has not run.
  const std::vector<medusa::draft_root_call> missing = {{4, h}, {7, h}};
  CHECK_THROWS_WITH_AS(b.draft_roots(missing, rows), doctest::Contains("request 7 has the features of 0 positions"),
                       medusa::invalid_input);
  CHECK(model.batched_calls == 0);
  const std::vector<medusa::draft_root_call> one = {{4, h}};
  b.draft_roots(one, std::span(rows).subspan(0, 1));
  CHECK(model.batched_calls == 1);
  CHECK(rows[0].size() == static_cast<std::size_t>(tiny_model::vocab));
  CHECK(b.tokens_run() == 3);  // all three caught-up rows, once
}
