// SPDX-License-Identifier: Apache-2.0
// `medusa::cuda::device_step` under the emulated executor, around a toy engine whose forward
// reads the KV cache: every token equals plain greedy decoding of the toy (computed on the host),
// with heads that know the toy and with heads that do not, near the end of the context (smaller
// trees, then plain steps, mixed in one batch), at EOS, at a callback's stop, when one request's
// logits turn NaN; and bad arguments are refused before anything runs.
#include <doctest/doctest.h>
#include <medusa/cuda/device_step.hpp>
#include <medusa/cuda/emulated_executor.hpp>
#include <medusa/tree.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

namespace mc = medusa::cuda;
namespace mk = medusa::cuda::kernels;

namespace {

using step_t = mc::device_step<mc::emulated_executor, float>;

constexpr int vocab = 48;
constexpr int head_dim = 4;  // K rows hold [token, 0, 0, 0]

// The toy: the token after t (at position p, preceded by `prev`) is (5t + 3 + s·prev) mod V.
// With s = 0 it is a Markov chain the oracle heads below know; with s = 1 it needs the previous
// slot, which for a tree's root is the last committed slot of the cache.
struct toy_model {
  int s = 0;
  [[nodiscard]] std::int32_t next(std::int32_t t, std::int32_t prev) const { return (5 * t + 3 + s * prev) % vocab; }

  // Plain greedy decoding of `prompt` on the host: up to `n` tokens, at most up to slot `context`.
  [[nodiscard]] std::vector<std::int32_t> reference(const std::vector<std::int32_t>& prompt, int n, int context,
                                                    int eos = -1) const {
    std::vector<std::int32_t> seq = prompt, out;
    while (static_cast<int>(out.size()) < n) {
      const std::int32_t t = next(seq.back(), seq.size() > 1 ? seq[seq.size() - 2] : 0);
      if (t == eos) break;
      out.push_back(t);
      if (static_cast<int>(seq.size()) >= context) break;  // the token chosen at the last slot ends it
      seq.push_back(t);
    }
    return out;
  }
};

// A batch's cache (strided: one range of `capacity` slots per request, one layer, one KV head)
// and the toy forward over it. All of it is host memory, which is the emulated executor's.
struct toy_engine {
  toy_model model;
  int batch = 0, capacity = 0;
  std::vector<float> k, v;
  std::vector<std::int32_t> bases;
  int nan_request = -1, nan_after = 0;  // request whose logits turn NaN after that many passes
  int passes = 0;

  toy_engine(toy_model m, int b, int cap)
      : model(m), batch(b), capacity(cap), k(static_cast<std::size_t>(b * cap * head_dim), -1.0f),
        v(k.size(), 0.0f), bases(static_cast<std::size_t>(b)) {
    for (int r = 0; r < b; ++r) bases[static_cast<std::size_t>(r)] = r * cap;
  }

  mk::batch_kv kv() {
    mk::batch_kv p{};
    p.k = k.data();
    p.v = v.data();
    p.element_bytes = 4;
    p.shape = {1, 1, head_dim};
    p.head_stride = head_dim;
    p.slot_stride = head_dim;
    p.layer_stride = static_cast<std::size_t>(batch * capacity * head_dim);
    p.slots_per_request = capacity;
    p.slot_bases = bases.data();
    return p;
  }
  float& slot(int b, int s) { return k[static_cast<std::size_t>((b * capacity + s) * head_dim)]; }

  // The prompt's K rows (what a prefill writes), the first token and the last row's hidden state.
  void prefill(int b, const std::vector<std::int32_t>& prompt, std::vector<std::int32_t>& first,
               std::vector<float>& hidden, int dim) {
    for (std::size_t i = 0; i < prompt.size(); ++i) slot(b, static_cast<int>(i)) = static_cast<float>(prompt[i]);
    const std::int32_t last = prompt.back(), prev = prompt.size() > 1 ? prompt[prompt.size() - 2] : 0;
    first.push_back(model.next(last, prev));
    for (int c = 0; c < dim; ++c) hidden.push_back(c == last ? 1.0f : 0.0f);
  }

  // Row (b, i) of the pass: writes its token's K row at slot L_b + i, reads its predecessor (the
  // parent's row of the pass, or the cache's slot L_b - 1 for the first row), checks its position,
  // and writes one-hot logits of the toy's next token and the one-hot hidden state of its token.
  void forward(const mc::step_pass& p) {
    ++passes;
    const int N = p.rows_per_request;
    for (int b = 0; b < p.batch; ++b) {
      const int L = p.cache_lengths[b];
      for (int i = 0; i < N; ++i) {
        const int row = p.qo_indptr[b] + i;
        const std::int32_t t = p.tokens[row];
        if (L + i < capacity) slot(b, L + i) = static_cast<float>(t);
        int parent = -1;  // the deepest ancestor: the largest index below i in the mask row
        for (int j = i - 1; j >= 0 && p.tree_mask != nullptr && parent < 0; --j)
          if ((p.tree_mask[i * p.words_per_row + j / 32] >> (j % 32)) & 1u) parent = j;
        const int prev_slot = parent >= 0 ? L + parent : L - 1;
        const bool in_cache = prev_slot >= 0 && prev_slot < capacity;
        const auto prev = static_cast<std::int32_t>(in_cache ? slot(b, prev_slot) : 0.0f);
        const int depth = parent < 0 ? 0 : p.positions[p.qo_indptr[b] + parent] - L + 1;
        const bool position_ok = p.positions[row] == L + depth;
        float* logits = p.logits + static_cast<std::size_t>(row) * vocab;
        const std::int32_t n = model.next(t, prev);
        const bool poisoned = b == nan_request && passes > nan_after;
        for (int c = 0; c < vocab; ++c)
          logits[c] = !position_ok || poisoned ? std::numeric_limits<float>::quiet_NaN() : c == n ? 1.0f : 0.0f;
        if (p.hidden != nullptr)
          for (int c = 0; c < vocab; ++c) p.hidden[static_cast<std::size_t>(row) * vocab + static_cast<std::size_t>(c)] = c == t;
      }
    }
  }
};

// Heads that know the s = 0 toy: on the one-hot state of token t (the last accepted), head h
// proposes next^(h+2)(t) first (identity ResBlocks: W = 0, b = 0).
struct oracle_heads {
  int heads;
  std::vector<float> zeros_w, zeros_b;
  std::vector<std::vector<float>> proj;
  medusa::head_stack<> stack;
  explicit oracle_heads(int h)
      : heads(h), zeros_w(vocab * vocab, 0.0f), zeros_b(vocab, 0.0f),
        stack(vocab, vocab, static_cast<std::size_t>(h), 1, medusa::projection_kind::per_head) {
    const toy_model m{};
    for (int k = 0; k < h; ++k) {
      auto& u = proj.emplace_back(static_cast<std::size_t>(vocab * vocab), 0.0f);
      for (int t = 0; t < vocab; ++t) {
        std::int32_t x = t;
        for (int s = 0; s < k + 2; ++s) x = m.next(x, 0);
        u[static_cast<std::size_t>(x * vocab + t)] = 1.0f;
        u[static_cast<std::size_t>(((x + 1) % vocab) * vocab + t)] = 0.5f;  // a second choice, for rank 1
      }
      stack.set_resblock(static_cast<std::size_t>(k), 0, medusa::weight_ptr::of(zeros_w.data()),
                         medusa::weight_ptr::of(zeros_b.data()));
      stack.set_projection(static_cast<std::size_t>(k), medusa::weight_ptr::of(u.data()));
    }
  }
};

std::vector<std::vector<std::int32_t>> prompts(int B) {
  std::vector<std::vector<std::int32_t>> out;
  for (int b = 0; b < B; ++b) {
    std::vector<std::int32_t> p;
    for (int i = 0; i < 3 + 2 * b; ++i) p.push_back(static_cast<std::int32_t>((7 * b + 11 * i + 1) % vocab));
    out.push_back(p);
  }
  return out;
}

struct run_result {
  std::vector<mc::device_request_result> results;
  mc::device_step_stats stats;
};

// Prefill + generate of `ps` on a fresh toy engine.
template <class OnToken = mc::keep_decoding>
run_result run(step_t& step, toy_engine& eng, const std::vector<std::vector<std::int32_t>>& ps,
               mc::device_decode_options opt, OnToken on_token = {}) {
  std::vector<std::int32_t> first;
  std::vector<float> hidden;
  std::vector<int> lengths;
  for (int b = 0; b < static_cast<int>(ps.size()); ++b) {
    eng.prefill(b, ps[static_cast<std::size_t>(b)], first, hidden, step.medusa() ? vocab : 0);
    lengths.push_back(static_cast<int>(ps[static_cast<std::size_t>(b)].size()));
  }
  run_result r;
  r.results = step.generate({first, lengths, hidden}, eng.kv(), opt, [&](const mc::step_pass& p) { eng.forward(p); },
                            on_token);
  r.stats = step.stats();
  return r;
}

}  // namespace

TEST_CASE("plain device decoding equals the host's greedy decoding of the toy") {
  mc::emulated_executor ex;
  step_t step(ex, vocab);
  const toy_model model{.s = 1};
  toy_engine eng(model, 3, 64);
  const auto ps = prompts(3);
  const auto r = run(step, eng, ps, {.max_new_tokens = 20, .max_context = 64});
  for (int b = 0; b < 3; ++b) {
    CHECK(r.results[static_cast<std::size_t>(b)].tokens == model.reference(ps[static_cast<std::size_t>(b)], 20, 64));
    CHECK(r.results[static_cast<std::size_t>(b)].stop == medusa::stop_reason::max_tokens);
  }
  CHECK(r.stats.steps == 19);  // the first token comes from the prefill
}

TEST_CASE("Medusa device decoding equals plain greedy decoding, with heads that know the model and without") {
  const auto tree = medusa::tree::preset("mc_sim_7b_63");
  oracle_heads heads(tree.depth());
  mc::emulated_executor ex;
  step_t step(ex, tree, heads.stack);
  const auto ps = prompts(3);
  for (const int s : {0, 1}) {
    CAPTURE(s);
    const toy_model model{.s = s};
    toy_engine eng(model, 3, 128);
    const auto r = run(step, eng, ps, {.max_new_tokens = 40, .max_context = 128});
    long long tree_steps = 0, accepted = 0;
    for (std::size_t a = 0; a < r.stats.accepted.size(); ++a) {
      tree_steps += r.stats.accepted[a];
      accepted += r.stats.accepted[a] * static_cast<long long>(a);
    }
    for (int b = 0; b < 3; ++b) {
      const auto& got = r.results[static_cast<std::size_t>(b)];
      CHECK(got.tokens == model.reference(ps[static_cast<std::size_t>(b)], 40, 128));
      CHECK(got.stop == medusa::stop_reason::max_tokens);
      CHECK(got.error.empty());
    }
    if (s == 0) {
      CHECK(accepted == tree_steps * tree.depth());  // the heads know the chain: every draft accepted
    } else {
      CHECK(accepted < tree_steps * tree.depth());
    }
    CHECK(r.stats.by_size.front() == tree_steps);  // the whole tree fits all along
  }
}

TEST_CASE("near the context's end a request takes smaller trees, then plain steps, and uses every slot") {
  const auto tree = medusa::tree::preset("mc_sim_7b_63");
  oracle_heads heads(tree.depth());
  mc::emulated_executor ex;
  step_t step(ex, tree, heads.stack);
  const std::vector<int> sizes = step.step_sizes();
  REQUIRE(sizes.size() == static_cast<std::size_t>(tree.depth()) + 1);
  CHECK(sizes.front() == tree.num_nodes());
  CHECK(sizes.back() == 1);
  const auto ps = prompts(4);  // prompts of 3, 5, 7 and 9 tokens: their steps shrink at different rounds
  for (const int s : {0, 1}) {
    CAPTURE(s);
    const toy_model model{.s = s};
    const int context = 80;
    toy_engine eng(model, 4, 96);  // the cache holds more than the context: rows past it are written, not committed
    const auto r = run(step, eng, ps, {.max_new_tokens = 500, .max_context = context});
    for (int b = 0; b < 4; ++b) {
      const auto& p = ps[static_cast<std::size_t>(b)];
      const auto& got = r.results[static_cast<std::size_t>(b)];
      CHECK(got.tokens == model.reference(p, 500, context));
      CHECK(got.tokens.size() == static_cast<std::size_t>(context) - p.size() + 1);  // every slot, and the last choice
      CHECK(got.stop == medusa::stop_reason::context_full);
    }
    if (s == 1) {  // one token a step: every size serves some step on the way to the end
      for (std::size_t j = 1; j < r.stats.by_size.size(); ++j) {
        CAPTURE(j);
        CHECK(r.stats.by_size[j] > 0);
      }
    }
  }
}

TEST_CASE("EOS ends a request unemitted, a callback ends it after the token, the others go on") {
  const auto tree = medusa::tree::preset("mc_sim_7b_63");
  oracle_heads heads(tree.depth());
  mc::emulated_executor ex;
  step_t medusa_step(ex, tree, heads.stack), plain_step(ex, vocab);
  const toy_model model{.s = 0};
  const auto ps = prompts(2);
  const auto full = model.reference(ps[0], 30, 128);
  const std::int32_t eos = full[9];
  for (step_t* step : {&medusa_step, &plain_step}) {
    CAPTURE(step->medusa());
    toy_engine eng(model, 2, 128);
    const auto r = run(*step, eng, ps, {.max_new_tokens = 30, .max_context = 128, .eos_token = eos});
    for (int b = 0; b < 2; ++b) {
      const auto want = model.reference(ps[static_cast<std::size_t>(b)], 30, 128, eos);
      CHECK(r.results[static_cast<std::size_t>(b)].tokens == want);
      CHECK(r.results[static_cast<std::size_t>(b)].stop ==
            (want.size() < 30 ? medusa::stop_reason::eos : medusa::stop_reason::max_tokens));
    }
    CHECK(r.results[0].stop == medusa::stop_reason::eos);

    toy_engine eng2(model, 2, 128);
    const std::int32_t stop = full[4];
    const auto c = run(*step, eng2, ps, {.max_new_tokens = 30, .max_context = 128},
                       [&](int request, std::int32_t token) { return !(request == 0 && token == stop); });
    auto want = full;
    want.resize(static_cast<std::size_t>(std::find(full.begin(), full.end(), stop) - full.begin()) + 1);
    CHECK(c.results[0].tokens == want);
    CHECK(c.results[0].stop == medusa::stop_reason::callback);
    CHECK(c.results[1].tokens == model.reference(ps[1], 30, 128));
  }
}

TEST_CASE("a request whose logits turn NaN fails alone, naming its status") {
  const auto tree = medusa::tree::preset("mc_sim_7b_63");
  oracle_heads heads(tree.depth());
  mc::emulated_executor ex;
  step_t step(ex, tree, heads.stack);
  const toy_model model{.s = 1};
  toy_engine eng(model, 3, 128);
  eng.nan_request = 1;
  eng.nan_after = 8;  // the warm-up runs, then a few steps
  const auto ps = prompts(3);
  const auto r = run(step, eng, ps, {.max_new_tokens = 30, .max_context = 128});
  CHECK(r.results[1].stop == medusa::stop_reason::failed);
  CHECK(r.results[1].error.find("request 1") != std::string::npos);
  CHECK(r.results[1].error.find("non_finite_logit") != std::string::npos);
  const auto want1 = model.reference(ps[1], 30, 128);
  CHECK(std::equal(r.results[1].tokens.begin(), r.results[1].tokens.end(), want1.begin()));  // a prefix of it
  for (const int b : {0, 2}) CHECK(r.results[static_cast<std::size_t>(b)].tokens == model.reference(ps[static_cast<std::size_t>(b)], 30, 128));
}

TEST_CASE("bad arguments are refused before anything runs") {
  const auto tree = medusa::tree::preset("mc_sim_7b_63");
  oracle_heads heads(tree.depth());
  mc::emulated_executor ex;
  oracle_heads two(2);
  CHECK_THROWS_WITH_AS(step_t(ex, tree, two.stack), doctest::Contains("needs 4 heads"), medusa::invalid_input);
  CHECK_THROWS_AS(step_t(ex, 0), medusa::invalid_input);

  step_t step(ex, tree, heads.stack);
  toy_engine eng(toy_model{}, 2, 64);
  auto forward = [&](const mc::step_pass& p) { eng.forward(p); };
  const std::vector<std::int32_t> first{1, 2};
  const std::vector<int> lengths{3, 3};
  const std::vector<float> hidden(2 * vocab, 0.0f);
  const mc::device_decode_options ok{.max_new_tokens = 8, .max_context = 64};
  const long long launches = ex.launches();
  CHECK_THROWS_WITH_AS(step.generate({{}, {}, {}}, eng.kv(), ok, forward), doctest::Contains("empty batch"),
                       medusa::invalid_input);
  CHECK_THROWS_WITH_AS(step.generate({first, std::span<const int>(lengths).first(1), hidden}, eng.kv(), ok, forward),
                       doctest::Contains("1 lengths for 2 requests"), medusa::invalid_input);
  CHECK_THROWS_WITH_AS(step.generate({first, lengths, std::span<const float>(hidden).first(vocab)}, eng.kv(), ok, forward),
                       doctest::Contains("hidden values"), medusa::invalid_input);
  CHECK_THROWS_WITH_AS(step.generate({first, lengths, hidden}, eng.kv(), {.max_new_tokens = 8, .max_context = 65}, forward),
                       doctest::Contains("a context of 65 slots for a cache of 64"), medusa::invalid_input);
  CHECK_THROWS_WITH_AS(step.generate({first, lengths, hidden}, eng.kv(), {.max_new_tokens = 0, .max_context = 64}, forward),
                       doctest::Contains("max_new_tokens"), medusa::invalid_input);
  const std::vector<std::int32_t> bad_first{1, vocab};
  CHECK_THROWS_WITH_AS(step.generate({bad_first, lengths, hidden}, eng.kv(), ok, forward),
                       doctest::Contains("outside the vocabulary"), medusa::invalid_input);
  const std::vector<int> long_prompt{3, 65};
  CHECK_THROWS_WITH_AS(step.generate({first, long_prompt, hidden}, eng.kv(), ok, forward),
                       doctest::Contains("request 1 has 65 committed slots"), medusa::invalid_input);
  CHECK(ex.launches() == launches);
  CHECK(eng.passes == 0);
}
