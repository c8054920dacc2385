// SPDX-License-Identifier: Apache-2.0
// The GPU engine's code run on the host: the same forward pass, paged cache, commit and
// device-side Medusa step as on a device, with its kernel bodies under the kernel emulation and
// plain float GEMMs in place of cuBLAS (src/cuda/host_executor.hpp). Checked against the CPU engine
// (logits, hidden states) and against itself (Medusa tokens equal plain greedy tokens, through the
// library's decoders and through the device step), on small random models with both RoPE styles
// and grouped-query heads, and on stories260K when ../shared is present.
#include <medusa_llama/llama.hpp>
#include <medusa_llama/load.hpp>

#include "../src/cuda/device_decoder.hpp"
#include "../src/cuda/engine_state.hpp"
#include "../src/cuda/host_executor.hpp"

#include <medusa/decoder.hpp>
#include <medusa/half.hpp>
#include <medusa/io.hpp>
#include <medusa/tree.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <span>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using namespace medusa_llama;
namespace cd = medusa_llama::cuda_detail;

namespace {

std::size_t sz(int v) { return static_cast<std::size_t>(v); }

// Under AddressSanitizer the emulated kernels run about 15 times slower: the same checks decode
// shorter sequences there.
constexpr bool sanitized = medusa::cuda::emulation_sanitized;
constexpr int tokens(int n) { return sanitized ? std::max(12, n / 3) : n; }

model small_model(rope_style rope, int kv_heads, std::uint64_t seed, bool shared_classifier = true, int hidden_dim = 96) {
  model_config c;
  c.dim = 64;
  c.hidden_dim = hidden_dim;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = kv_heads;
  c.vocab_size = 97;
  c.seq_len = 160;
  c.rope = rope;
  c.shared_classifier = shared_classifier;
  return model::random(c, seed, 0.25f);
}

cd::engine_limits limits(int max_context = 160, int max_tokens = 48) {
  return {.max_requests = 4, .max_context = max_context, .max_tokens = max_tokens, .page_size = 8,
          .num_pages = 4 * 20, .kv_split = 32};
}

// Every element within `tol` of the largest |want| (logits and hidden states are compared at
// their own scale: a relative test per element would fail on values near 0).
void check_close(std::span<const float> got, std::span<const float> want, float tol, const char* what) {
  REQUIRE(got.size() == want.size());
  float scale = 0.0f, worst = 0.0f;
  for (float w : want) scale = std::max(scale, std::fabs(w));
  for (std::size_t i = 0; i < got.size(); ++i) {
    const float e = std::fabs(got[i] - want[i]);
    if (!(e <= tol * scale)) FAIL(what << " element " << i << ": got " << got[i] << ", want " << want[i] << " (scale " << scale << ")");
    worst = std::max(worst, e);
  }
  MESSAGE(what << ": largest difference " << worst / scale << " of the scale " << scale);
}

std::vector<std::int32_t> random_tokens(std::mt19937& rng, int n, int vocab) {
  std::vector<std::int32_t> t(sz(n));
  for (auto& x : t) x = std::uniform_int_distribution<int>(0, vocab - 1)(rng);
  return t;
}

// One ragged forward on both engines (all rows), compared.
template <class Gpu>
void same_forward(Gpu& gpu, batch_engine& cpu, const medusa::ragged_batch& shape, float tol) {
  const model_config& c = cpu.config();
  const std::size_t rows = shape.last_row_only ? shape.requests.size() : shape.tokens.size();
  std::vector<float> lg(rows * sz(c.vocab_size)), hg(rows * sz(c.dim)), lc(lg.size()), hc(hg.size());
  medusa::ragged_batch b = shape;
  b.logits = lg;
  b.hidden = hg;
  gpu.forward(b);
  b.logits = lc;
  b.hidden = hc;
  cpu.forward(b);
  check_close(lg, lc, tol, "logits");
  check_close(hg, hc, tol, "hidden");
}

// Packed ancestor masks of a random tree of n nodes.
std::vector<std::uint32_t> random_tree_mask(std::mt19937& rng, int n, int& wpr) {
  wpr = (n + 31) / 32;
  std::vector<int> parent(sz(n), -1);
  for (int i = 1; i < n; ++i) parent[sz(i)] = std::uniform_int_distribution<int>(0, i - 1)(rng);
  std::vector<std::uint32_t> w(sz(n * wpr), 0u);
  for (int i = 0; i < n; ++i)
    for (int u = i; u >= 0; u = parent[sz(u)]) w[sz(i * wpr + u / 32)] |= 1u << (u % 32);
  return w;
}

template <class T>
void check_against_cpu(const model& m, float tol, bool skinny_gemm = false) {
  std::mt19937 rng(5);
  cd::host_executor ex(skinny_gemm);
  cd::engine_state<cd::host_executor, T> gpu(ex, m, limits());
  // The CPU engine with the same weight rounding (its activations stay float).
  const weight_format w = std::is_same_v<T, float> ? weight_format::f32 : weight_format::bf16;
  batch_engine cpu(m, {.page_size = 8, .max_requests = 4, .max_context = 160, .max_tokens = 48, .threads = 1, .weights = w});
  gpu.reserve(0, 40);
  gpu.reserve(2, 70);
  cpu.reserve(0, 40);
  cpu.reserve(2, 70);
  const int V = m.config().vocab_size;
  // Prefill: 23 and 55 tokens (more than a pass holds: cut into passes), every row's outputs.
  auto t0 = random_tokens(rng, 23, V), t2 = random_tokens(rng, 55, V);
  std::vector<std::int32_t> tokens(t0), positions;
  tokens.insert(tokens.end(), t2.begin(), t2.end());
  for (int i = 0; i < 23; ++i) positions.push_back(i);
  for (int i = 0; i < 55; ++i) positions.push_back(i);
  const int requests[] = {0, 2}, indptr[] = {0, 23, 78}, lengths0[] = {0, 0};
  medusa::ragged_batch b;
  b.requests = requests;
  b.qo_indptr = indptr;
  b.tokens = tokens;
  b.positions = positions;
  b.cache_lengths = lengths0;
  same_forward(gpu, cpu, b, tol);
  // A tree step: each request its own tree (7 and 12 nodes), positions L + depth.
  int w0 = 0, w2 = 0;
  const auto m0 = random_tree_mask(rng, 7, w0), m2 = random_tree_mask(rng, 12, w2);
  const medusa::tree_mask_view masks[] = {{m0, w0}, {m2, w2}};
  auto s0 = random_tokens(rng, 7, V), s2 = random_tokens(rng, 12, V);
  std::vector<std::int32_t> st(s0), sp;
  st.insert(st.end(), s2.begin(), s2.end());
  const auto depth = [](std::span<const std::uint32_t> w, int wpr, int i) {
    int d = -1;
    for (int j = 0; j <= i; ++j) d += (w[sz(i * wpr + j / 32)] >> (j % 32)) & 1u;
    return d;
  };
  for (int i = 0; i < 7; ++i) sp.push_back(23 + depth(m0, w0, i));
  for (int i = 0; i < 12; ++i) sp.push_back(55 + depth(m2, w2, i));
  const int tindptr[] = {0, 7, 19}, tlengths[] = {23, 55};
  medusa::ragged_batch tb;
  tb.requests = requests;
  tb.qo_indptr = tindptr;
  tb.tokens = st;
  tb.positions = sp;
  tb.cache_lengths = tlengths;
  tb.request_masks = masks;
  same_forward(gpu, cpu, tb, tol);
  // Last rows only (a prefill's form), after a decode token each.
  const int dindptr[] = {0, 1, 2}, dlengths[] = {30, 62};
  const std::int32_t dtok[] = {5, 9}, dpos[] = {30, 62};
  medusa::ragged_batch db;
  db.requests = requests;
  db.qo_indptr = dindptr;
  db.tokens = dtok;
  db.positions = dpos;
  db.cache_lengths = dlengths;
  db.last_row_only = true;
  same_forward(gpu, cpu, db, tol);
}

// Greedy decoding of `prompts` through the library's batch decoder over `model`.
template <class Model, class Heads, class Tree>
std::vector<std::vector<std::int32_t>> library_decode(Model& model, Heads& heads, const Tree& tree,
                                                      const std::vector<std::vector<std::int32_t>>& prompts, int n) {
  medusa::batch_decoder dec(model, heads, tree, medusa::greedy_policy{}, static_cast<int>(prompts.size()));
  for (std::size_t r = 0; r < prompts.size(); ++r) dec.join(static_cast<int>(r), prompts[r], {.max_new_tokens = n});
  std::vector<std::vector<std::int32_t>> out(prompts.size());
  std::size_t done = 0;
  while (done < prompts.size())
    for (medusa::request_update& u : dec.step())
      if (u.finished) {
        if (u.error) std::rethrow_exception(u.error);
        out[sz(u.request)] = u.result.tokens;
        ++done;
      }
  return out;
}

std::vector<std::vector<std::int32_t>> tokens_of(const std::vector<medusa::cuda::device_request_result>& r) {
  std::vector<std::vector<std::int32_t>> out;
  for (const auto& x : r) out.push_back(x.tokens);
  return out;
}

}  // namespace

TEST_CASE("the GPU engine's forward equals the CPU engine's: ragged prefill in passes, per-request trees, last rows") {
  SUBCASE("adjacent-pair RoPE, grouped-query heads, tied classifier") {
    check_against_cpu<float>(small_model(rope_style::adjacent_pairs, 2, 1), 2e-5f);
  }
  SUBCASE("split-half RoPE, one KV head per query head, separate classifier") {
    check_against_cpu<float>(small_model(rope_style::split_halves, 4, 2, false), 2e-5f);
  }
  SUBCASE("bf16 weights and activations: within bf16 rounding") {
    check_against_cpu<medusa::bfloat16>(small_model(rope_style::adjacent_pairs, 2, 3), 3e-2f);
  }
  SUBCASE("bf16 through the library's skinny GEMM: within bf16 rounding") {
    // A hidden size that is not a multiple of 8: the SwiGLU GEMM's last group of W1/W3 rows is padded.
    check_against_cpu<medusa::bfloat16>(small_model(rope_style::adjacent_pairs, 2, 3, true, 92), 3e-2f,
                                        /*skinny_gemm*/ true);
  }
}

TEST_CASE_TEMPLATE("Medusa through the library's decoder over the GPU engine equals its plain decoding", T, float,
                   medusa::half, medusa::bfloat16) {
  const model m = small_model(rope_style::adjacent_pairs, 2, 11);
  const medusa::head_weights hw = random_heads(m, 3, 7);
  const auto stack = hw.view();
  medusa::portable_gemm gemm;
  medusa::head_stack_runner heads(stack, gemm);
  std::mt19937 rng(9);
  const std::vector<std::vector<std::int32_t>> prompts = {random_tokens(rng, 9, 97), random_tokens(rng, 17, 97),
                                                          random_tokens(rng, 4, 97)};
  cd::host_executor ex;
  cd::engine_state<cd::host_executor, T> gpu(ex, m, limits());
  medusa::no_heads none;
  const auto plain = library_decode(gpu, none, medusa::plain_tree{}, prompts, tokens(40));
  const auto tree = medusa::tree::from_text("[[0],[0,0],[1],[0,1],[0,0,0]]");
  const auto med = library_decode(gpu, heads, tree, prompts, tokens(40));
  CHECK(med == plain);
  if constexpr (std::is_same_v<T, float>) {
    // and the tokens are the CPU engine's
    batch_engine cpu(m, {.page_size = 8, .max_requests = 4, .max_context = 160, .max_tokens = 48, .threads = 1});
    CHECK(library_decode(cpu, none, medusa::plain_tree{}, prompts, tokens(40)) == plain);
  }
}

TEST_CASE_TEMPLATE("the device-side step (the graph's sequence) decodes exactly as plain decoding", T, float,
                   medusa::bfloat16) {
  const model m = small_model(rope_style::split_halves, 2, 21);
  const medusa::head_weights hw = random_heads(m, 4, 5);
  const auto stack = hw.view();
  std::mt19937 rng(3);
  const std::vector<std::vector<std::int32_t>> prompts = {random_tokens(rng, 12, 97), random_tokens(rng, 5, 97),
                                                          random_tokens(rng, 20, 97)};
  cd::host_executor ex;
  cd::engine_state<cd::host_executor, T> gpu(ex, m, limits(160, 3 * 64));
  cd::device_decoder<cd::host_executor, T> plain(gpu, nullptr, nullptr);
  const auto p = plain.generate(prompts, tokens(32), /*eos*/ -1);
  for (const auto& r : p) {
    CHECK(static_cast<int>(r.tokens.size()) == tokens(32));
    CHECK(r.stop == medusa::stop_reason::max_tokens);
  }
  const auto tree = medusa::tree::preset("mc_sim_7b_63");
  // the preset is 4 deep: 4 heads
  cd::device_decoder<cd::host_executor, T> med(gpu, &tree, &stack);
  const auto r = med.generate(prompts, tokens(32), -1);
  CHECK(tokens_of(r) == tokens_of(p));
  // The library's own decoder on the same engine agrees.
  medusa::no_heads none;
  CHECK(library_decode(gpu, none, medusa::plain_tree{}, prompts, tokens(32)) == tokens_of(p));
  // Steps: random heads rarely guess right, but each step commits at least its root.
  CHECK(med.stats().step.steps >= 1);
  CHECK(med.stats().step.steps <= plain.stats().step.steps);
  // The drafts were accepted often enough that long paths were committed.
  REQUIRE(med.stats().step.accepted.size() == 5);
  CHECK(med.stats().step.accepted[2] + med.stats().step.accepted[3] + med.stats().step.accepted[4] > 0);
}

TEST_CASE("through the library's skinny GEMM (bf16) the device-side step decodes exactly as plain decoding") {
  using T = medusa::bfloat16;
  const model m = small_model(rope_style::split_halves, 2, 22);
  const medusa::head_weights hw = random_heads(m, 4, 5);
  const auto stack = hw.view();
  std::mt19937 rng(8);
  const std::vector<std::vector<std::int32_t>> prompts = {random_tokens(rng, 12, 97), random_tokens(rng, 5, 97),
                                                          random_tokens(rng, 20, 97)};
  cd::host_executor ex(/*skinny_gemm*/ true);
  cd::engine_state<cd::host_executor, T> gpu(ex, m, limits(160, 3 * 8));
  cd::device_decoder<cd::host_executor, T> plain(gpu, nullptr, nullptr);
  const auto p = plain.generate(prompts, tokens(24), /*eos*/ -1);
  // A small tree (the emulated GEMM costs about a millisecond a launch): 4 deep, 8 nodes.
  const auto tree = medusa::tree::from_text("[[0],[0,0],[1],[0,1],[0,0,0],[0,0,0,0],[2]]");
  cd::device_decoder<cd::host_executor, T> med(gpu, &tree, &stack);
  const auto r = med.generate(prompts, tokens(24), -1);
  CHECK(tokens_of(r) == tokens_of(p));
  for (const auto& x : r) CHECK(static_cast<int>(x.tokens.size()) == tokens(24));
  REQUIRE(med.stats().step.accepted.size() == 5);
  CHECK(med.stats().step.accepted[1] + med.stats().step.accepted[2] + med.stats().step.accepted[3] > 0);
}

TEST_CASE("the device-side step stops at EOS and at the end of the context like plain decoding") {
  const model m = small_model(rope_style::adjacent_pairs, 2, 31);
  const medusa::head_weights hw = random_heads(m, 2, 6);
  const auto stack = hw.view();
  std::mt19937 rng(4);
  const std::vector<std::vector<std::int32_t>> prompts = {random_tokens(rng, 6, 97), random_tokens(rng, 8, 97)};
  cd::host_executor ex;
  cd::engine_state<cd::host_executor, float> gpu(ex, m, limits(48));
  cd::device_decoder<cd::host_executor, float> plain(gpu, nullptr, nullptr);
  const auto p = plain.generate(prompts, 100, -1);
  // The context (48) ends both requests before 100 tokens.
  for (const auto& r : p) CHECK(r.stop == medusa::stop_reason::context_full);
  // An EOS: the 5th token of request 0's plain output (or an earlier copy of it).
  const std::int32_t eos = p[0].tokens.at(4);
  const auto first_eos = std::find(p[0].tokens.begin(), p[0].tokens.end(), eos);
  const auto pe = plain.generate(prompts, 100, eos);
  CHECK(pe[0].stop == medusa::stop_reason::eos);
  CHECK(pe[0].tokens == std::vector<std::int32_t>(p[0].tokens.begin(), first_eos));
  const auto tree = medusa::tree::from_text("[[0],[1],[0,0]]");
  cd::device_decoder<cd::host_executor, float> med(gpu, &tree, &stack);
  const auto me = med.generate(prompts, 100, eos);
  CHECK(me[0].stop == medusa::stop_reason::eos);
  CHECK(me[0].tokens == pe[0].tokens);
  // Near the context's end Medusa takes plain steps: the same tokens, to the last slot.
  const auto mc = med.generate(prompts, 100, -1);
  for (std::size_t b = 0; b < prompts.size(); ++b) {
    CHECK(mc[b].stop == medusa::stop_reason::context_full);
    CHECK(mc[b].tokens == p[b].tokens);
  }
}

TEST_CASE("near the end of the context the device step decodes exactly as plain decoding, to the last slot") {
  const model m = small_model(rope_style::split_halves, 2, 61);
  const medusa::head_weights hw = random_heads(m, 4, 8);
  const auto stack = hw.view();
  std::mt19937 rng(6);
  // Prompts of 5 and 11 tokens in a context of 72: where the 64-node tree no longer fits, smaller
  // trees, then plain steps.
  const int context = 72;
  const std::vector<std::vector<std::int32_t>> prompts = {random_tokens(rng, 5, 97), random_tokens(rng, 11, 97)};
  cd::host_executor ex;
  cd::engine_state<cd::host_executor, float> gpu(ex, m, limits(context, 2 * 64));
  // The reference: the library's plain greedy decoder on the same engine; every slot is used, and
  // the token chosen at the last one is emitted too.
  medusa::no_heads none;
  const auto want = library_decode(gpu, none, medusa::plain_tree{}, prompts, 100);
  for (std::size_t b = 0; b < prompts.size(); ++b)
    REQUIRE(want[b].size() == sz(context) - prompts[b].size() + 1);
  cd::device_decoder<cd::host_executor, float> plain(gpu, nullptr, nullptr);
  const auto tree = medusa::tree::preset("mc_sim_7b_63");
  cd::device_decoder<cd::host_executor, float> med(gpu, &tree, &stack);
  for (auto* dec : {&plain, &med}) {
    CAPTURE(dec->medusa());
    const auto r = dec->generate(prompts, 100, -1);
    CHECK(tokens_of(r) == want);
    for (const auto& x : r) CHECK(x.stop == medusa::stop_reason::context_full);
    // max_new_tokens reached exactly at the last slot: a length stop, not the context's
    const auto exact = dec->generate(std::span(prompts).first(1), static_cast<int>(want[0].size()), -1);
    CHECK(exact[0].tokens == want[0]);
    CHECK(exact[0].stop == medusa::stop_reason::max_tokens);
  }
  // Whole trees ran, then every smaller size, then plain steps.
  REQUIRE(med.stats().step.accepted.size() == 5);
  long long tree_steps = 0;
  for (long long n : med.stats().step.accepted) tree_steps += n;
  CHECK(tree_steps > 0);
  REQUIRE(med.stats().step.by_size.size() == 5);
  for (const long long n : med.stats().step.by_size) CHECK(n > 0);
}

TEST_CASE("the GPU engine refuses bad batches and bad commits before touching the cache") {
  const model m = small_model(rope_style::adjacent_pairs, 2, 41);
  cd::host_executor ex;
  cd::engine_state<cd::host_executor, float> gpu(ex, m, limits());
  gpu.reserve(1, 16);
  const std::int32_t tok[] = {3, 4};
  const std::int32_t pos[] = {0, 1};
  const int req[] = {1}, indptr[] = {0, 2}, len[] = {15};
  medusa::ragged_batch b;
  b.requests = req;
  b.qo_indptr = indptr;
  b.tokens = tok;
  b.positions = pos;
  b.cache_lengths = len;  // slots [15, 17): 16 are mapped
  CHECK_THROWS_WITH_AS(gpu.forward(b), doctest::Contains("not all mapped"), engine_error);
  const int bad_req[] = {9};
  b.requests = bad_req;
  CHECK_THROWS_AS(gpu.forward(b), engine_error);
  const int path[] = {0, 1};
  CHECK_THROWS_AS(gpu.commit(1, 0, 1, path), engine_error);  // 2 rows from a 1-node tree
  CHECK_THROWS_AS(gpu.commit(7, 0, 4, path), engine_error);  // no such request
}

TEST_CASE("stories260K on the emulated GPU engine: greedy tokens equal the CPU engine's, Medusa equals plain") {
  const fs::path dir = fs::path(MEDUSA_SHARED_DIR) / "models" / "stories260K";
  if (!fs::exists(dir / "stories260K.bin")) {
    MESSAGE("skipped: " << (dir / "stories260K.bin").string() << " is absent");
    return;
  }
  const model m = model::load_llama2c(dir / "stories260K.bin");
  cd::host_executor ex;
  cd::engine_state<cd::host_executor, float> gpu(ex, m, {.max_requests = 2, .max_context = 256, .max_tokens = 64,
                                                         .page_size = 16, .num_pages = 32, .kv_split = 256});
  const std::vector<std::vector<std::int32_t>> prompts = {{1}, {1, 403, 407}};
  cd::device_decoder<cd::host_executor, float> plain(gpu, nullptr, nullptr);
  const auto p = plain.generate(prompts, tokens(100), -1);
  engine cpu(m);
  for (std::size_t b = 0; b < prompts.size(); ++b) {
    const auto r = medusa::generate_vanilla(cpu, prompts[b], medusa::greedy_policy{}, {.max_new_tokens = tokens(100)});
    CHECK(p[b].tokens == r.tokens);
  }
  // Medusa with random heads over a small tree: the same tokens.
  const auto tree = medusa::tree::from_text("[[0],[1],[0,0],[0,1],[0,0,0]]");
  const medusa::head_weights hw = random_heads(m, tree.depth(), 1);
  const auto stack = hw.view();
  cd::device_decoder<cd::host_executor, float> med(gpu, &tree, &stack);
  const auto r = med.generate(prompts, tokens(48), -1);
  for (std::size_t b = 0; b < prompts.size(); ++b)
    CHECK(r[b].tokens == std::vector<std::int32_t>(p[b].tokens.begin(), p[b].tokens.begin() + tokens(48)));
}

TEST_CASE("synthetic weights of a shape, made by the fill kernel: deterministic, finite, and lossless under Medusa") {
  model_config c = small_model(rope_style::adjacent_pairs, 2, 1).config();
  cd::host_executor ex;
  auto logits_of = [&](std::uint64_t seed) {
    cd::engine_state<cd::host_executor, medusa::bfloat16> gpu(ex, cd::device_weights<cd::host_executor, medusa::bfloat16>(ex, c, seed),
                                                              limits());
    gpu.reserve(0, 8);
    const std::int32_t tok[] = {1, 5, 9, 2}, pos[] = {0, 1, 2, 3};
    const int req[] = {0}, indptr[] = {0, 4}, len[] = {0};
    std::vector<float> logits(4 * sz(c.vocab_size));
    medusa::ragged_batch b;
    b.requests = req;
    b.qo_indptr = indptr;
    b.tokens = tok;
    b.positions = pos;
    b.cache_lengths = len;
    b.logits = logits;
    gpu.forward(b);
    return logits;
  };
  const auto a = logits_of(3), again = logits_of(3), other = logits_of(4);
  CHECK(a == again);
  CHECK(a != other);
  for (float x : a) REQUIRE(std::isfinite(x));
  cd::engine_state<cd::host_executor, medusa::bfloat16> gpu(ex, cd::device_weights<cd::host_executor, medusa::bfloat16>(ex, c, 5),
                                                            limits(160, 3 * 16));
  const medusa::head_weights hw = random_heads(model::random(c, 1), 3, 2);
  const auto stack = hw.view();
  const auto tree = medusa::tree::from_text("[[0],[1],[0,0],[0,0,0],[1,0]]");
  std::mt19937 rng(8);
  const std::vector<std::vector<std::int32_t>> prompts = {random_tokens(rng, 7, 97), random_tokens(rng, 3, 97)};
  cd::device_decoder<cd::host_executor, medusa::bfloat16> plain(gpu, nullptr, nullptr), med(gpu, &tree, &stack);
  CHECK(tokens_of(med.generate(prompts, tokens(24), -1)) == tokens_of(plain.generate(prompts, tokens(24), -1)));
}

TEST_CASE("step cost on the executor: a time for each size after the context, and the heads' time") {
  const model m = small_model(rope_style::adjacent_pairs, 2, 51);
  cd::host_executor ex;
  cd::engine_state<cd::host_executor, float> gpu(ex, m, limits());
  const int rows[] = {1, 4, 12};
  const auto t = gpu.measure_forward(rows, 40, 2);
  REQUIRE(t.size() == 3);
  for (double s : t) CHECK(s > 0.0);
  CHECK(gpu.pages().mapped_slots(0) == 0);  // the request's pages are given back
  const medusa::head_weights hw = random_heads(m, 2, 3);
  CHECK(gpu.measure_heads(hw.view(), 2) > 0.0);
  const int too_many[] = {1, 49};  // max_tokens is 48
  CHECK_THROWS_AS(gpu.measure_forward(too_many, 10, 1), engine_error);
}
