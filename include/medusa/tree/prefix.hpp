// SPDX-License-Identifier: Apache-2.0
//! @file tree/prefix.hpp
//! The first nodes of a tree as a tree of their own: the smaller steps a decoder takes where a
//! whole tree no longer fits (a short KV pool, the end of the context).
#pragma once

#include <medusa/config.hpp>
#include <medusa/tree/errors.hpp>
#include <medusa/tree/options.hpp>
#include <medusa/tree/runtime_tree.hpp>

#include <algorithm>
#include <string>
#include <vector>

MEDUSA_NAMESPACE_BEGIN
namespace detail {

// The first `m` nodes of `t` as a tree of their own (nodes are ordered by depth, so they hold the
// root and every node's parent): the largest part of a tree step that fits a short KV pool.
template <class Tree>
::medusa::tree first_nodes(const Tree& t, int m) {
  std::vector<std::vector<int>> paths;  // node i >= 1: the ranks from the root down to it
  for (int i = 1; i < m; ++i) {
    std::vector<int>& path = paths.emplace_back();
    for (int v = i; v > 0; v = static_cast<int>(t.parent(v))) path.push_back(static_cast<int>(t.rank(v)));
    std::reverse(path.begin(), path.end());
  }
  tree_options opts;
  opts.topk = std::max(1, static_cast<int>(t.topk()));
  opts.max_depth = std::max(1, static_cast<int>(t.depth()));
  ::medusa::tree part = ::medusa::tree::from_paths(paths, opts);
  for (int i = 0; i < m; ++i)  // node i must keep its index: its token, row and slot are node i's
    if (part.parent(i) != static_cast<int>(t.parent(i)))
      throw tree_error(tree_errc::not_prefix_closed, "the first " + std::to_string(m) +
                                                         " nodes of the tree are not in canonical order (node " +
                                                         std::to_string(i) + ")");
  return part;
}

}  // namespace detail
MEDUSA_NAMESPACE_END
