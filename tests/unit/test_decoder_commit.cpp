// SPDX-License-Identifier: Apache-2.0
// Models that commit accepted paths themselves (`commit`, `max_context()`) and have no KV view the
// host may write, as a GPU engine keeps its cache in device memory: the decoders must drive them
// to exactly the tokens of plain greedy decoding, call `commit` once per tree step with a valid
// path, check what it returns, and stop at the end of the context as a view-based model does.
#include "tiny_transformer.hpp"

#include <medusa/decoder.hpp>
#include <medusa/decoder/calibrate.hpp>
#include <medusa/decoder/step_cost.hpp>
#include <medusa/drafts.hpp>
#include <medusa/kv_cache.hpp>
#include <medusa/tree.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace {

using tiny::oracle_heads;
using tiny::random_heads;
using tiny::tiny_model;

const medusa::kv_extents extents{tiny_model::layers, tiny_model::kv_heads, tiny_model::head_dim};

// One call of a model's commit.
struct commit_call {
  int request = 0;
  int length = 0;  // L
  int nodes = 0;   // N
  std::vector<int> path;
};

// A single-request model that keeps its cache to itself: the tiny transformer is private, so
// there is no kv_cache member; commit moves the rows in the private view and is recorded.
class private_cache_model {
 public:
  private_cache_model(int capacity, int max_context) : m_(capacity), max_context_(max_context) {}

  int vocab_size() const { return m_.vocab_size(); }
  int hidden_size() const { return m_.hidden_size(); }
  int max_context() const { return max_context_; }
  void forward(const medusa::forward_batch& b) {
    REQUIRE(b.cache_length + static_cast<int>(b.tokens.size()) <= max_context_);
    m_.forward(b);
  }
  int commit(int committed_length, int num_tree_nodes, std::span<const int> path) {
    calls.push_back({0, committed_length, num_tree_nodes, {path.begin(), path.end()}});
    return medusa::kv_commit(m_.kv_cache(), committed_length, num_tree_nodes, path) + length_offset;
  }

  std::vector<commit_call> calls;
  int length_offset = 0;  // fault injection: a commit that reports a wrong length

 private:
  tiny_model m_;
  int max_context_;
};

// The same, also handing out a view (of decoy buffers): the decoder must commit through `commit`
// and never ask for the view.
class both_forms_model : public private_cache_model {
 public:
  using private_cache_model::private_cache_model;
  medusa::kv_cache_view<float> kv_cache() {
    ++kv_cache_calls;
    return medusa::make_kv_view<float>(decoy_k_, decoy_v_, extents, 512);
  }
  int kv_cache_calls = 0;

 private:
  std::vector<float> decoy_k_ = std::vector<float>(static_cast<std::size_t>(tiny_model::layers) * 512 *
                                                   tiny_model::kv_heads * tiny_model::head_dim);
  std::vector<float> decoy_v_ = decoy_k_;
};

// A ragged-batch engine over the tiny transformer's weights whose paged pool is private (pages
// mapped on demand, unmapped after commits): no kv_cache(request), commit(request, L, N, path).
class private_paged_engine {
 public:
  static constexpr int page_size = 4;

  private_paged_engine(const tiny_model& weights, int pool_pages, int max_context, int max_requests)
      : w_(weights), max_context_(max_context), tables_(static_cast<std::size_t>(max_requests)) {
    const std::size_t elems = static_cast<std::size_t>(pool_pages) * page_size * tiny_model::layers *
                              tiny_model::kv_heads * tiny_model::head_dim;
    k_.assign(elems, std::numeric_limits<float>::quiet_NaN());  // unwritten slots must never be read
    v_.assign(elems, std::numeric_limits<float>::quiet_NaN());
    for (int p = 0; p < pool_pages; ++p) free_.push_back(static_cast<std::int32_t>(p));  // handed out last first
  }

  int vocab_size() const { return tiny_model::vocab; }
  int hidden_size() const { return tiny_model::dim; }
  int max_context() const { return max_context_; }

  void reserve(int r, int slots) {
    REQUIRE(slots <= max_context_);  // the decoder checks the context before it maps
    auto& t = table(r);
    const int need = medusa::kv_pages_to_map(static_cast<int>(t.size()), 0, slots, page_size);
    REQUIRE(need <= static_cast<int>(free_.size()));
    for (int i = 0; i < need; ++i) {
      t.push_back(free_.back());
      free_.pop_back();
    }
  }
  void release(int r, int length) {
    auto& t = table(r);
    const int n = medusa::kv_pages_releasable(static_cast<int>(t.size()), length, page_size);
    for (int i = 0; i < n; ++i) {
      free_.push_back(t.back());
      t.pop_back();
    }
  }

  void forward(const medusa::ragged_batch& b) {
    for (int i = 0; i < b.size(); ++i) {
      const int r = b.requests[static_cast<std::size_t>(i)];
      const medusa::forward_batch f = tiny::request_slice(b, i);
      w_.run(view(r), f);
    }
    if (after_forward) after_forward();
  }

  int commit(int r, int committed_length, int num_tree_nodes, std::span<const int> path) {
    calls.push_back({r, committed_length, num_tree_nodes, {path.begin(), path.end()}});
    const auto nth = std::count_if(calls.begin(), calls.end(), [&](const commit_call& c) { return c.request == r; });
    const int commits_of_r = static_cast<int>(nth);
    if (fault) fault(r, commits_of_r);
    const int length = medusa::kv_commit(view(r), committed_length, num_tree_nodes, path);
    return r == bad_request && commits_of_r >= bad_from ? length + 1 : length;
  }

  void set_max_context(int c) { max_context_ = c; }
  // The commits of request r.
  [[nodiscard]] std::vector<commit_call> calls_of(int r) const {
    std::vector<commit_call> out;
    for (const auto& c : calls)
      if (c.request == r) out.push_back(c);
    return out;
  }

  std::vector<commit_call> calls;
  // Fault injection: request bad_request's commits from the bad_from-th on report L + A + 2.
  int bad_request = -1, bad_from = 0;
  std::function<void(int request, int nth_commit)> fault;  // may throw (a device error)
  std::function<void()> after_forward;

 private:
  std::vector<std::int32_t>& table(int r) {
    REQUIRE(r >= 0);
    REQUIRE(r < static_cast<int>(tables_.size()));
    return tables_[static_cast<std::size_t>(r)];
  }
  medusa::paged_kv_cache_view<float> view(int r) {
    return medusa::make_paged_kv_view<float>(k_, v_, extents, page_size, medusa::kv_layout::nhd, table(r));
  }

  const tiny_model& w_;
  int max_context_;
  std::vector<float> k_, v_;
  std::vector<std::vector<std::int32_t>> tables_;
  std::vector<std::int32_t> free_;
};

// (a) What the concepts accept. Each negative has a positive control one member away.
template <class M>
concept has_kv_cache = requires(M& m) { m.kv_cache(); };
template <class M>
concept has_request_kv_cache = requires(M& m) { m.kv_cache(0); };

struct no_cache_model {  // forward and a context, but no way to commit
  int vocab_size() const { return 8; }
  int hidden_size() const { return 4; }
  int max_context() const { return 16; }
  void forward(const medusa::forward_batch&) {}
};
struct committing_model : no_cache_model {
  int commit(int length, int, std::span<const int> path) { return length + static_cast<int>(path.size()); }
};
struct commit_without_context {  // commit, but nothing bounds the context
  int vocab_size() const { return 8; }
  int hidden_size() const { return 4; }
  void forward(const medusa::forward_batch&) {}
  int commit(int length, int, std::span<const int> path) { return length + static_cast<int>(path.size()); }
};
struct batch_form_on_single_model : no_cache_model {  // the batch form does not make a single-request model
  int commit(int, int length, int, std::span<const int> path) { return length + static_cast<int>(path.size()); }
};
struct no_cache_engine {
  int vocab_size() const { return 8; }
  int hidden_size() const { return 4; }
  int max_context() const { return 16; }
  void forward(const medusa::ragged_batch&) {}
};
struct committing_engine : no_cache_engine {
  int commit(int, int length, int, std::span<const int> path) { return length + static_cast<int>(path.size()); }
};

static_assert(medusa::decoder_model<private_cache_model>);
static_assert(medusa::kv_committing_single_model<private_cache_model>);
static_assert(!has_kv_cache<private_cache_model>);
static_assert(medusa::decoder_model<both_forms_model>);
static_assert(has_kv_cache<both_forms_model>);
static_assert(medusa::batch_decoder_model<private_paged_engine>);
static_assert(medusa::kv_committing_model<private_paged_engine>);
static_assert(!has_request_kv_cache<private_paged_engine>);
static_assert(medusa::decoder_model<tiny_model>);  // a view-based model stays valid
static_assert(!medusa::kv_committing_single_model<tiny_model>);

static_assert(!medusa::decoder_model<no_cache_model>);
static_assert(medusa::decoder_model<committing_model>);
static_assert(!medusa::decoder_model<commit_without_context>);
static_assert(!medusa::kv_committing_single_model<commit_without_context>);
static_assert(!medusa::decoder_model<batch_form_on_single_model>);
static_assert(!medusa::batch_decoder_model<no_cache_engine>);
static_assert(medusa::batch_decoder_model<committing_engine>);
static_assert(!medusa::batch_decoder_model<no_cache_model>);  // a single-request form is not a batch one
static_assert(!medusa::batch_decoder_model<committing_model>);

// The single-request adapter forwards commit to the batch form and a view only when there is one.
using one_private = medusa::detail::single_request_model<private_cache_model>;
using one_both = medusa::detail::single_request_model<both_forms_model>;
using one_view = medusa::detail::single_request_model<tiny_model>;
static_assert(medusa::kv_committing_model<one_private>);
static_assert(!has_request_kv_cache<one_private>);
static_assert(medusa::kv_committing_model<one_both>);
static_assert(has_request_kv_cache<one_both>);
static_assert(!medusa::kv_committing_model<one_view>);
static_assert(has_request_kv_cache<one_view>);

// docs/decoder.md, "Models that commit their own cache": the signature as documented.
struct my_gpu_model {
  int vocab_size() const { return 8; }
  int hidden_size() const { return 4; }
  int max_context() const { return 4096; }                 // bounds the context (there is no view)
  void forward(const medusa::forward_batch&) {}            // writes K/V at [L, L+T) of the device cache
  int commit(int committed_length, int num_tree_nodes,     // rows of path[j] at L+path[j] -> L+j
             std::span<const int> path) {
    (void)num_tree_nodes;
    return committed_length + static_cast<int>(path.size());  // the new length L + A + 1
  }
};
static_assert(medusa::decoder_model<my_gpu_model>);

const std::vector<std::int32_t> prompt = {1, 5, 9, 13, 2, 7};

std::vector<std::int32_t> prompt_of(int i) {
  std::vector<std::int32_t> p;
  const int len = 3 + (i * 5) % 11;
  for (int t = 0; t < len; ++t) p.push_back((t * 7 + i * 13 + 1) % tiny_model::vocab);
  return p;
}

// Oracle heads that know the greedy continuation of each prompt (deep acceptance, many paths).
oracle_heads oracle_for(tiny_model& ref, const std::vector<std::vector<std::int32_t>>& prompts,
                        const medusa::decode_options& opt) {
  oracle_heads heads{5, {}, {}};
  for (const auto& p : prompts) {
    auto seq = p;
    const auto plain = medusa::generate_vanilla(ref, p, medusa::greedy_policy{}, opt);
    seq.insert(seq.end(), plain.tokens.begin(), plain.tokens.end());
    heads.more_states.push_back(tiny::states_of(ref, seq));
    heads.more_sequences.push_back(std::move(seq));
  }
  return heads;
}

// The commits of one request agree with its statistics: one per tree step, each a valid accepted
// path (a root path of `tree` when given) whose length is that step's accepted drafts plus the
// root, each at the length the previous one left (tree steps run back to back here).
void check_commits(const std::vector<commit_call>& calls, const medusa::decode_result& out, int prompt_length,
                   int max_nodes, const medusa::tree* tree = nullptr) {
  CHECK(static_cast<int>(calls.size()) == out.stats.tree_steps);
  std::vector<int> histogram(out.stats.accepted_histogram.size(), 0);
  int length = prompt_length;
  for (const commit_call& c : calls) {
    CHECK(c.length == length);
    CHECK(c.nodes > 1);
    CHECK(c.nodes <= max_nodes);
    if (tree != nullptr) CHECK(c.nodes == tree->num_nodes());
    REQUIRE(!c.path.empty());
    CHECK(c.path[0] == 0);
    for (std::size_t j = 1; j < c.path.size(); ++j) {
      CHECK(c.path[j] > c.path[j - 1]);
      CHECK(c.path[j] < c.nodes);
      if (tree != nullptr) CHECK(tree->parent(c.path[j]) == c.path[j - 1]);
    }
    REQUIRE(c.path.size() - 1 < histogram.size());
    ++histogram[c.path.size() - 1];
    length = c.length + static_cast<int>(c.path.size());
  }
  CHECK(histogram == out.stats.accepted_histogram);
}

std::optional<medusa::kv_errc> kv_code(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const medusa::kv_cache_error& k) {
    return k.code();
  } catch (...) {
    return std::nullopt;
  }
}

template <class Decoder>
std::map<int, medusa::request_update> drain(Decoder& dec) {
  std::map<int, medusa::request_update> finished;
  int steps = 0;
  while (!dec.empty()) {
    for (auto& u : dec.step())
      if (u.finished) finished[u.request] = std::move(u);
    REQUIRE(++steps < 10000);
  }
  return finished;
}

}  // namespace

TEST_CASE("decoder: a model that commits itself gives exactly plain greedy tokens, one commit per tree step") {
  tiny_model ref(512);
  medusa::decode_options opt;
  opt.max_new_tokens = 80;
  const auto plain = medusa::generate_vanilla(ref, prompt, medusa::greedy_policy{}, opt);
  REQUIRE(plain.tokens.size() == 80);
  oracle_heads oracle = oracle_for(ref, {prompt}, opt);
  random_heads rnd(5, 11);

  private_cache_model model(512, 512);
  const auto vanilla = medusa::generate_vanilla(model, prompt, medusa::greedy_policy{}, opt);
  CHECK(vanilla.tokens == plain.tokens);
  CHECK(model.calls.empty());  // plain steps commit nothing

  auto run = [&](auto& heads, const auto& tree, int max_nodes, const medusa::tree* fixed) {
    model.calls.clear();
    medusa::decoder dec(model, heads, tree, medusa::greedy_policy{});
    const auto out = dec.generate(prompt, opt);
    CHECK(out.tokens == plain.tokens);
    CHECK(out.reason == medusa::stop_reason::max_tokens);
    CHECK(out.stats.tree_steps > 0);
    check_commits(model.calls, out, static_cast<int>(prompt.size()), max_nodes, fixed);
    return out;
  };
  SUBCASE("a preset tree, oracle heads: deep acceptance") {
    const medusa::tree tree = medusa::tree::preset("mc_sim_7b_63");
    const auto out = run(oracle, tree, tree.num_nodes(), &tree);
    CHECK(out.stats.mean_accepted() > 2.0);
    CHECK(std::any_of(model.calls.begin(), model.calls.end(), [](const commit_call& c) { return c.path.size() >= 3; }));
  }
  SUBCASE("a preset tree, random heads") {
    const medusa::tree tree = medusa::tree::preset("vicuna_7b_stage2");
    run(rnd, tree, tree.num_nodes(), &tree);
  }
  SUBCASE("a small custom tree") {
    const medusa::tree tree = medusa::tree::from_text("[[0],[1],[0,0],[0,1],[1,0],[0,0,0]]");
    REQUIRE(tree.num_nodes() == 7);
    const auto out = run(oracle, tree, tree.num_nodes(), &tree);
    CHECK(out.stats.accepted_histogram[2] > 0);  // steps that accepted two drafts of the small tree
  }
  SUBCASE("per-step drafts: each tree step its own tree") {
    const medusa::step_drafter drafter(
        {.dynamic_nodes = 8, .lookup = medusa::ngram_lookup{.min_ngram = 1, .max_tokens = 6}}, 5);
    run(oracle, drafter, drafter.max_nodes(), nullptr);
  }
}

TEST_CASE("decoder: a model with both a view and commit is committed through commit, never through the view") {
  tiny_model ref(512);
  medusa::decode_options opt;
  opt.max_new_tokens = 50;
  const auto plain = medusa::generate_vanilla(ref, prompt, medusa::greedy_policy{}, opt);
  oracle_heads heads = oracle_for(ref, {prompt}, opt);
  both_forms_model model(512, 512);
  const medusa::tree tree = medusa::tree::preset("mc_sim_7b_63");
  medusa::decoder dec(model, heads, tree, medusa::greedy_policy{});
  const auto out = dec.generate(prompt, opt);
  CHECK(out.tokens == plain.tokens);
  CHECK(model.kv_cache_calls == 0);
  check_commits(model.calls, out, static_cast<int>(prompt.size()), tree.num_nodes(), &tree);
}

TEST_CASE("batch_decoder: requests joined at once over a private paged pool get exactly their plain tokens") {
  tiny_model weights(512);
  medusa::decode_options opt;
  opt.max_new_tokens = 48;
  const std::vector<std::vector<std::int32_t>> prompts = {prompt_of(0), prompt_of(1), prompt_of(2)};
  std::vector<medusa::decode_result> alone;
  for (const auto& p : prompts) alone.push_back(medusa::generate_vanilla(weights, p, medusa::greedy_policy{}, opt));
  oracle_heads oracle = oracle_for(weights, prompts, opt);
  random_heads rnd(5, 3);

  auto check = [&](auto& heads, const auto& tree, int max_nodes, const medusa::tree* fixed) {
    private_paged_engine eng(weights, 400, 256, 3);
    medusa::batch_decoder dec(eng, heads, tree, medusa::greedy_policy{}, 3);
    for (int i = 0; i < 3; ++i) dec.join(i, prompts[static_cast<std::size_t>(i)], opt);
    auto finished = drain(dec);
    REQUIRE(finished.size() == 3);
    int tree_steps = 0;
    for (int i = 0; i < 3; ++i) {
      CAPTURE(i);
      const auto& u = finished.at(i);
      INFO(u.error_message());
      CHECK(u.reason == medusa::stop_reason::max_tokens);
      CHECK(u.result.tokens == alone[static_cast<std::size_t>(i)].tokens);
      check_commits(eng.calls_of(i), u.result, static_cast<int>(prompts[static_cast<std::size_t>(i)].size()), max_nodes,
                    fixed);
      tree_steps += u.result.stats.tree_steps;
    }
    CHECK(static_cast<int>(eng.calls.size()) == tree_steps);
    CHECK(tree_steps > 0);
  };
  SUBCASE("oracle heads, a preset tree") {
    const medusa::tree tree = medusa::tree::preset("mc_sim_7b_63");
    check(oracle, tree, tree.num_nodes(), &tree);
  }
  SUBCASE("random heads, a small custom tree") {
    const medusa::tree tree = medusa::tree::from_text("[[0],[1],[0,0],[0,1],[1,0],[0,0,0]]");
    check(rnd, tree, tree.num_nodes(), &tree);
  }
  SUBCASE("per-step drafts") {
    const medusa::step_drafter drafter({.paths = medusa::tree::preset("mc_sim_7b_63").sorted_paths(),
                                        .lookup = medusa::ngram_lookup{.min_ngram = 1, .max_tokens = 6}},
                                       5);
    check(oracle, drafter, drafter.max_nodes(), nullptr);
  }
}

TEST_CASE("a commit that reports a wrong length fails its request with a kv_cache_error; the others go on") {
  tiny_model weights(512);
  random_heads heads(5, 11);
  const medusa::tree tree = medusa::tree::preset("vicuna_7b_stage2");
  medusa::decode_options opt;
  opt.max_new_tokens = 30;
  std::vector<std::vector<std::int32_t>> alone;
  for (int i = 0; i < 3; ++i)
    alone.push_back(medusa::generate_vanilla(weights, prompt_of(i), medusa::greedy_policy{}, opt).tokens);

  auto run = [&](private_paged_engine& eng, int bad) {
    medusa::batch_decoder dec(eng, heads, tree, medusa::greedy_policy{}, 3);
    for (int i = 0; i < 3; ++i) dec.join(i, prompt_of(i), opt);
    auto finished = drain(dec);
    REQUIRE(finished.size() == 3);
    const auto& u = finished.at(bad);
    CHECK(u.reason == medusa::stop_reason::failed);
    REQUIRE(u.error != nullptr);
    // What it streamed before it failed is its own output.
    CHECK(u.result.tokens.size() < alone[static_cast<std::size_t>(bad)].size());
    CHECK(std::equal(u.result.tokens.begin(), u.result.tokens.end(), alone[static_cast<std::size_t>(bad)].begin()));
    for (int i = 0; i < 3; ++i)
      if (i != bad) {
        CAPTURE(i);
        INFO(finished.at(i).error_message());
        CHECK(finished.at(i).reason == medusa::stop_reason::max_tokens);
        CHECK(finished.at(i).result.tokens == alone[static_cast<std::size_t>(i)]);
      }
    return u;
  };
  SUBCASE("one more slot than L + A + 1 at the request's third commit") {
    private_paged_engine eng(weights, 400, 256, 3);
    eng.bad_request = 1;
    eng.bad_from = 3;
    const auto u = run(eng, 1);
    CHECK(kv_code(u.error) == medusa::kv_errc::invalid_length);
    CHECK(u.error_message().find("request 1:") != std::string::npos);
    CHECK(u.error_message().find("expected") != std::string::npos);
    CHECK(eng.calls_of(1).size() == 3);  // the decoder stopped committing it
  }
  SUBCASE("a commit that throws (a device error)") {
    private_paged_engine eng(weights, 400, 256, 3);
    eng.fault = [](int r, int nth) {
      if (r == 2 && nth == 2) throw std::runtime_error("device lost");
    };
    const auto u = run(eng, 2);
    CHECK(u.error_message() == "device lost");
    CHECK(!kv_code(u.error).has_value());
  }

  SUBCASE("the single-request decoder throws it") {
    private_cache_model model(512, 512);
    model.length_offset = -1;
    medusa::decoder dec(model, heads, tree, medusa::greedy_policy{});
    try {
      (void)dec.generate(prompt, opt);
      FAIL("a wrong commit length must throw");
    } catch (const medusa::kv_cache_error& e) {
      CHECK(e.code() == medusa::kv_errc::invalid_length);
      CHECK(std::string(e.what()).find("request 0:") != std::string::npos);
    }
    CHECK(model.calls.size() == 1);
  }
}

TEST_CASE("the decoder checks appends and paths against max_context() before the model sees them") {
  tiny_model weights(512);
  random_heads heads(5, 7);
  const medusa::tree tree = medusa::tree::preset("vicuna_7b_stage2");  // 64 nodes
  medusa::decode_options opt;
  opt.max_new_tokens = 30;

  SUBCASE("the context shrinks below the next append: capacity_exceeded before any page is mapped") {
    private_paged_engine eng(weights, 400, 256, 2);
    medusa::batch_decoder dec(eng, heads, tree, medusa::greedy_policy{}, 2);
    dec.join(0, prompt_of(0), opt);
    (void)dec.step();  // prefill and a first tree step
    REQUIRE(dec.contains(0));
    const std::size_t commits = eng.calls.size();
    eng.set_max_context(dec.length(0) + 10);  // the decoder would want L + 64 (reserve REQUIREs it fits)
    auto finished = drain(dec);
    const auto& u = finished.at(0);
    CHECK(u.reason == medusa::stop_reason::failed);
    CHECK(kv_code(u.error) == medusa::kv_errc::capacity_exceeded);
    CHECK(eng.calls.size() == commits);
  }
  SUBCASE("the context shrinks between the forward and the commit: the model is never called") {
    private_paged_engine eng(weights, 400, 256, 2);
    medusa::batch_decoder dec(eng, heads, tree, medusa::greedy_policy{}, 2);
    dec.join(0, prompt_of(0), opt);
    (void)dec.step();
    REQUIRE(eng.calls.size() == 1);
    eng.after_forward = [&] { eng.set_max_context(dec.length(0) + 10); };
    auto finished = drain(dec);
    const auto& u = finished.at(0);
    CHECK(u.reason == medusa::stop_reason::failed);
    CHECK(kv_code(u.error) == medusa::kv_errc::capacity_exceeded);
    CHECK(eng.calls.size() == 1);
  }
  SUBCASE("the checks are kv_commit's and kv_check_append's own: same code, same message") {
    const int capacity = 80;
    std::vector<float> k(static_cast<std::size_t>(tiny_model::layers) * capacity * tiny_model::kv_heads *
                         tiny_model::head_dim),
        v(k.size());
    const auto kv = medusa::make_kv_view<float>(k, v, extents, capacity);
    const int n = tree.num_nodes();
    const int child = tree.child_begin(0), grandchild = tree.child_begin(child);
    REQUIRE(tree.parent(grandchild) == child);
    const int stranger = tree.child_begin(0) + 1;  // a sibling of `child`: not the parent of `grandchild`
    REQUIRE(tree.parent(grandchild) != stranger);
    struct commit_case {
      int length;
      std::vector<int> path;
      std::optional<medusa::kv_errc> want;
    };
    const std::vector<commit_case> cases = {
        {10, {0, child, grandchild}, std::nullopt},
        {10, {}, medusa::kv_errc::invalid_path},
        {10, {1, child}, medusa::kv_errc::invalid_path},
        {10, {0, grandchild, child}, medusa::kv_errc::invalid_path},
        {10, {0, n}, medusa::kv_errc::invalid_path},
        {10, {0, stranger, grandchild}, medusa::kv_errc::path_not_in_tree},
        {-1, {0}, medusa::kv_errc::invalid_length},
        {capacity - n + 1, {0}, medusa::kv_errc::capacity_exceeded},
        {capacity - n, {0, child}, std::nullopt},
    };
    auto outcome = [](auto&& f) -> std::pair<std::optional<medusa::kv_errc>, std::string> {
      try {
        f();
        return {std::nullopt, ""};
      } catch (const medusa::kv_cache_error& e) {
        return {e.code(), e.what()};
      }
    };
    for (const commit_case& c : cases) {
      CAPTURE(c.length);
      CAPTURE(c.path.size());
      const auto view = outcome([&] { (void)medusa::kv_commit(kv, c.length, tree, c.path); });
      const auto within =
          outcome([&] { medusa::detail::kv_validate_commit_within(capacity, c.length, tree, c.path, -1); });
      CHECK(view.first == c.want);
      CHECK(within.first == c.want);
      CHECK(within.second == view.second);
    }
    const std::vector<std::pair<int, int>> appends = {
        {0, 80}, {1, 80}, {-1, 3}, {3, -1}, {std::numeric_limits<int>::max(), 1}};
    for (const std::pair<int, int>& append : appends) {
      const int length = append.first, count = append.second;
      CAPTURE(length);
      CAPTURE(count);
      const auto view = outcome([&] { medusa::kv_check_append(kv, length, count); });
      const auto within = outcome([&] { medusa::detail::kv_check_append_within(capacity, length, count); });
      CHECK(within.first == view.first);
      CHECK(within.second == view.second);
      CHECK(view.first.has_value() == (length != 0));
    }
  }
}

TEST_CASE("a small max_context stops exactly where a view of that capacity does") {
  random_heads heads(5, 5);
  const medusa::tree tree = medusa::tree::preset("vicuna_7b_stage2");
  medusa::decode_options opt;
  opt.max_new_tokens = 500;
  const int context = static_cast<int>(prompt.size()) + 70;  // the 64-node tree fits only at the start
  tiny_model small(context);                                 // the view-based reference
  const auto v_plain = medusa::generate_vanilla(small, prompt, medusa::greedy_policy{}, opt);
  medusa::decoder v_dec(small, heads, tree, medusa::greedy_policy{});
  const auto v_medusa = v_dec.generate(prompt, opt);
  REQUIRE(v_plain.reason == medusa::stop_reason::context_full);
  REQUIRE(v_medusa.tokens == v_plain.tokens);

  SUBCASE("one request: the private cache is larger than max_context (only max_context may stop it), or exactly it") {
   for (int capacity : {512, context}) {
    CAPTURE(capacity);
    private_cache_model model(capacity, context);
    const auto plain = medusa::generate_vanilla(model, prompt, medusa::greedy_policy{}, opt);
    CHECK(plain.reason == medusa::stop_reason::context_full);
    CHECK(plain.tokens == v_plain.tokens);
    medusa::decoder dec(model, heads, tree, medusa::greedy_policy{});
    model.calls.clear();
    const auto out = dec.generate(prompt, opt);
    CHECK(out.reason == medusa::stop_reason::context_full);
    CHECK(out.tokens == v_medusa.tokens);
    CHECK(out.stats.steps == v_medusa.stats.steps);
    CHECK(out.stats.tree_steps == v_medusa.stats.tree_steps);
    CHECK(out.stats.tree_steps >= 1);
    check_commits(model.calls, out, static_cast<int>(prompt.size()), tree.num_nodes(), &tree);
    for (const commit_call& c : model.calls) CHECK(c.length + c.nodes <= context);
   }
  }

  SUBCASE("a prompt longer than the context: the same decode_error") {
    private_cache_model model(512, context);
    const std::vector<std::int32_t> long_prompt(static_cast<std::size_t>(context) + 1, 3);
    std::string want;
    try {
      (void)medusa::generate_vanilla(small, long_prompt, medusa::greedy_policy{}, opt);
    } catch (const medusa::decode_error& e) {
      want = e.what();
    }
    REQUIRE(want.find("does not fit the context of " + std::to_string(context)) != std::string::npos);
    CHECK_THROWS_WITH_AS(medusa::generate_vanilla(model, long_prompt, medusa::greedy_policy{}, opt), want.c_str(),
                         medusa::decode_error);
  }

  SUBCASE("a batch of requests over a private paged pool, each at the end of the shared context") {
    tiny_model weights(512);
    private_paged_engine eng(weights, 400, context, 3);
    medusa::batch_decoder dec(eng, heads, tree, medusa::greedy_policy{}, 3);
    for (int i = 0; i < 3; ++i) dec.join(i, prompt_of(i), opt);
    auto finished = drain(dec);
    REQUIRE(finished.size() == 3);
    for (int i = 0; i < 3; ++i) {
      CAPTURE(i);
      const auto& u = finished.at(i);
      INFO(u.error_message());
      CHECK(u.reason == medusa::stop_reason::context_full);
      const auto want = medusa::generate_vanilla(small, prompt_of(i), medusa::greedy_policy{}, opt);
      CHECK(u.result.tokens == want.tokens);
      CHECK(static_cast<int>(u.result.tokens.size()) == context - static_cast<int>(prompt_of(i).size()) + 1);
      for (const commit_call& c : eng.calls_of(i)) CHECK(c.length + c.nodes <= context);
    }
  }
}

TEST_CASE("calibration and step costs read max_context() of a model that commits itself") {
  tiny_model ref(512);
  random_heads heads(3, 9);
  std::vector<std::int32_t> tokens = prompt;
  const auto plain = medusa::generate_vanilla(ref, prompt, medusa::greedy_policy{}, {.max_new_tokens = 30});
  tokens.insert(tokens.end(), plain.tokens.begin(), plain.tokens.end());

  private_cache_model model(512, 64);
  medusa::path_counter mine(3, 4), theirs(3, 4);
  medusa::count_paths(model, heads, tokens, mine, static_cast<int>(prompt.size()) - 1);
  medusa::count_paths(ref, heads, tokens, theirs, static_cast<int>(prompt.size()) - 1);
  CHECK(mine.positions() > 0);
  CHECK(mine.counts() == theirs.counts());
  private_cache_model short_context(512, static_cast<int>(tokens.size()) - 1);
  CHECK_THROWS_AS(medusa::count_paths(short_context, heads, tokens, mine), medusa::invalid_input);

  const auto curve =
      medusa::measure_step_cost(model, heads, {.rows = {1, 2, 4}, .context = 16, .repeats = 1, .budget_seconds = 0.0});
  CHECK(curve.rows.size() == 3);
  CHECK(curve.seconds.size() == 3);
  // 64 slots leave no room for a 64-row step after any prefix (the private cache would have).
  CHECK_THROWS_WITH_AS(medusa::measure_step_cost(model, heads, {.rows = {1, 64}, .repeats = 1, .budget_seconds = 0.0}),
                       doctest::Contains("cache of 64 slots"), medusa::invalid_input);
}
