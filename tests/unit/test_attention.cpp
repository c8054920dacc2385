// SPDX-License-Identifier: Apache-2.0
// CPU tree attention against a naive double-precision reference for every layout and dtype, and
// against running each root-to-node path as its own causal sequence, for many and few query rows
// per KV head; a row's bits alone against the same row in any call (what keeps greedy Medusa
// identical to plain decoding), with the built-in kernels and a caller's. The same file is built
// again with MEDUSA_PORTABLE_KERNELS (test_attention_portable.cpp) and for x86-64-v3 and
// x86-64-v4 (test_attention_x86_64_v3.cpp, test_attention_x86_64_v4.cpp).
#include <medusa/attention.hpp>
#include <medusa/kv_cache.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <medusa/tree.hpp>

namespace {

using medusa::kv_errc;
using medusa::kv_extents;
using medusa::kv_layout;

std::vector<int> random_parents(std::mt19937& rng, int n) {
  std::vector<int> p(static_cast<std::size_t>(n), -1);
  for (int i = 1; i < n; ++i) {
    // mostly shallow-and-wide like Medusa trees, sometimes long chains
    const int lo = (i % 7 == 0) ? i - 1 : 0;
    p[static_cast<std::size_t>(i)] = std::uniform_int_distribution<int>(lo, i - 1)(rng);
  }
  return p;
}

// Packed ancestor-or-self mask from a parent array (the packed_mask layout of docs/tree.md).
std::vector<std::uint32_t> packed_mask(const std::vector<int>& parents, int wpr) {
  const int n = static_cast<int>(parents.size());
  std::vector<std::uint32_t> w(static_cast<std::size_t>(n * wpr), 0u);
  for (int i = 0; i < n; ++i)
    for (int u = i; u >= 0; u = parents[static_cast<std::size_t>(u)])
      w[static_cast<std::size_t>(i * wpr + u / 32)] |= 1u << (u % 32);
  return w;
}

bool visible(const std::vector<std::uint32_t>& w, int wpr, int i, int j) {
  return ((w[static_cast<std::size_t>(i * wpr + j / 32)] >> (j % 32)) & 1u) != 0;
}

// Naive reference: query (i, h) attends slots [0, L) and L + j for visible j; double math.
template <class View, class Vis>
std::vector<float> reference(const View& kv, int layer, int L, const std::vector<float>& q, int n, int hq, Vis vis,
                             float scale) {
  const int D = kv.head_dim();
  const int G = hq / kv.num_kv_heads();
  std::vector<float> out(q.size(), 0.0f);
  for (int i = 0; i < n; ++i)
    for (int h = 0; h < hq; ++h) {
      const int g = h / G;
      std::vector<int> slots(static_cast<std::size_t>(L));
      std::iota(slots.begin(), slots.end(), 0);
      for (int j = 0; j < n; ++j)
        if (vis(i, j)) slots.push_back(L + j);
      if (slots.empty()) continue;
      const float* qi = q.data() + (i * hq + h) * D;
      std::vector<double> s;
      double mx = -1e300;
      for (int t : slots) {
        double dot = 0;
        for (int d = 0; d < D; ++d) dot += static_cast<double>(qi[d]) * static_cast<double>(static_cast<float>(kv.k(layer, t, g, d)));
        s.push_back(dot * scale);
        mx = std::max(mx, s.back());
      }
      double sum = 0;
      for (double& x : s) sum += (x = std::exp(x - mx));
      for (int d = 0; d < D; ++d) {
        double acc = 0;
        for (std::size_t k = 0; k < slots.size(); ++k)
          acc += s[k] * static_cast<double>(static_cast<float>(kv.v(layer, slots[k], g, d)));
        out[static_cast<std::size_t>((i * hq + h) * D + d)] = static_cast<float>(acc / sum);
      }
    }
  return out;
}

template <class T>
void fill_random(std::vector<T>& v, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (auto& x : v) x = T(u(rng));
}

void check_close(const std::vector<float>& got, const std::vector<float>& want, float tol = 2e-5f) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i)
    if (!(std::fabs(got[i] - want[i]) <= tol * (1.0f + std::fabs(want[i])))) {
      FAIL("element " << i << ": got " << got[i] << ", want " << want[i]);
    }
}

// A random float cache (1 layer, `hkv` heads of `dim`, `cap` slots) and `n` random queries of
// `hq` heads; k, v and q are drawn in that order.
struct random_problem {
  std::vector<float> k, v, q;
  random_problem(std::mt19937& rng, int cap, int hkv, int dim, int n, int hq)
      : k(static_cast<std::size_t>(cap * hkv * dim)), v(k.size()), q(static_cast<std::size_t>(n * hq * dim)) {
    fill_random(k, rng);
    fill_random(v, rng);
    fill_random(q, rng);
  }
  [[nodiscard]] auto view(int hkv, int dim, int cap, kv_layout layout = kv_layout::nhd) {
    return medusa::make_kv_view<float>(k, v, kv_extents{1, hkv, dim}, cap, layout);
  }
};

// Node ids from the root to `node`.
std::vector<int> root_path(const std::vector<int>& parents, int node) {
  std::vector<int> path;
  for (int u = node; u >= 0; u = parents[static_cast<std::size_t>(u)]) path.push_back(u);
  std::reverse(path.begin(), path.end());
  return path;
}

struct config {
  int layers, kv_heads, group, dim, L, n;
};

// Runs tree attention (random tree) and causal attention on `kv` and checks both against the
// reference.
template <class View>
void check_view(const View& kv, const config& c, std::mt19937& rng) {
  const int hq = c.kv_heads * c.group;
  std::vector<float> q(static_cast<std::size_t>(c.n * hq * c.dim)), out(q.size(), 7.0f);
  fill_random(q, rng);
  for (auto& x : q) x *= 3.0f;  // peaky enough that the online max matters
  const auto parents = random_parents(rng, c.n);
  const int wpr = (c.n + 31) / 32 + (c.n % 3 == 0 ? 1 : 0);  // sometimes more words than needed
  const auto words = packed_mask(parents, wpr);
  const int layer = c.layers - 1;
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.dim));
  medusa::tree_attention(kv, layer, c.L, q, c.n, hq, medusa::tree_mask_view{words, wpr}, out);
  check_close(out, reference(kv, layer, c.L, q, c.n, hq, [&](int i, int j) { return visible(words, wpr, i, j); }, scale));
  medusa::causal_attention(kv, 0, c.L, q, c.n, hq, out, medusa::attention_options{0.3f});
  check_close(out, reference(kv, 0, c.L, q, c.n, hq, [](int i, int j) { return j <= i; }, 0.3f));
}

template <class T>
void check_all_layouts(const config& c, std::mt19937& rng) {
  CAPTURE(c.layers);
  CAPTURE(c.kv_heads);
  CAPTURE(c.group);
  CAPTURE(c.dim);
  CAPTURE(c.L);
  CAPTURE(c.n);
  const kv_extents ext{c.layers, c.kv_heads, c.dim};
  const int cap = c.L + c.n + 3;
  std::vector<T> k(static_cast<std::size_t>(c.layers * c.kv_heads * c.dim * cap)), v(k.size());
  fill_random(k, rng);
  fill_random(v, rng);
  for (kv_layout layout : {kv_layout::nhd, kv_layout::hnd}) {
    check_view(medusa::make_kv_view<T>(k, v, ext, cap, layout), c, rng);
    const int page = layout == kv_layout::nhd ? 16 : 5;
    const int blocks = (cap + page - 1) / page;
    const int pool = blocks + 4;
    std::vector<T> pk(static_cast<std::size_t>(c.layers * c.kv_heads * c.dim * page * pool)), pv(pk.size());
    fill_random(pk, rng);
    fill_random(pv, rng);
    std::vector<std::int32_t> table(static_cast<std::size_t>(pool));
    std::iota(table.begin(), table.end(), 0);
    std::shuffle(table.begin(), table.end(), rng);
    table.resize(static_cast<std::size_t>(blocks));
    check_view(medusa::make_paged_kv_view<T>(pk, pv, ext, page, layout, table), c, rng);
  }
}

}  // namespace

TEST_CASE_TEMPLATE("tree and causal attention match the naive reference", T, float, medusa::half, medusa::bfloat16) {
  std::mt19937 rng(2024);
  const config fixed[] = {
      {1, 1, 1, 8, 0, 1},    {1, 1, 1, 16, 0, 5},    {2, 2, 2, 32, 1, 9},    {1, 2, 4, 64, 63, 33},
      {1, 1, 3, 20, 64, 64}, {1, 4, 1, 16, 65, 65},  {1, 2, 2, 128, 130, 70}, {2, 1, 8, 48, 7, 3},
      {1, 3, 2, 24, 200, 1},
  };
  for (const auto& c : fixed) check_all_layouts<T>(c, rng);
  for (int i = 0; i < 4; ++i) {
    std::uniform_int_distribution<int> u(1, 4);
    const config c{u(rng) % 2 + 1, u(rng), u(rng), 8 * u(rng) + (i == 2 ? 3 : 0),
                   std::uniform_int_distribution<int>(0, 150)(rng), std::uniform_int_distribution<int>(1, 80)(rng)};
    check_all_layouts<T>(c, rng);
  }
}

TEST_CASE_TEMPLATE("few query rows per KV head (row blocks of 1, 2, 3 and a remainder) match the reference", T,
                   float, medusa::half, medusa::bfloat16) {
  std::mt19937 rng(31);
  // {layers, kv_heads, group, dim, L, n}: rows per KV head = group * n
  const config fixed[] = {
      {1, 1, 1, 16, 0, 1},   {1, 2, 1, 64, 130, 1}, {1, 6, 1, 64, 128, 1}, {2, 1, 1, 128, 200, 1},  // 1 row
      {1, 2, 1, 48, 64, 1},  {1, 1, 1, 20, 70, 1},  {1, 2, 1, 8, 3, 1},                            // 1 row
      {1, 2, 1, 32, 90, 2},  {1, 2, 2, 64, 90, 1},  {1, 1, 2, 20, 65, 1},                           // 2 rows
      {1, 2, 1, 64, 90, 3},  {1, 1, 3, 32, 70, 1},  {1, 3, 3, 16, 1, 1},                            // 3 rows
      {1, 2, 1, 64, 100, 5}, {1, 1, 5, 16, 65, 1},  {1, 2, 1, 24, 40, 5},                           // 5 rows
      {1, 2, 1, 64, 100, 6}, {1, 1, 7, 32, 40, 1},  {1, 1, 3, 64, 129, 2},                          // 6, 7 rows
  };
  for (const auto& c : fixed) check_all_layouts<T>(c, rng);
}

TEST_CASE("a query row gets the same bits whatever the other rows of its call") {
  // Causal rows [0, n) see the same keys for any chunk length >= n: computed alone or among other
  // rows (shared prefix blocks, shared complete chunk blocks, groups of rows), every row's
  // arithmetic is the same, a call with one row in all included. Every head dimension, every
  // build.
  std::mt19937 rng(12);
  for (int D : {8, 16, 20, 24, 64, 72}) {
    for (int G : {1, 2, 3}) {
      CAPTURE(D);
      CAPTURE(G);
      const int hkv = 2, hq = hkv * G, L = D == 24 ? 120 : 75, nmax = D == 8 ? 70 : 9;
      random_problem p(rng, L + nmax, hkv, D, nmax, hq);
      const auto kv = p.view(hkv, D, L + nmax);
      const std::vector<float>& q = p.q;
      std::vector<float> all(q.size());
      medusa::causal_attention(kv, 0, L, q, nmax, hq, all);
      for (int n = 1; n < nmax; n += n < 10 ? 1 : 13) {
        CAPTURE(n);
        const auto len = static_cast<std::size_t>(n * hq * D);
        std::vector<float> part(len);
        medusa::causal_attention(kv, 0, L, std::span<const float>(q).first(len), n, hq, part);
        CHECK(std::equal(part.begin(), part.end(), all.begin()));
      }
    }
  }
}

TEST_CASE("a tree node gets the same bits whatever the other nodes of its tree") {
  // Nodes are numbered parents first, so the first k nodes of a tree are a tree of their own in
  // which node i < k sees the same keys: its row must not change with k, nor with the query heads
  // sharing its KV head, for float caches (read in place or copied) and converted bfloat16 ones.
  std::mt19937 rng(13);
  for (int D : {8, 20, 24, 32, 64, 72}) {
    const int hkv = 2, G = D % 16 == 0 ? 4 : 3, hq = hkv * G, n = 70;
    const int L = std::uniform_int_distribution<int>(0, 140)(rng);
    CAPTURE(D);
    CAPTURE(L);
    const auto parents = random_parents(rng, n);
    const int wpr = (n + 31) / 32;
    const auto words = packed_mask(parents, wpr);
    random_problem p(rng, L + n, hkv, D, n, hq);
    std::vector<medusa::bfloat16> kb(p.k.begin(), p.k.end()), vb(p.v.begin(), p.v.end());
    const auto kv = p.view(hkv, D, L + n, kv_layout::hnd);
    const auto kvb = medusa::make_kv_view<medusa::bfloat16>(kb, vb, kv_extents{1, hkv, D}, L + n);
    auto check = [&](const auto& view) {
      std::vector<float> all(p.q.size());
      medusa::tree_attention(view, 0, L, p.q, n, hq, medusa::tree_mask_view{words, wpr}, all);
      for (int k : {1, 2, 5, 33, 64, 65}) {
        CAPTURE(k);
        const auto len = static_cast<std::size_t>(k * hq * D);
        std::vector<float> part(len);
        medusa::tree_attention(view, 0, L, std::span<const float>(p.q).first(len), k, hq,
                               medusa::tree_mask_view{std::span(words).first(static_cast<std::size_t>(k * wpr)), wpr},
                               part);
        CHECK(std::equal(part.begin(), part.end(), all.begin()));
      }
    };
    check(kv);
    check(kvb);
  }
}

// A separate NHD cache holding the first L slots of `kv`, then the tree rows of `path` in order:
// the path run as its own causal sequence.
struct path_cache {
  std::vector<float> k, v;
  medusa::kv_cache_view<float> view;
  template <class View>
  path_cache(const View& kv, int L, const std::vector<int>& path, int hkv, int D)
      : k(static_cast<std::size_t>((L + static_cast<int>(path.size())) * hkv * D)), v(k.size()),
        view(medusa::make_kv_view<float>(k, v, kv_extents{1, hkv, D}, L + static_cast<int>(path.size()), kv_layout::nhd)) {
    for (int t = 0; t < L + static_cast<int>(path.size()); ++t) {
      const int src = t < L ? t : L + path[static_cast<std::size_t>(t - L)];
      for (int h = 0; h < hkv; ++h)
        for (int d = 0; d < D; ++d) {
          view.k(0, t, h, d) = kv.k(0, src, h, d);
          view.v(0, t, h, d) = kv.v(0, src, h, d);
        }
    }
  }
};

TEST_CASE("tree attention equals each root-to-node path run as its own causal sequence") {
  std::mt19937 rng(77);
  for (int trial = 0; trial < 6; ++trial) {
    const int D = trial % 2 ? 64 : 24, hkv = 2, G = trial % 3 + 1, hq = hkv * G;
    const int L = std::uniform_int_distribution<int>(0, 100)(rng);
    const int n = std::uniform_int_distribution<int>(2, 70)(rng);
    const auto parents = random_parents(rng, n);
    const int wpr = (n + 31) / 32;
    const auto words = packed_mask(parents, wpr);
    // the tree cache: prefix + the n tree rows
    random_problem p(rng, L + n, hkv, D, n, hq);
    const auto kv = p.view(hkv, D, L + n, kv_layout::hnd);
    const std::vector<float>& q = p.q;
    std::vector<float> out(q.size());
    medusa::tree_attention(kv, 0, L, q, n, hq, medusa::tree_mask_view{words, wpr}, out);
    for (int node = 0; node < n; ++node) {
      const auto path = root_path(parents, node);
      const int m = static_cast<int>(path.size());
      path_cache pc(kv, L, path, hkv, D);
      const auto& pkv = pc.view;
      std::vector<float> pq(static_cast<std::size_t>(m * hq * D)), pout(pq.size());
      for (int t = 0; t < m; ++t)
        std::copy_n(q.begin() + path[static_cast<std::size_t>(t)] * hq * D, hq * D, pq.begin() + t * hq * D);
      medusa::causal_attention(pkv, 0, L, pq, m, hq, pout);
      // the last row of the path sees the same keys at the same positions as the node: same bits
      REQUIRE(std::equal(pout.begin() + (m - 1) * hq * D, pout.end(), out.begin() + node * hq * D));
    }
  }
}

namespace {

// The node at depth k of a tree over a prefix of L slots, and the same query decoded alone (one
// row, causal) after the prefix and its k ancestors were committed, see the same keys at the same
// positions, so they take them in the same 64-key position blocks: same bits, with `kernels`.
void check_tree_rows_equal_decoded_alone(std::mt19937& rng, int trials, const medusa::attention_kernels* kernels) {
  for (int trial = 0; trial < trials; ++trial) {
    const int dims[] = {64, 8, 20, 24, 16, 72, 32, 48};
    const int D = dims[trial % 8], hkv = 2, G = trial % 3 + 1, hq = hkv * G;
    const int L = std::uniform_int_distribution<int>(0, 140)(rng);
    const int n = std::uniform_int_distribution<int>(2, 90)(rng);
    CAPTURE(D);
    CAPTURE(G);
    CAPTURE(L);
    CAPTURE(n);
    const auto parents = random_parents(rng, n);
    const int wpr = (n + 31) / 32;
    const auto words = packed_mask(parents, wpr);
    random_problem p(rng, L + n, hkv, D, n, hq);
    const auto kv = p.view(hkv, D, L + n);
    const std::vector<float>& q = p.q;
    const medusa::attention_options opts{0.0f, kernels};
    std::vector<float> out(q.size());
    medusa::tree_attention(kv, 0, L, q, n, hq, medusa::tree_mask_view{words, wpr}, out, opts);
    for (int node = 0; node < n; ++node) {
      CAPTURE(node);
      const auto path = root_path(parents, node);
      const int m = static_cast<int>(path.size());
      path_cache pc(kv, L, path, hkv, D);
      const auto& pkv = pc.view;
      std::vector<float> alone(static_cast<std::size_t>(hq * D));
      medusa::causal_attention(pkv, 0, L + m - 1,
                               std::span<const float>(q).subspan(static_cast<std::size_t>(node * hq * D), alone.size()),
                               1, hq, alone, opts);
      REQUIRE(std::equal(alone.begin(), alone.end(), out.data() + static_cast<std::size_t>(node * hq * D)));
    }
  }
}

}  // namespace

TEST_CASE("a tree node gets the same bits as its row decoded alone once its ancestors are committed") {
  // What keeps greedy Medusa identical to plain decoding, for every head dimension and build.
  std::mt19937 rng(91);
  check_tree_rows_equal_decoded_alone(rng, 16, nullptr);
}

namespace {

// A kernel set that counts its calls and runs the built-in kernels.
std::atomic<long> counted[4];
constexpr medusa::attention_kernels counting_kernels{
    [](const float* q, const float* const* keys, int n, int d, float* s) noexcept {
      ++counted[0];
      medusa::builtin_attention_kernels().scores(q, keys, n, d, s);
    },
    [](float* s, int n, float m) noexcept {
      ++counted[1];
      return medusa::builtin_attention_kernels().exp2_sum(s, n, m);
    },
    [](const float* p, const float* const* values, int n, int d, float* o) noexcept {
      ++counted[2];
      medusa::builtin_attention_kernels().accumulate(p, values, n, d, o);
    },
    [](float* o, int d, float a) noexcept {
      ++counted[3];
      medusa::builtin_attention_kernels().scale(o, d, a);
    },
};

// Plain scalar kernels: sums in order, libm's exp2. Other bits than the built-in set's, the same
// results to rounding.
constexpr medusa::attention_kernels scalar_kernels{
    [](const float* q, const float* const* keys, int n, int d, float* s) noexcept {
      for (int j = 0; j < n; ++j) {
        float acc = 0.0f;
        for (int x = 0; x < d; ++x) acc += q[x] * keys[j][x];
        s[j] = acc;
      }
    },
    [](float* s, int n, float m) noexcept {
      float sum = 0.0f;
      for (int j = 0; j < n; ++j) sum += (s[j] = std::exp2(s[j] - m));
      return sum;
    },
    [](const float* p, const float* const* values, int n, int d, float* o) noexcept {
      for (int j = 0; j < n; ++j)
        for (int x = 0; x < d; ++x) o[x] += p[j] * values[j][x];
    },
    [](float* o, int d, float a) noexcept {
      for (int x = 0; x < d; ++x) o[x] *= a;
    },
};

}  // namespace

TEST_CASE("a caller's kernel set is the one that runs") {
  std::mt19937 rng(21);
  for (int D : {16, 24, 64}) {
    CAPTURE(D);
    const int hkv = 2, hq = 4, L = 150, n = 12;
    random_problem p(rng, L + n, hkv, D, n, hq);
    const auto kv = p.view(hkv, D, L + n);
    const auto parents = random_parents(rng, n);
    const auto words = packed_mask(parents, 1);
    std::vector<float> a(p.q.size()), b(p.q.size(), 3.0f), c(p.q.size());
    medusa::tree_attention(kv, 0, L, p.q, n, hq, medusa::tree_mask_view{words, 1}, a);
    for (auto& x : counted) x = 0;
    const medusa::attention_options counting{0.0f, &counting_kernels};
    medusa::tree_attention(kv, 0, L, p.q, n, hq, medusa::tree_mask_view{words, 1}, b, counting);
    CHECK(a == b);
    // Every row meets 2 prefix blocks and one block of its tree keys: one scores call each, and as
    // many exp2 sums and accumulations; a rescale wherever the running maximum grows.
    CHECK(counted[0] == n * hq * 3);
    CHECK(counted[1] == n * hq * 3);
    CHECK(counted[2] == n * hq * 3);
    CHECK(counted[3] > 0);
    CHECK(counted[3] <= n * hq * 2);
    // other kernels, other bits, the same attention
    const medusa::attention_options scalar{0.0f, &scalar_kernels};
    medusa::tree_attention(kv, 0, L, p.q, n, hq, medusa::tree_mask_view{words, 1}, c, scalar);
    check_close(c, reference(kv, 0, L, p.q, n, hq, [&](int i, int j) { return visible(words, 1, i, j); },
                             1.0f / std::sqrt(static_cast<float>(D))));
  }
}

TEST_CASE("with a caller's kernel set too, a tree node gets the same bits as its row decoded alone") {
  std::mt19937 rng(92);
  check_tree_rows_equal_decoded_alone(rng, 8, &scalar_kernels);
  check_tree_rows_equal_decoded_alone(rng, 4, &counting_kernels);
}

TEST_CASE("a kernel set with a null member is refused before any output is written") {
  std::vector<float> k(10 * 2 * 8, 0.5f), v(k.size(), 1.0f);
  const auto kv = medusa::make_kv_view<float>(k, v, kv_extents{1, 2, 8}, 10);
  std::vector<float> q(3 * 4 * 8, 0.1f), out(q.size(), 5.0f);
  const std::uint32_t words[] = {0x1u, 0x3u, 0x5u};
  for (int member = 0; member < 4; ++member) {
    medusa::attention_kernels bad = medusa::builtin_attention_kernels();
    const char* name = "";
    switch (member) {
      case 0: bad.scores = nullptr, name = "scores"; break;
      case 1: bad.exp2_sum = nullptr, name = "exp2_sum"; break;
      case 2: bad.accumulate = nullptr, name = "accumulate"; break;
      default: bad.scale = nullptr, name = "scale"; break;
    }
    CAPTURE(name);
    try {
      medusa::tree_attention(kv, 0, 4, q, 3, 4, medusa::tree_mask_view{words, 1}, out, {0.0f, &bad});
      FAIL("expected kv_cache_error");
    } catch (const medusa::kv_cache_error& e) {
      CHECK(e.code() == kv_errc::invalid_shape);
      CHECK(std::string(e.what()).find(std::string("the ") + name + " function is null") != std::string::npos);
    }
    CHECK(std::all_of(out.begin(), out.end(), [](float x) { return x == 5.0f; }));
  }
  const medusa::attention_kernels none{};
  CHECK_THROWS_AS(medusa::causal_attention(kv, 0, 4, q, 3, 4, out, {0.0f, &none}), medusa::kv_cache_error);
  CHECK(std::all_of(out.begin(), out.end(), [](float x) { return x == 5.0f; }));
}

TEST_CASE("a NaN in a key the row sees gives NaN; rows that do not see it are unaffected") {
  for (int D : {8, 64}) {
    CAPTURE(D);
    std::mt19937 rng(16);
    const int L = 40, n = 3;
    random_problem p(rng, L + n, 1, D, n, 1);
    p.k[static_cast<std::size_t>((L + 1) * D)] = std::numeric_limits<float>::quiet_NaN();  // node 1's key
    const auto kv = p.view(1, D, L + n);
    const std::uint32_t words[] = {0x1u, 0x3u, 0x5u};  // root 0, children 1 and 2
    std::vector<float> out(p.q.size());
    medusa::tree_attention(kv, 0, L, p.q, n, 1, medusa::tree_mask_view{words, 1}, out);
    CHECK(std::isnan(out[static_cast<std::size_t>(D)]));                     // node 1 sees itself
    CHECK(std::none_of(out.begin(), out.begin() + D, [](float x) { return std::isnan(x); }));  // the root
    CHECK(std::none_of(out.begin() + 2 * D, out.end(), [](float x) { return std::isnan(x); }));  // node 2
  }
}

TEST_CASE("a caller-provided parallel-for gives the same bits as the sequential run") {
  std::mt19937 rng(5);
  for (int hkv : {1, 2, 8}) {
    const int D = 32, G = 2, hq = hkv * G, L = 90, n = 40;
    std::vector<medusa::bfloat16> k(static_cast<std::size_t>((L + n) * hkv * D)), v(k.size());
    fill_random(k, rng);
    fill_random(v, rng);
    const auto kv = medusa::make_kv_view<medusa::bfloat16>(k, v, kv_extents{1, hkv, D}, L + n);
    const auto parents = random_parents(rng, n);
    const auto words = packed_mask(parents, 2);
    std::vector<float> q(static_cast<std::size_t>(n * hq * D)), a(q.size()), b(q.size());
    fill_random(q, rng);
    medusa::tree_attention(kv, 0, L, q, n, hq, medusa::tree_mask_view{words, 2}, a);
    int calls = 0;
    auto two_threads = [&calls](std::size_t count, auto&& body) {
      calls = static_cast<int>(count);
      std::thread t([&] {
        for (std::size_t i = 0; i < count; i += 2) body(i);
      });
      for (std::size_t i = 1; i < count; i += 2) body(i);
      t.join();
    };
    medusa::tree_attention(kv, 0, L, q, n, hq, medusa::tree_mask_view{words, 2}, b, {}, two_threads);
    CHECK(calls >= hkv);
    CHECK(a == b);
    // in place: out aliases the queries
    std::vector<float> inplace = q;
    medusa::tree_attention(kv, 0, L, std::span<const float>(inplace), n, hq, medusa::tree_mask_view{words, 2},
                           std::span<float>(inplace));
    CHECK(inplace == a);
  }
}

TEST_CASE("queries that see nothing get zeros; extra mask bits beyond N are ignored") {
  std::vector<float> k(4 * 8, 1.0f), v(4 * 8, 2.0f);
  const auto kv = medusa::make_kv_view<float>(k, v, kv_extents{1, 1, 8}, 4);
  const std::uint32_t words[] = {0x0u, 0xFFFFFFFEu};  // node 0 sees nothing; node 1 sees 1 (+ junk bits)
  std::vector<float> q(2 * 8, 0.5f), out(q.size(), 9.0f);
  medusa::tree_attention(kv, 0, 0, q, 2, 1, medusa::tree_mask_view{words, 1}, out);
  for (int d = 0; d < 8; ++d) {
    CHECK(out[static_cast<std::size_t>(d)] == 0.0f);
    CHECK(out[static_cast<std::size_t>(8 + d)] == doctest::Approx(2.0f));
  }
  medusa::tree_attention(kv, 0, 0, std::span<const float>(), 0, 1, medusa::causal_mask{}, std::span<float>());
  // one query row in all (head_dim a multiple of 16): blind to its own row, it sees the prefix only
  std::vector<float> k16(4 * 16, 1.0f), v16(4 * 16, 3.0f), q16(16, 0.5f), out16(16, 9.0f);
  for (int d = 0; d < 16; ++d) v16[static_cast<std::size_t>(2 * 16 + d)] = -5.0f;  // slot 2: the query's own row
  const auto kv16 = medusa::make_kv_view<float>(k16, v16, kv_extents{1, 1, 16}, 4);
  const std::uint32_t none[] = {0x0u};
  medusa::tree_attention(kv16, 0, 0, q16, 1, 1, medusa::tree_mask_view{none, 1}, out16);
  CHECK(std::all_of(out16.begin(), out16.end(), [](float x) { return x == 0.0f; }));
  medusa::tree_attention(kv16, 0, 2, q16, 1, 1, medusa::tree_mask_view{none, 1}, out16);
  for (float x : out16) CHECK(x == doctest::Approx(3.0f));
}

TEST_CASE("bad input: typed errors, output untouched") {
  std::vector<float> k(2 * 10 * 2 * 8), v(k.size());
  const auto kv = medusa::make_kv_view<float>(k, v, kv_extents{2, 2, 8}, 10);
  const std::uint32_t words[] = {0x1u, 0x3u, 0x5u};
  const medusa::tree_mask_view mask{words, 1};
  std::vector<float> q(3 * 4 * 8, 0.1f), out(q.size(), 5.0f);
  auto expect = [&](kv_errc code, auto&& call) {
    try {
      call();
      FAIL("expected kv_cache_error " << medusa::to_string(code));
    } catch (const medusa::kv_cache_error& e) {
      CHECK_MESSAGE(e.code() == code, e.what());
    }
    REQUIRE(std::all_of(out.begin(), out.end(), [](float x) { return x == 5.0f; }));
  };
  expect(kv_errc::invalid_shape, [&] { medusa::tree_attention(kv, 2, 0, q, 3, 4, mask, out); });
  expect(kv_errc::invalid_shape, [&] { medusa::tree_attention(kv, -1, 0, q, 3, 4, mask, out); });
  expect(kv_errc::invalid_shape, [&] { medusa::tree_attention(kv, 0, 0, q, 4, 3, mask, out); });  // 3 % 2
  expect(kv_errc::size_mismatch, [&] { medusa::tree_attention(kv, 0, 0, q, 2, 4, mask, out); });
  expect(kv_errc::size_mismatch,
         [&] { medusa::tree_attention(kv, 0, 0, q, 3, 4, medusa::tree_mask_view{std::span(words, 2), 1}, out); });
  expect(kv_errc::size_mismatch,
         [&] { medusa::tree_attention(kv, 0, 0, q, 3, 4, medusa::tree_mask_view{words, 0}, out); });
  expect(kv_errc::capacity_exceeded, [&] { medusa::tree_attention(kv, 0, 8, q, 3, 4, mask, out); });
  expect(kv_errc::invalid_length, [&] { medusa::tree_attention(kv, 0, -1, q, 3, 4, mask, out); });
  expect(kv_errc::invalid_shape, [&] {
    medusa::tree_attention(kv, 0, 0, q, 3, 4, mask, out, medusa::attention_options{std::nanf("")});
  });
  expect(kv_errc::size_mismatch, [&] {
    medusa::tree_attention(kv, 0, 0, std::span<const float>(q).subspan(0, q.size()), 3, 4, mask,
                           std::span<float>(q).subspan(8), {});
  });
  // paged: the table must map [0, L+N) to pool pages
  std::vector<float> pool(4 * 4 * 2 * 8), pool_v(pool.size());  // 1 layer, 4 pages of 4 slots
  std::vector<std::int32_t> table{3, 1};
  const auto pkv = medusa::make_paged_kv_view<float>(pool, pool_v, kv_extents{1, 2, 8}, 4, kv_layout::nhd, table);
  expect(kv_errc::block_table_too_short, [&] { medusa::tree_attention(pkv, 0, 6, q, 3, 4, mask, out); });
  table[1] = 4;
  expect(kv_errc::invalid_block, [&] { medusa::tree_attention(pkv, 0, 2, q, 3, 4, mask, out); });
  table[1] = 0;
  CHECK_NOTHROW(medusa::tree_attention(pkv, 0, 5, q, 3, 4, mask, out));
}

namespace {
struct toy_tree {  // a masked_tree of its own, without mask_view(): the overload packs the words
  std::vector<int> parents;
  [[nodiscard]] int num_nodes() const { return static_cast<int>(parents.size()); }
  [[nodiscard]] int parent(int i) const { return parents[static_cast<std::size_t>(i)]; }
  [[nodiscard]] int words_per_row() const { return (num_nodes() + 31) / 32; }
  [[nodiscard]] std::uint32_t packed_mask_word(int row, int word) const {
    return packed_mask(parents, words_per_row())[static_cast<std::size_t>(row * words_per_row() + word)];
  }
  [[nodiscard]] bool mask(int q, int k) const { return ((packed_mask_word(q, k / 32) >> (k % 32)) & 1u) != 0; }
};
static_assert(medusa::masked_tree<toy_tree> && !medusa::tree_like<toy_tree>);
}  // namespace

TEST_CASE("the tree overload reads the mask through the tree interface") {
  std::mt19937 rng(8);
  const toy_tree t{{-1, 0, 0, 1, 1, 1, 2, 2, 2}};  // the worked example of docs/tree.md
  CHECK(t.packed_mask_word(8, 0) == 0x105u);
  CHECK(t.packed_mask_word(3, 0) == 0x00Bu);
  const int L = 12, n = 9, hq = 4, D = 16;
  std::vector<medusa::half> k(static_cast<std::size_t>((L + n) * 2 * D)), v(k.size());
  fill_random(k, rng);
  fill_random(v, rng);
  const auto kv = medusa::make_kv_view<medusa::half>(k, v, kv_extents{1, 2, D}, L + n, kv_layout::hnd);
  std::vector<float> q(static_cast<std::size_t>(n * hq * D)), a(q.size()), b(q.size());
  fill_random(q, rng);
  medusa::tree_attention(kv, 0, L, q, hq, t, a);
  const auto words = packed_mask(t.parents, 1);
  medusa::tree_attention(kv, 0, L, q, n, hq, medusa::tree_mask_view{words, 1}, b);
  CHECK(a == b);
}

TEST_CASE("all preset trees (medusa::tree) give path-consistent attention") {
  std::mt19937 rng(99);
  for (std::string_view name : medusa::preset_names()) {
    CAPTURE(name);
    const auto t = medusa::tree::preset(name);
    const int n = t.num_nodes(), L = 37, hkv = 2, hq = 4, D = 32;
    random_problem p(rng, L + n, hkv, D, n, hq);
    const auto kv = p.view(hkv, D, L + n);
    std::vector<float> out(p.q.size());
    medusa::tree_attention(kv, 0, L, p.q, hq, t, out);
    // reference: visibility from the tree's parent links (ancestor-or-self)
    auto vis = [&t](int i, int j) {
      for (int u = i; u >= 0; u = t.parent(u))
        if (u == j) return true;
      return false;
    };
    check_close(out, reference(kv, 0, L, p.q, n, hq, vis, 1.0f / std::sqrt(static_cast<float>(D))));
  }
}

// --- the examples of attention.hpp and docs/kv_cache.md, as written there -----------------------
namespace doc_example {

int header_main() {
  const medusa::kv_extents ext{1, 1, 8};                  // 1 layer, 1 KV head, head_dim 8
  std::vector<float> k(32 * 8, 0.5f), v(32 * 8, 1.0f);
  auto kv = medusa::make_kv_view<float>(k, v, ext, 32);
  // tree: root 0, children 1 and 2 -> rows 0b001, 0b011, 0b101
  const std::uint32_t mask[] = {0x1, 0x3, 0x5};
  std::vector<float> q(3 * 2 * 8, 0.1f), out(q.size());   // 3 nodes, 2 query heads
  medusa::tree_attention(kv, /*layer*/ 0, /*L*/ 10, q, 3, 2, medusa::tree_mask_view{mask, 1}, out);
  return out[0] == 1.0f ? 0 : 1;                          // every V row is 1
}

// Plain scalar dot products; any function of the values alone will do.
void my_scores(const float* q, const float* const* keys, int n, int head_dim, float* s) noexcept {
  for (int j = 0; j < n; ++j) {
    float acc = 0.0f;
    for (int d = 0; d < head_dim; ++d) acc += q[d] * keys[j][d];
    s[j] = acc;
  }
}

void attend(const medusa::kv_cache_view<float>& kv, int L, std::span<const float> q, int num_q_heads,
            const medusa::tree& tree, std::span<float> out) {
  static const medusa::attention_kernels kernels = [] {
    medusa::attention_kernels k = medusa::builtin_attention_kernels();  // the library's, then
    k.scores = &my_scores;                                              // replace what you have
    return k;
  }();
  medusa::attention_options opts;
  opts.kernels = &kernels;
  medusa::tree_attention(kv, 0, L, q, num_q_heads, tree, out, opts);
}

}  // namespace doc_example

TEST_CASE("the examples of attention.hpp and docs/kv_cache.md run") {
  CHECK(doc_example::header_main() == 0);
  std::mt19937 rng(3);
  const auto t = medusa::tree::preset("vicuna_7b_stage2");
  const int n = t.num_nodes(), L = 70, hkv = 2, hq = 4, D = 24;
  random_problem p(rng, L + n, hkv, D, n, hq);
  const auto kv = p.view(hkv, D, L + n);
  std::vector<float> out(p.q.size());
  doc_example::attend(kv, L, p.q, hq, t, out);
  auto vis = [&t](int i, int j) {
    for (int u = i; u >= 0; u = t.parent(u))
      if (u == j) return true;
    return false;
  };
  check_close(out, reference(kv, 0, L, p.q, n, hq, vis, 1.0f / std::sqrt(static_cast<float>(D))));
}

#if MEDUSA_ISA_AVX2
// With FMA the scalar exp2 fuses its multiply-adds (detail/mul_add.hpp) as the vector forms do, so
// all three give one result: a weight does not depend on which form its key went through.
TEST_CASE("the scalar exp2 gives the bits of the vector forms") {
  std::vector<float> t;
  for (float x = -140.0f; x <= 140.0f; x += 0.0173f) t.push_back(x);
  for (int k = -130; k <= 130; ++k) t.push_back(static_cast<float>(k) + 0.5f);  // ties of the rounding
  for (const float x : {0.0f, -0.0f, std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                        std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::denorm_min()})
    t.push_back(x);
  while (t.size() % 16 != 0) t.push_back(1.0f);
  std::vector<float> scalar(t.size()), vec(t.size());
  for (std::size_t i = 0; i < t.size(); ++i) scalar[i] = medusa::detail::exp2_approx(t[i]);
  const auto require_scalar_bits = [&] {
    for (std::size_t i = 0; i < t.size(); ++i) {
      INFO("t = " << t[i]);
      REQUIRE(std::bit_cast<std::uint32_t>(vec[i]) == std::bit_cast<std::uint32_t>(scalar[i]));
    }
  };
  for (std::size_t i = 0; i < t.size(); i += 8) _mm256_storeu_ps(&vec[i], medusa::detail::exp2_approx(_mm256_loadu_ps(&t[i])));
  require_scalar_bits();
#if MEDUSA_ISA_AVX512
  for (std::size_t i = 0; i < t.size(); i += 16) _mm512_storeu_ps(&vec[i], medusa::detail::exp2_approx(_mm512_loadu_ps(&t[i])));
  require_scalar_bits();
#endif
}
#endif
