// SPDX-License-Identifier: Apache-2.0
// kv_cache_view mappings and the accepted-path commit (docs/kv_cache.md): every layout and dtype
// against a naive gather reference, overlapping moves, batches, and bad input leaving the bytes
// unchanged.
#include <medusa/kv_cache.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <medusa/tree.hpp>

namespace {

using medusa::kv_errc;
using medusa::kv_extents;
using medusa::kv_layout;

// A random prefix-closed tree given by its parent array (parent[i] < i), and a root path in it.
std::vector<int> random_parents(std::mt19937& rng, int n) {
  std::vector<int> p(static_cast<std::size_t>(n), -1);
  for (int i = 1; i < n; ++i) p[static_cast<std::size_t>(i)] = std::uniform_int_distribution<int>(0, i - 1)(rng);
  return p;
}
std::vector<int> root_path(const std::vector<int>& parents, int node) {
  std::vector<int> path;
  for (int u = node; u >= 0; u = parents[static_cast<std::size_t>(u)]) path.push_back(u);
  std::reverse(path.begin(), path.end());
  return path;
}

struct parent_tree {  // the minimal tree interface kv_commit's tree overload needs
  std::vector<int> parents;
  [[nodiscard]] int num_nodes() const { return static_cast<int>(parents.size()); }
  [[nodiscard]] int parent(int i) const { return parents[static_cast<std::size_t>(i)]; }
};

template <class T>
T value_for(int kv, int layer, int slot, int head, int d) {
  // distinct enough in every dtype: small integers are exact in half and bfloat16
  return T(static_cast<float>(((kv * 7 + layer * 13 + slot * 5 + head * 3 + d) % 200) - 100));
}

template <class T>
std::vector<std::uint16_t> raw16(const std::vector<T>& v) {  // for byte comparisons of any T
  std::vector<std::uint16_t> r(v.size() * sizeof(T) / 2);
  std::memcpy(r.data(), v.data(), v.size() * sizeof(T));
  return r;
}

// Fills a view with distinct values, snapshots it logically, commits, and compares with the
// gather reference: rows L+j <- old rows L+path[j], everything else unchanged.
template <class View>
void fill(const View& kv, int slots) {
  using T = typename View::value_type;
  for (int l = 0; l < kv.num_layers(); ++l)
    for (int s = 0; s < slots; ++s)
      for (int h = 0; h < kv.num_kv_heads(); ++h)
        for (int d = 0; d < kv.head_dim(); ++d) {
          kv.k(l, s, h, d) = value_for<T>(0, l, s, h, d);
          kv.v(l, s, h, d) = value_for<T>(1, l, s, h, d);
        }
}
template <class View>
std::vector<float> snapshot(const View& kv, int slots) {
  std::vector<float> out;
  for (int l = 0; l < kv.num_layers(); ++l)
    for (int s = 0; s < slots; ++s)
      for (int h = 0; h < kv.num_kv_heads(); ++h)
        for (int d = 0; d < kv.head_dim(); ++d) {
          out.push_back(static_cast<float>(kv.k(l, s, h, d)));
          out.push_back(static_cast<float>(kv.v(l, s, h, d)));
        }
  return out;
}
std::vector<float> expected_after_commit(const std::vector<float>& snap, int layers, int slots, int heads, int dim,
                                         int L, const std::vector<int>& path) {
  std::vector<float> e = snap;
  const std::size_t row = static_cast<std::size_t>(heads) * static_cast<std::size_t>(dim) * 2;
  for (int l = 0; l < layers; ++l)
    for (std::size_t j = 0; j < path.size(); ++j) {
      const std::size_t base = static_cast<std::size_t>(l) * static_cast<std::size_t>(slots) * row;
      std::copy_n(snap.begin() + static_cast<std::ptrdiff_t>(base + static_cast<std::size_t>(L + path[j]) * row),
                  row, e.begin() + static_cast<std::ptrdiff_t>(base + (static_cast<std::size_t>(L) + j) * row));
    }
  return e;
}

struct shape {
  int layers, heads, dim, capacity;
};

template <class T>
struct contiguous_cache {
  std::vector<T> k, v;
  medusa::kv_cache_view<T> view;
  contiguous_cache(const shape& s, kv_layout layout)
      : k(static_cast<std::size_t>(s.layers * s.heads * s.dim * s.capacity)), v(k.size()) {
    view = medusa::make_kv_view<T>(k, v, kv_extents{s.layers, s.heads, s.dim}, s.capacity, layout);
  }
};

template <class T>
struct paged_cache {
  std::vector<T> k, v;
  std::vector<std::int32_t> table;
  medusa::paged_kv_cache_view<T> view;
  // `blocks` mapped blocks in a pool of `pool_pages` pages, shuffled so pages are not in order.
  paged_cache(const shape& s, int page_size, int pool_pages, int blocks, kv_layout layout, std::mt19937& rng)
      : k(static_cast<std::size_t>(s.layers * s.heads * s.dim * page_size * pool_pages)), v(k.size()) {
    std::vector<std::int32_t> pages(static_cast<std::size_t>(pool_pages));
    std::iota(pages.begin(), pages.end(), 0);
    std::shuffle(pages.begin(), pages.end(), rng);
    table.assign(pages.begin(), pages.begin() + blocks);
    view = medusa::make_paged_kv_view<T>(k, v, kv_extents{s.layers, s.heads, s.dim}, page_size, layout, table);
  }
};

template <class View>
void check_random_commits(const View& kv, int rounds, std::mt19937& rng) {
  const int cap = kv.capacity();
  for (int round = 0; round < rounds; ++round) {
    const int n = std::uniform_int_distribution<int>(1, std::min(cap, 40))(rng);
    const int L = std::uniform_int_distribution<int>(0, cap - n)(rng);
    const auto parents = random_parents(rng, n);
    // node choice: root (A = 0), the deepest node, or a random one
    int node = std::uniform_int_distribution<int>(0, n - 1)(rng);
    if (round % 5 == 0) node = 0;
    if (round % 5 == 1) {
      std::size_t best = 0;
      for (int u = 0; u < n; ++u) {
        const std::size_t len = root_path(parents, u).size();
        if (len > best) best = len, node = u;
      }
    }
    const auto path = root_path(parents, node);
    fill(kv, cap);
    const auto snap = snapshot(kv, cap);
    const int len = medusa::kv_commit(kv, L, parent_tree{parents}, path);
    REQUIRE(len == L + static_cast<int>(path.size()));
    REQUIRE(snapshot(kv, cap) ==
            expected_after_commit(snap, kv.num_layers(), cap, kv.num_kv_heads(), kv.head_dim(), L, path));
  }
}

}  // namespace

TEST_CASE("views are trivially copyable and map NHD, HND and pages as documented") {
  static_assert(std::is_trivially_copyable_v<medusa::kv_cache_view<float>>);
  static_assert(std::is_trivially_copyable_v<medusa::paged_kv_cache_view<medusa::half>>);
  static_assert(medusa::kv_view<medusa::kv_cache_view<const medusa::bfloat16>>);
  static_assert(!medusa::kv_view<medusa::kv_cache_view<double>>);
  const shape s{3, 4, 8, 10};
  contiguous_cache<float> nhd(s, kv_layout::nhd), hnd(s, kv_layout::hnd);
  for (int l = 0; l < 3; ++l)
    for (int t = 0; t < 10; ++t)
      for (int h = 0; h < 4; ++h) {
        CHECK(nhd.view.k_row(l, t, h) == nhd.k.data() + ((l * 10 + t) * 4 + h) * 8);
        CHECK(hnd.view.v_row(l, t, h) == hnd.v.data() + ((l * 4 + h) * 10 + t) * 8);
      }
  CHECK(nhd.view.capacity() == 10);
  std::mt19937 rng(1);
  for (kv_layout pl : {kv_layout::nhd, kv_layout::hnd}) {
    paged_cache<float> pc(s, 4, 7, 5, pl, rng);
    CHECK(pc.view.capacity() == 20);
    for (int l = 0; l < 3; ++l)
      for (int t = 0; t < 20; ++t)
        for (int h = 0; h < 4; ++h) {
          const int page = pc.table[static_cast<std::size_t>(t / 4)];
          const int in_page = pl == kv_layout::nhd ? (t % 4) * 4 * 8 + h * 8 : h * 4 * 8 + (t % 4) * 8;
          CHECK(pc.view.k_row(l, t, h) == pc.k.data() + (l * 7 + page) * 4 * 4 * 8 + in_page);
        }
  }
}

TEST_CASE_TEMPLATE("commit moves the accepted rows for every contiguous layout", T, float, medusa::half,
                   medusa::bfloat16) {
  std::mt19937 rng(7);
  for (kv_layout layout : {kv_layout::nhd, kv_layout::hnd}) {
    for (const shape& s : {shape{1, 1, 1, 8}, shape{2, 3, 5, 50}, shape{3, 2, 16, 64}}) {
      contiguous_cache<T> c(s, layout);
      check_random_commits(c.view, 25, rng);
    }
  }
}

TEST_CASE_TEMPLATE("commit moves the accepted rows through a block table", T, float, medusa::half,
                   medusa::bfloat16) {
  std::mt19937 rng(11);
  for (kv_layout layout : {kv_layout::nhd, kv_layout::hnd})
    for (int page : {1, 3, 16}) {
      const shape s{2, 3, 4, 0};
      const int blocks = 64 / page + 1;
      paged_cache<T> c(s, page, blocks + 5, blocks, layout, rng);
      check_random_commits(c.view, 25, rng);
    }
}

TEST_CASE("strided views with padding: commit touches only the rows it moves") {
  // [layer][slot][head] with 3 padding elements after each row and 5 after each slot
  const kv_extents ext{2, 2, 4};
  const auto m = medusa::layout_kv_strided::mapping::strided(ext, 20, /*layer*/ 20 * 19, /*slot*/ 19, /*head*/ 7);
  std::vector<float> k(m.required_span_size(), -1.0f), v(k.size(), -2.0f);
  auto kv = medusa::make_kv_view<float>(k, v, m);
  fill(kv, 20);
  std::vector<bool> in_row(k.size(), false);
  for (int l = 0; l < 2; ++l)
    for (int t = 0; t < 20; ++t)
      for (int h = 0; h < 2; ++h)
        for (int d = 0; d < 4; ++d) in_row[static_cast<std::size_t>(l * 380 + t * 19 + h * 7 + d)] = true;
  const auto snap = snapshot(kv, 20);
  const std::vector<int> path{0, 2, 6};  // the overlapping example of docs/kv_cache.md: j=1 reads L+2, j=2 writes L+2
  CHECK(medusa::kv_commit(kv, 3, 9, path) == 6);
  CHECK(snapshot(kv, 20) == expected_after_commit(snap, 2, 20, 2, 4, 3, path));
  for (std::size_t i = 0; i < k.size(); ++i)
    if (!in_row[i]) REQUIRE((k[i] == -1.0f && v[i] == -2.0f));
}

TEST_CASE("overlapping chains: identity paths move nothing, shifted chains move in order") {
  const shape s{2, 2, 3, 32};
  contiguous_cache<float> c(s, kv_layout::nhd);
  fill(c.view, 32);
  auto before = c.k;
  CHECK(medusa::kv_commit(c.view, 4, 10, std::vector<int>{0, 1, 2, 3, 4}) == 9);  // chain: no move
  CHECK(c.k == before);
  for (const std::vector<int>& path : {std::vector<int>{0, 1, 3, 4, 5, 9}, std::vector<int>{0, 5, 6, 7, 8, 9},
                                        std::vector<int>{0, 9}, std::vector<int>{0}}) {
    fill(c.view, 32);
    const auto snap = snapshot(c.view, 32);
    CHECK(medusa::kv_commit(c.view, 2, 10, path) == 2 + static_cast<int>(path.size()));
    CHECK(snapshot(c.view, 32) == expected_after_commit(snap, 2, 32, 2, 3, 2, path));
  }
}

TEST_CASE("batched commit over a shared page pool with different lengths and paths") {
  std::mt19937 rng(3);
  const kv_extents ext{2, 2, 8};
  const int page = 4, pool = 64;
  std::vector<medusa::bfloat16> k(static_cast<std::size_t>(2 * pool * page * 2 * 8)), v(k.size());
  std::vector<int> pages(pool);
  std::iota(pages.begin(), pages.end(), 0);
  std::shuffle(pages.begin(), pages.end(), rng);
  const int B = 5;
  std::vector<std::vector<std::int32_t>> tables(B);
  std::vector<medusa::paged_kv_cache_view<medusa::bfloat16>> views;
  for (int b = 0; b < B; ++b) {
    tables[static_cast<std::size_t>(b)].assign(pages.begin() + b * 12, pages.begin() + b * 12 + 10);  // 40 slots each
    views.push_back(medusa::make_paged_kv_view<medusa::bfloat16>(k, v, ext, page, kv_layout::hnd, tables[static_cast<std::size_t>(b)]));
  }
  std::vector<std::vector<int>> paths;
  std::vector<medusa::kv_commit_request> reqs;
  std::vector<int> Ls{0, 7, 13, 20, 30};
  for (int b = 0; b < B; ++b) {
    const auto parents = random_parents(rng, 10);
    paths.push_back(root_path(parents, std::uniform_int_distribution<int>(0, 9)(rng)));
  }
  for (int b = 0; b < B; ++b) reqs.push_back({Ls[static_cast<std::size_t>(b)], 10, paths[static_cast<std::size_t>(b)]});
  std::vector<std::vector<float>> snaps;
  for (int b = 0; b < B; ++b) {
    fill(views[static_cast<std::size_t>(b)], 40);
  }
  for (int b = 0; b < B; ++b) snaps.push_back(snapshot(views[static_cast<std::size_t>(b)], 40));
  std::vector<int> lens(B, -1);
  medusa::kv_commit_batch(views, reqs, lens);
  for (int b = 0; b < B; ++b) {
    const auto& path = paths[static_cast<std::size_t>(b)];
    CHECK(lens[static_cast<std::size_t>(b)] == Ls[static_cast<std::size_t>(b)] + static_cast<int>(path.size()));
    CHECK(snapshot(views[static_cast<std::size_t>(b)], 40) ==
          expected_after_commit(snaps[static_cast<std::size_t>(b)], 2, 40, 2, 8, Ls[static_cast<std::size_t>(b)], path));
  }
  // one bad request (L + N beyond its 40 slots): nothing at all is written, the error names it
  reqs[3].committed_length = 31;
  const auto kraw = raw16(k), vraw = raw16(v);
  std::fill(lens.begin(), lens.end(), -1);
  try {
    medusa::kv_commit_batch<medusa::paged_kv_cache_view<medusa::bfloat16>>(views, reqs, lens);
    FAIL("expected kv_cache_error");
  } catch (const medusa::kv_cache_error& e) {
    CHECK(e.code() == kv_errc::block_table_too_short);
    CHECK(e.request() == 3);
    CHECK(std::string(e.what()).find("kv request #3") != std::string::npos);
  }
  CHECK(raw16(k) == kraw);
  CHECK(raw16(v) == vraw);
  CHECK(lens == std::vector<int>(B, -1));
  std::vector<int> short_lens(2);
  CHECK_THROWS_AS(medusa::kv_commit_batch<medusa::paged_kv_cache_view<medusa::bfloat16>>(views, reqs, short_lens),
                  medusa::kv_cache_error);
}

TEST_CASE("bad input: typed error, cache bytes unchanged") {
  const shape s{2, 2, 4, 16};
  contiguous_cache<medusa::half> c(s, kv_layout::nhd);
  fill(c.view, 16);
  const auto kraw = raw16(c.k), vraw = raw16(c.v);
  auto expect = [&](kv_errc code, auto&& call) {
    try {
      call();
      FAIL("expected kv_cache_error " << medusa::to_string(code));
    } catch (const medusa::kv_cache_error& e) {
      CHECK_MESSAGE(e.code() == code, e.what());
      CHECK(std::string(e.what()).rfind("medusa: ", 0) == 0);
    }
    REQUIRE(raw16(c.k) == kraw);
    REQUIRE(raw16(c.v) == vraw);
  };
  using P = std::vector<int>;
  expect(kv_errc::invalid_path, [&] { (void)medusa::kv_commit(c.view, 2, 8, P{}); });
  expect(kv_errc::invalid_path, [&] { (void)medusa::kv_commit(c.view, 2, 8, P{1, 3}); });
  expect(kv_errc::invalid_path, [&] { (void)medusa::kv_commit(c.view, 2, 8, P{0, 3, 3}); });
  expect(kv_errc::invalid_path, [&] { (void)medusa::kv_commit(c.view, 2, 8, P{0, 4, 2}); });
  expect(kv_errc::invalid_path, [&] { (void)medusa::kv_commit(c.view, 2, 8, P{0, 2, 8}); });   // node >= N
  expect(kv_errc::invalid_path, [&] { (void)medusa::kv_commit(c.view, 2, 8, P{0, -1}); });     // padding
  expect(kv_errc::invalid_path, [&] { (void)medusa::kv_commit(c.view, 2, 0, P{0}); });
  expect(kv_errc::invalid_path, [&] { (void)medusa::kv_commit(c.view, 2, 2, P{0, 1, 2}); });   // longer than N
  expect(kv_errc::invalid_length, [&] { (void)medusa::kv_commit(c.view, -1, 8, P{0}); });
  expect(kv_errc::capacity_exceeded, [&] { (void)medusa::kv_commit(c.view, 9, 8, P{0, 1}); }); // 9+8 > 16
  expect(kv_errc::capacity_exceeded, [&] { (void)medusa::kv_commit(c.view, 2147483640, 8, P{0}); });
  // a path that is increasing but not a root path of the given tree
  const parent_tree t{{-1, 0, 0, 1, 2}};
  expect(kv_errc::path_not_in_tree, [&] { (void)medusa::kv_commit(c.view, 2, t, P{0, 1, 4}); });
  expect(kv_errc::path_not_in_tree, [&] { (void)medusa::kv_commit(c.view, 2, t, P{0, 3}); });
  CHECK(medusa::kv_commit(c.view, 2, t, P{0, 2, 4}) == 5);  // and the good one works

  // paged: short table, bad page id
  std::mt19937 rng(5);
  paged_cache<float> pc(shape{1, 2, 4, 0}, 4, 6, 3, kv_layout::nhd, rng);  // 12 slots
  fill(pc.view, 12);
  const auto pk = pc.k, pv = pc.v;
  auto expect_paged = [&](kv_errc code, auto&& call) {
    try {
      call();
      FAIL("expected kv_cache_error");
    } catch (const medusa::kv_cache_error& e) {
      CHECK_MESSAGE(e.code() == code, e.what());
    }
    REQUIRE(pc.k == pk);
    REQUIRE(pc.v == pv);
  };
  expect_paged(kv_errc::block_table_too_short, [&] { (void)medusa::kv_commit(pc.view, 5, 8, P{0, 7}); });
  pc.table[2] = 6;  // outside the 6-page pool
  expect_paged(kv_errc::invalid_block, [&] { (void)medusa::kv_commit(pc.view, 5, 7, P{0, 6}); });
  pc.table[2] = -1;
  expect_paged(kv_errc::invalid_block, [&] { (void)medusa::kv_check_append(pc.view, 8, 1); });
  CHECK(medusa::kv_commit(pc.view, 0, 8, P{0, 5}) == 2);  // pages 0 and 1 are fine
  CHECK_NOTHROW(medusa::kv_check_append(pc.view, 0, 8));
}

TEST_CASE("view construction checks buffer sizes and shapes") {
  std::vector<float> k(100), v(100);
  CHECK_THROWS_AS((void)medusa::make_kv_view<float>(k, v, kv_extents{2, 2, 4}, 10, kv_layout::nhd),
                  medusa::kv_cache_error);  // needs 160
  CHECK_NOTHROW((void)medusa::make_kv_view<float>(k, v, kv_extents{2, 2, 4}, 6, kv_layout::hnd));
  try {
    (void)medusa::make_kv_view<float>(k, v, kv_extents{0, 2, 4}, 1);
    FAIL("expected error");
  } catch (const medusa::kv_cache_error& e) {
    CHECK(e.code() == kv_errc::invalid_shape);
  }
  const std::vector<std::int32_t> table{0};
  CHECK_THROWS_AS((void)medusa::make_paged_kv_view<float>(k, v, kv_extents{1, 1, 3}, 4, kv_layout::nhd, table),
                  medusa::kv_cache_error);  // 100 is not a whole number of 12-element pages
  CHECK_THROWS_AS((void)medusa::make_paged_kv_view<float>(k, v, kv_extents{1, 1, 4}, 0, kv_layout::nhd, table),
                  medusa::kv_cache_error);
  const auto pv = medusa::make_paged_kv_view<float>(k, v, kv_extents{1, 1, 5}, 4, kv_layout::nhd, table);
  CHECK(pv.mapping().num_pages == 5);
  CHECK(pv.capacity() == 4);
}

TEST_CASE("page accounting and truncation") {
  CHECK(medusa::kv_pages_for(0, 16) == 0);
  CHECK(medusa::kv_pages_for(1, 16) == 1);
  CHECK(medusa::kv_pages_for(32, 16) == 2);
  CHECK(medusa::kv_pages_for(33, 16) == 3);
  CHECK(medusa::kv_pages_to_map(2, 30, 64, 16) == 4);  // 94 slots -> 6 pages, 2 mapped
  CHECK(medusa::kv_pages_to_map(8, 30, 64, 16) == 0);
  CHECK(medusa::kv_pages_releasable(6, 35, 16) == 3);  // keep 3 pages for 35 slots
  CHECK(medusa::kv_pages_releasable(2, 35, 16) == 0);
  CHECK_THROWS_AS((void)medusa::kv_pages_for(5, 0), medusa::kv_cache_error);
  CHECK_THROWS_AS((void)medusa::kv_pages_to_map(-1, 0, 1, 16), medusa::kv_cache_error);
  static_assert(medusa::kv_pages_for(17, 16) == 2);

  std::mt19937 rng(9);
  paged_cache<float> pc(shape{1, 1, 2, 0}, 4, 8, 6, kv_layout::nhd, rng);
  CHECK(medusa::kv_pages_releasable(pc.view, 9) == 3);
  CHECK(medusa::kv_truncate(pc.view, 20, 9) == 9);
  CHECK(medusa::kv_truncate(pc.view, 20, 20) == 20);
  CHECK_THROWS_AS((void)medusa::kv_truncate(pc.view, 20, 21), medusa::kv_cache_error);
  CHECK_THROWS_AS((void)medusa::kv_truncate(pc.view, 25, 3), medusa::kv_cache_error);  // beyond capacity 24
  CHECK_THROWS_AS((void)medusa::kv_truncate(pc.view, 5, -1), medusa::kv_cache_error);
  // after a commit, the pages beyond the new length may go
  fill(pc.view, 24);
  const int len = medusa::kv_commit(pc.view, 10, 12, std::vector<int>{0, 3, 9});
  CHECK(len == 13);
  CHECK(medusa::kv_pages_releasable(pc.view, len) == 2);
}

TEST_CASE("the example of kv_commit in the header documentation") {
  const medusa::kv_extents ext{2, 2, 4};
  std::vector<float> k(2 * 16 * 2 * 4), v(k.size());
  auto kv = medusa::make_kv_view<float>(k, v, ext, 16, medusa::kv_layout::nhd);
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = static_cast<float>(i);
  const int path[] = {0, 2, 8};
  CHECK(medusa::kv_commit(kv, 5, 9, path) == 8);
  CHECK(kv.k(1, 6, 1, 3) == static_cast<float>(((1 * 16 + 7) * 2 + 1) * 4 + 3));
  CHECK(kv.k(0, 7, 0, 0) == static_cast<float>((13 * 2) * 4));
}

TEST_CASE("every retrieve row of every preset tree commits; a sibling swap is rejected") {
  std::mt19937 rng(21);
  for (std::string_view name : medusa::preset_names()) {
    CAPTURE(name);
    const auto t = medusa::tree::preset(name);
    const int n = t.num_nodes(), L = 5;
    contiguous_cache<medusa::bfloat16> c(shape{2, 2, 4, L + n}, kv_layout::hnd);
    for (int row = 0; row < t.num_leaves(); ++row) {
      std::vector<int> path;
      for (int col = 0; col <= t.depth() && t.retrieve(row, col) >= 0; ++col) path.push_back(t.retrieve(row, col));
      path.resize(static_cast<std::size_t>(std::uniform_int_distribution<int>(1, static_cast<int>(path.size()))(rng)));
      fill(c.view, L + n);
      const auto snap = snapshot(c.view, L + n);
      REQUIRE(medusa::kv_commit(c.view, L, t, path) == L + static_cast<int>(path.size()));
      REQUIRE(snapshot(c.view, L + n) == expected_after_commit(snap, 2, L + n, 2, 4, L, path));
    }
    // depth-1 nodes 1 and 2 are siblings: [0, 1, child of 2] is increasing but not a root path
    if (n > 3 && t.child_count(2) > 0) {
      const std::vector<int> bad{0, 1, t.child_begin(2)};
      CHECK_THROWS_AS((void)medusa::kv_commit(c.view, L, t, bad), medusa::kv_cache_error);
    }
  }
}
