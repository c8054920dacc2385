// SPDX-License-Identifier: Apache-2.0
// Property tests of the run-time tree compiler on seeded random prefix-closed trees (2..1024
// nodes, plus a 4096-node one), against a naive re-implementation of the reference; and a
// randomized "garbage text never crashes: success or tree_error" test.
#include <medusa/tree.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

namespace {

using medusa::tree;
using paths_t = std::vector<std::vector<int>>;

// A random prefix-closed tree with `n` nodes (root included): each new node is a child, with an
// unused random rank, of a random node that still has room.
paths_t random_tree(std::mt19937& rng, int n, int topk, int max_depth) {
  long long capacity = 1, level = 1;  // nodes of the full tree, capped
  for (int d = 1; d <= max_depth && capacity < n; ++d) {
    level = std::min<long long>(level * topk, n);
    capacity += level;
  }
  n = static_cast<int>(std::min<long long>(n, capacity));
  paths_t nodes{{}};  // index 0 = root (empty path)
  std::vector<std::set<int>> used(1);
  while (static_cast<int>(nodes.size()) < n) {
    const auto p = static_cast<std::size_t>(std::uniform_int_distribution<int>(0, static_cast<int>(nodes.size()) - 1)(rng));
    if (static_cast<int>(nodes[p].size()) >= max_depth || static_cast<int>(used[p].size()) >= topk) continue;
    int r;
    do r = std::uniform_int_distribution<int>(0, topk - 1)(rng);
    while (used[p].count(r));
    used[p].insert(r);
    auto child = nodes[p];
    child.push_back(r);
    nodes.push_back(child);
    used.emplace_back();
  }
  nodes.erase(nodes.begin());
  std::shuffle(nodes.begin(), nodes.end(), rng);
  return nodes;
}

// The reference's generate_medusa_buffers, written naively from the buffer definitions in
// docs/tree.md.
struct reference {
  paths_t sorted;
  std::vector<int> parent, position, tree_index;
  std::vector<std::vector<int>> retrieve;
  explicit reference(paths_t paths, int topk) {
    std::sort(paths.begin(), paths.end(), [](const auto& a, const auto& b) {
      return a.size() != b.size() ? a.size() < b.size() : a < b;
    });
    sorted = paths;
    std::map<std::vector<int>, int> id{{{}, 0}};
    for (std::size_t i = 0; i < sorted.size(); ++i) id[sorted[i]] = static_cast<int>(i) + 1;
    parent = {-1};
    position = {0};
    tree_index = {0};
    std::size_t depth = 0;
    for (const auto& p : sorted) {
      parent.push_back(id.at(std::vector<int>(p.begin(), p.end() - 1)));
      position.push_back(static_cast<int>(p.size()));
      tree_index.push_back(1 + topk * (static_cast<int>(p.size()) - 1) + p.back());
      depth = std::max(depth, p.size());
    }
    // walk the sorted list backwards, skipping prefixes of rows already emitted
    std::vector<std::vector<int>> emitted;
    for (auto it = sorted.rbegin(); it != sorted.rend(); ++it) {
      const auto& p = *it;
      bool prefix = false;
      for (const auto& e : emitted)
        if (e.size() > p.size() && std::equal(p.begin(), p.end(), e.begin())) prefix = true;
      if (prefix) continue;
      emitted.push_back(p);
      std::vector<int> row{0};
      for (std::size_t l = 1; l <= p.size(); ++l) row.push_back(id.at(std::vector<int>(p.begin(), p.begin() + static_cast<long>(l))));
      row.resize(depth + 1, -1);
      retrieve.push_back(row);
    }
  }
};

bool is_ancestor_or_self(const tree& t, int a, int node) {
  for (; node >= 0; node = t.parent(node))
    if (node == a) return true;
  return false;
}

void check_properties(const tree& t, const paths_t& input) {
  const int n = t.num_nodes();
  REQUIRE(n == static_cast<int>(input.size()) + 1);
  // position = depth = length of the node's path; parent path = path minus its last rank
  CHECK(t.parent(0) == -1);
  CHECK(t.node_depth(0) == 0);
  CHECK(t.rank(0) == -1);
  for (int i = 1; i < n; ++i) {
    const auto& p = t.sorted_paths()[static_cast<std::size_t>(i) - 1];
    REQUIRE(t.node_depth(i) == static_cast<int>(p.size()));
    REQUIRE(t.rank(i) == p.back());
    REQUIRE(t.parent(i) < i);
    REQUIRE(t.node_depth(t.parent(i)) == t.node_depth(i) - 1);
    REQUIRE(t.tree_index(i) == 1 + t.topk() * (t.node_depth(i) - 1) + t.rank(i));
  }
  // mask(i, j) == j is i or an ancestor of i; packed == dense; padding bits zero
  const int w = t.words_per_row();
  CHECK(w == (n + 31) / 32);
  CHECK(static_cast<int>(t.packed_mask().size()) == n * w);
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      const bool m = t.mask(i, j);
      if (m != is_ancestor_or_self(t, j, i) || m != medusa::is_ancestor_or_self(t, j, i) ||
          m != (((t.packed_mask_word(i, j / 32) >> (j % 32)) & 1u) != 0)) {
        FAIL("mask mismatch at " << i << "," << j);
      }
    }
    for (int j = n; j < 32 * w; ++j) REQUIRE(((t.packed_mask_word(i, j / 32) >> (j % 32)) & 1u) == 0);
  }
  // children: contiguous, ascending rank, CSR-consecutive; first_child / next_sibling agree
  for (int i = 0; i < n; ++i) {
    const int b = t.child_begin(i), c = t.child_count(i);
    if (i + 1 < n) REQUIRE(b + c == t.child_begin(i + 1));
    for (int k = b; k < b + c; ++k) {
      REQUIRE(t.parent(k) == i);
      if (k > b) REQUIRE(t.rank(k) > t.rank(k - 1));
      REQUIRE(medusa::next_sibling(t, k) == (k + 1 < b + c ? k + 1 : -1));
    }
    REQUIRE(medusa::first_child(t, i) == (c ? b : -1));
  }
  int counted = 0;
  for (int i = 0; i < n; ++i) counted += t.child_count(i);
  CHECK(counted == n - 1);
  // depth_begin and max_rank
  CHECK(t.depth_begin(0) == 0);
  CHECK(t.depth_begin(1) == 1);
  CHECK(t.depth_begin(t.depth() + 1) == n);
  for (int d = 1; d <= t.depth(); ++d) {
    REQUIRE(t.depth_begin(d) < t.depth_begin(d + 1));  // no gaps in depth
    int mr = -1;
    for (int i = t.depth_begin(d); i < t.depth_begin(d + 1); ++i) {
      REQUIRE(t.node_depth(i) == d);
      mr = std::max(mr, t.rank(i));
    }
    REQUIRE(t.max_rank(d) == mr);
  }
  // retrieve: each row a root-to-leaf path, -1 padded, every leaf exactly once
  std::set<int> leaves_seen;
  int leaves = 0;
  for (int i = 0; i < n; ++i) leaves += t.child_count(i) == 0;
  CHECK(t.num_leaves() == leaves);
  CHECK(static_cast<int>(t.retrieve_indices().size()) == leaves * (t.depth() + 1));
  for (int r = 0; r < t.num_leaves(); ++r) {
    REQUIRE(t.retrieve(r, 0) == 0);
    int c = 1;
    while (c <= t.depth() && t.retrieve(r, c) >= 0) {
      REQUIRE(t.parent(t.retrieve(r, c)) == t.retrieve(r, c - 1));
      ++c;
    }
    const int leaf = t.retrieve(r, c - 1);
    REQUIRE(t.child_count(leaf) == 0);
    REQUIRE(t.leaf(r) == leaf);
    for (; c <= t.depth(); ++c) REQUIRE(t.retrieve(r, c) == -1);
    REQUIRE(leaves_seen.insert(leaf).second);
    if (r > 0) {  // depth descending, then canonical order descending
      const int prev = t.leaf(r - 1);
      REQUIRE((t.node_depth(prev) > t.node_depth(leaf) || (t.node_depth(prev) == t.node_depth(leaf) && prev > leaf)));
    }
  }
  // the naive reference gives the same buffers
  const reference ref(input, t.topk());
  CHECK(t.sorted_paths() == ref.sorted);
  CHECK(std::vector<int>(t.parents().begin(), t.parents().end()) == ref.parent);
  CHECK(std::vector<int>(t.node_depths().begin(), t.node_depths().end()) == ref.position);
  CHECK(std::vector<int>(t.tree_indices().begin(), t.tree_indices().end()) == ref.tree_index);
  std::vector<int> flat;
  for (const auto& row : ref.retrieve) flat.insert(flat.end(), row.begin(), row.end());
  CHECK(std::vector<int>(t.retrieve_indices().begin(), t.retrieve_indices().end()) == flat);
}

bool same_buffers(const tree& a, const tree& b) {
  auto eq = [](auto x, auto y) { return std::equal(x.begin(), x.end(), y.begin(), y.end()); };
  return a.sorted_paths() == b.sorted_paths() && eq(a.parents(), b.parents()) && eq(a.node_depths(), b.node_depths()) &&
         eq(a.ranks(), b.ranks()) && eq(a.tree_indices(), b.tree_indices()) &&
         eq(a.retrieve_indices(), b.retrieve_indices()) && eq(a.packed_mask(), b.packed_mask()) &&
         eq(a.child_begins(), b.child_begins()) && eq(a.depth_begins(), b.depth_begins()) &&
         eq(a.max_ranks(), b.max_ranks()) && a.topk() == b.topk();
}

std::string to_text(const paths_t& paths, bool python) {
  std::string s = "[";
  for (std::size_t k = 0; k < paths.size(); ++k) {
    if (k) s += python ? ", " : ",";
    s += python ? "(" : "[";
    for (std::size_t j = 0; j < paths[k].size(); ++j) {
      if (j) s += python ? ", " : ",";
      s += std::to_string(paths[k][j]);
    }
    if (python && paths[k].size() == 1) s += ",";
    s += python ? ")" : "]";
  }
  return s + "]";
}

}  // namespace

TEST_CASE("random trees: properties, reference equality, input order never matters") {
  std::mt19937 rng(20240117);
  const int sizes[] = {2, 3, 5, 9, 17, 33, 64, 65, 100, 256, 257, 500, 1024};
  for (int n : sizes) {
    for (int rep = 0; rep < (n <= 64 ? 20 : n <= 256 ? 4 : 1); ++rep) {
      const int topk = n > 200 ? std::uniform_int_distribution<int>(8, 40)(rng) : std::uniform_int_distribution<int>(1, 12)(rng);
      const int max_depth = std::uniform_int_distribution<int>(1, 16)(rng);
      const auto paths = random_tree(rng, n, topk, max_depth);
      CAPTURE(n);
      CAPTURE(topk);
      const auto t = tree::from_paths(paths, {.topk = topk, .max_depth = 16});
      check_properties(t, paths);
      auto shuffled = paths;
      std::shuffle(shuffled.begin(), shuffled.end(), rng);
      CHECK(same_buffers(t, tree::from_paths(shuffled, {.topk = topk})));
      CHECK(same_buffers(t, tree::from_text(to_text(shuffled, rep % 2 == 1), {.topk = topk})));
    }
  }
}

TEST_CASE("a 1024-node tree and a 4096-node tree") {
  // full two-level tree: 31 depth-1 nodes, 31 * 32 = 992 depth-2 nodes -> 1024 nodes
  paths_t paths;
  for (int a = 0; a < 31; ++a) paths.push_back({a});
  for (int a = 0; a < 31; ++a)
    for (int b = 0; b < 32; ++b) paths.push_back({a, b});
  const auto t = tree::from_paths(paths, {.topk = 32});
  CHECK(t.num_nodes() == 1024);
  CHECK(t.words_per_row() == 32);
  CHECK(t.num_leaves() == 992);
  CHECK(t.max_rank(1) == 30);
  CHECK(t.max_rank(2) == 31);
  CHECK(t.retrieve(0, 2) == 1023);
  CHECK(t.tree_index(1023) == 1 + 32 + 31);
  CHECK(t.mask(1023, 31));
  CHECK_FALSE(t.mask(1023, 30));
  check_properties(t, paths);

  std::mt19937 rng(7);
  const auto big = random_tree(rng, 4096, 20, 16);
  const auto tb = tree::from_paths(big, {.topk = 20});
  CHECK(tb.num_nodes() == 4096);
  CHECK_THROWS_AS((void)tree::from_paths(random_tree(rng, 4097, 20, 16), {.topk = 20}), medusa::tree_error);
  CHECK(tree::from_paths(random_tree(rng, 4097, 20, 16), {.topk = 20, .max_nodes = 8192}).num_nodes() == 4097);
}

TEST_CASE("invalid random trees are rejected with the documented code") {
  std::mt19937 rng(99);
  for (int rep = 0; rep < 200; ++rep) {
    auto paths = random_tree(rng, std::uniform_int_distribution<int>(3, 60)(rng), 6, 5);
    auto bad = paths;
    const auto k = static_cast<std::size_t>(std::uniform_int_distribution<int>(0, static_cast<int>(bad.size()) - 1)(rng));
    medusa::tree_errc want{};
    switch (rep % 4) {
      case 0:  // duplicate
        bad.push_back(bad[k]);
        want = medusa::tree_errc::duplicate_path;
        break;
      case 1:  // rank out of range
        bad[k].back() = 6;
        want = medusa::tree_errc::rank_out_of_range;
        break;
      case 2: {  // remove a node that has a child -> not prefix-closed
        const auto it = std::find_if(bad.begin(), bad.end(), [&](const auto& p) {
          return std::any_of(bad.begin(), bad.end(), [&](const auto& q) {
            return q.size() == p.size() + 1 && std::equal(p.begin(), p.end(), q.begin());
          });
        });
        if (it == bad.end()) continue;
        bad.erase(it);
        want = medusa::tree_errc::not_prefix_closed;
        break;
      }
      default:  // too deep
        bad[k].resize(6, 0);
        want = medusa::tree_errc::too_deep;
        break;
    }
    medusa::tree_errc got{};
    CHECK_FALSE(tree::try_from_paths(bad, {.topk = 6, .max_depth = 5}, &got).has_value());
    CHECK(got == want);
  }
}

TEST_CASE("garbage text never crashes: success or tree_error") {
  std::mt19937 rng(12345);
  const std::string alphabet = "[](),- 0123456789\n\t.e+x\"";
  const std::string seeds[] = {"[[0],[1],[0,0],[0,1],[1,0]]", "[(0,), (1,), (0, 0)]", "mc_sim_7b_63",
                               std::string(medusa::preset_text("zephyr_stage2"))};
  int ok = 0, rejected = 0;
  auto run = [&](const std::string& s) {
    try {
      const auto t = tree::from_text(s, {.topk = 10, .max_depth = 16, .max_nodes = 512});
      // a success is a valid tree
      REQUIRE(t.num_nodes() >= 2);
      for (int i = 1; i < t.num_nodes(); ++i) REQUIRE(t.parent(i) < i);
      ++ok;
    } catch (const medusa::tree_error& e) {
      REQUIRE(std::string(e.what()).find('\n') == std::string::npos);
      ++rejected;
    }
  };
  for (int it = 0; it < 20000; ++it) {
    std::string s;
    const int mode = it % 4;
    if (mode == 0) {  // random characters from the grammar's alphabet
      const int len = std::uniform_int_distribution<int>(0, 40)(rng);
      for (int i = 0; i < len; ++i) s += alphabet[std::uniform_int_distribution<std::size_t>(0, alphabet.size() - 1)(rng)];
    } else if (mode == 1) {  // random bytes
      const int len = std::uniform_int_distribution<int>(0, 24)(rng);
      for (int i = 0; i < len; ++i) s += static_cast<char>(std::uniform_int_distribution<int>(0, 255)(rng));
    } else {  // mutations of valid texts
      s = seeds[static_cast<std::size_t>(it) % 4];
      const int edits = std::uniform_int_distribution<int>(1, 4)(rng);
      for (int e = 0; e < edits && !s.empty(); ++e) {
        const auto pos = std::uniform_int_distribution<std::size_t>(0, s.size() - 1)(rng);
        const char c = alphabet[std::uniform_int_distribution<std::size_t>(0, alphabet.size() - 1)(rng)];
        switch (std::uniform_int_distribution<int>(0, 2)(rng)) {
          case 0: s[pos] = c; break;
          case 1: s.insert(pos, 1, c); break;
          default: s.erase(pos, 1); break;
        }
      }
    }
    run(s);
  }
  // pathological inputs: deep nesting, huge numbers, long paths, many paths
  run(std::string(100000, '['));
  run(std::string(100000, '[') + std::string(100000, ']'));
  run("[[" + std::string(5000, '9') + "]]");
  run("[[-" + std::string(5000, '9') + "]]");
  run("[[0" + std::string(20000, ',') + "]]");
  {
    std::string s = "[[0";
    for (int i = 0; i < 100000; ++i) s += ",0";
    run(s + "]]");
  }
  {
    std::string s = "[";
    for (int i = 0; i < 100000; ++i) s += "[0],";
    run(s + "]");
  }
  run(std::string("[[0],[1]]\0", 10));
  CHECK(ok > 0);
  CHECK(rejected > 0);
  MESSAGE("garbage: " << ok << " accepted, " << rejected << " rejected");
}
