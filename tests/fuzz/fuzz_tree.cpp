// SPDX-License-Identifier: Apache-2.0
// libFuzzer target for tree text (JSON `[[0],[0,0]]`, the Python literal `[(0,), (0, 0)]`, preset
// names): parse_tree_text, tree::from_text, tree::from_file on the same bytes, and a run-time tree
// built from whatever parses, with the default and the widest options. The three readers must
// agree, and every compiled tree must satisfy the compiler's invariants. Any crash, sanitizer
// report, broken invariant or exception other than medusa's typed errors is a bug.
#include <medusa/tree.hpp>

#include "fuzz_common.hpp"

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

namespace {

// The invariants of docs/tree.md that hold for every compiled tree.
void check_tree(const medusa::tree& t, const medusa::tree_options& o) {
  const int n = t.num_nodes();
  MEDUSA_FUZZ_CHECK(n >= 1 && n <= o.max_nodes);
  MEDUSA_FUZZ_CHECK(t.depth() >= 0 && t.depth() <= o.max_depth);
  MEDUSA_FUZZ_CHECK(t.sorted_paths().size() == static_cast<std::size_t>(n - 1));
  MEDUSA_FUZZ_CHECK(t.parent(0) == -1 && t.node_depth(0) == 0 && t.tree_index(0) == 0);
  for (int u = 1; u < n; ++u) {
    const int p = t.parent(u);
    MEDUSA_FUZZ_CHECK(p >= 0 && p < u);
    MEDUSA_FUZZ_CHECK(t.node_depth(u) == t.node_depth(p) + 1);
    MEDUSA_FUZZ_CHECK(t.rank(u) >= 0 && t.rank(u) < o.topk);
    MEDUSA_FUZZ_CHECK(t.mask(u, u) && t.mask(u, 0) && t.mask(u, p));
    MEDUSA_FUZZ_CHECK(!t.mask(p, u));
    const auto& path = t.sorted_paths()[static_cast<std::size_t>(u - 1)];
    MEDUSA_FUZZ_CHECK(path.size() == static_cast<std::size_t>(t.node_depth(u)) && path.back() == t.rank(u));
  }
  int children = 0;
  for (int u = 0; u < n; ++u) {
    children += t.child_count(u);
    for (int c = t.child_begin(u); c < t.child_begin(u) + t.child_count(u); ++c) MEDUSA_FUZZ_CHECK(t.parent(c) == u);
  }
  MEDUSA_FUZZ_CHECK(children == n - 1);
  const int cols = t.depth() + 1;
  for (int r = 0; r < t.num_leaves(); ++r) {
    const int leaf = t.leaf(r);
    MEDUSA_FUZZ_CHECK(leaf >= 0 && leaf < n && t.child_count(leaf) == 0);
    MEDUSA_FUZZ_CHECK(t.retrieve(r, 0) == 0 && t.retrieve(r, t.node_depth(leaf)) == leaf);
    for (int c = t.node_depth(leaf) + 1; c < cols; ++c) MEDUSA_FUZZ_CHECK(t.retrieve(r, c) == -1);
  }
}

std::optional<medusa::tree> compile_text(std::string_view text, const medusa::tree_options& o, medusa::tree_errc* code) {
  try {
    auto t = medusa::tree::from_text(text, o);
    check_tree(t, o);
    return t;
  } catch (const medusa::tree_error& e) {
    *code = e.code();
    return std::nullopt;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  constexpr medusa::tree_options defaults{};
  constexpr medusa::tree_options widest{medusa::max_tree_topk, medusa::max_tree_depth, medusa::max_tree_nodes};

  // 1. The parser alone, then a tree from its paths.
  std::optional<std::vector<std::vector<int>>> paths;
  try {
    paths = medusa::parse_tree_text(text);
  } catch (const medusa::tree_error& e) {
    MEDUSA_FUZZ_CHECK(e.code() == medusa::tree_errc::malformed_text || e.code() == medusa::tree_errc::too_many_nodes);
  }
  for (const auto& o : {defaults, widest}) {
    std::optional<medusa::tree> from_paths;
    if (paths) {
      try {
        from_paths = medusa::tree::from_paths(*paths, o);
        check_tree(*from_paths, o);
      } catch (const medusa::tree_error&) {
      }
    }
    // 2. The same text through tree::from_text: what parses as paths compiles the same way.
    medusa::tree_errc code{};
    const auto from_text = compile_text(text, o, &code);
    if (from_paths) {
      MEDUSA_FUZZ_CHECK(from_text.has_value());
      MEDUSA_FUZZ_CHECK(from_text->sorted_paths() == from_paths->sorted_paths());
    }
    // 3. And from a file: the same outcome as the text.
    const auto file = medusa_fuzz::input_file(data, size, "tree.json");
    try {
      const auto t = medusa::tree::from_file(file, o);
      check_tree(t, o);
      MEDUSA_FUZZ_CHECK(from_text.has_value() && t.sorted_paths() == from_text->sorted_paths());
    } catch (const medusa::tree_error& e) {
      MEDUSA_FUZZ_CHECK(!from_text.has_value() && e.code() == code);
    }
  }
  return 0;
}
