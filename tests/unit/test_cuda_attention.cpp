// SPDX-License-Identifier: Apache-2.0
// The CUDA tree-attention kernel bodies, run by the host emulation, against the CPU library's
// `tree_attention` and a double-precision reference: batches of requests with their own lengths
// and trees, every preset, causal chunks, FlashInfer custom masks, contiguous and paged caches,
// f32/f16/bf16 K and V, grouped-query heads, one split and many. And the property the kernels
// are built for: a row has the same bits alone (plain decoding after its ancestors were
// committed), in a tree and in a causal chunk.
#include <doctest/doctest.h>
#include <medusa/attention.hpp>
#include <medusa/cuda/emulation.hpp>
#include <medusa/cuda/kernels/attention.hpp>
#include <medusa/kv_cache.hpp>
#include <medusa/tree.hpp>

#include "../common_attention_cases.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

namespace mc = medusa::cuda;
namespace mk = medusa::cuda::kernels;
using mk::attention_mask_kind;
using namespace medusa_test;

namespace {

// Under AddressSanitizer the emulation runs about 15 times slower: the sweeps there take fewer
// committed lengths.
constexpr bool sanitized = medusa::cuda::emulation_sanitized;

// Emulated kernels against medusa::tree_attention and the naive reference, every request.
template <class KV, class O = float>
void check_batch(const shape& s, const std::vector<request>& reqs, std::uint32_t seed, float scale = 0.0f) {
  std::mt19937 rng(seed);
  batch_fixture<KV> f(s, reqs, rng);
  mk::attention_plan plan;
  const auto out = f.template emulate<O>(scale, &plan);
  CAPTURE(plan.splits);
  CAPTURE(plan.rows_per_block);
  for (int b = 0; b < f.B; ++b) {
    CAPTURE(b);
    const auto got = f.rows_of(out, b);
    if (s.mask != attention_mask_kind::flashinfer) check_close(got, f.cpu(b, scale), tolerance<KV, O>());
    check_close(got, f.naive(b, scale), tolerance<KV, O>());
  }
}

}  // namespace

TEST_CASE_TEMPLATE("tree attention of a batch equals the CPU's, contiguous and paged", KV, float, medusa::half,
                   medusa::bfloat16) {
  std::mt19937 rng(7);
  for (const int page : {0, 16, 5}) {
    for (const int split : {0, 32, 64}) {
      CAPTURE(page);
      CAPTURE(split);
      shape s;
      s.hq = 4;
      s.hkv = 2;
      s.dim = 16;
      s.capacity = 160;
      s.page_size = page;
      s.kv_split = split;
      check_batch<KV>(s, random_batch(rng, 3, 120, 12, true), rng());
    }
  }
}

TEST_CASE_TEMPLATE("outputs in the cache's 16-bit type", KV, medusa::half, medusa::bfloat16) {
  std::mt19937 rng(8);
  shape s;
  s.hq = 2;
  s.hkv = 2;
  s.dim = 32;
  s.capacity = 100;
  s.kv_split = 32;
  check_batch<KV, KV>(s, random_batch(rng, 2, 90, 9, true), rng());
}

TEST_CASE("head dims of 8 to 128 and groups of 1 to 8 query heads") {
  std::mt19937 rng(9);
  struct dims {
    int hq, hkv, dim;
  };
  for (const dims d : {dims{8, 4, 8}, dims{2, 1, 24}, dims{8, 1, 40}, dims{2, 2, 64}, dims{1, 1, 96}, dims{2, 1, 128}}) {
    CAPTURE(d.dim);
    shape s;
    s.hq = d.hq;
    s.hkv = d.hkv;
    s.dim = d.dim;
    s.capacity = 96;
    s.kv_split = 64;
    check_batch<medusa::bfloat16>(s, random_batch(rng, 2, 80, 5, true), rng(), d.dim == 24 ? 0.3f : 0.0f);
  }
}

TEST_CASE("every preset tree, one per request, with a different committed length each") {
  std::mt19937 rng(10);
  const auto names = medusa::preset_names();
  for (std::size_t i = 0; i < names.size(); i += 2) {
    std::vector<request> rs;
    for (std::size_t j = i; j < std::min(names.size(), i + 2); ++j) {
      CAPTURE(names[j]);
      const medusa::tree t = medusa::tree::preset(names[j]);
      rs.push_back({std::uniform_int_distribution<int>(0, 100)(rng), t.num_nodes(), parents_of(t)});
    }
    shape s;
    s.hq = 2;
    s.hkv = 1;
    s.dim = 16;
    s.capacity = 192;
    s.kv_split = 64;
    s.page_size = i % 4 == 0 ? 16 : 0;
    check_batch<medusa::half>(s, rs, rng());
  }
}

TEST_CASE("one tree mask shared by the batch (no per-request offsets)") {
  std::mt19937 rng(11);
  const medusa::tree t = medusa::tree::preset("mc_sim_7b_63");
  shape s;
  s.capacity = 200;
  s.kv_split = 96;
  batch_fixture<float> f(s, {{40, t.num_nodes(), parents_of(t)}, {100, t.num_nodes(), parents_of(t)}}, rng);
  f.shared_mask = true;  // the kernel reads every request's rows from word 0
  f.words.resize(static_cast<std::size_t>(t.num_nodes() * f.wpr));
  const auto out = f.template emulate<float>();
  for (int b = 0; b < 2; ++b) check_close(f.rows_of(out, b), f.cpu(b), 2e-5f);
}

TEST_CASE("causal chunks (prefill) and single tokens (decoding) of a batch") {
  std::mt19937 rng(12);
  for (const int page : {0, 8}) {
    shape s;
    s.mask = attention_mask_kind::causal;
    s.hq = 6;
    s.hkv = 2;
    s.dim = 16;
    s.capacity = 180;
    s.page_size = page;
    s.kv_split = 64;
    check_batch<medusa::bfloat16>(s, random_batch(rng, 3, 100, 40, false), rng());
    check_batch<float>(s, {{0, 1, {}}, {63, 1, {}}, {64, 1, {}}, {150, 1, {}}}, rng());
  }
}

TEST_CASE("one plan and one set of arguments serve new lengths and queries, as a captured launch replays") {
  // What a CUDA graph replays: the arguments and the workspace bound at capture, with the
  // lengths and queries they point to rewritten between runs. Lengths past the first run's
  // change each request's number of splits.
  std::mt19937 rng(16);
  auto f = replay_fixture(rng);
  const mk::attention_plan plan = mk::plan_attention(f.problem());
  std::vector<float> out(static_cast<std::size_t>(f.T * f.out_stride), 1e4f);
  std::vector<float> ws((plan.workspace_bytes + sizeof(float) - 1) / sizeof(float), std::numeric_limits<float>::quiet_NaN());
  auto a = f.params(f.host_arrays(), out.data());
  REQUIRE(mk::bind_attention_workspace(plan, a, ws.data(), ws.size() * sizeof(float)));
  for (int round = 0; round < replay_rounds; ++round) {
    CAPTURE(round);
    f.set_lengths(replay_lengths(round));
    for (auto& x : f.q) x = std::uniform_real_distribution<float>(-2.0f, 2.0f)(rng);
    mc::emulate(plan.main, [&](auto& ctx) { mk::attention_main(ctx, plan, a); });
    mc::emulate(plan.merge, [&](auto& ctx) { mk::attention_merge(ctx, plan, a); });
    for (int b = 0; b < 2; ++b) {
      CAPTURE(b);
      check_close(f.rows_of(out, b), f.cpu(b), tolerance<medusa::half, float>());
      check_close(f.rows_of(out, b), f.naive(b), tolerance<medusa::half, float>());
    }
  }
}

TEST_CASE("FlashInfer custom masks: the tree's stream, and arbitrary bits including the prefix") {
  std::mt19937 rng(13);
  shape s;
  s.mask = attention_mask_kind::flashinfer;
  s.hq = 4;
  s.hkv = 2;
  s.dim = 16;
  s.capacity = 140;
  s.kv_split = 64;
  check_batch<medusa::half>(s, random_batch(rng, 3, 120, 10, true), rng());

  // The library's writer produces the same stream the fixture wrote by hand.
  const medusa::tree t = medusa::tree::preset("mc_sim_7b_63");
  std::vector<std::uint8_t> stream(medusa::full_row_stream_bytes(t.num_nodes(), 37));
  medusa::write_full_row_stream(t, 37, std::span<std::uint8_t>(stream));
  batch_fixture<float> f(s, {{37, t.num_nodes(), parents_of(t)}}, rng);
  CHECK(stream == f.custom);

  // Random bits, prefix included, and one row that sees nothing (output 0).
  batch_fixture<float> g(s, random_batch(rng, 2, 100, 9, true), rng);
  for (int b = 0; b < g.B; ++b) {
    const request& r = g.req[static_cast<std::size_t>(b)];
    for (int i = 0; i < r.n; ++i)
      for (int key = 0; key < r.L + r.n; ++key) g.set_custom(b, i, key, rng() % 3 != 0);
  }
  const request& r0 = g.req[0];
  for (int key = 0; key < r0.L + r0.n; ++key) g.set_custom(0, 0, key, false);
  const auto out = g.template emulate<float>();
  for (int b = 0; b < g.B; ++b) check_close(g.rows_of(out, b), g.naive(b), 2e-5f);
  for (int c = 0; c < s.hq * s.dim; ++c) CHECK(out[static_cast<std::size_t>(c)] == 0.0f);
}

TEST_CASE_TEMPLATE("a tree node has the same bits as its row decoded alone after its ancestors were committed", KV,
                   float, medusa::bfloat16) {
  std::mt19937 rng(14);
  // Committed lengths around the 32-key tiles and the splits, so that a node's ancestors and the
  // node itself fall in another tile or split than they do alone.
  const std::vector<int> lengths = sanitized ? std::vector<int>{5, 62, 127} : std::vector<int>{0, 5, 31, 60, 62, 63, 64, 93, 127};
  for (const int L : lengths)
    for (const int page : {0, 16}) {
    CAPTURE(L);
    CAPTURE(page);
    const medusa::tree t = medusa::tree::preset(L % 3 == 0 ? "mc_sim_7b_63" : "vicuna_7b_stage2");
    const auto parents = parents_of(t);
    shape s;
    s.hq = 4;
    s.hkv = 2;
    s.dim = 32;
    s.capacity = 256;
    s.page_size = page;
    s.kv_split = 32 * (1 + L % 3);  // 32, 64 or 96: tiles and splits cut across the tree keys
    batch_fixture<KV> tree(s, {{L, t.num_nodes(), parents}}, rng);
    const auto tree_out = tree.template emulate<float>();
    for (int u = 1; u < t.num_nodes(); u += 2) {
      batch_fixture<KV> alone = alone_fixture(tree, parents, u, rng);
      const auto alone_out = alone.template emulate<float>();
      CAPTURE(u);
      CHECK(std::memcmp(alone_out.data(), tree_out.data() + static_cast<std::size_t>(u * tree.out_stride),
                        static_cast<std::size_t>(s.hq * s.dim) * sizeof(float)) == 0);
      // and the value is right
      check_close(std::vector<float>(alone_out.begin(), alone_out.begin() + s.hq * s.dim), alone.naive(0), 2e-2f);
    }
  }
}

TEST_CASE_TEMPLATE("16-byte and element-wise K/V reads give the same bits", KV, float, medusa::bfloat16) {
  std::mt19937 rng(31);
  const medusa::tree t = medusa::tree::preset("vicuna_7b_stage2");
  for (const int page : {0, 16})
    for (const int dim : {32, 128}) {
      CAPTURE(page);
      CAPTURE(dim);
      shape s;
      s.hq = 4;
      s.hkv = 2;
      s.dim = dim;
      s.capacity = 160;
      s.page_size = page;
      s.kv_split = 64;
      // A tree over a prefix that ends inside a tile (tail keys read from the cache) and a decode row.
      batch_fixture<KV> f(s, {{45, t.num_nodes(), parents_of(t)}, {70, 1, {}}}, rng);
      mk::attention_plan plan;
      const auto vec = f.template emulate<float>(0.0f, &plan);
      const auto elementwise = f.template emulate<float>(0.0f, nullptr, true);
      REQUIRE(mk::detail::attention_kv_vectorized<KV>(f.device_kv(), dim));
      CHECK(std::memcmp(vec.data(), elementwise.data(), vec.size() * sizeof(float)) == 0);
      check_close(f.rows_of(vec, 0), f.naive(0), tolerance<KV, float>());
    }
}

TEST_CASE_TEMPLATE("the single-query kernel gives the general kernel's bits", KV, float, medusa::bfloat16) {
  // Decode batches (one token a request) under each mask, across group sizes, head dims (36: the
  // element-wise reads of 16-bit caches), splits longer than a stage (float rows of 128: 64 keys a
  // stage) and lengths around the tiles, stages and splits; contiguous and paged caches.
  std::mt19937 rng(41);
  struct config {
    int hq, hkv, dim, split;
    attention_mask_kind mask;
  };
  std::vector<config> configs = {{1, 1, 128, 256, attention_mask_kind::causal},
                                 {8, 1, 64, 128, attention_mask_kind::tree},
                                 {4, 2, 36, 64, attention_mask_kind::flashinfer},
                                 {6, 3, 32, 32, attention_mask_kind::causal},
                                 {8, 4, 8, 128, attention_mask_kind::causal},     // stories260K's heads
                                 {8, 4, 16, 128, attention_mask_kind::tree}};     // tinystories-656K's
  if (!sanitized) configs.push_back({16, 1, 128, 96, attention_mask_kind::tree});  // G = 16: the general kernel
  for (const config& c : configs)
    for (const int page : {0, 16}) {
      CAPTURE(c.hq);
      CAPTURE(c.hkv);
      CAPTURE(c.dim);
      CAPTURE(c.split);
      CAPTURE(page);
      shape s;
      s.hq = c.hq;
      s.hkv = c.hkv;
      s.dim = c.dim;
      s.capacity = 300;
      s.page_size = page;
      s.kv_split = c.split;
      s.mask = c.mask;
      const std::vector<request> reqs = {{0, 1, {-1}}, {31, 1, {-1}}, {64, 1, {-1}}, {130, 1, {-1}}, {299, 1, {-1}}};
      batch_fixture<KV> f(s, reqs, rng);
      if (c.mask == attention_mask_kind::flashinfer)  // random bits, prefix included
        for (int b = 0; b < f.B; ++b)
          for (int key = 0; key <= reqs[static_cast<std::size_t>(b)].L; ++key) f.set_custom(b, 0, key, rng() % 3 != 0);
      mk::attention_plan plan;
      const auto fast = f.template emulate<float>(0.0f, &plan);
      CHECK(plan.single_query == (c.hq / c.hkv <= mk::attention_single_query_group_max));
      f.s.single_query = false;
      mk::attention_plan general_plan;
      const auto general = f.template emulate<float>(0.0f, &general_plan);
      REQUIRE_FALSE(general_plan.single_query);
      CHECK(std::memcmp(fast.data(), general.data(), fast.size() * sizeof(float)) == 0);
      for (int b = 0; b < f.B; ++b) check_close(f.rows_of(fast, b), f.naive(b), tolerance<KV, float>());
      if (c.dim % 8 == 0) {  // and over K and V read element by element
        f.s.single_query = true;
        const auto elementwise = f.template emulate<float>(0.0f, nullptr, true);
        CHECK(std::memcmp(fast.data(), elementwise.data(), fast.size() * sizeof(float)) == 0);
      }
    }
}

TEST_CASE("a causal chunk has the same bits as decoding its tokens one at a time") {
  std::mt19937 rng(15);
  shape s;
  s.mask = attention_mask_kind::causal;
  s.hq = 2;
  s.hkv = 1;
  s.dim = 64;
  s.capacity = 200;
  s.kv_split = 64;
  batch_fixture<medusa::bfloat16> chunk(s, {{50, 40, {}}}, rng);
  const auto chunk_out = chunk.template emulate<float>();
  for (int i = 0; i < 40; i += 7) {
    batch_fixture<medusa::bfloat16> one = one_of_chunk(chunk, i, rng);
    const auto one_out = one.template emulate<float>();
    CAPTURE(i);
    CHECK(std::memcmp(one_out.data(), chunk_out.data() + static_cast<std::size_t>(i * chunk.out_stride),
                      static_cast<std::size_t>(s.hq * s.dim) * sizeof(float)) == 0);
  }
}

TEST_CASE("a NaN in a key the row sees gives NaN; rows that do not see it are unaffected") {
  std::mt19937 rng(16);
  shape s;
  s.hq = 1;
  s.hkv = 1;
  s.dim = 8;
  s.capacity = 64;
  s.kv_split = 32;
  // root 0, children 1 and 2: node 2 does not see node 1
  batch_fixture<float> f(s, {{40, 3, {-1, 0, 0}}}, rng);
  const std::size_t row1 = static_cast<std::size_t>(s.layer * s.capacity + 41) * static_cast<std::size_t>(s.dim);
  f.k[row1] = std::numeric_limits<float>::quiet_NaN();
  const auto out = f.template emulate<float>();
  CHECK(std::isnan(out[static_cast<std::size_t>(f.out_stride)]));       // node 1 sees itself
  CHECK(!std::isnan(out[0]));                                            // the root does not see node 1
  CHECK(!std::isnan(out[static_cast<std::size_t>(2 * f.out_stride)]));  // nor does node 2
}

TEST_CASE("plans refuse bad sizes and argument checks name the mismatch") {
  const mk::attention_problem ok{.batch = 2, .max_tokens = 8, .max_tokens_per_request = 4, .max_kv_length = 64,
                                 .num_q_heads = 4, .num_kv_heads = 2, .head_dim = 16};
  const mk::attention_plan plan = mk::plan_attention(ok);
  CHECK(plan.group == 2);
  CHECK(plan.problem.kv_split == 128);
  CHECK(plan.splits == 1);
  CHECK(plan.workspace_bytes == 0);
  const auto refused = [](mk::attention_problem p, mc::launch_errc code) {
    try {
      (void)mk::plan_attention(p);
      FAIL("accepted");
    } catch (const mc::launch_error& e) {
      CHECK(e.code() == code);
      CHECK(std::string(e.what()).find("attention") != std::string::npos);
    }
  };
  auto p = ok;
  p.batch = 0;
  refused(p, mc::launch_errc::invalid_shape);
  p = ok;
  p.num_q_heads = 3;
  refused(p, mc::launch_errc::invalid_shape);
  p = ok;
  p.head_dim = 256;
  refused(p, mc::launch_errc::unsupported);
  p = ok;
  p.kv_split = 48;
  refused(p, mc::launch_errc::invalid_shape);
  p = ok;
  p.max_tokens_per_request = 9;
  refused(p, mc::launch_errc::invalid_shape);
  p = ok;
  p.batch = 70000;
  refused(p, mc::launch_errc::invalid_shape);

  std::vector<medusa::half> k(2 * 64 * 2 * 16), v(k.size());
  auto view = medusa::make_kv_view<medusa::half>(k, v, {1, 2, 16}, 64);
  mk::attention_params<medusa::half> a;
  a.kv = mk::make_batch_kv(view);
  a.batch = 1;
  a.q_row_stride = a.out_row_stride = 64;
  CHECK_NOTHROW(mk::check_attention_args(plan, a));
  auto bad = a;
  bad.kv.shape.head_dim = 8;
  CHECK_THROWS_AS(mk::check_attention_args(plan, bad), mc::launch_error);
  bad = a;
  bad.q_row_stride = 63;
  CHECK_THROWS_WITH(mk::check_attention_args(plan, bad), doctest::Contains("row strides"));
  bad = a;
  bad.batch = 3;
  CHECK_THROWS_AS(mk::check_attention_args(plan, bad), mc::launch_error);
  bad = a;
  bad.layer = 1;
  CHECK_THROWS_AS(mk::check_attention_args(plan, bad), mc::launch_error);
  mk::attention_params<float> wrong_type;
  wrong_type.kv = a.kv;
  wrong_type.batch = 1;
  wrong_type.q_row_stride = wrong_type.out_row_stride = 64;
  CHECK_THROWS_WITH(mk::check_attention_args(plan, wrong_type), doctest::Contains("elements"));
}

TEST_CASE("a request beyond the plan's bounds is left untouched, the others are computed") {
  std::mt19937 rng(17);
  shape s;
  s.capacity = 64;
  s.kv_split = 32;
  batch_fixture<float> f(s, {{10, 3, {-1, 0, 1}}, {20, 2, {-1, 0}}}, rng);
  // Plan for at most 2 tokens per request: request 0 (3 tokens) is out of bounds.
  const mk::attention_plan plan = mk::plan_attention({.batch = 2, .max_tokens = 5, .max_tokens_per_request = 2,
                                                      .max_kv_length = 64, .num_q_heads = s.hq, .num_kv_heads = s.hkv,
                                                      .head_dim = s.dim, .mask = attention_mask_kind::tree,
                                                      .kv_split = 32});
  std::vector<float> out(static_cast<std::size_t>(f.T * f.out_stride), 1e4f);
  mk::attention_params<float> a;
  a.q = f.q.data();
  a.q_row_stride = f.q_stride;
  a.out = out.data();
  a.out_row_stride = f.out_stride;
  a.batch = 2;
  a.qo_indptr = f.indptr.data();
  a.cache_lengths = f.lengths.data();
  a.kv = f.device_kv();
  a.layer = s.layer;
  a.tree_mask = f.words.data();
  a.words_per_row = f.wpr;
  a.tree_mask_offsets = f.mask_offsets.data();
  std::vector<unsigned char> ws(plan.workspace_bytes);
  REQUIRE(mk::bind_attention_workspace(plan, a, ws.data(), ws.size()));
  mc::emulate(plan.main, [&](auto& ctx) { mk::attention_main(ctx, plan, a); });
  if (plan.splits > 1) mc::emulate(plan.merge, [&](auto& ctx) { mk::attention_merge(ctx, plan, a); });
  for (int c = 0; c < s.hq * s.dim; ++c) CHECK(out[static_cast<std::size_t>(c)] == 1e4f);
  check_close(f.rows_of(out, 1), f.cpu(1), 2e-5f);
}
