// SPDX-License-Identifier: Apache-2.0
// Heads and per-step drafters told which request they serve: heads with
// `forward(hidden, rows, requests, logits)` (`request_draft_heads`) get the id of every row, in
// slot order; a drafter's `draft(request, ...)` and its branch source's `find(request, ...)` get
// the id of every call; `release(request)` reaches both when a request leaves. Heads that keep one
// state per request (an oracle per request, which fails on another request's hidden state) decode
// a batch with joins and leaves exactly as plain greedy. `basic_step_drafter` takes any branch
// source, and stays lossless whatever it proposes.
#include "tiny_transformer.hpp"

#include <medusa/decoder.hpp>
#include <medusa/drafts.hpp>
#include <medusa/tree.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <type_traits>
#include <vector>

namespace {

using tiny::oracle_heads;
using tiny::random_heads;
using tiny::tiny_model;

constexpr int capacity = 256;

// A ragged-batch engine over tiny_model's weights, one contiguous cache per request id. It records,
// per step of the test's loop, the requests of the decoding pass that took a tree step, in order.
class batch_engine {
 public:
  explicit batch_engine(const tiny_model& w, const int* step) : w_(w), step_(step) {}
  int vocab_size() const { return tiny_model::vocab; }
  int hidden_size() const { return tiny_model::dim; }
  medusa::kv_cache_view<float> kv_cache(int r) {
    auto& c = caches_[r];
    const std::size_t size = static_cast<std::size_t>(tiny_model::layers) * capacity * tiny_model::kv_heads * tiny_model::head_dim;
    if (c.k.empty()) c.k.assign(size, 0.0f), c.v.assign(size, 0.0f);
    return medusa::make_kv_view<float>(c.k, c.v, {tiny_model::layers, tiny_model::kv_heads, tiny_model::head_dim}, capacity);
  }
  void forward(const medusa::ragged_batch& b) {
    for (int i = 0; i < b.size(); ++i) {
      const int r = b.requests[static_cast<std::size_t>(i)];
      if (!b.last_row_only && b.count(i) > 1) tree_members[*step_].push_back(r);
      w_.run(kv_cache(r), tiny::request_slice(b, i));
    }
  }
  std::map<int, std::vector<int>> tree_members;  // step → requests taking a tree step, in pass order

 private:
  struct cache {
    std::vector<float> k, v;
  };
  const tiny_model& w_;
  const int* step_;
  std::map<int, cache> caches_;
};
static_assert(medusa::batch_decoder_model<batch_engine>);

// What the heads and the drafter were told.
struct call_log {
  int step = 0;
  std::map<int, std::vector<int>> head_rows;    // step → the heads' rows' requests
  std::map<int, std::vector<int>> draft_calls;  // step → the branch source's calls' requests
  std::vector<int> head_releases, source_releases;
};

// One oracle per request: each knows only its own request's greedy continuation, and fails
// (REQUIRE) on a hidden state that is not one of its request's. Heads told the wrong request fail.
struct per_request_heads {
  int heads;
  std::map<int, oracle_heads> oracles;
  call_log* log;
  bool counts_steps = false;  // a loop the test does not step (the single-request decoder): one step per call
  int num_heads() const { return heads; }
  void forward(std::span<const float>, std::span<float>) { FAIL("the decoders pass request ids to these heads"); }
  void forward(std::span<const float> hidden, int rows, std::span<const int> requests, std::span<float> logits) {
    REQUIRE(requests.size() == static_cast<std::size_t>(rows));
    const std::size_t d = tiny_model::dim, hv = static_cast<std::size_t>(heads) * tiny_model::vocab;
    if (counts_steps) ++log->step;
    auto& seen = log->head_rows[log->step];
    CHECK(seen.empty());  // one call per step
    for (int r = 0; r < rows; ++r) {
      const int id = requests[static_cast<std::size_t>(r)];
      CHECK(std::find(seen.begin(), seen.end(), id) == seen.end());
      CHECK(std::find(log->head_releases.begin(), log->head_releases.end(), id) == log->head_releases.end());
      seen.push_back(id);
      REQUIRE(oracles.count(id) == 1);
      oracles.at(id).forward(hidden.subspan(static_cast<std::size_t>(r) * d, d),
                             logits.subspan(static_cast<std::size_t>(r) * hv, hv));
    }
  }
  void release(int request) { log->head_releases.push_back(request); }
};
static_assert(medusa::request_draft_heads<per_request_heads>);
static_assert(medusa::request_releasing<per_request_heads>);
static_assert(!medusa::request_draft_heads<random_heads>);
static_assert(!medusa::request_releasing<random_heads>);

// A branch source that knows each request's greedy continuation (by id) and proposes its next
// tokens, every third one wrong: it checks that the history it is given is that request's.
struct truth_source {
  int max_tokens = 4;
  const std::map<int, std::vector<std::int32_t>>* sequences = nullptr;  // request → prompt + greedy tokens
  call_log* log = nullptr;
  int find(int request, std::span<const std::int32_t> history, std::span<std::int32_t> out) {
    if (log != nullptr) log->draft_calls[log->step].push_back(request);
    REQUIRE(sequences->count(request) == 1);
    const auto& seq = sequences->at(request);
    REQUIRE(history.size() <= seq.size());
    REQUIRE(std::equal(history.begin(), history.end(), seq.begin()));  // this request's tokens
    int n = 0;
    for (std::size_t i = history.size(); i < seq.size() && n < max_tokens && n < static_cast<int>(out.size()); ++i, ++n)
      out[static_cast<std::size_t>(n)] = i % 3 == 2 ? (seq[i] + 1) % tiny_model::vocab : seq[i];
    return n;
  }
  void release(int request) {
    if (log != nullptr) log->source_releases.push_back(request);
  }
};
static_assert(medusa::branch_source<truth_source>);
static_assert(medusa::branch_source<medusa::ngram_lookup>);

// The older forms still fit: `max_tokens()` as a function, `find(history, out)` without an id.
struct repeat_last {
  int max_tokens() const { return 3; }
  int find(std::span<const std::int32_t> history, std::span<std::int32_t> out) const {
    const int n = std::min<int>(3, static_cast<int>(out.size()));
    for (int i = 0; i < n; ++i) out[static_cast<std::size_t>(i)] = history.back();
    return n;
  }
};
static_assert(medusa::branch_source<repeat_last>);
static_assert(!medusa::branch_source<int>);

// A drafter written against the form without ids still satisfies step_drafts.
struct legacy_drafter {
  int max_nodes() const { return 1; }
  int max_depth() const { return 0; }
  int heads_depth() const { return 0; }
  std::optional<medusa::tree> draft(std::span<const std::int32_t>, std::span<const float>, int, std::span<std::int32_t>) {
    return std::nullopt;
  }
};
static_assert(medusa::step_drafts<legacy_drafter>);
static_assert(!medusa::request_step_drafts<legacy_drafter>);
static_assert(medusa::step_drafts<medusa::step_drafter>);
static_assert(medusa::request_step_drafts<medusa::step_drafter>);
static_assert(medusa::request_step_drafts<medusa::basic_step_drafter<truth_source>>);

std::vector<std::int32_t> prompt_of(int id) {
  std::vector<std::int32_t> p;
  const int len = 3 + (id * 5) % 9;
  for (int t = 0; t < len; ++t) p.push_back((t * 7 + id * 13 + 1) % tiny_model::vocab);
  return p;
}

// The prompt followed by its plain greedy continuation.
std::vector<std::int32_t> followed_by(std::vector<std::int32_t> prompt, const medusa::decode_result& plain) {
  prompt.insert(prompt.end(), plain.tokens.begin(), plain.tokens.end());
  return prompt;
}

}  // namespace

TEST_CASE("heads and drafter get the id of every row and call: the requests served, in slot order") {
  tiny_model weights(capacity);
  medusa::decode_options opt;
  opt.max_new_tokens = 32;
  const std::vector<int> ids = {10, 11, 12, 13, 14};
  call_log log;
  std::map<int, medusa::decode_result> alone;
  std::map<int, std::vector<std::int32_t>> sequences;
  per_request_heads heads{5, {}, &log};
  for (int id : ids) {
    alone[id] = medusa::generate_vanilla(weights, prompt_of(id), medusa::greedy_policy{}, opt);
    auto seq = followed_by(prompt_of(id), alone[id]);
    heads.oracles.emplace(id, oracle_heads{5, seq, tiny::states_of(weights, seq)});
    sequences[id] = std::move(seq);
  }
  const medusa::basic_step_drafter<truth_source> drafter(
      {.paths = medusa::tree::preset("mc_sim_7b_63").sorted_paths(), .lookup = truth_source{4, &sequences, &log}}, 5);

  batch_engine eng(weights, &log.step);
  medusa::batch_decoder dec(eng, heads, drafter, medusa::greedy_policy{}, 3);
  std::map<int, medusa::decode_result> out;
  std::vector<int> waiting = {13, 14};
  for (int id : {10, 11, 12}) dec.join(id, prompt_of(id), opt);
  bool saw_slot_order = false;
  for (log.step = 0; !dec.empty() || !waiting.empty(); ++log.step) {
    REQUIRE(log.step < 200);
    if (log.step == 3) {
      dec.leave(11);  // slot 1 is free: 13 takes it, ahead of 12 in slot order
      CHECK(log.head_releases == std::vector<int>{11});
      CHECK(log.source_releases == std::vector<int>{11});
    }
    while (log.step >= 3 && !waiting.empty() && dec.size() < dec.max_batch()) {
      dec.join(waiting.front(), prompt_of(waiting.front()), opt);
      waiting.erase(waiting.begin());
    }
    for (auto& u : dec.step()) {
      if (!u.finished) continue;
      INFO(u.error_message());
      CHECK(u.reason == medusa::stop_reason::max_tokens);
      out[u.request] = std::move(u.result);
    }
    saw_slot_order = saw_slot_order || log.head_rows[log.step] == std::vector<int>{10, 13, 12};
  }

  // Greedy output is plain greedy's, and the oracles accepted deep (they were asked about their own requests).
  CHECK(out.size() == 4);
  CHECK(out.count(11) == 0);
  for (const auto& [id, res] : out) {
    CAPTURE(id);
    CHECK(res.tokens == alone[id].tokens);
    CHECK(res.stats.mean_accepted() > 1.8);
  }
  // Every step, the heads' rows and the drafter's calls are the requests of the pass's tree steps, in order.
  int steps_with_rows = 0;
  for (int s = 0; s < log.step; ++s) {
    CAPTURE(s);
    CHECK(log.head_rows[s] == eng.tree_members[s]);
    CHECK(log.draft_calls[s] == eng.tree_members[s]);
    steps_with_rows += log.head_rows[s].empty() ? 0 : 1;
  }
  CHECK(steps_with_rows > 8);
  CHECK(saw_slot_order);
  // Each request that joined was released once, when it left.
  auto sorted = [](std::vector<int> v) { return std::sort(v.begin(), v.end()), v; };
  CHECK(sorted(log.head_releases) == ids);
  CHECK(sorted(log.source_releases) == ids);
}

TEST_CASE("the single-request decoder passes request id 0, and releases it at the end") {
  tiny_model model(capacity);
  medusa::decode_options opt;
  opt.max_new_tokens = 24;
  const auto prompt = prompt_of(3);
  const auto plain = medusa::generate_vanilla(model, prompt, medusa::greedy_policy{}, opt);
  call_log log;
  const auto seq = followed_by(prompt, plain);
  const std::map<int, std::vector<std::int32_t>> sequences = {{0, seq}};
  per_request_heads heads{4, {}, &log, true};
  heads.oracles.emplace(0, oracle_heads{4, seq, tiny::states_of(model, seq)});
  medusa::decoder dec(model, heads,
                      medusa::basic_step_drafter<truth_source>({.paths = {{0}, {0, 0}, {1}}, .lookup = truth_source{3, &sequences, &log}}, 4),
                      medusa::greedy_policy{});
  const auto res = dec.generate(prompt, opt);
  CHECK(res.tokens == plain.tokens);
  CHECK(log.step > 3);  // tree steps
  CHECK(log.head_rows.size() == static_cast<std::size_t>(log.step));
  for (int s = 1; s <= log.step; ++s) {
    CHECK(log.head_rows[s] == std::vector<int>{0});
    CHECK(log.draft_calls[s] == std::vector<int>{0});
  }
  CHECK(log.head_releases == std::vector<int>{0});
  CHECK(log.source_releases == std::vector<int>{0});
}

TEST_CASE("a custom branch source drives step_drafter's branch: lossless, and deep when it is right") {
  tiny_model model(capacity);
  medusa::decode_options opt;
  opt.max_new_tokens = 60;
  const auto prompt = prompt_of(5);
  const auto plain = medusa::generate_vanilla(model, prompt, medusa::greedy_policy{}, opt);
  const std::map<int, std::vector<std::int32_t>> sequences = {{0, followed_by(prompt, plain)}};
  random_heads rnd(2, 5);

  // The branch alone (no heads' tree): two of every three proposed tokens are right.
  medusa::decoder truth(model, rnd, medusa::basic_step_drafter<truth_source>({.lookup = truth_source{6, &sequences}}, 2),
                        medusa::greedy_policy{});
  const auto a = truth.generate(prompt, opt);
  CHECK(a.tokens == plain.tokens);
  CHECK(a.stats.mean_accepted() > 1.5);

  // With the heads' tree, and under rejection sampling at T = 0 (greedy's tokens).
  medusa::rejection_policy greedy_rejection;
  greedy_rejection.temperature = 0.0f;
  medusa::decoder hybrid(
      model, rnd,
      medusa::basic_step_drafter<truth_source>({.paths = {{0}, {1}, {0, 0}}, .lookup = truth_source{5, &sequences}}, 2),
      greedy_rejection);
  CHECK(hybrid.generate(prompt, opt).tokens == plain.tokens);

  // A source of the older form (no id, max_tokens() a function) that is mostly wrong: still lossless.
  medusa::decoder repeat(model, rnd, medusa::basic_step_drafter<repeat_last>({.paths = {{0}, {0, 0}}, .lookup = repeat_last{}}, 2),
                         medusa::greedy_policy{});
  CHECK(repeat.generate(prompt, opt).tokens == plain.tokens);

  // step_drafter is basic_step_drafter<ngram_lookup>, its options step_drafter_options.
  static_assert(std::is_same_v<medusa::step_drafter::branch_type, medusa::ngram_lookup>);
  static_assert(std::is_same_v<medusa::step_drafter::options_type, medusa::step_drafter_options>);
}
