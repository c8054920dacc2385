// SPDX-License-Identifier: Apache-2.0
// Compile-time trees: static_assert-checked properties (worked example, presets, a 256-node tree,
// use as a template argument), compile-time == run-time buffers for every preset, and the preset
// table of docs/tree.md including its SHA-256 hash column (a tiny SHA-256 lives below).
#include <medusa/tree.hpp>
#include <medusa/tree/presets.hpp>

#include <doctest/doctest.h>

#include <array>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <span>
#include <sstream>
#include <string>
#include <vector>

namespace {

// ---- compile-time checks -----------------------------------------------------------------------
constexpr auto demo = medusa::static_tree_from<"[[0],[0,0],[0,1],[0,2],[1],[1,0],[1,1],[1,2]]">;
static_assert(demo.num_nodes() == 9 && demo.depth() == 2 && demo.topk() == 10 && demo.num_leaves() == 6);
static_assert(demo.parent(0) == -1 && demo.parent(2) == 0 && demo.parent(5) == 1 && demo.parent(8) == 2);
static_assert(demo.tree_index(3) == 11 && demo.tree_index(6) == 11 && demo.tree_index(8) == 13);
static_assert(demo.node_depth(0) == 0 && demo.node_depth(1) == 1 && demo.node_depth(8) == 2);
static_assert(demo.retrieve(0, 0) == 0 && demo.retrieve(0, 1) == 2 && demo.retrieve(0, 2) == 8);
static_assert(demo.retrieve(5, 1) == 1 && demo.retrieve(5, 2) == 3);
static_assert(demo.words_per_row() == 1);
static_assert(demo.packed_mask_word(0, 0) == 0x001 && demo.packed_mask_word(3, 0) == 0x00B &&
              demo.packed_mask_word(6, 0) == 0x045 && demo.packed_mask_word(8, 0) == 0x105);
static_assert(demo.mask(8, 2) && !demo.mask(8, 1) && demo.mask(4, 0) && !demo.mask(0, 4));
static_assert(demo.child_begin(0) == 1 && demo.child_count(0) == 2 && demo.child_begin(2) == 6 &&
              demo.child_count(2) == 3 && demo.child_count(7) == 0);
static_assert(demo.depth_begin(0) == 0 && demo.depth_begin(1) == 1 && demo.depth_begin(2) == 3 &&
              demo.depth_begin(3) == 9);
static_assert(demo.max_rank(1) == 1 && demo.max_rank(2) == 2);
static_assert(medusa::next_sibling(demo, 6) == 7 && medusa::first_child(demo, 1) == 3);
static_assert(medusa::tree_like<decltype(demo)>);

// the Python literal form and input order give the same value
static_assert(medusa::static_tree_from<"[(1,), (0, 2), (0,), (1, 0), (0, 1), (1, 2), (0, 0), (1, 1)]"> == demo);
// padding and a single-node tree
constexpr auto mixed = medusa::static_tree_from<"[[0],[1],[0,0],[0,1],[1,0],[0,0,0],[2],[0,0,0,0],[0,1,0]]">;
static_assert(mixed.retrieve(3, 0) == 0 && mixed.retrieve(3, 1) == 3 && mixed.retrieve(3, 2) == -1);
static_assert(mixed.retrieve(0, 4) == 9 && mixed.depth() == 4);
static_assert(medusa::static_tree_from<"[[0]]">.num_nodes() == 2);
// options as a template argument
constexpr auto k5 = medusa::static_tree_from<"[[0],[0,3],[0,3,4]]", medusa::tree_options{.topk = 5}>;
static_assert(k5.topk() == 5 && k5.tree_index(2) == 9 && k5.tree_index(3) == 15);

// the preset table of docs/tree.md, at compile time
template <auto T>
constexpr std::array<int, 5> per_depth() {
  std::array<int, 5> a{};
  for (int d = 1; d <= T.depth(); ++d) a[static_cast<std::size_t>(d)] = T.depth_begin(d + 1) - T.depth_begin(d);
  return a;
}
namespace p = medusa::presets;
static_assert(p::named<"mc_sim_7b_63">.num_nodes() == 64);
static_assert(per_depth<p::named<"mc_sim_7b_63">>() == std::array<int, 5>{0, 10, 28, 23, 2} && p::named<"mc_sim_7b_63">.num_leaves() == 42);
static_assert(per_depth<p::named<"vicuna_7b_stage2">>() == std::array<int, 5>{0, 10, 23, 23, 7} && p::named<"vicuna_7b_stage2">.num_leaves() == 42);
static_assert(per_depth<p::named<"vicuna_7b_stage1_ablation">>() == std::array<int, 5>{0, 10, 21, 25, 7} &&
              p::named<"vicuna_7b_stage1_ablation">.num_leaves() == 42);
static_assert(per_depth<p::named<"vicuna_7b_stage1">>() == std::array<int, 5>{0, 10, 32, 20, 1} && p::named<"vicuna_7b_stage1">.num_leaves() == 44);
static_assert(per_depth<p::named<"vicuna_13b_stage2">>() == std::array<int, 5>{0, 10, 19, 25, 9} && p::named<"vicuna_13b_stage2">.num_leaves() == 42);
static_assert(per_depth<p::named<"vicuna_13b_stage1">>() == std::array<int, 5>{0, 10, 29, 23, 1} && p::named<"vicuna_13b_stage1">.num_leaves() == 44);
static_assert(per_depth<p::named<"vicuna_33b_stage2">>() == std::array<int, 5>{0, 10, 24, 24, 5} && p::named<"vicuna_33b_stage2">.num_leaves() == 43);
static_assert(per_depth<p::named<"vicuna_33b_stage1">>() == std::array<int, 5>{0, 10, 34, 19, 0} && p::named<"vicuna_33b_stage1">.num_leaves() == 46);
static_assert(per_depth<p::named<"zephyr_stage2">>() == std::array<int, 5>{0, 10, 27, 23, 3} && p::named<"zephyr_stage2">.num_leaves() == 44);
static_assert(p::named<"vicuna_33b_stage1">.depth() == 3 && p::named<"zephyr_stage2">.depth() == 4);
static_assert(p::named<"mc_sim_7b_63">.max_rank(1) == 9 && p::named<"mc_sim_7b_63">.max_rank(4) == 1);

// a kernel-style template instantiated per tree shape
template <auto Tree>
  requires medusa::tree_like<decltype(Tree)>
constexpr int deepest_leaf_row() {
  return Tree.retrieve(0, Tree.depth());
}
static_assert(deepest_leaf_row<p::named<"mc_sim_7b_63">>() == 63);
static_assert(deepest_leaf_row<demo>() == 8);
// named tag types (for __global__ kernels) carry the same value
static_assert(p::tag_of<"zephyr_stage2">::tree == p::named<"zephyr_stage2"> && p::tag_of<"zephyr_stage2">::name == "zephyr_stage2");
static_assert(deepest_leaf_row<p::tag_of<"vicuna_33b_stage1">::tree>() == 63);
static_assert(p::tag<0>::name == medusa::preset_names()[0] && p::tag<8>::index == 8);
static_assert(p::all.size() == medusa::preset_table.size() && p::all[3] == p::tag<3>::tree);

// from a constexpr array of paths: the same value as from text, in any input order
constexpr medusa::tree_path demo_paths[] = {{1, 2}, {0}, {0, 0}, {1}, {0, 1}, {0, 2}, {1, 0}, {1, 1}};
static_assert(medusa::static_tree_of<demo_paths> == demo);
constexpr std::array<medusa::tree_path, 3> k5_paths{{{0}, {0, 3}, {0, 3, 4}}};
static_assert(medusa::static_tree_of<k5_paths, medusa::tree_options{.topk = 5}> == k5);

// the spans of the run-time tree, at compile time
static_assert(demo.node_depths().size() == 9 && demo.node_depths()[8] == 2 && demo.node_depth(2) == 1);
static_assert(demo.parents()[5] == 1 && demo.ranks()[5] == 2 && demo.tree_indices()[8] == 13);
static_assert(demo.retrieve_indices().size() == 6 * 3 && demo.retrieve_indices()[2] == 8);
static_assert(demo.packed_mask().size() == 9 && demo.packed_mask()[8] == 0x105);
static_assert(demo.mask_view().words_per_row == 1 && demo.mask_view().visible(8, 2) && !demo.mask_view().visible(8, 1));
static_assert(demo.depth_begins().size() == 4 && demo.max_ranks().size() == 3 && demo.leaves().size() == 6);
static_assert(demo.child_begins()[2] == 6 && demo.child_counts()[2] == 3);
constexpr auto positions = [] {
  std::array<int, 9> out{};
  medusa::write_node_positions(demo, 100, out.data());
  return out;
}();
static_assert(positions[0] == 100 && positions[3] == 102);

// the largest static tree: 15 depth-1 nodes and 15 * 16 depth-2 nodes, topk 16 -> 256 nodes
constexpr auto big = medusa::static_tree_from<
    "[[0],[1],[2],[3],[4],[5],[6],[7],[8],[9],[10],[11],[12],[13],[14],"
    "[0,0],[0,1],[0,2],[0,3],[0,4],[0,5],[0,6],[0,7],[0,8],[0,9],[0,10],[0,11],[0,12],[0,13],[0,14],[0,15],"
    "[1,0],[1,1],[1,2],[1,3],[1,4],[1,5],[1,6],[1,7],[1,8],[1,9],[1,10],[1,11],[1,12],[1,13],[1,14],[1,15],"
    "[2,0],[2,1],[2,2],[2,3],[2,4],[2,5],[2,6],[2,7],[2,8],[2,9],[2,10],[2,11],[2,12],[2,13],[2,14],[2,15],"
    "[3,0],[3,1],[3,2],[3,3],[3,4],[3,5],[3,6],[3,7],[3,8],[3,9],[3,10],[3,11],[3,12],[3,13],[3,14],[3,15],"
    "[4,0],[4,1],[4,2],[4,3],[4,4],[4,5],[4,6],[4,7],[4,8],[4,9],[4,10],[4,11],[4,12],[4,13],[4,14],[4,15],"
    "[5,0],[5,1],[5,2],[5,3],[5,4],[5,5],[5,6],[5,7],[5,8],[5,9],[5,10],[5,11],[5,12],[5,13],[5,14],[5,15],"
    "[6,0],[6,1],[6,2],[6,3],[6,4],[6,5],[6,6],[6,7],[6,8],[6,9],[6,10],[6,11],[6,12],[6,13],[6,14],[6,15],"
    "[7,0],[7,1],[7,2],[7,3],[7,4],[7,5],[7,6],[7,7],[7,8],[7,9],[7,10],[7,11],[7,12],[7,13],[7,14],[7,15],"
    "[8,0],[8,1],[8,2],[8,3],[8,4],[8,5],[8,6],[8,7],[8,8],[8,9],[8,10],[8,11],[8,12],[8,13],[8,14],[8,15],"
    "[9,0],[9,1],[9,2],[9,3],[9,4],[9,5],[9,6],[9,7],[9,8],[9,9],[9,10],[9,11],[9,12],[9,13],[9,14],[9,15],"
    "[10,0],[10,1],[10,2],[10,3],[10,4],[10,5],[10,6],[10,7],[10,8],[10,9],[10,10],[10,11],[10,12],[10,13],[10,14],[10,15],"
    "[11,0],[11,1],[11,2],[11,3],[11,4],[11,5],[11,6],[11,7],[11,8],[11,9],[11,10],[11,11],[11,12],[11,13],[11,14],[11,15],"
    "[12,0],[12,1],[12,2],[12,3],[12,4],[12,5],[12,6],[12,7],[12,8],[12,9],[12,10],[12,11],[12,12],[12,13],[12,14],[12,15],"
    "[13,0],[13,1],[13,2],[13,3],[13,4],[13,5],[13,6],[13,7],[13,8],[13,9],[13,10],[13,11],[13,12],[13,13],[13,14],[13,15],"
    "[14,0],[14,1],[14,2],[14,3],[14,4],[14,5],[14,6],[14,7],[14,8],[14,9],[14,10],[14,11],[14,12],[14,13],[14,14],[14,15]]",
    medusa::tree_options{.topk = 16}>;
static_assert(big.num_nodes() == 256 && big.words_per_row() == 8 && big.num_leaves() == 240);
static_assert(big.parent(255) == 15 && big.tree_index(255) == 1 + 16 + 15 && big.max_rank(1) == 14);
static_assert(big.packed_mask_word(255, 7) == 0x80000000u && big.packed_mask_word(255, 0) == 0x00008001u);

// ---- a tiny SHA-256 (FIPS 180-4), for the hash column of the preset table -----------------------
std::string sha256_hex(const std::string& msg) {
  static constexpr std::uint32_t k[64] = {
      0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5, 0xd807aa98,
      0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786,
      0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8,
      0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13,
      0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819,
      0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a,
      0x5b9cca4f, 0x682e6ff3, 0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
      0xc67178f2};
  std::uint32_t h[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  std::string m = msg;
  const std::uint64_t bits = static_cast<std::uint64_t>(msg.size()) * 8;
  m += static_cast<char>(0x80);
  while (m.size() % 64 != 56) m += '\0';
  for (int i = 7; i >= 0; --i) m += static_cast<char>((bits >> (8 * i)) & 0xff);
  auto rotr = [](std::uint32_t x, int n) { return (x >> n) | (x << (32 - n)); };
  for (std::size_t off = 0; off < m.size(); off += 64) {
    std::uint32_t w[64];
    for (int i = 0; i < 16; ++i) {
      w[i] = 0;
      for (int b = 0; b < 4; ++b)
        w[i] = (w[i] << 8) | static_cast<unsigned char>(m[off + static_cast<std::size_t>(4 * i + b)]);
    }
    for (int i = 16; i < 64; ++i) {
      const std::uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
      const std::uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
      w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    std::uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], hh = h[7];
    for (int i = 0; i < 64; ++i) {
      const std::uint32_t t1 = hh + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + k[i] + w[i];
      const std::uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
      hh = g;
      g = f;
      f = e;
      e = d + t1;
      d = c;
      c = b;
      b = a;
      a = t1 + t2;
    }
    h[0] += a; h[1] += b; h[2] += c; h[3] += d; h[4] += e; h[5] += f; h[6] += g; h[7] += hh;
  }
  std::string hex;
  char buf[9];
  for (const std::uint32_t x : h) {
    std::snprintf(buf, sizeof buf, "%08x", x);
    hex += buf;
  }
  return hex;
}

std::string compact_json(const std::vector<std::vector<int>>& paths) {
  std::string s = "[";
  for (std::size_t k = 0; k < paths.size(); ++k) {
    s += k ? ",[" : "[";
    for (std::size_t j = 0; j < paths[k].size(); ++j) {
      if (j) s += ',';
      s += std::to_string(paths[k][j]);
    }
    s += "]";
  }
  return s + "]";
}

// The sorted paths of any tree_like, rebuilt from parent and rank.
template <medusa::tree_like T>
std::vector<std::vector<int>> paths_of(const T& t) {
  std::vector<std::vector<int>> out;
  for (int i = 1; i < t.num_nodes(); ++i) {
    std::vector<int> p;
    for (int n = i; n > 0; n = t.parent(n)) p.insert(p.begin(), t.rank(n));
    out.push_back(p);
  }
  return out;
}

template <class T>
std::vector<T> to_vector(std::span<const T> s) {
  return {s.begin(), s.end()};
}

template <medusa::tree_like A, medusa::tree_like B>
void check_identical(const A& a, const B& b) {
  REQUIRE(a.num_nodes() == b.num_nodes());
  CHECK(a.depth() == b.depth());
  CHECK(a.topk() == b.topk());
  CHECK(a.num_leaves() == b.num_leaves());
  CHECK(a.words_per_row() == b.words_per_row());
  const int n = a.num_nodes();
  for (int i = 0; i < n; ++i) {
    REQUIRE(a.parent(i) == b.parent(i));
    REQUIRE(a.node_depth(i) == b.node_depth(i));
    REQUIRE(a.rank(i) == b.rank(i));
    REQUIRE(a.tree_index(i) == b.tree_index(i));
    REQUIRE(a.child_begin(i) == b.child_begin(i));
    REQUIRE(a.child_count(i) == b.child_count(i));
    for (int w = 0; w < a.words_per_row(); ++w) REQUIRE(a.packed_mask_word(i, w) == b.packed_mask_word(i, w));
    for (int j = 0; j < n; ++j) REQUIRE(a.mask(i, j) == b.mask(i, j));
  }
  for (int d = 0; d <= a.depth() + 1; ++d) REQUIRE(a.depth_begin(d) == b.depth_begin(d));
  for (int d = 1; d <= a.depth(); ++d) REQUIRE(a.max_rank(d) == b.max_rank(d));
  for (int r = 0; r < a.num_leaves(); ++r)
    for (int c = 0; c <= a.depth(); ++c) REQUIRE(a.retrieve(r, c) == b.retrieve(r, c));
  // the same spans, of the same lengths
  CHECK(to_vector(a.parents()) == to_vector(b.parents()));
  CHECK(to_vector(a.node_depths()) == to_vector(b.node_depths()));
  CHECK(to_vector(a.ranks()) == to_vector(b.ranks()));
  CHECK(to_vector(a.tree_indices()) == to_vector(b.tree_indices()));
  CHECK(to_vector(a.retrieve_indices()) == to_vector(b.retrieve_indices()));
  CHECK(to_vector(a.packed_mask()) == to_vector(b.packed_mask()));
  CHECK(to_vector(a.child_begins()) == to_vector(b.child_begins()));
  CHECK(to_vector(a.child_counts()) == to_vector(b.child_counts()));
  CHECK(to_vector(a.depth_begins()) == to_vector(b.depth_begins()));
  CHECK(to_vector(a.max_ranks()) == to_vector(b.max_ranks()));
  CHECK(to_vector(a.leaves()) == to_vector(b.leaves()));
  for (int L : {0, 5}) {
    std::vector<std::uint8_t> sa(medusa::full_row_stream_bytes(n, L)), sb(sa.size());
    medusa::write_full_row_stream(a, L, sa);
    medusa::write_full_row_stream(b, L, sb);
    CHECK(sa == sb);
  }
  CHECK(medusa::same_shape(a, b));
}

}  // namespace

TEST_CASE("compile-time and run-time trees give identical buffers for every preset") {
  REQUIRE(medusa::preset_names().size() == medusa::presets::all.size());
  for (std::size_t i = 0; i < medusa::presets::all.size(); ++i) {
    const auto name = medusa::preset_names()[i];
    CAPTURE(name);
    const auto rt = medusa::tree::preset(name);
    check_identical(medusa::presets::all[i], rt);
    CHECK(paths_of(medusa::presets::all[i]) == rt.sorted_paths());
    for (std::size_t j = 0; j < medusa::presets::all.size(); ++j)
      CHECK(medusa::same_shape(medusa::presets::all[j], rt) == (i == j));
  }
  check_identical(demo, medusa::tree::from_text("[[0],[0,0],[0,1],[0,2],[1],[1,0],[1,1],[1,2]]"));
  check_identical(mixed, medusa::tree::from_text("[[0],[1],[0,0],[0,1],[1,0],[0,0,0],[2],[0,0,0,0],[0,1,0]]"));
  std::vector<std::vector<int>> paths;
  for (int a = 0; a < 15; ++a) paths.push_back({a});
  for (int a = 0; a < 15; ++a)
    for (int b = 0; b < 16; ++b) paths.push_back({a, b});
  check_identical(big, medusa::tree::from_paths(paths, {.topk = 16}));
}

TEST_CASE("preset table: nodes, depth, nodes per depth, leaves, hash") {
  struct row {
    const char* name;
    int depth;
    std::vector<int> per_depth;
    int leaves;
    const char* hash;
  };
  const row table[] = {
      {"mc_sim_7b_63", 4, {10, 28, 23, 2}, 42, "7e63acaa76293e94"},
      {"vicuna_7b_stage2", 4, {10, 23, 23, 7}, 42, "0c5a284e812ae126"},
      {"vicuna_7b_stage1_ablation", 4, {10, 21, 25, 7}, 42, "5fdf3d81f5f73037"},
      {"vicuna_7b_stage1", 4, {10, 32, 20, 1}, 44, "ff4bbdd31724dfb3"},
      {"vicuna_13b_stage2", 4, {10, 19, 25, 9}, 42, "f8d56c05f6889af0"},
      {"vicuna_13b_stage1", 4, {10, 29, 23, 1}, 44, "460a17cc4908c242"},
      {"vicuna_33b_stage2", 4, {10, 24, 24, 5}, 43, "0d8977dca014312c"},
      {"vicuna_33b_stage1", 3, {10, 34, 19}, 46, "c103f91c3f869f85"},
      {"zephyr_stage2", 4, {10, 27, 23, 3}, 44, "9bcf79a2d0dc3341"},
  };
  CHECK(sha256_hex("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  CHECK(sha256_hex(std::string(1000, 'a')).substr(0, 16) == "41edece42d63e8d9");
  for (std::size_t i = 0; i < std::size(table); ++i) {
    const auto& r = table[i];
    CAPTURE(r.name);
    CHECK(medusa::preset_names()[i] == r.name);
    const auto t = medusa::tree::preset(r.name);
    CHECK(t.num_nodes() == 64);
    CHECK(t.depth() == r.depth);
    std::vector<int> per;
    for (int d = 1; d <= t.depth(); ++d) per.push_back(t.depth_begin(d + 1) - t.depth_begin(d));
    CHECK(per == r.per_depth);
    CHECK(t.num_leaves() == r.leaves);
    CHECK(sha256_hex(compact_json(t.sorted_paths())).substr(0, 16) == r.hash);
    CHECK(t.max_rank(1) == 9);
  }
}

TEST_CASE("preset data matches the reference's preset module, in source order") {
  const std::filesystem::path spec_path = std::filesystem::path(MEDUSA_SHARED_DIR) / "docs/medusa-spec.md";
  std::ifstream in(spec_path);
  if (!in) {
    MESSAGE("skipped: " << spec_path << " not found");
    return;
  }
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string spec = ss.str();
  const auto appendix = spec.find("## Appendix A");
  REQUIRE(appendix != std::string::npos);
  for (const auto name : medusa::preset_names()) {
    CAPTURE(name);
    std::string quoted = "\"";
    quoted += name;
    quoted += "\": [";
    const auto key = spec.find(quoted, appendix);
    REQUIRE(key != std::string::npos);
    const auto open = spec.find('[', key);
    const auto close = spec.find("\n]", open);
    REQUIRE(close != std::string::npos);
    const std::string text = spec.substr(open, close + 2 - open);
    CHECK(medusa::parse_tree_text(text) == medusa::parse_tree_text(medusa::preset_text(name)));
  }
}
