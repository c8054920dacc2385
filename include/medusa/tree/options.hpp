// SPDX-License-Identifier: Apache-2.0
//! @file tree/options.hpp
//! Limits and parameters of the tree compiler.
#pragma once

#include <medusa/config.hpp>

MEDUSA_NAMESPACE_BEGIN

//! Candidates per head assumed by `tree_indices` (the reference's constant).
inline constexpr int default_topk = 10;
//! Default cap on the path length (number of heads a tree may use).
inline constexpr int default_max_depth = 16;
//! Default cap on the number of nodes (root included) of a run-time `tree`.
inline constexpr int default_max_nodes = 4096;
//! Largest `tree_options::max_nodes` accepted (the packed mask of such a tree is 32 MiB).
inline constexpr int max_tree_nodes = 16384;
//! Largest `static_tree<N>`.
inline constexpr int max_static_tree_nodes = 256;
//! Longest path of a `static_tree` (its retrieve rows are stored inline, `depth + 1` columns).
inline constexpr int max_static_tree_depth = 16;
//! Largest accepted `tree_options::topk` (keeps `tree_indices` far from int overflow).
inline constexpr int max_tree_topk = 1 << 20;
//! Largest accepted `tree_options::max_depth`.
inline constexpr int max_tree_depth = max_tree_nodes;

//! Parameters of the tree compiler. A structural type, so it can also be a template argument.
struct tree_options {
  int topk = default_topk;            //!< candidates per head (K); ranks must be in [0, topk)
  int max_depth = default_max_depth;  //!< longest path allowed (heads available)
  int max_nodes = default_max_nodes;  //!< most nodes allowed, root included (run-time trees)
};

MEDUSA_NAMESPACE_END
