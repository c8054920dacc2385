// SPDX-License-Identifier: Apache-2.0
// An engine's own KV layout plugs into the library: a paged cache laid out
// [layer][page][kv_head][slot-in-page][dim] with a block table per request, defined here and
// nowhere in the library. The commit and tree attention run through it and agree with the same
// data in the library's dense layout; a bad block table is rejected through the layout's own check.
#include <medusa/attention.hpp>
#include <medusa/kv_cache.hpp>
#include <medusa/tree.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <vector>

namespace {

// The engine's layout: a pool of pages per layer, each page [kv_head][page_size][head_dim].
struct layer_page_head_layout {
  struct mapping {
    medusa::kv_extents shape{};
    std::span<const std::int32_t> block_table;  // logical block -> page of the pool
    int page_size = 0;
    int num_pages = 0;

    [[nodiscard]] constexpr const medusa::kv_extents& extents() const noexcept { return shape; }
    [[nodiscard]] constexpr int slots() const noexcept { return static_cast<int>(block_table.size()) * page_size; }
    [[nodiscard]] constexpr std::size_t offset(int layer, int slot, int head) const noexcept {
      const auto page = static_cast<std::size_t>(block_table[static_cast<std::size_t>(slot / page_size)]);
      const auto H = static_cast<std::size_t>(shape.num_kv_heads), P = static_cast<std::size_t>(page_size);
      return (((static_cast<std::size_t>(layer) * static_cast<std::size_t>(num_pages) + page) * H +
               static_cast<std::size_t>(head)) * P + static_cast<std::size_t>(slot % page_size)) *
             static_cast<std::size_t>(shape.head_dim);
    }
    // The engine's own check of its block table, called by the library before any access.
    void validate_slots(int begin, int end, int request) const {
      if (end > slots())
        throw medusa::kv_cache_error(medusa::kv_errc::block_table_too_short,
                                     "slots up to " + std::to_string(end) + " are not mapped", request);
      for (int b = begin / page_size; b * page_size < end; ++b)
        if (block_table[static_cast<std::size_t>(b)] < 0 || block_table[static_cast<std::size_t>(b)] >= num_pages)
          throw medusa::kv_cache_error(medusa::kv_errc::invalid_block, "block " + std::to_string(b) + " is not in the pool",
                                       request);
    }
  };
};

using engine_view = medusa::kv_cache_view<float, layer_page_head_layout>;
static_assert(medusa::kv_layout_mapping<layer_page_head_layout::mapping>);
static_assert(medusa::writable_kv_view<engine_view>);
static_assert(medusa::kv_view<medusa::kv_cache_view<const float, layer_page_head_layout>>);
static_assert(!medusa::writable_kv_view<medusa::kv_cache_view<const float, layer_page_head_layout>>);

constexpr int layers = 2, heads = 2, dim = 16, page = 4, pages = 8;

float value(int kv, int layer, int slot, int head, int d) {
  return static_cast<float>(((kv * 7 + layer * 13 + slot * 5 + head * 3 + d) % 97) - 48) / 16.0f;
}

// The same logical cache in both layouts.
struct both {
  std::vector<std::int32_t> table{5, 2, 7, 0, 3};  // 20 slots, scrambled pages
  std::vector<float> pk = std::vector<float>(static_cast<std::size_t>(layers * pages * heads * page * dim), -1.0f);
  std::vector<float> pv = pk;
  std::vector<float> dk = std::vector<float>(static_cast<std::size_t>(layers * 20 * heads * dim), -1.0f);
  std::vector<float> dv = dk;
  engine_view paged{pk.data(), pv.data(), {{layers, heads, dim}, table, page, pages}};
  medusa::kv_cache_view<float> dense = medusa::make_kv_view<float>(dk, dv, {layers, heads, dim}, 20);

  both() {
    for (int l = 0; l < layers; ++l)
      for (int s = 0; s < 20; ++s)
        for (int h = 0; h < heads; ++h)
          for (int d = 0; d < dim; ++d) {
            paged.k(l, s, h, d) = dense.k(l, s, h, d) = value(0, l, s, h, d);
            paged.v(l, s, h, d) = dense.v(l, s, h, d) = value(1, l, s, h, d);
          }
  }
  [[nodiscard]] bool same() const {
    for (int l = 0; l < layers; ++l)
      for (int s = 0; s < 20; ++s)
        for (int h = 0; h < heads; ++h)
          for (int d = 0; d < dim; ++d)
            if (paged.k(l, s, h, d) != dense.k(l, s, h, d) || paged.v(l, s, h, d) != dense.v(l, s, h, d)) return false;
    return true;
  }
};

}  // namespace

TEST_CASE("commit through an engine-defined layout moves the same rows as the dense layout") {
  const auto tree = medusa::tree::from_text("[[0],[1],[0,0],[0,1],[1,0],[0,0,0]]");
  both c;
  const int L = 9;
  const int path[] = {0, 2, 3};  // [0,0] is not a child of [1]: rejected before anything moves
  try {
    (void)medusa::kv_commit(c.paged, L, tree, path);
    FAIL("no exception");
  } catch (const medusa::kv_cache_error& e) {
    CHECK(e.code() == medusa::kv_errc::path_not_in_tree);
  }
  CHECK(c.same());
  const int ok[] = {0, 1, 3, 6};  // root -> [0] -> [0,0] -> [0,0,0]
  const int n1 = medusa::kv_commit(c.paged, L, tree, ok);
  const int n2 = medusa::kv_commit(c.dense, L, tree, ok);
  CHECK(n1 == L + 4);
  CHECK(n1 == n2);
  CHECK(c.same());
  CHECK(c.paged.k(1, L + 3, 1, 5) == value(0, 1, L + 6, 1, 5));
}

TEST_CASE("tree attention through an engine-defined layout equals the dense layout") {
  const auto tree = medusa::tree::from_text("[[0],[1],[0,0],[0,1],[1,0],[0,0,0]]");
  both c;
  const int L = 13, n = tree.num_nodes(), hq = 4;
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> q(static_cast<std::size_t>(n * hq * dim)), a(q.size()), b(q.size());
  for (float& x : q) x = nd(rng);
  for (int layer = 0; layer < layers; ++layer) {
    medusa::tree_attention(c.paged, layer, L, q, hq, tree, a);
    medusa::tree_attention(c.dense, layer, L, q, hq, tree, b);
    for (std::size_t i = 0; i < a.size(); ++i) REQUIRE(std::abs(a[i] - b[i]) < 1e-6f);
  }
  // The layout's own check runs first: a block outside the pool, or slots the table does not map.
  c.table[4] = pages;
  CHECK_THROWS_AS(medusa::tree_attention(c.paged, 0, L, q, hq, tree, a), medusa::kv_cache_error);
  try {
    medusa::kv_check_append(c.paged, 15, 6);
    FAIL("no exception");
  } catch (const medusa::kv_cache_error& e) {
    CHECK(e.code() == medusa::kv_errc::block_table_too_short);
  }
}
