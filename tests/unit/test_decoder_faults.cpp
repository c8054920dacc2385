// SPDX-License-Identifier: Apache-2.0
// Faults during decoding: a model that returns NaN or +Inf logits or hidden states at some step
// fails that request alone with a model_output_error naming the request and the step; the step
// commits nothing, so the request's cache keeps `cache_length` valid slots and the request can be
// resumed (joined again over its cached prefix, with the output of an uninterrupted run) or
// dropped. A full context ends a request with context_full and nothing is written past it.
#include "tiny_transformer.hpp"

#include <medusa/decoder.hpp>
#include <medusa/tree.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace {

using tiny::random_heads;
using tiny::tiny_model;

constexpr float nan_value = std::numeric_limits<float>::quiet_NaN();
constexpr float canary = -12345.0f;

// A batch engine over shared tiny_model weights: one contiguous cache per request, `guard` slots
// of canaries past each request's context, and a hook that may corrupt any request's outputs.
class fault_engine {
 public:
  static constexpr int guard = 16;
  static constexpr std::size_t slot_floats = static_cast<std::size_t>(tiny_model::kv_heads) * tiny_model::head_dim;

  fault_engine(const tiny_model& weights, int context, int requests) : w_(weights), context_(context) {
    for (int r = 0; r < requests; ++r) {
      caches_.emplace_back();
      drop(r);
    }
  }

  int vocab_size() const { return tiny_model::vocab; }
  int hidden_size() const { return tiny_model::dim; }
  int max_context() const { return context_; }

  // The view spans the guard slots too: only max_context() keeps the decoder out of them.
  medusa::kv_cache_view<float> kv_cache(int r) {
    cache& c = caches_.at(static_cast<std::size_t>(r));
    return medusa::make_kv_view<float>(c.k, c.v, medusa::kv_extents{tiny_model::layers, tiny_model::kv_heads, tiny_model::head_dim},
                                       context_ + guard);
  }

  void forward(const medusa::ragged_batch& b) {
    for (int i = 0; i < b.size(); ++i) {
      const int r = b.requests[static_cast<std::size_t>(i)];
      const int n = b.count(i);
      const int L = b.cache_lengths[static_cast<std::size_t>(i)];
      REQUIRE(L + n <= context_);  // never a slot past the context
      const medusa::forward_batch f = tiny::request_slice(b, i);
      w_.run(kv_cache(r), f);
      cache& c = caches_.at(static_cast<std::size_t>(r));
      ++c.passes;
      c.rows.push_back(n);
      if (corrupt) corrupt(r, c.passes, f.logits, f.hidden);
    }
  }

  // The engine drops a request: its slots hold garbage again, canaries restored.
  void drop(int r) {
    cache& c = caches_.at(static_cast<std::size_t>(r));
    const std::size_t slots = static_cast<std::size_t>(context_ + guard);
    c.k.assign(tiny_model::layers * slots * slot_floats, nan_value);
    c.v.assign(c.k.size(), nan_value);
    for (int l = 0; l < tiny_model::layers; ++l)
      for (std::size_t s = static_cast<std::size_t>(context_); s < slots; ++s)
        for (std::size_t e = 0; e < slot_floats; ++e) {
          c.k[(static_cast<std::size_t>(l) * slots + s) * slot_floats + e] = canary;
          c.v[(static_cast<std::size_t>(l) * slots + s) * slot_floats + e] = canary;
        }
    c.passes = 0;
    c.rows.clear();
  }

  // True when every guard slot of request r still holds its canary.
  [[nodiscard]] bool guard_intact(int r) const {
    const cache& c = caches_.at(static_cast<std::size_t>(r));
    const std::size_t slots = static_cast<std::size_t>(context_ + guard);
    for (int l = 0; l < tiny_model::layers; ++l)
      for (std::size_t s = static_cast<std::size_t>(context_); s < slots; ++s)
        for (std::size_t e = 0; e < slot_floats; ++e) {
          const std::size_t at = (static_cast<std::size_t>(l) * slots + s) * slot_floats + e;
          if (c.k[at] != canary || c.v[at] != canary) return false;
        }
    return true;
  }

  // Largest |difference| between slots [0, count) of request r's cache and of `other`'s request o.
  [[nodiscard]] float max_difference(int r, const fault_engine& other, int o, int count) const {
    const cache& a = caches_.at(static_cast<std::size_t>(r));
    const cache& b = other.caches_.at(static_cast<std::size_t>(o));
    const std::size_t slots = static_cast<std::size_t>(context_ + guard);
    float worst = 0.0f;
    for (int l = 0; l < tiny_model::layers; ++l)
      for (std::size_t s = 0; s < static_cast<std::size_t>(count); ++s)
        for (std::size_t e = 0; e < slot_floats; ++e) {
          const std::size_t at = (static_cast<std::size_t>(l) * slots + s) * slot_floats + e;
          worst = std::max({worst, std::abs(a.k[at] - b.k[at]), std::abs(a.v[at] - b.v[at])});
          if (std::isnan(a.k[at]) || std::isnan(a.v[at])) return std::numeric_limits<float>::infinity();
        }
    return worst;
  }

  // Forward passes request r took part in since its last drop, and the rows of each.
  [[nodiscard]] int passes(int r) const { return caches_.at(static_cast<std::size_t>(r)).passes; }
  [[nodiscard]] const std::vector<int>& rows(int r) const { return caches_.at(static_cast<std::size_t>(r)).rows; }

  // corrupt(request, pass of that request since its drop (1 = first), logits, hidden)
  std::function<void(int, int, std::span<float>, std::span<float>)> corrupt;

 private:
  struct cache {
    std::vector<float> k, v;
    int passes = 0;
    std::vector<int> rows;
  };
  const tiny_model& w_;
  int context_;
  std::vector<cache> caches_;
};
static_assert(medusa::batch_decoder_model<fault_engine>);

std::vector<std::int32_t> prompt_of(int i) {
  std::vector<std::int32_t> p;
  const int len = 4 + (i * 5) % 9;
  for (int t = 0; t < len; ++t) p.push_back((t * 11 + i * 7 + 2) % tiny_model::vocab);
  return p;
}

template <class Decoder>
std::map<int, medusa::request_update> drain(Decoder& dec) {
  std::map<int, medusa::request_update> done;
  while (!dec.empty())
    for (medusa::request_update& u : dec.step())
      if (u.finished) done[u.request] = std::move(u);
  return done;
}

// The error of a failed update, as a model_output_error (fails the test if it is another type).
medusa::model_output_error output_error_of(const medusa::request_update& u) {
  REQUIRE(u.reason == medusa::stop_reason::failed);
  REQUIRE(u.error != nullptr);
  try {
    std::rethrow_exception(u.error);
  } catch (const medusa::model_output_error& e) {
    return e;
  } catch (const std::exception& e) {
    FAIL("expected a model_output_error, got: " << e.what());
  }
  throw std::logic_error("unreachable");
}

std::vector<std::int32_t> concat(std::vector<std::int32_t> a, const std::vector<std::int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

constexpr int requests = 3;
constexpr int context = 96;

struct fixture {
  tiny_model weights{context + fault_engine::guard};
  random_heads heads{5, 11};
  medusa::tree tree = medusa::tree::preset("vicuna_7b_stage2");
  medusa::decode_options opt;
  std::vector<std::vector<std::int32_t>> alone;  // each request decoded alone, never corrupted
  fixture() {
    opt.max_new_tokens = 40;
    for (int i = 0; i < requests; ++i)
      alone.push_back(medusa::generate_vanilla(weights, prompt_of(i), medusa::greedy_policy{}, opt).tokens);
  }
};

}  // namespace

TEST_CASE("non-finite model outputs fail one request with a model_output_error naming it and the step") {
  fixture fx;
  const int bad = 1;

  struct fault_case {
    const char* name;
    int pass;                   // the bad request's forward pass that is corrupted (1 = prefill)
    medusa::model_output what;  // which output
    float value;
  };
  const fault_case cases[] = {
      {"NaN logits at a tree step", 4, medusa::model_output::logits, nan_value},
      {"+Inf logits at a tree step", 3, medusa::model_output::logits, std::numeric_limits<float>::infinity()},
      {"NaN hidden states at a tree step", 5, medusa::model_output::hidden, nan_value},
      {"-Inf hidden state at the prefill", 1, medusa::model_output::hidden, -std::numeric_limits<float>::infinity()},
      {"NaN logits at the prefill", 1, medusa::model_output::logits, nan_value},
  };
  for (const fault_case& c : cases) {
    const std::string name = c.name;
    CAPTURE(name);
    fault_engine eng(fx.weights, context, requests);
    eng.corrupt = [&](int r, int pass, std::span<float> logits, std::span<float> hidden) {
      if (r != bad || pass != c.pass) return;
      // Row 0 (the root) is read by every step: rows off the accepted path are never read.
      if (c.what == medusa::model_output::logits) logits[3] = c.value;
      else std::fill(hidden.begin(), hidden.end(), c.value);
    };
    medusa::batch_decoder dec(eng, fx.heads, fx.tree, medusa::greedy_policy{}, requests);
    for (int i = 0; i < requests; ++i) dec.join(i, prompt_of(i), fx.opt);
    auto done = drain(dec);
    REQUIRE(done.size() == requests);
    const medusa::model_output_error e = output_error_of(done[bad]);
    CHECK(e.request() == bad);
    CHECK(e.step() == static_cast<std::uint64_t>(c.pass - 1));  // pass 1 is the prefill: step 0
    CHECK(e.output() == c.what);
    const std::string msg = e.what();
    CHECK(msg.find("request 1, step " + std::to_string(c.pass - 1) + ": non-finite " +
                   std::string(medusa::to_string(c.what))) != std::string::npos);
    CHECK(msg.find(c.value != c.value ? "NaN" : c.value > 0 ? "+Inf" : "-Inf") != std::string::npos);
    // What it streamed is a prefix of its uninterrupted output; the others are untouched.
    const auto& got = done[bad].result.tokens;
    CHECK(std::equal(got.begin(), got.end(), fx.alone[bad].begin()));
    for (int i = 0; i < requests; ++i)
      if (i != bad) CHECK(done[i].result.tokens == fx.alone[static_cast<std::size_t>(i)]);
    // A failed step counts none of its slots: after a tree step every emitted token is committed,
    // so the valid slots are exactly the prompt and the tokens.
    // A failed prefill (one chunk here) leaves no valid slot.
    const int prompt = static_cast<int>(prompt_of(bad).size());
    CHECK(done[bad].result.cache_length == (c.pass == 1 ? 0 : prompt + static_cast<int>(got.size())));
    CHECK(eng.guard_intact(bad));
  }
}

TEST_CASE("a request that failed on a non-finite output resumes over its cached prefix, or is dropped") {
  fixture fx;
  const int bad = 2;
  for (const bool resume : {true, false}) {
    for (const int fault_pass : {2, 4, 8}) {  // the prefill's second chunk, the first tree step, a later one
      CAPTURE(resume);
      CAPTURE(fault_pass);
      fault_engine eng(fx.weights, context, requests);
      bool armed = true;
      eng.corrupt = [&](int r, int pass, std::span<float> logits, std::span<float>) {
        if (armed && r == bad && pass == fault_pass) logits[3] = nan_value;
      };
      medusa::decode_options opt = fx.opt;
      opt.prefill_chunk = 2;  // the bad prompt (5 tokens) takes 3 chunks
      medusa::batch_decoder dec(eng, fx.heads, fx.tree, medusa::greedy_policy{}, requests);
      for (int i = 0; i < requests; ++i) dec.join(i, prompt_of(i), opt);
      std::map<int, medusa::request_update> done;
      std::vector<std::int32_t> resumed_tokens;
      int valid = -1;
      while (!dec.empty()) {
        std::optional<medusa::request_update> failed;
        for (medusa::request_update& u : dec.step()) {
          if (!u.finished) continue;
          if (u.request == bad && u.reason == medusa::stop_reason::failed) failed = std::move(u);
          else done[u.request] = std::move(u);
        }
        if (failed) {
          armed = false;
          const medusa::decode_result& r = failed->result;
          valid = r.cache_length;
          // The valid prefix holds what a clean run of the same tokens writes.
          const std::vector<std::int32_t> so_far = concat(prompt_of(bad), r.tokens);
          CHECK(valid <= static_cast<int>(so_far.size()));
          if (valid > 0) {
            fault_engine clean(fx.weights, context, requests);
            const std::vector<std::int32_t> pos = [&] {
              std::vector<std::int32_t> p(so_far.size());
              for (std::size_t t = 0; t < p.size(); ++t) p[t] = static_cast<std::int32_t>(t);
              return p;
            }();
            std::vector<float> z(so_far.size() * tiny_model::vocab), h(so_far.size() * tiny_model::dim);
            const int indptr[2] = {0, static_cast<int>(so_far.size())};
            const int lengths[1] = {0};
            medusa::ragged_batch b;
            b.requests = std::span<const int>(&bad, 1);
            b.qo_indptr = indptr;
            b.tokens = so_far;
            b.positions = pos;
            b.cache_lengths = lengths;
            b.logits = z;
            b.hidden = h;
            clean.forward(b);
            CHECK(eng.max_difference(bad, clean, bad, valid) < 1e-4f);
          }
          if (resume) {
            // Join again over the cached prefix: only the rest of the prompt runs.
            medusa::decode_options again = opt;
            again.cached_prompt_tokens = std::min(valid, static_cast<int>(so_far.size()) - 1);
            again.max_new_tokens = opt.max_new_tokens - static_cast<int>(r.tokens.size());
            resumed_tokens = r.tokens;
            dec.join(bad, so_far, again);
          } else {
            // Drop it: the engine frees its slots; the id is reused by a fresh request.
            eng.drop(bad);
            dec.join(bad, prompt_of(bad), opt);
          }
        }
      }
      REQUIRE(done.size() == requests);
      CHECK(valid >= 0);
      CHECK(done[bad].reason == medusa::stop_reason::max_tokens);
      if (resume)
        CHECK(concat(resumed_tokens, done[bad].result.tokens) == fx.alone[bad]);
      else
        CHECK(done[bad].result.tokens == fx.alone[bad]);
      for (int i = 0; i < requests; ++i) {
        CAPTURE(i);
        if (i != bad) CHECK(done[i].result.tokens == fx.alone[static_cast<std::size_t>(i)]);
        CHECK(eng.guard_intact(i));
      }
    }
  }
}

TEST_CASE("a resumed request prefills only the tokens past its cached prefix") {
  fixture fx;
  fault_engine eng(fx.weights, context, 1);
  const std::vector<std::int32_t> prompt = prompt_of(1);
  medusa::decode_options opt = fx.opt;
  opt.max_new_tokens = 10;
  medusa::batch_decoder dec(eng, fx.heads, fx.tree, medusa::greedy_policy{}, 1);
  dec.join(0, prompt, opt);
  const medusa::decode_result first = drain(dec)[0].result;
  REQUIRE(first.reason == medusa::stop_reason::max_tokens);
  // A completed request's cache is as valid as a failed one's: continue it for 30 more tokens.
  const std::vector<std::int32_t> so_far = concat(prompt, first.tokens);
  opt.cached_prompt_tokens = std::min(first.cache_length, static_cast<int>(so_far.size()) - 1);
  opt.max_new_tokens = 30;
  const int passes = eng.passes(0);
  dec.join(0, so_far, opt);
  const medusa::decode_result second = drain(dec)[0].result;
  REQUIRE(eng.rows(0).size() > static_cast<std::size_t>(passes));
  CHECK(eng.rows(0)[static_cast<std::size_t>(passes)] == static_cast<int>(so_far.size()) - opt.cached_prompt_tokens);
  CHECK(second.stats.prompt_tokens == static_cast<int>(so_far.size()));
  CHECK(concat(first.tokens, second.tokens) == std::vector<std::int32_t>(fx.alone[1].begin(), fx.alone[1].end()));
}

TEST_CASE("a plain step's non-finite output leaves its token out of the valid slots") {
  fixture fx;
  fault_engine eng(fx.weights, context, 1);
  eng.corrupt = [&](int, int pass, std::span<float> logits, std::span<float>) {
    if (pass == 7) logits[0] = nan_value;
  };
  medusa::no_heads none;
  medusa::batch_decoder dec(eng, none, medusa::plain_tree{}, medusa::greedy_policy{}, 1);
  dec.join(0, prompt_of(0), fx.opt);
  auto done = drain(dec);
  const medusa::model_output_error e = output_error_of(done[0]);
  CHECK(e.step() == 6);
  CHECK(e.output() == medusa::model_output::logits);
  // Six plain steps emitted six tokens; the sixth ran in the failed pass, so its slot is not valid.
  const medusa::decode_result& r = done[0].result;
  CHECK(r.tokens.size() == 6);
  CHECK(r.cache_length == static_cast<int>(prompt_of(0).size()) + 5);
  eng.corrupt = nullptr;
  medusa::decode_options again = fx.opt;
  const std::vector<std::int32_t> so_far = concat(prompt_of(0), r.tokens);
  again.cached_prompt_tokens = std::min(r.cache_length, static_cast<int>(so_far.size()) - 1);
  again.max_new_tokens = fx.opt.max_new_tokens - 6;
  dec.join(0, so_far, again);
  CHECK(concat(r.tokens, drain(dec)[0].result.tokens) == fx.alone[0]);
}

TEST_CASE("decoder::generate rethrows a model_output_error and decodes cleanly afterwards") {
  fixture fx;
  const std::vector<std::int32_t> prompt = prompt_of(0);
  // tiny_model is a single-request model: corrupt it by wrapping its forward.
  struct faulty_single {
    tiny_model& m;
    int calls = 0;
    int fault_at = 0;
    int vocab_size() const { return m.vocab_size(); }
    int hidden_size() const { return m.hidden_size(); }
    medusa::kv_cache_view<float> kv_cache() const { return m.kv_cache(); }
    void forward(const medusa::forward_batch& b) {
      m.forward(b);
      if (++calls == fault_at) b.logits[1] = nan_value;
    }
  } model{fx.weights, 0, 3};
  medusa::decoder dec(model, fx.heads, fx.tree, medusa::greedy_policy{});
  try {
    (void)dec.generate(prompt, fx.opt);
    FAIL("expected a model_output_error");
  } catch (const medusa::model_output_error& e) {
    CHECK(e.request() == 0);
    CHECK(e.step() == 2);
  }
  model.fault_at = 0;
  CHECK(dec.generate(prompt, fx.opt).tokens == fx.alone[0]);
}

TEST_CASE("bad cached_prompt_tokens is refused at join and changes nothing") {
  fixture fx;
  fault_engine eng(fx.weights, context, 2);
  medusa::batch_decoder dec(eng, fx.heads, fx.tree, medusa::greedy_policy{}, 2);
  const std::vector<std::int32_t> prompt = prompt_of(0);
  for (const int cached : {-1, static_cast<int>(prompt.size()), static_cast<int>(prompt.size()) + 3}) {
    CAPTURE(cached);
    medusa::decode_options opt = fx.opt;
    opt.cached_prompt_tokens = cached;
    CHECK_THROWS_WITH_AS(dec.join(0, prompt, opt), doctest::Contains("cached_prompt_tokens must be in [0, "),
                         medusa::decode_error);
    CHECK(dec.empty());
  }
  dec.join(0, prompt, fx.opt);
  CHECK(drain(dec)[0].result.tokens == fx.alone[0]);
}

TEST_CASE("a full context ends requests with context_full and nothing is written past it") {
  fixture fx;
  for (const int ctx : {20, 33, 57}) {
    CAPTURE(ctx);
    fault_engine eng(fx.weights, ctx, requests);
    medusa::decode_options opt;
    opt.max_new_tokens = 1000;
    medusa::batch_decoder dec(eng, fx.heads, fx.tree, medusa::greedy_policy{}, requests);
    for (int i = 0; i < requests; ++i) dec.join(i, prompt_of(i), opt);
    auto done = drain(dec);
    REQUIRE(done.size() == requests);
    for (int i = 0; i < requests; ++i) {
      CAPTURE(i);
      const medusa::decode_result& r = done[i].result;
      CHECK(done[i].reason == medusa::stop_reason::context_full);
      // Every slot is used: the prompt, then one token per slot, the last one emitted unrun.
      CHECK(static_cast<int>(prompt_of(i).size() + r.tokens.size()) == ctx + 1);
      CHECK(r.cache_length == ctx);
      CHECK(eng.guard_intact(i));
      // Lossless up to the last slot.
      medusa::decode_options plain = opt;
      plain.max_new_tokens = static_cast<int>(r.tokens.size());
      tiny_model big(ctx + 8);
      CHECK(medusa::generate_vanilla(big, prompt_of(i), medusa::greedy_policy{}, plain).tokens == r.tokens);
    }
  }
}
