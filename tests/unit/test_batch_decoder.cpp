// SPDX-License-Identifier: Apache-2.0
// batch_decoder on a serving engine built here over the tiny transformer: one paged KV pool that
// all requests share, pages mapped on demand and unmapped after commits, scrambled page order.
// Every request of a batch, whatever joins and leaves around it, must get exactly the tokens it
// gets decoded alone; a request that fails must fail alone.
#include "tiny_transformer.hpp"

#include <medusa/decoder.hpp>
#include <medusa/draft_model.hpp>
#include <medusa/draft_tree.hpp>
#include <medusa/drafts.hpp>
#include <medusa/tree.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using tiny::oracle_heads;
using tiny::random_heads;
using tiny::tiny_model;

// The pool ran out of pages (what a real engine would answer with preemption).
struct pool_exhausted : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A ragged-batch engine over tiny_model's weights with a lazily mapped paged pool.
class paged_engine {
 public:
  static constexpr int page_size = 4;

  paged_engine(const tiny_model& weights, int pool_pages, int max_context, int max_requests, bool bound_context = true)
      : w_(weights), pool_pages_(pool_pages), max_context_(max_context), bound_(bound_context),
        tables_(static_cast<std::size_t>(max_requests)) {
    const std::size_t elems = static_cast<std::size_t>(pool_pages) * page_size * tiny_model::layers *
                              tiny_model::kv_heads * tiny_model::head_dim;
    k_.assign(elems, std::numeric_limits<float>::quiet_NaN());  // unwritten slots must never be read
    v_.assign(elems, std::numeric_limits<float>::quiet_NaN());
    // Pages are handed out from the back of the free list in a scrambled order (a permutation
    // when gcd(5, pages) = 1, else descending), so block tables are far from sequential.
    for (int p = 0; p < pool_pages; ++p)
      free_.push_back(static_cast<std::int32_t>(std::gcd(5, pool_pages) == 1 ? (p * 5 + 3) % pool_pages : p));
  }

  int vocab_size() const { return tiny_model::vocab; }
  int hidden_size() const { return tiny_model::dim; }

  medusa::paged_kv_cache_view<float> kv_cache(int r) {
    const auto& t = table(r);
    return medusa::make_paged_kv_view<float>(k_, v_, {tiny_model::layers, tiny_model::kv_heads, tiny_model::head_dim},
                                             page_size, medusa::kv_layout::nhd, t);
  }

  void reserve(int r, int slots) {
    auto& t = table(r);
    REQUIRE(slots <= max_context_);
    const int need = medusa::kv_pages_to_map(static_cast<int>(t.size()), 0, slots, page_size);
    if (need > static_cast<int>(free_.size()))
      throw pool_exhausted("request " + std::to_string(r) + " needs " + std::to_string(need) + " pages, " +
                           std::to_string(free_.size()) + " are free");
    grant(r, slots);
  }

  // Maps what the pool has left, up to `slots`; returns the slots now addressable.
  int grant(int r, int slots) {
    auto& t = table(r);
    const int need = std::min(medusa::kv_pages_to_map(static_cast<int>(t.size()), 0, slots, page_size),
                              static_cast<int>(free_.size()));
    for (int i = 0; i < need; ++i) {
      t.push_back(free_.back());
      free_.pop_back();
    }
    in_use_ += need;
    peak_ = std::max(peak_, in_use_);
    ++reserves;
    return static_cast<int>(t.size()) * page_size;
  }

  void release(int r, int length) {
    auto& t = table(r);
    const int n = medusa::kv_pages_releasable(static_cast<int>(t.size()), length, page_size);
    for (int i = 0; i < n; ++i) {
      free_.push_back(t.back());
      t.pop_back();
    }
    in_use_ -= n;
    ++releases;
  }

  int max_context() const { return bound_ ? max_context_ : 0; }

  void forward(const medusa::ragged_batch& b) {
    ++forward_calls;
    REQUIRE(b.qo_indptr.size() == b.requests.size() + 1);
    REQUIRE(b.qo_indptr[0] == 0);
    REQUIRE(b.qo_indptr.back() == static_cast<int>(b.tokens.size()));
    max_requests_in_pass = std::max(max_requests_in_pass, b.size());
    for (int i = 0; i < b.size(); ++i) {
      const int r = b.requests[static_cast<std::size_t>(i)];
      const int n = b.count(i);
      REQUIRE(n >= 1);
      if (!b.last_row_only) rows_seen.push_back(n);
      const medusa::forward_batch f = tiny::request_slice(b, i);
      w_.run(kv_cache(r), f);
      if (corrupt) corrupt(r, f.logits);
    }
  }

  [[nodiscard]] int pages_in_use() const { return in_use_; }
  [[nodiscard]] int peak_pages() const { return peak_; }
  [[nodiscard]] int pages_mapped(int r) { return static_cast<int>(table(r).size()); }

  int forward_calls = 0, reserves = 0, releases = 0, max_requests_in_pass = 0;
  std::vector<int> rows_seen;  // tokens of each request in each decoding pass
  std::function<void(int request, std::span<float> logits)> corrupt;  // fault injection

 private:
  std::vector<std::int32_t>& table(int r) {
    REQUIRE(r >= 0);
    REQUIRE(r < static_cast<int>(tables_.size()));
    return tables_[static_cast<std::size_t>(r)];
  }

  const tiny_model& w_;
  int pool_pages_, max_context_;
  bool bound_;
  std::vector<float> k_, v_;
  std::vector<std::vector<std::int32_t>> tables_;
  std::vector<std::int32_t> free_;
  int in_use_ = 0, peak_ = 0;
};

// The same engine over a pool that grants what it has left (`reserve` returns the slots mapped).
class granting_engine : public paged_engine {
 public:
  using paged_engine::paged_engine;
  int reserve(int r, int slots) { return grant(r, slots); }
};

static_assert(medusa::batch_decoder_model<paged_engine>);
static_assert(!medusa::kv_granting_model<paged_engine>);
static_assert(medusa::kv_granting_model<granting_engine>);
// The single-request decoder hands a granted count through to its batch of one.
struct granting_single_model : tiny_model {
  using tiny_model::tiny_model;
  int reserve(int, int slots) { return slots; }
};
static_assert(medusa::kv_granting_model<medusa::detail::single_request_model<granting_single_model>>);
static_assert(!medusa::kv_granting_model<medusa::detail::single_request_model<tiny_model>>);
static_assert(medusa::kv_reserving_model<paged_engine>);
static_assert(medusa::kv_releasing_model<paged_engine>);
static_assert(medusa::context_bounded_model<paged_engine>);

// Prompts of different lengths.
std::vector<std::int32_t> prompt_of(int i) {
  std::vector<std::int32_t> p;
  const int len = 3 + (i * 5) % 11;
  for (int t = 0; t < len; ++t) p.push_back((t * 7 + i * 13 + 1) % tiny_model::vocab);
  return p;
}

// Steps `dec` until its batch is empty; the final update of every request, by id.
template <class Decoder>
std::map<int, medusa::request_update> drain(Decoder& dec) {
  std::map<int, medusa::request_update> finished;
  while (!dec.empty())
    for (auto& u : dec.step())
      if (u.finished) finished[u.request] = std::move(u);
  return finished;
}

// Runs a scripted batch: request i joins before step join_at[i] or, when the batch is full, as soon
// as there is room; a request in leave_at leaves before that step. Returns each finished request's result.
template <class Decoder>
std::map<int, medusa::decode_result> run_script(Decoder& dec, const std::vector<int>& join_at,
                                                const std::map<int, int>& leave_at, const medusa::decode_options& opt,
                                                std::map<int, std::vector<std::int32_t>>* streamed = nullptr) {
  std::map<int, medusa::decode_result> out;
  int step = 0;
  const int n = static_cast<int>(join_at.size());
  std::vector<bool> joined(join_at.size(), false);
  while (true) {
    for (const auto& [id, at] : leave_at)
      if (at == step && dec.contains(id)) dec.leave(id);
    // Requests due by now join in order while there is room (a scheduler's waiting queue).
    for (int i = 0; i < n; ++i)
      if (!joined[static_cast<std::size_t>(i)] && join_at[static_cast<std::size_t>(i)] <= step &&
          dec.size() < dec.max_batch()) {
        dec.join(i, prompt_of(i), opt);
        joined[static_cast<std::size_t>(i)] = true;
      }
    const bool pending_joins = std::find(joined.begin(), joined.end(), false) != joined.end();
    if (dec.empty() && !pending_joins) break;
    for (auto& u : dec.step()) {
      if (streamed != nullptr) (*streamed)[u.request].insert((*streamed)[u.request].end(), u.tokens.begin(), u.tokens.end());
      if (u.finished) {
        INFO(u.error_message());
        CHECK(u.reason != medusa::stop_reason::failed);
        out[u.request] = std::move(u.result);
      }
    }
    ++step;
    REQUIRE(step < 10000);
  }
  return out;
}

}  // namespace

TEST_CASE("a batch with joins and leaves gives each request exactly its tokens alone (greedy)") {
  tiny_model weights(512);
  medusa::decode_options opt;
  opt.max_new_tokens = 48;
  const int requests = 7;
  std::vector<medusa::decode_result> alone;
  for (int i = 0; i < requests; ++i) alone.push_back(medusa::generate_vanilla(weights, prompt_of(i), medusa::greedy_policy{}, opt));

  // Oracle heads know every request's continuation ("trained" heads: deep acceptance).
  oracle_heads oracle{5, {}, {}};
  for (int i = 0; i < requests; ++i) {
    auto seq = prompt_of(i);
    seq.insert(seq.end(), alone[static_cast<std::size_t>(i)].tokens.begin(), alone[static_cast<std::size_t>(i)].tokens.end());
    oracle.more_states.push_back(tiny::states_of(weights, seq));
    oracle.more_sequences.push_back(std::move(seq));
  }
  random_heads rnd(5, 11);
  const std::vector<int> join_at = {0, 0, 0, 2, 3, 3, 9};
  const std::map<int, int> leave_at = {{2, 4}};  // request 2 leaves mid-way

  auto check = [&](auto& heads, const auto& tree) {
    paged_engine eng(weights, 600, 256, requests);
    medusa::batch_decoder dec(eng, heads, tree, medusa::greedy_policy{}, 4);
    std::map<int, std::vector<std::int32_t>> streamed;
    const auto out = run_script(dec, join_at, leave_at, opt, &streamed);
    CHECK(out.size() == requests - 1);
    CHECK(out.count(2) == 0);
    int tree_steps = 0;
    for (const auto& [id, res] : out) {
      CAPTURE(id);
      CHECK(res.tokens == alone[static_cast<std::size_t>(id)].tokens);
      CHECK(streamed[id] == res.tokens);
      CHECK(res.reason == medusa::stop_reason::max_tokens);
      CHECK(res.stats.prompt_tokens == static_cast<int>(prompt_of(id).size()));
      tree_steps += res.stats.tree_steps;
    }
    // Request 2 streamed a prefix of its own tokens before it left.
    const auto& t2 = alone[2].tokens;
    CHECK(streamed[2].size() < t2.size());
    CHECK(std::equal(streamed[2].begin(), streamed[2].end(), t2.begin()));
    CHECK(tree_steps > 0);
    CHECK(eng.max_requests_in_pass == 4);  // the batch was full at times, and shared passes
    return out;
  };
  SUBCASE("oracle heads") {
    const auto out = check(oracle, medusa::tree::preset("mc_sim_7b_63"));
    for (const auto& [id, res] : out) CHECK(res.stats.mean_accepted() > 1.8);
  }
  SUBCASE("random heads") { check(rnd, medusa::tree::preset("vicuna_7b_stage2")); }
  SUBCASE("per-step drafts: dynamic trees and lookup branches, each request its own tree") {
    const medusa::step_drafter dynamic({.dynamic_nodes = 8, .lookup = medusa::ngram_lookup{.min_ngram = 1, .max_tokens = 6}}, 5);
    const auto out = check(oracle, dynamic);
    for (const auto& [id, res] : out) CHECK(res.stats.mean_accepted() > 1.5);
    const medusa::step_drafter hybrid({.paths = medusa::tree::preset("mc_sim_7b_63").sorted_paths(),
                                       .lookup = medusa::ngram_lookup{.min_ngram = 1, .max_tokens = 6}},
                                      5);
    check(rnd, hybrid);
  }
  SUBCASE("a batch draft model: each request its own draft cache, its pages freed when it leaves") {
    paged_engine draft_eng(weights, 600, 256, requests);  // the target's weights: every chain accepted
    const medusa::draft_model_branch<paged_engine> draft(draft_eng, tiny_model::vocab, {.max_tokens = 4});
    const auto out = check(rnd, medusa::basic_step_drafter<medusa::draft_model_branch<paged_engine>>({.lookup = draft}, 5));
    for (const auto& [id, res] : out) CHECK(res.stats.mean_accepted() > 3.0);
    CHECK(draft.tokens_run() > 0);
    CHECK(draft_eng.pages_in_use() == 0);  // every request's draft cache released, request 2's too
  }
}

TEST_CASE("pages are mapped on demand and released after each commit") {
  tiny_model weights(512);
  random_heads heads(5, 3);
  const medusa::tree tree = medusa::tree::preset("mc_sim_7b_63");  // 64 nodes = 16 pages per tree pass
  const int n = tree.num_nodes();
  const int ps = paged_engine::page_size;
  paged_engine eng(weights, 200, 256, 4);
  medusa::batch_decoder dec(eng, heads, tree, medusa::greedy_policy{}, 4);
  medusa::decode_options opt;
  opt.max_new_tokens = 30;
  for (int i = 0; i < 3; ++i) dec.join(i, prompt_of(i), opt);
  CHECK(eng.pages_in_use() == 0);  // joining maps nothing
  int peak_bound = 0;              // the most pages the three could hold at once: L + N each
  while (!dec.empty()) {
    std::vector<int> lengths;
    for (int i = 0; i < 3; ++i) lengths.push_back(dec.contains(i) ? dec.length(i) : -1);
    for (auto& u : dec.step()) {
      if (u.finished) {
        eng.release(u.request, 0);  // the engine frees a finished request
        continue;
      }
      // After the commit only the pages of the committed slots stay mapped.
      CHECK(eng.pages_mapped(u.request) == medusa::kv_pages_for(dec.length(u.request), ps));
    }
    int bound = 0;
    for (int i = 0; i < 3; ++i)
      if (lengths[static_cast<std::size_t>(i)] >= 0)
        bound += medusa::kv_pages_for(std::max(lengths[static_cast<std::size_t>(i)], static_cast<int>(prompt_of(i).size())) + n, ps);
    peak_bound = std::max(peak_bound, bound);
  }
  CHECK(eng.pages_in_use() == 0);
  CHECK(eng.peak_pages() > 0);
  CHECK(eng.peak_pages() <= peak_bound);
  // Far below what mapping every request's whole context up front would take (3 × 64 pages).
  CHECK(eng.peak_pages() < 3 * 256 / ps / 2);
  CHECK(eng.reserves > 0);
  CHECK(eng.releases > 0);
}

TEST_CASE("a lazily mapped cache with max_context runs tree steps alone too") {
  tiny_model weights(512);
  random_heads heads(5, 3);
  paged_engine eng(weights, 100, 256, 1);
  medusa::decode_options opt;
  opt.max_new_tokens = 40;
  const auto p = prompt_of(1);
  const auto alone = medusa::generate_vanilla(weights, p, medusa::greedy_policy{}, opt);
  medusa::batch_decoder dec(eng, heads, medusa::tree::preset("vicuna_7b_stage2"), medusa::greedy_policy{}, 1);
  dec.join(0, p, opt);
  const medusa::decode_result res = drain(dec).at(0).result;
  CHECK(res.tokens == alone.tokens);
  CHECK(res.stats.tree_steps > 0);
  CHECK(eng.peak_pages() <= medusa::kv_pages_for(static_cast<int>(p.size()) + 40 + 64, paged_engine::page_size));

  SUBCASE("without max_context the prompt cannot fit, and the error says why") {
    paged_engine unbounded(weights, 100, 256, 1, /*bound_context=*/false);
    static_assert(medusa::context_bounded_model<paged_engine>);  // (reports 0 here)
    medusa::batch_decoder d2(unbounded, heads, medusa::tree::preset("vicuna_7b_stage2"), medusa::greedy_policy{}, 1);
    CHECK_THROWS_WITH_AS(d2.join(0, p, opt), doctest::Contains("does not fit the context of 0 tokens"),
                         medusa::decode_error);
  }
}

TEST_CASE("the context limit: tree steps near the end fall back to single steps, then context_full") {
  tiny_model weights(512);
  random_heads heads(5, 5);
  const medusa::tree tree = medusa::tree::preset("vicuna_7b_stage2");
  medusa::decode_options opt;
  opt.max_new_tokens = 500;
  const auto p = prompt_of(2);
  tiny_model small(static_cast<int>(p.size()) + 70);
  const auto alone = medusa::generate_vanilla(small, p, medusa::greedy_policy{}, opt);
  REQUIRE(alone.reason == medusa::stop_reason::context_full);
  paged_engine eng(weights, 200, static_cast<int>(p.size()) + 70, 2);
  medusa::batch_decoder dec(eng, heads, tree, medusa::greedy_policy{}, 2);
  dec.join(0, p, opt);
  const medusa::decode_result res = drain(dec).at(0).result;
  CHECK(res.reason == medusa::stop_reason::context_full);
  CHECK(res.tokens == alone.tokens);
  CHECK(res.stats.tree_steps >= 1);
}

// Oracle heads over the greedy continuations of `prompts` (deep acceptance), and those continuations.
static oracle_heads oracle_for(tiny_model& weights, const std::vector<std::vector<std::int32_t>>& prompts,
                        const medusa::decode_options& opt, std::vector<medusa::decode_result>& alone) {
  oracle_heads oracle{5, {}, {}};
  for (const auto& p : prompts) {
    alone.push_back(medusa::generate_vanilla(weights, p, medusa::greedy_policy{}, opt));
    auto seq = p;
    seq.insert(seq.end(), alone.back().tokens.begin(), alone.back().tokens.end());
    oracle.more_states.push_back(tiny::states_of(weights, seq));
    oracle.more_sequences.push_back(std::move(seq));
  }
  return oracle;
}

TEST_CASE("a KV pool that grants part of a reserve shrinks tree steps to what fits; greedy stays plain greedy") {
  tiny_model weights(512);
  const medusa::tree tree = medusa::tree::preset("vicuna_7b_stage2");
  const int N = tree.num_nodes();
  medusa::decode_options opt;
  opt.max_new_tokens = 40;
  const std::vector<std::vector<std::int32_t>> prompts = {prompt_of(1), prompt_of(2)};
  std::vector<medusa::decode_result> alone;
  oracle_heads oracle = oracle_for(weights, prompts, opt, alone);
  // Partial steps: more than the root, fewer than the whole tree.
  auto partial_steps = [&](const paged_engine& e) {
    return std::count_if(e.rows_seen.begin(), e.rows_seen.end(), [&](int n) { return n > 1 && n < N; });
  };

  SUBCASE("one request: whole trees while they fit, then their first nodes, then plain steps") {
    const int L0 = static_cast<int>(prompts[0].size());
    const int pages = medusa::kv_pages_for(L0 + N, paged_engine::page_size);  // one whole tree, at first
    granting_engine eng(weights, pages, 256, 1);
    medusa::batch_decoder dec(eng, oracle, tree, medusa::greedy_policy{}, 1);
    dec.join(0, prompts[0], opt);
    const medusa::request_update u = drain(dec).at(0);
    INFO(u.error_message());
    CHECK(u.reason == medusa::stop_reason::max_tokens);
    CHECK(u.result.tokens == alone[0].tokens);
    CHECK(std::count(eng.rows_seen.begin(), eng.rows_seen.end(), N) >= 1);
    CHECK(partial_steps(eng) >= 1);
    CHECK(u.result.stats.tree_steps > u.result.stats.steps / 4);  // partial trees still accept drafts
    CHECK(eng.peak_pages() <= pages);
  }
  SUBCASE("sampled drafts: a part of the tree is verified with its own depth's draft rows") {
    const int L0 = static_cast<int>(prompts[0].size());
    granting_engine eng(weights, medusa::kv_pages_for(L0 + N, paged_engine::page_size), 256, 1);
    random_heads rnd(5, 7);
    medusa::batch_decoder dec(eng, rnd, tree, medusa::draft_sampling_policy{}, 1);
    dec.join(0, prompts[0], opt);
    const medusa::request_update u = drain(dec).at(0);
    INFO(u.error_message());
    CHECK(u.reason == medusa::stop_reason::max_tokens);
    CHECK(partial_steps(eng) >= 1);
  }
  SUBCASE("sampled trees that do not fit take a plain step: their first nodes would select draws by value") {
    // Records the size of every tree the sampler drafts.
    struct recording {
      medusa::tree_sampler<medusa::draft_model_branch<tiny_model>> inner;
      std::vector<int>* sizes;
      int max_nodes() const { return inner.max_nodes(); }
      int max_depth() const { return inner.max_depth(); }
      int heads_depth() const { return 0; }
      std::optional<medusa::tree> draft(int request, std::span<const std::int32_t> history, std::span<const float> hl, int vocab,
                                        std::span<std::int32_t> tokens, std::uint64_t seed, std::uint64_t step) {
        auto t = inner.draft(request, history, hl, vocab, tokens, seed, step);
        if (t) sizes->push_back(t->num_nodes());
        return t;
      }
      std::span<const float> draft_probs(int request) const { return inner.draft_probs(request); }
    };
    tiny_model draft_w(512, 11);
    std::vector<int> sizes;
    const medusa::sampling_warp warp{.temperature = 1.0f};
    const recording drafts{{medusa::draft_model_branch<tiny_model>(draft_w, tiny_model::vocab), {.max_nodes = 8, .max_depth = 4, .topk = 2, .expand = 2}, warp},
                           &sizes};
    const int L0 = static_cast<int>(prompts[0].size());
    granting_engine eng(weights, medusa::kv_pages_for(L0 + opt.max_new_tokens + 2, paged_engine::page_size), 256, 1);
    medusa::no_heads none;
    medusa::batch_decoder dec(eng, none, drafts, medusa::speculative_policy{warp}, 1);
    dec.join(0, prompts[0], opt);
    const medusa::request_update u = drain(dec).at(0);
    INFO(u.error_message());
    CHECK(u.reason == medusa::stop_reason::max_tokens);
    CHECK(static_cast<int>(u.result.tokens.size()) == opt.max_new_tokens);
    // Every tree pass ran a whole drafted tree, in order; some drafted trees ran as plain steps.
    std::vector<int> tree_passes;
    for (const int n : eng.rows_seen)
      if (n > 1) tree_passes.push_back(n);
    std::size_t at = 0;
    for (const int n : tree_passes) {
      while (at < sizes.size() && sizes[at] != n) ++at;
      CHECK(at < sizes.size());
      ++at;
    }
    CHECK(tree_passes.size() < sizes.size());
    CHECK(std::count_if(sizes.begin(), sizes.end(), [](int n) { return n > 2; }) >= 1);  // trees, not only chains
  }
  SUBCASE("two requests share a pool too small for both trees: each gets its tokens alone") {
    int need = 0;
    for (const auto& p : prompts) need += medusa::kv_pages_for(static_cast<int>(p.size()) + opt.max_new_tokens, paged_engine::page_size);
    granting_engine eng(weights, need + 2, 256, 2);
    medusa::batch_decoder dec(eng, oracle, tree, medusa::greedy_policy{}, 2);
    dec.join(0, prompts[0], opt);
    dec.join(1, prompts[1], opt);
    const auto out = drain(dec);
    for (int r = 0; r < 2; ++r) {
      INFO("request " << r << ": " << out.at(r).error_message());
      CHECK(out.at(r).result.tokens == alone[static_cast<std::size_t>(r)].tokens);
    }
    CHECK(partial_steps(eng) >= 1);
  }
  SUBCASE("a pool that cannot take one more token fails the request with pool_exhausted") {
    const int L0 = static_cast<int>(prompts[0].size());
    const int pages = medusa::kv_pages_for(L0 + 3, paged_engine::page_size);
    const int slots = pages * paged_engine::page_size;
    granting_engine eng(weights, pages, 256, 1);
    medusa::batch_decoder dec(eng, oracle, tree, medusa::greedy_policy{}, 1);
    dec.join(0, prompts[0], opt);
    const medusa::request_update u = drain(dec).at(0);
    REQUIRE(u.reason == medusa::stop_reason::failed);
    CHECK_THROWS_AS(std::rethrow_exception(u.error), medusa::kv_cache_error);
    try {
      std::rethrow_exception(u.error);
    } catch (const medusa::kv_cache_error& e) {
      CHECK(e.code() == medusa::kv_errc::pool_exhausted);
    }
    CHECK(u.error_message().find("KV pool is exhausted") != std::string::npos);
    // Every slot was used before it failed, and what it emitted is plain greedy's prefix.
    CHECK(u.result.cache_length == slots);
    REQUIRE(u.result.tokens.size() <= alone[0].tokens.size());
    CHECK(std::equal(u.result.tokens.begin(), u.result.tokens.end(), alone[0].tokens.begin()));
    CHECK(static_cast<int>(u.result.tokens.size()) == slots - L0);  // the next one is chosen, not emitted
  }
}

TEST_CASE("sampling in a batch draws each request's own stream: the tokens it gets alone") {
  tiny_model weights(512);
  random_heads heads(4, 9);
  medusa::rejection_policy policy;
  policy.temperature = 0.9f;
  const medusa::tree tree = medusa::tree::preset("mc_sim_7b_63");
  medusa::decode_options opt;
  opt.max_new_tokens = 40;
  std::vector<medusa::decode_result> alone;
  for (int i = 0; i < 3; ++i) {
    opt.seed = 100 + static_cast<std::uint64_t>(i);
    medusa::decoder single(weights, heads, tree, policy);
    alone.push_back(single.generate(prompt_of(i), opt));
  }
  paged_engine eng(weights, 300, 256, 3);
  medusa::batch_decoder dec(eng, heads, tree, policy, 3);
  for (int i = 0; i < 3; ++i) {
    opt.seed = 100 + static_cast<std::uint64_t>(i);
    dec.join(i, prompt_of(i), opt);
  }
  auto out = drain(dec);
  for (int i = 0; i < 3; ++i) {
    CAPTURE(i);
    CHECK(out[i].result.tokens == alone[static_cast<std::size_t>(i)].tokens);
  }
  CHECK(out[0].result.tokens != out[1].result.tokens);
}

TEST_CASE("plain batched decoding (no heads, the one-node tree) equals plain decoding") {
  tiny_model weights(512);
  medusa::decode_options opt;
  opt.max_new_tokens = 25;
  paged_engine eng(weights, 200, 256, 5);
  medusa::no_heads none;
  medusa::batch_decoder dec(eng, none, medusa::plain_tree{}, medusa::greedy_policy{}, 5);
  const auto out = run_script(dec, {0, 0, 1, 1, 6}, {}, opt);
  REQUIRE(out.size() == 5);
  for (const auto& [id, res] : out) {
    CAPTURE(id);
    CHECK(res.tokens == medusa::generate_vanilla(weights, prompt_of(id), medusa::greedy_policy{}, opt).tokens);
    CHECK(res.stats.tree_steps == 0);
    CHECK(res.stats.steps == 24);
  }
}

TEST_CASE("a request that fails is reported with its id; the others go on") {
  tiny_model weights(512);
  random_heads heads(5, 11);
  const medusa::tree tree = medusa::tree::preset("vicuna_7b_stage2");
  medusa::decode_options opt;
  opt.max_new_tokens = 30;
  std::vector<std::vector<std::int32_t>> alone;
  for (int i = 0; i < 3; ++i) alone.push_back(medusa::generate_vanilla(weights, prompt_of(i), medusa::greedy_policy{}, opt).tokens);

  auto run = [&](paged_engine& eng, int bad, int good_expected) {
    medusa::batch_decoder dec(eng, heads, tree, medusa::greedy_policy{}, 3);
    for (int i = 0; i < 3; ++i) dec.join(i, prompt_of(i), opt);
    auto finished = drain(dec);
    REQUIRE(finished.size() == 3);
    CHECK(finished[bad].reason == medusa::stop_reason::failed);
    CHECK(finished[bad].error != nullptr);
    int good = 0;
    for (int i = 0; i < 3; ++i)
      if (i != bad) {
        CAPTURE(i);
        CHECK(finished[i].reason == medusa::stop_reason::max_tokens);
        CHECK(finished[i].result.tokens == alone[static_cast<std::size_t>(i)]);
        ++good;
      }
    CHECK(good == good_expected);
    return finished[bad].error_message();
  };

  SUBCASE("NaN logits of one request after a few steps") {
    paged_engine eng(weights, 300, 256, 3);
    int calls = 0;
    eng.corrupt = [&](int r, std::span<float> z) {
      if (r == 1 && ++calls == 4) z[3] = std::numeric_limits<float>::quiet_NaN();
    };
    CHECK(run(eng, 1, 2).find("NaN") != std::string::npos);
  }
  SUBCASE("+Inf in a plain step's logits (the first root)") {
    paged_engine eng(weights, 300, 256, 3);
    eng.corrupt = [&](int r, std::span<float> z) {
      if (r == 2 && z.size() == tiny_model::vocab) z[0] = std::numeric_limits<float>::infinity();
    };
    CHECK(!run(eng, 2, 2).empty());
  }
  SUBCASE("the engine cannot map pages for one request") {
    // 3 requests of up to ~16 + 30 + 64 slots: 30 pages each at most. Starve the pool so the
    // third reservation of a step fails while the others fit.
    paged_engine eng(weights, 2 * 30 + 3, 256, 3);
    const std::string msg = run(eng, 2, 2);
    CHECK(msg.find("request 2 needs") != std::string::npos);
  }
  SUBCASE("a token callback that throws") {
    paged_engine eng(weights, 300, 256, 3);
    medusa::batch_decoder dec(eng, heads, tree, medusa::greedy_policy{}, 3);
    for (int i = 0; i < 3; ++i)
      dec.join(i, prompt_of(i), opt, [i](std::int32_t) -> bool {
        if (i == 0) throw std::runtime_error("client went away");
        return true;
      });
    auto finished = drain(dec);
    CHECK(finished[0].reason == medusa::stop_reason::failed);
    CHECK(finished[0].error_message() == "client went away");
    CHECK(finished[1].result.tokens == alone[1]);
    CHECK(finished[2].result.tokens == alone[2]);
  }
}

TEST_CASE("join and leave reject bad input with a decode_error and change nothing") {
  tiny_model weights(512);
  random_heads heads(5, 11);
  paged_engine eng(weights, 100, 64, 4);
  medusa::batch_decoder dec(eng, heads, medusa::tree::preset("vicuna_7b_stage2"), medusa::greedy_policy{}, 2);
  medusa::decode_options opt;
  dec.join(0, prompt_of(0), opt);
  CHECK_THROWS_WITH_AS(dec.join(0, prompt_of(1), opt), doctest::Contains("already in the batch"), medusa::decode_error);
  CHECK_THROWS_WITH_AS(dec.join(1, {}, opt), doctest::Contains("empty"), medusa::decode_error);
  CHECK_THROWS_WITH_AS(dec.join(1, std::vector<std::int32_t>(65, 1), opt), doctest::Contains("does not fit the context of 64"),
                       medusa::decode_error);
  CHECK_THROWS_WITH_AS(dec.join(1, std::vector<std::int32_t>{1, 40}, opt), doctest::Contains("outside the vocabulary"),
                       medusa::decode_error);
  medusa::decode_options bad = opt;
  bad.max_new_tokens = -1;
  CHECK_THROWS_AS(dec.join(1, prompt_of(1), bad), medusa::decode_error);
  bad = opt;
  bad.prefill_chunk = 0;
  CHECK_THROWS_AS(dec.join(1, prompt_of(1), bad), medusa::decode_error);
  CHECK_THROWS_WITH_AS(dec.leave(5), doctest::Contains("not in the batch"), medusa::decode_error);
  CHECK(dec.size() == 1);
  dec.join(1, prompt_of(1), opt);
  CHECK_THROWS_WITH_AS(dec.join(2, prompt_of(2), opt), doctest::Contains("batch is full"), medusa::decode_error);
  CHECK(dec.size() == 2);
  dec.leave(1);
  CHECK(dec.size() == 1);
  CHECK(!dec.contains(1));
  CHECK_THROWS_AS((medusa::batch_decoder(eng, heads, medusa::tree::preset("vicuna_7b_stage2"), medusa::greedy_policy{}, 0)),
                  medusa::decode_error);
}

TEST_CASE("an empty batch steps to nothing; a request wanting no tokens ends at once") {
  tiny_model weights(512);
  random_heads heads(5, 11);
  paged_engine eng(weights, 100, 256, 2);
  medusa::batch_decoder dec(eng, heads, medusa::tree::preset("vicuna_7b_stage2"), medusa::greedy_policy{}, 2);
  CHECK(dec.step().empty());
  medusa::decode_options opt;
  opt.max_new_tokens = 0;
  dec.join(0, prompt_of(0), opt);
  const auto ups = dec.step();
  REQUIRE(ups.size() == 1);
  CHECK(ups[0].finished);
  CHECK(ups[0].tokens.empty());
  CHECK(ups[0].reason == medusa::stop_reason::max_tokens);
  CHECK(eng.forward_calls == 0);
  CHECK(dec.empty());
}

TEST_CASE("a masked vocabulary (-inf on half the tokens): greedy still equals plain, sampling never picks a masked token") {
  tiny_model weights(512);
  random_heads heads(5, 21);
  const medusa::tree tree = medusa::tree::preset("mc_sim_7b_63");
  auto mask_odd = [](int, std::span<float> z) {  // a constraint banning every odd token
    for (std::size_t i = 0; i < z.size(); ++i)
      if (i % tiny_model::vocab % 2 == 1) z[i] = -std::numeric_limits<float>::infinity();
  };
  medusa::decode_options opt;
  opt.max_new_tokens = 40;
  auto decode_all = [&](auto& dec, paged_engine& eng, std::uint64_t seed) {
    std::map<int, medusa::decode_result> out;
    for (int i = 0; i < 3; ++i) {
      opt.seed = seed + static_cast<std::uint64_t>(i);
      dec.join(i, prompt_of(i), opt);
    }
    while (!dec.empty())
      for (auto& u : dec.step())
        if (u.finished) {
          INFO(u.error_message());
          REQUIRE(u.reason != medusa::stop_reason::failed);
          eng.release(u.request, 0);
          out[u.request] = std::move(u.result);
        }
    return out;
  };
  SUBCASE("greedy") {
    paged_engine eng(weights, 300, 256, 3);
    eng.corrupt = mask_odd;
    medusa::no_heads none;
    medusa::batch_decoder plain(eng, none, medusa::plain_tree{}, medusa::greedy_policy{}, 3);
    const auto want = decode_all(plain, eng, 0);
    medusa::batch_decoder dec(eng, heads, tree, medusa::greedy_policy{}, 3);
    const auto got = decode_all(dec, eng, 0);
    for (int i = 0; i < 3; ++i) {
      CAPTURE(i);
      CHECK(got.at(i).tokens == want.at(i).tokens);
      CHECK(got.at(i).tokens.size() == 40);
      for (auto t : got.at(i).tokens) CHECK(t % 2 == 0);
    }
  }
  SUBCASE("rejection sampling at T = 1 and typical acceptance") {
    paged_engine eng(weights, 300, 256, 3);
    eng.corrupt = mask_odd;
    medusa::rejection_policy rejection;
    rejection.temperature = 1.0f;
    medusa::typical_policy typical;
    typical.temperature = 0.9f;
    for (std::uint64_t seed : {1u, 2u, 3u, 4u}) {
      medusa::batch_decoder dec(eng, heads, tree, rejection, 3);
      for (const auto& [id, r] : decode_all(dec, eng, seed * 10))
        for (auto t : r.tokens) CHECK(t % 2 == 0);
      medusa::batch_decoder dt(eng, heads, tree, typical, 3);
      for (const auto& [id, r] : decode_all(dt, eng, seed * 10))
        for (auto t : r.tokens) CHECK(t % 2 == 0);
    }
  }
}
