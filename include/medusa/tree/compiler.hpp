// SPDX-License-Identifier: Apache-2.0
//! @file tree/compiler.hpp
//! The tree compiler core, shared by run-time and compile-time trees: validation in a fixed
//! order, the canonical sort, and every buffer (parents, depths, ranks, tree indices, children,
//! per-depth offsets, leaves, packed ancestor mask). Everything here is `constexpr`, allocates
//! nothing and reports problems as a `detail::tree_fault`; `detail::throw_fault` turns one into a
//! `tree_error` with a message at run time.
#pragma once

#include <medusa/config.hpp>
#include <medusa/error.hpp>
#include <medusa/tree/errors.hpp>
#include <medusa/tree/options.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <string>
#include <string_view>

MEDUSA_NAMESPACE_BEGIN

namespace detail {

constexpr tree_fault check_options(const tree_options& o) {
  tree_fault f;
  f.bad_options = f.failed = true;
  f.lowest = 1;
  if (o.topk < 1 || o.topk > max_tree_topk) {
    f.reason = "topk";
    f.value = o.topk;
    f.other = max_tree_topk;
  } else if (o.max_depth < 1 || o.max_depth > max_tree_depth) {
    f.reason = "max_depth";
    f.value = o.max_depth;
    f.other = max_tree_depth;
  } else if (o.max_nodes < 2 || o.max_nodes > max_tree_nodes) {
    f.reason = "max_nodes";
    f.lowest = 2;
    f.value = o.max_nodes;
    f.other = max_tree_nodes;
  } else {
    return tree_fault{};
  }
  return f;
}

// ---- the compiler core, shared by run-time and compile-time trees ----------------------------
// Paths in CSR form: path k is flat[begin[k] .. begin[k+1]).
struct path_list {
  const int* flat = nullptr;
  const int* begin = nullptr;
  int count = 0;
  constexpr int len(int k) const { return begin[k + 1] - begin[k]; }
  constexpr const int* data(int k) const { return flat + begin[k]; }
};

constexpr int compare_ranks(const int* a, const int* b, int len) {
  for (int i = 0; i < len; ++i)
    if (a[i] != b[i]) return a[i] < b[i] ? -1 : 1;
  return 0;
}

// Canonical order: (length, path); ties (duplicates) by input index so the sort is total.
constexpr bool canonical_less(const path_list& in, int x, int y) {
  const int lx = in.len(x), ly = in.len(y);
  if (lx != ly) return lx < ly;
  const int c = compare_ranks(in.data(x), in.data(y), lx);
  if (c != 0) return c < 0;
  return x < y;
}

// Validation steps 1 (empty tree, node limit) and 2 (per path, input order: empty, ranks,
// depth); sets depth. The order is documented in docs/tree.md, Errors.
constexpr tree_fault validate_paths(const path_list& in, const tree_options& o, int& depth) {
  if (tree_fault f = check_options(o); f.failed) return f;
  if (in.count == 0) return fault(tree_errc::empty_tree, -1);
  if (in.count > o.max_nodes - 1) return fault(tree_errc::too_many_nodes, -1, in.count + 1LL, o.max_nodes);
  depth = 0;
  for (int k = 0; k < in.count; ++k) {
    const int len = in.len(k);
    if (len == 0) return fault(tree_errc::empty_path, k);
    const int* p = in.data(k);
    for (int j = 0; j < len; ++j)
      if (p[j] < 0 || p[j] >= o.topk) return fault(tree_errc::rank_out_of_range, k, p[j], o.topk);
    if (len > o.max_depth) return fault(tree_errc::too_deep, k, len, o.max_depth);
    depth = std::max(depth, len);
  }
  return tree_fault{};
}

// Where the core writes; sizes in brackets (N = paths + 1, W = ceil(N / 32)).
struct tree_out {
  int* order = nullptr;        // [N-1] scratch: node i >= 1 is input path order[i-1]
  int* parent = nullptr;       // [N]
  int* rank = nullptr;         // [N]
  int* node_depth = nullptr;   // [N]
  int* tree_index = nullptr;   // [N]
  int* child_begin = nullptr;  // [N]
  int* child_count = nullptr;  // [N]
  int* leaf = nullptr;         // [N] leaf node of each retrieve row
  int* depth_begin = nullptr;  // [depth + 2]
  int* max_rank = nullptr;     // [depth + 1]
  std::uint32_t* mask = nullptr;  // [N * W], zero-filled by the caller
  int num_leaves = 0;
};

// The compiler's outputs bound to a tree's own buffers: both tree types name them alike
// (`parent_`, `rank_`, ...), as arrays or vectors already sized for the tree.
template <class Tree>
constexpr tree_out bind_outputs(Tree& t, int* order) {
  tree_out out;
  out.order = order;
  out.parent = std::data(t.parent_);
  out.rank = std::data(t.rank_);
  out.node_depth = std::data(t.node_depth_);
  out.tree_index = std::data(t.tree_index_);
  out.child_begin = std::data(t.child_begin_);
  out.child_count = std::data(t.child_count_);
  out.leaf = std::data(t.leaf_);
  out.depth_begin = std::data(t.depth_begin_);
  out.max_rank = std::data(t.max_rank_);
  out.mask = std::data(t.mask_);
  return out;
}

// Retrieve rows from compiled outputs: row r is the path root..leaf(r), node of depth c in column
// c, -1 past the leaf; `depth + 1` columns per row.
constexpr void write_retrieve(const tree_out& out, int depth, int* retrieve) {
  const int cols = depth + 1;
  for (int row = 0; row < out.num_leaves; ++row) {
    int* r = retrieve + static_cast<std::size_t>(row) * static_cast<std::size_t>(cols);
    int node = out.leaf[row];
    for (int c = cols - 1; c > out.node_depth[node]; --c) r[c] = -1;
    for (int c = out.node_depth[node]; c >= 0; --c, node = out.parent[node]) r[c] = node;
  }
}

// Validation steps 3 (duplicates) and 4 (prefix closure), then every buffer. `depth` comes from
// validate_paths.
constexpr tree_fault compile_sorted(const path_list& in, const tree_options& o, int depth, tree_out& out) {
  const int P = in.count, N = P + 1;
  int* order = out.order;
  for (int k = 0; k < P; ++k) order[k] = k;
  std::sort(order, order + P, [&in](int x, int y) { return canonical_less(in, x, y); });
  auto same = [&in](int x, int y) {
    return in.len(x) == in.len(y) && compare_ranks(in.data(x), in.data(y), in.len(x)) == 0;
  };
  // (3) duplicates: report the second occurrence with the smallest input index
  int dup = -1, dup_first = -1;
  for (int s = 1; s < P; ++s) {
    if (same(order[s - 1], order[s]) && (s == 1 || !same(order[s - 2], order[s - 1]))) {
      if (dup < 0 || order[s] < dup) {
        dup = order[s];
        dup_first = order[s - 1];
      }
    }
  }
  if (dup >= 0) return fault(tree_errc::duplicate_path, dup, 0, dup_first);

  // per-depth offsets (lengths are non-decreasing in canonical order)
  int* db = out.depth_begin;
  db[0] = 0;
  for (int d = 1; d <= depth + 1; ++d) db[d] = 1;
  for (int s = 0; s < P; ++s) db[in.len(order[s]) + 1]++;
  for (int d = 2; d <= depth + 1; ++d) db[d] += db[d - 1] - 1;

  auto path_of = [&](int node) { return in.data(order[node - 1]); };
  out.parent[0] = -1;
  out.rank[0] = -1;
  out.node_depth[0] = 0;
  out.tree_index[0] = 0;
  for (int i = 1; i < N; ++i) {
    const int len = in.len(order[i - 1]);
    out.node_depth[i] = len;
    out.rank[i] = path_of(i)[len - 1];
    out.tree_index[i] = 1 + o.topk * (len - 1) + out.rank[i];
  }
  // (4) parents, depth by depth with two pointers: parents of consecutive nodes never go back
  for (int i = db[1]; i < db[2]; ++i) out.parent[i] = 0;
  for (int d = 2; d <= depth; ++d) {
    int p = db[d - 1];
    for (int i = db[d]; i < db[d + 1]; ++i) {
      const int* pi = path_of(i);
      while (p < db[d] && compare_ranks(path_of(p), pi, d - 1) < 0) ++p;
      if (p == db[d] || compare_ranks(path_of(p), pi, d - 1) != 0) {
        // name the shortest missing prefix
        int missing = d - 1;
        for (int m = 1; m < d - 1; ++m) {
          bool found = false;
          for (int q = db[m]; q < db[m + 1] && !found; ++q) found = compare_ranks(path_of(q), pi, m) == 0;
          if (!found) {
            missing = m;
            break;
          }
        }
        return fault(tree_errc::not_prefix_closed, order[i - 1], missing);
      }
      out.parent[i] = p;
    }
  }
  // children: the children lists, concatenated in node order, are nodes 1..N-1 (a CSR)
  for (int i = 0; i < N; ++i) out.child_count[i] = 0;
  for (int i = 1; i < N; ++i) out.child_count[out.parent[i]]++;
  out.child_begin[0] = 1;
  for (int i = 1; i < N; ++i) out.child_begin[i] = out.child_begin[i - 1] + out.child_count[i - 1];
  out.max_rank[0] = -1;
  for (int d = 1; d <= depth; ++d) {
    int m = -1;
    for (int i = db[d]; i < db[d + 1]; ++i) m = std::max(m, out.rank[i]);
    out.max_rank[d] = m;
  }
  // retrieve rows: leaves in reverse canonical order (depth desc, then path desc)
  int nl = 0;
  for (int i = N - 1; i >= 1; --i)
    if (out.child_count[i] == 0) out.leaf[nl++] = i;
  out.num_leaves = nl;
  // ancestor mask: row i = row of parent(i) | bit i
  const int W = (N + 31) / 32;
  for (int i = 0; i < N; ++i) {
    std::uint32_t* row = out.mask + static_cast<std::size_t>(i) * W;
    if (i > 0) {
      const std::uint32_t* prow = out.mask + static_cast<std::size_t>(out.parent[i]) * W;
      for (int w = 0; w <= out.parent[i] / 32; ++w) row[w] = prow[w];
    }
    row[i / 32] |= std::uint32_t{1} << (i % 32);
  }
  return tree_fault{};
}

// ---- messages (run time only) ----------------------------------------------------------------
inline std::string format_ranks(const int* p, int len) {
  std::string s = "[";
  const int shown = len > 16 ? 15 : len;
  for (int j = 0; j < shown; ++j) {
    if (j) s += ',';
    s += std::to_string(p[j]);
  }
  if (shown < len) s += ",...](" + std::to_string(len) + " ranks)";
  else s += ']';
  return s;
}

[[noreturn]] inline void throw_fault(const tree_fault& f, const path_list* in, std::string_view text) {
  if (f.bad_options)
    throw invalid_input(std::string("tree_options: ") + f.reason + " " + std::to_string(f.value) +
                        " is out of range [" + std::to_string(f.lowest) + ", " +
                        std::to_string(f.other) + "]");
  std::string head;
  if (f.path_index >= 0 && in && f.path_index < in->count)
    head = "tree path #" + std::to_string(f.path_index) + " " +
           format_ranks(in->data(f.path_index), in->len(f.path_index)) + ": ";
  std::string msg;
  switch (f.code) {
    case tree_errc::empty_tree:
      msg = "tree has no paths (the root is implicit; list at least one path, e.g. [[0]])";
      break;
    case tree_errc::empty_path:
      msg = head + "empty path (the root is implicit and is not listed)";
      break;
    case tree_errc::rank_out_of_range:
      msg = head + "rank " + std::to_string(f.value) +
            (f.value < 0 ? " < 0" : " >= topk " + std::to_string(f.other));
      break;
    case tree_errc::too_deep:
      msg = head + "depth " + std::to_string(f.value) + " > max_depth " + std::to_string(f.other);
      break;
    case tree_errc::duplicate_path:
      msg = head + "duplicate of path #" + std::to_string(f.other);
      break;
    case tree_errc::not_prefix_closed:
      msg = head + "not prefix-closed: its prefix " +
            (in ? format_ranks(in->data(f.path_index), static_cast<int>(f.value)) : std::string("?")) +
            " is missing";
      break;
    case tree_errc::too_many_nodes:
      if (f.value > 0)
        msg = "tree has " + std::to_string(f.value) + " nodes (paths + the root), more than max_nodes " +
              std::to_string(f.other);
      else
        msg = "tree text has more than " + std::to_string(f.other - 1) + " paths, so more than max_nodes " +
              std::to_string(f.other) + " nodes";
      break;
    case tree_errc::malformed_text: {
      std::size_t line = 1, col = 1;
      for (std::size_t i = 0; i < f.offset && i < text.size(); ++i) {
        if (text[i] == '\n') {
          ++line;
          col = 1;
        } else {
          ++col;
        }
      }
      msg = std::string("tree text: ") + f.reason + " at offset " + std::to_string(f.offset) + " (line " +
            std::to_string(line) + ", column " + std::to_string(col) + ")";
      if (f.offset < text.size()) msg += " near '" + printable(text.substr(f.offset), 16) + "'";
      else msg += " (end of text)";
      break;
    }
    case tree_errc::unknown_preset:
      msg = "unknown tree preset";
      break;
  }
  throw tree_error(f.code, msg, f.path_index);
}

}  // namespace detail

MEDUSA_NAMESPACE_END
