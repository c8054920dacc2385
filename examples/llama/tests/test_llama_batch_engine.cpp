// SPDX-License-Identifier: Apache-2.0
// The serving engine on a small random model built in memory: ragged causal and tree passes
// against the single-request engine run per request, lazy page mapping and release, argument
// validation, and batches cut into several passes by max_tokens.
#include <medusa_llama/llama.hpp>

#include <medusa/tree.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <set>
#include <string>
#include <vector>

using namespace medusa_llama;

namespace {

std::size_t sz(int v) { return static_cast<std::size_t>(v); }

// 2 layers, GQA (4 query heads, 2 KV heads of 16), vocabulary 97, context 96.
model small_model() {
  return model::random({.dim = 64, .hidden_dim = 96, .n_layers = 2, .n_heads = 4, .n_kv_heads = 2, .vocab_size = 97, .seq_len = 96},
                       11, 0.2f);
}

constexpr std::size_t V = 97, D = 64;

std::vector<int> random_tokens(int n, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<int> t(sz(n));
  for (auto& x : t) x = static_cast<int>(rng() % 97u);
  return t;
}

// Largest |a - b| over the largest |b|: a relative error of the whole set of rows.
double rel_diff(std::span<const float> a, std::span<const float> b) {
  REQUIRE(a.size() == b.size());
  double d = 0, scale = 1e-30;
  for (std::size_t i = 0; i < a.size(); ++i) {
    d = std::max(d, static_cast<double>(std::abs(a[i] - b[i])));
    scale = std::max(scale, static_cast<double>(std::abs(b[i])));
  }
  return d / scale;
}

// Requests appended one after another: the spans of a ragged batch.
struct ragged {
  std::vector<int> requests, indptr{0}, lengths, tokens, positions;

  void add(int request, int cache_length, std::span<const int> toks, std::span<const int> pos) {
    requests.push_back(request);
    lengths.push_back(cache_length);
    tokens.insert(tokens.end(), toks.begin(), toks.end());
    positions.insert(positions.end(), pos.begin(), pos.end());
    indptr.push_back(static_cast<int>(tokens.size()));
  }
  // A non-empty `mask` is every request's (the first n_b nodes of one tree); empty: causal.
  [[nodiscard]] medusa::ragged_batch batch(std::span<float> logits, std::span<float> hidden,
                                           medusa::tree_mask_view mask = {}, bool last_row_only = false) const {
    masks.assign(mask.empty() ? 0 : requests.size(), mask);
    return {.requests = requests, .qo_indptr = indptr, .tokens = tokens, .positions = positions, .cache_lengths = lengths,
            .request_masks = masks, .last_row_only = last_row_only, .logits = logits, .hidden = hidden};
  }
  mutable std::vector<medusa::tree_mask_view> masks;
};

std::vector<int> iota_from(int start, int n) {
  std::vector<int> v(sz(n));
  for (int i = 0; i < n; ++i) v[sz(i)] = start + i;
  return v;
}

// Positions of the first n nodes of `tree` after L committed slots.
std::vector<int> tree_positions(const medusa::tree& tree, int L, int n) {
  std::vector<int> p(sz(n));
  for (int i = 0; i < n; ++i) p[sz(i)] = L + tree.node_depth(i);
  return p;
}

// Accumulates the comparison of batched rows against reference rows.
struct agreement {
  double worst = 0;
  bool identical = true;
  void add(std::span<const float> got, std::span<const float> want) {
    worst = std::max(worst, rel_diff(got, want));
    identical = identical && std::equal(got.begin(), got.end(), want.begin(), want.end());
  }
  [[nodiscard]] std::string note() const { return identical ? " (bit-identical)" : " (not bit-identical)"; }
};

}  // namespace

TEST_CASE("ragged causal prefill and ragged tree pass equal the single engine run per request") {
  const model m = small_model();
  batch_engine be(m, {.page_size = 4, .max_requests = 6, .max_tokens = 64, .threads = 2});
  const medusa::tree tree = medusa::tree::from_text("[[0],[1],[0,0],[0,1]]");
  REQUIRE(tree.num_nodes() == 5);
  // Request ids out of order, prompts of different lengths, tree passes of different sizes
  // (one a plain step of the root alone).
  const int ids[] = {3, 0, 5};
  const int prompt_len[] = {11, 5, 17};
  const int tree_len[] = {5, 1, 3};
  std::vector<std::vector<int>> prompts, drafts;
  ragged prefill, step;
  for (int i = 0; i < 3; ++i) {
    prompts.push_back(random_tokens(prompt_len[i], 10u + static_cast<unsigned>(i)));
    drafts.push_back(random_tokens(tree_len[i], 20u + static_cast<unsigned>(i)));
    be.reserve(ids[i], prompt_len[i]);
    prefill.add(ids[i], 0, prompts.back(), iota_from(0, prompt_len[i]));
    step.add(ids[i], prompt_len[i], drafts.back(), tree_positions(tree, prompt_len[i], tree_len[i]));
  }
  std::vector<float> pl(prefill.tokens.size() * V), ph(prefill.tokens.size() * D);
  be.forward(prefill.batch(pl, ph));
  for (int i = 0; i < 3; ++i) be.reserve(ids[i], prompt_len[i] + tree_len[i]);
  std::vector<float> tl(step.tokens.size() * V), th(step.tokens.size() * D);
  be.forward(step.batch(tl, th, tree.mask_view()));

  // The projection kernel gives a row the same bits in any pass of 3 or more rows; passes of 1 or
  // 2 rows split k over more accumulators (gemm.cpp) and round differently. So the prefill and the
  // tree rows of the 5- and 3-token requests must be bit-identical to the single engine's, and the
  // lone root (a 1-row pass in the single engine) close to it.
  agreement exact, close;
  for (int i = 0; i < 3; ++i) {
    CAPTURE(i);
    engine e(m, {.max_batch = 64, .threads = 2});
    const int n = prompt_len[i], t = tree_len[i], q0 = prefill.indptr[sz(i)], s0 = step.indptr[sz(i)];
    std::vector<float> rl(sz(n) * V), rh(sz(n) * D);
    const auto pos = iota_from(0, n);
    e.forward({.tokens = prompts[sz(i)], .positions = pos, .logits = rl, .hidden = rh});
    exact.add(std::span(pl).subspan(sz(q0) * V, sz(n) * V), rl);
    exact.add(std::span(ph).subspan(sz(q0) * D, sz(n) * D), rh);
    std::vector<float> tl1(sz(t) * V), th1(sz(t) * D);
    const auto tpos = tree_positions(tree, n, t);
    e.forward({.tokens = drafts[sz(i)], .positions = tpos, .cache_length = n, .tree_mask = tree.mask_view(), .logits = tl1,
               .hidden = th1});
    agreement& tree_rows = t >= 3 ? exact : close;
    tree_rows.add(std::span(tl).subspan(sz(s0) * V, sz(t) * V), tl1);
    tree_rows.add(std::span(th).subspan(sz(s0) * D, sz(t) * D), th1);
    // The K/V rows the request's pages hold are the single engine's cache rows.
    const auto kv = be.kv_cache(ids[i]);
    const auto ref = e.kv_cache();
    REQUIRE(kv.capacity() >= n + t);
    for (int l = 0; l < 2; ++l)
      for (int slot = 0; slot < n + t; ++slot) {
        agreement& rows = slot < n || t >= 3 ? exact : close;
        rows.add(std::span<const float>(kv.k_row(l, slot, 0), 32), std::span<const float>(ref.k_row(l, slot, 0), 32));
        rows.add(std::span<const float>(kv.v_row(l, slot, 0), 32), std::span<const float>(ref.v_row(l, slot, 0), 32));
      }
  }
  MESSAGE("batched vs single engine: passes of 3+ rows: max rel diff " << exact.worst << exact.note()
                                                                      << "; the 1-row tree pass: " << close.worst << close.note());
  CHECK(exact.identical);
  CHECK(exact.worst < 1e-5);
  CHECK(close.worst < 1e-5);
}

TEST_CASE("pages are mapped lazily, released past a length, and exhaustion changes nothing") {
  batch_engine be(small_model(), {.page_size = 4, .num_pages = 10, .max_requests = 3, .max_context = 40, .threads = 1});
  CHECK(be.max_context() == 40);
  CHECK(be.free_pages() == 10);
  CHECK(be.pages_in_use() == 0);
  CHECK(be.peak_pages_in_use() == 0);
  CHECK(be.kv_cache(0).capacity() == 0);
  be.reserve(0, 5);
  CHECK(be.pages_mapped(0) == 2);
  be.reserve(0, 8);  // still fits two pages
  be.reserve(0, 3);  // never shrinks
  CHECK(be.pages_mapped(0) == 2);
  be.reserve(0, 9);
  CHECK(be.pages_mapped(0) == 3);
  CHECK(be.kv_cache(0).capacity() == 12);
  be.reserve(1, 16);
  CHECK(be.pages_mapped(1) == 4);
  CHECK(be.pages_in_use() == 7);
  CHECK(be.free_pages() == 3);
  CHECK(be.peak_pages_in_use() == 7);
  // Every mapped page is a distinct page of the pool, and the tables are not runs of adjacent pages.
  std::set<int> pages;
  bool scattered = false;
  for (int r : {0, 1}) {
    const auto kv = be.kv_cache(r);
    const auto& map = kv.mapping();
    for (int b = 0; b < map.num_blocks; ++b) {
      CHECK((map.block_table[b] >= 0 && map.block_table[b] < 10));
      pages.insert(map.block_table[b]);
      if (b > 0 && map.block_table[b] != map.block_table[b - 1] + 1) scattered = true;
    }
  }
  CHECK(pages.size() == 7);
  CHECK(scattered);
  // release keeps the pages holding [0, length), the first blocks of the table.
  const auto before = be.kv_cache(1).mapping();
  const std::vector<std::int32_t> kept(before.block_table, before.block_table + 2);
  be.release(1, 5);
  CHECK(be.pages_mapped(1) == 2);
  CHECK(std::equal(kept.begin(), kept.end(), be.kv_cache(1).mapping().block_table));
  be.release(1, 8);  // nothing past slot 8 is mapped any more
  CHECK(be.pages_mapped(1) == 2);
  CHECK(be.pages_in_use() == 5);
  CHECK(be.peak_pages_in_use() == 7);
  be.release(0, 0);
  CHECK(be.pages_mapped(0) == 0);
  CHECK(be.pages_in_use() == 2);
  CHECK(be.free_pages() == 8);
  be.reset_peak();
  CHECK(be.peak_pages_in_use() == 2);
  // 40 slots need 10 pages; 8 are free: nothing is mapped.
  try {
    be.reserve(2, 40);
    FAIL("no exception");
  } catch (const engine_error& e) {
    CHECK(e.code() == engine_errc::out_of_pages);
    CHECK(e.request() == 2);
    const std::string what = e.what();
    CHECK(what.find("request 2") != std::string::npos);
    CHECK(what.find("10 more pages") != std::string::npos);
    CHECK(what.find("8 free of 10") != std::string::npos);
  }
  CHECK(be.pages_mapped(2) == 0);
  CHECK(be.free_pages() == 8);
  CHECK(be.pages_in_use() == 2);
  CHECK(be.peak_pages_in_use() == 2);
  be.reserve(2, 32);  // exactly the 8 free pages
  CHECK(be.free_pages() == 0);
  CHECK(be.peak_pages_in_use() == 10);
  auto code_of = [](auto&& f) {
    try {
      f();
    } catch (const engine_error& e) {
      return e.code();
    }
    FAIL("no exception");
    return engine_errc::bad_option;
  };
  CHECK(code_of([&] { be.reserve(0, 41); }) == engine_errc::bad_slot);  // beyond max_context
  CHECK(code_of([&] { be.reserve(0, -1); }) == engine_errc::bad_slot);
  CHECK(code_of([&] { be.release(0, -1); }) == engine_errc::bad_slot);
  CHECK(code_of([&] { be.reserve(3, 1); }) == engine_errc::bad_request);
  CHECK(code_of([&] { be.release(-1, 0); }) == engine_errc::bad_request);
  CHECK(code_of([&] { (void)be.kv_cache(3); }) == engine_errc::bad_request);
  CHECK(code_of([&] { (void)be.pages_mapped(3); }) == engine_errc::bad_request);
  CHECK(code_of([&] { be.reserve(0, 1); }) == engine_errc::out_of_pages);
  // Options out of range.
  CHECK(code_of([] { batch_engine bad(small_model(), {.page_size = 0}); }) == engine_errc::bad_option);
  CHECK(code_of([] { batch_engine bad(small_model(), {.max_requests = 0}); }) == engine_errc::bad_option);
  CHECK(code_of([] { batch_engine bad(small_model(), {.max_tokens = 0}); }) == engine_errc::bad_option);
  CHECK(code_of([] { batch_engine bad(small_model(), {.num_pages = -1}); }) == engine_errc::bad_option);
  CHECK(code_of([] { batch_engine bad(small_model(), {.weights = weight_format::int8}); }) == engine_errc::bad_option);
  // The default pool holds max_requests full contexts.
  batch_engine full(small_model(), {.page_size = 16, .max_requests = 2, .threads = 1});
  CHECK(full.options().num_pages == 2 * 6);
  CHECK(full.max_context() == 96);
}

TEST_CASE("bad ragged batches throw engine_error and write nothing") {
  batch_engine be(small_model(), {.page_size = 4, .max_requests = 4, .max_tokens = 8, .threads = 2});
  const auto a = random_tokens(6, 1), b = random_tokens(3, 2);
  be.reserve(0, 8);
  be.reserve(2, 4);
  ragged good;
  good.add(0, 0, a, iota_from(0, 6));
  good.add(2, 0, b, iota_from(0, 3));
  std::vector<float> logits(9 * V), hidden(9 * D);
  be.forward(good.batch(logits, hidden));
  // Everything the engine could write: the whole pool (all pages sit between the first and last
  // page's rows of layer 0 and 1) and the output buffers.
  const auto kv = be.kv_cache(0);
  const std::size_t pool = sz(be.options().num_pages) * 4 * 2 * 32;
  const std::vector<float> k0(kv.k_data(), kv.k_data() + pool), v0(kv.v_data(), kv.v_data() + pool);
  std::fill(logits.begin(), logits.end(), -7.0f);
  std::fill(hidden.begin(), hidden.end(), -7.0f);

  auto fails = [&](const ragged& r, engine_errc code, int request = -1, medusa::tree_mask_view mask = {},
                   bool last_row_only = false, std::size_t out_rows = 0) {
    const std::size_t rows = out_rows != 0 ? out_rows : (last_row_only ? r.requests.size() : r.tokens.size());
    std::vector<float> lg(rows * V, -7.0f), hd(rows * D, -7.0f);
    try {
      be.forward(r.batch(lg, hd, mask, last_row_only));
      FAIL("no exception");
    } catch (const engine_error& e) {
      CHECK(e.code() == code);
      CHECK(e.request() == request);
      if (request >= 0) CHECK(std::string(e.what()).find("request " + std::to_string(request)) != std::string::npos);
      MESSAGE(std::string(e.what()));
    }
    CHECK(std::all_of(lg.begin(), lg.end(), [](float x) { return x == -7.0f; }));
    CHECK(std::all_of(hd.begin(), hd.end(), [](float x) { return x == -7.0f; }));
  };
  const std::vector<int> one{5}, pos6{6}, pos3{3};
  auto step = [&](int r0, int L0, int r1, int L1) {
    ragged r;
    r.add(r0, L0, one, L0 == 6 ? pos6 : pos3);
    r.add(r1, L1, one, L1 == 6 ? pos6 : pos3);
    return r;
  };
  SUBCASE("batch shape") {
    ragged empty;
    fails(empty, engine_errc::bad_batch);  // no requests
    ragged r = step(0, 6, 2, 3);
    r.indptr.pop_back();  // B entries instead of B + 1
    fails(r, engine_errc::bad_batch);
    r = step(0, 6, 2, 3);
    r.indptr = {0, 2, 1};  // decreasing
    fails(r, engine_errc::bad_batch);
    r = step(0, 6, 2, 3);
    r.indptr = {1, 1, 2};  // does not start at 0
    fails(r, engine_errc::bad_batch);
    r = step(0, 6, 2, 3);
    r.indptr = {0, 1, 3};  // more tokens announced than given
    fails(r, engine_errc::bad_batch);
    r = step(0, 6, 2, 3);
    r.lengths.pop_back();
    fails(r, engine_errc::bad_batch);
    r = step(0, 6, 2, 3);
    r.requests.push_back(1);  // three requests, two requests' worth of indptr
    r.lengths.push_back(0);
    fails(r, engine_errc::bad_batch);
  }
  SUBCASE("request ids") {
    fails(step(0, 6, 4, 3), engine_errc::bad_request, 4);  // outside [0, max_requests)
    fails(step(0, 6, -1, 3), engine_errc::bad_request, -1);
    fails(step(2, 3, 2, 3), engine_errc::bad_request, 2);  // twice
  }
  SUBCASE("tokens and positions") {
    ragged r = step(0, 6, 2, 3);
    r.tokens[1] = 97;
    fails(r, engine_errc::bad_token, 2);
    r = step(0, 6, 2, 3);
    r.tokens[0] = -1;
    fails(r, engine_errc::bad_token, 0);
    r = step(0, 6, 2, 3);
    r.positions[1] = 96;
    fails(r, engine_errc::bad_position, 2);
  }
  SUBCASE("slots") {
    fails(step(0, 6, 2, 4), engine_errc::bad_slot, 2);   // slot 4: request 2 holds one page of 4 slots
    fails(step(0, 8, 2, 3), engine_errc::bad_slot, 0);   // slot 8: request 0 holds two pages
    fails(step(0, -1, 2, 3), engine_errc::bad_slot, 0);
    fails(step(0, 6, 1, 0), engine_errc::bad_slot, 1);   // request 1 holds no page
    fails(step(0, 96, 2, 3), engine_errc::bad_slot, 0);  // beyond max_context
  }
  SUBCASE("tree masks") {
    ragged r;
    r.add(0, 6, std::vector<int>{5, 6}, std::vector<int>{6, 7});
    r.add(2, 3, one, pos3);
    const std::uint32_t later[2] = {0x3, 0x3};  // row 0 sees row 1
    const std::uint32_t no_diag[2] = {0x1, 0x1};
    const std::uint32_t ok[2] = {0x1, 0x3};
    fails(r, engine_errc::bad_mask, -1, medusa::tree_mask_view{std::span(ok, 1), 1});  // one row for two tokens
    fails(r, engine_errc::bad_mask, -1, medusa::tree_mask_view{later, 1});
    fails(r, engine_errc::bad_mask, -1, medusa::tree_mask_view{no_diag, 1});
    ragged wide;  // 9 tree tokens: more than one pass holds
    be.reserve(1, 9);
    wide.add(1, 0, random_tokens(9, 3), iota_from(0, 9));
    const std::vector<std::uint32_t> chain{0x1, 0x3, 0x7, 0xf, 0x1f, 0x3f, 0x7f, 0xff, 0x1ff};
    fails(wide, engine_errc::bad_batch, 1, medusa::tree_mask_view{chain, 1});
  }
  SUBCASE("outputs") {
    const ragged r = step(0, 6, 2, 3);
    fails(r, engine_errc::bad_output, -1, {}, true, 2 + 1);    // B rows wanted, three given
    fails(r, engine_errc::bad_output, -1, {}, false, 1);       // T rows wanted, one given
    ragged z = step(0, 6, 2, 3);
    z.requests.push_back(1);  // request 1 with no tokens: it has no last row
    z.lengths.push_back(0);
    z.indptr.push_back(2);
    fails(z, engine_errc::bad_batch, 1, {}, true);
  }
  const auto kv_after = be.kv_cache(0);
  CHECK(std::equal(k0.begin(), k0.end(), kv_after.k_data()));
  CHECK(std::equal(v0.begin(), v0.end(), kv_after.v_data()));
  // The same engine still runs a good batch.
  std::vector<float> lg(2 * V);
  be.forward(step(0, 6, 2, 3).batch(lg, {}, {}, true));
  CHECK(std::all_of(lg.begin(), lg.end(), [](float x) { return std::isfinite(x); }));
}

TEST_CASE("a batch cut into passes by max_tokens gives the outputs of one pass") {
  const model m = small_model();
  batch_engine one(m, {.page_size = 8, .max_requests = 4, .max_tokens = 64, .threads = 2});
  batch_engine cut(m, {.page_size = 8, .max_requests = 4, .max_tokens = 5, .threads = 2});
  const medusa::tree tree = medusa::tree::from_text("[[0],[1],[0,0],[0,1]]");
  const int ids[] = {1, 3, 0};
  const int prompt_len[] = {11, 3, 7};  // 21 tokens: passes of 5 cut request 1 twice
  const int more_len[] = {6, 2, 4};     // a second causal chunk, last rows only
  const int tree_len[] = {5, 4, 2};     // one tree pass per request
  ragged prefill, chunk, step;
  for (int i = 0; i < 3; ++i) {
    const int n = prompt_len[i], k = more_len[i];
    prefill.add(ids[i], 0, random_tokens(n, 30u + static_cast<unsigned>(i)), iota_from(0, n));
    chunk.add(ids[i], n, random_tokens(k, 40u + static_cast<unsigned>(i)), iota_from(n, k));
    step.add(ids[i], n + k, random_tokens(tree_len[i], 50u + static_cast<unsigned>(i)), tree_positions(tree, n + k, tree_len[i]));
    for (batch_engine* e : {&one, &cut}) e->reserve(ids[i], n + k + tree_len[i]);
  }
  agreement all;
  auto both = [&](const ragged& r, medusa::tree_mask_view mask, bool last_row_only) {
    const std::size_t rows = last_row_only ? r.requests.size() : r.tokens.size();
    std::vector<float> l1(rows * V), h1(rows * D), l2(rows * V), h2(rows * D);
    one.forward(r.batch(l1, h1, mask, last_row_only));
    cut.forward(r.batch(l2, h2, mask, last_row_only));
    all.add(l2, l1);
    all.add(h2, h1);
  };
  both(prefill, {}, false);
  both(chunk, {}, true);
  both(step, tree.mask_view(), false);
  for (int i = 0; i < 3; ++i) {
    const auto a = one.kv_cache(ids[i]), b = cut.kv_cache(ids[i]);
    for (int l = 0; l < 2; ++l)
      for (int slot = 0; slot < prompt_len[i] + more_len[i] + tree_len[i]; ++slot) {
        all.add(std::span<const float>(b.k_row(l, slot, 0), 32), std::span<const float>(a.k_row(l, slot, 0), 32));
        all.add(std::span<const float>(b.v_row(l, slot, 0), 32), std::span<const float>(a.v_row(l, slot, 0), 32));
      }
  }
  MESSAGE("passes of 5 vs one pass: max rel diff " << all.worst << all.note());
  CHECK(all.worst < 1e-5);
}
