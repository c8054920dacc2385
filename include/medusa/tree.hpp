// SPDX-License-Identifier: Apache-2.0
//! @file tree.hpp
//! Trees of candidates: the umbrella of `<medusa/tree/...>`.
//!
//! A tree is a list of paths of ranks (`[a, b]` = the rank-a token of head 0, then the rank-b
//! token of head 1); the root is implicit. The compiler sorts the paths by `(length, path)`,
//! numbers the nodes in that order (root = 0) and derives every buffer of the reference (parents,
//! node depths, tree indices, retrieve indices, the ancestor mask) plus a few of our own
//! (docs/tree.md). Two types answer through one interface, the `tree_like` concept:
//!
//! | header | what |
//! |---|---|
//! | `tree/options.hpp` | limits and `tree_options` |
//! | `tree/errors.hpp` | `tree_errc`, `tree_error` |
//! | `tree/concepts.hpp` | `tree_topology` ⊂ `masked_tree` ⊂ `tree_like`, generic helpers |
//! | `tree/parse.hpp` | tree text (JSON or Python literal) → paths |
//! | `tree/compiler.hpp` | the constexpr compiler core shared by both tree types |
//! | `tree/static_tree.hpp` | `static_tree<N>`, `static_tree_from<"...">`, `static_tree_of<paths>` |
//! | `tree/runtime_tree.hpp` | `medusa::tree` (run time, owns its buffers) |
//! | `tree/mask.hpp` | `tree_mask_view`, dense and FlashInfer mask writers |
//! | `tree/preset_table.hpp` | the preset table, `preset_names()`, `preset_text()` |
//! | `tree/search.hpp` | `path_calibration`, `step_cost_curve`, `optimize_tree` (the best tree for a machine) |
//! | `tree/presets.hpp` | compile-time presets and tags (not included here: costs compile time) |
//!
//! @code
//! #include <medusa/tree.hpp>
//! constexpr auto demo = medusa::static_tree_from<"[[0],[1],[0,0]]">;
//! static_assert(demo.parent(3) == 1 && demo.retrieve(0, 2) == 3);
//! auto t = medusa::tree::from_text("[(0,), (1,), (0, 0)]");
//! bool same = medusa::same_shape(t, demo);  // true
//! @endcode
#pragma once

#include <medusa/tree/concepts.hpp>
#include <medusa/tree/errors.hpp>
#include <medusa/tree/mask.hpp>
#include <medusa/tree/options.hpp>
#include <medusa/tree/parse.hpp>
#include <medusa/tree/preset_table.hpp>
#include <medusa/tree/runtime_tree.hpp>
#include <medusa/tree/search.hpp>
#include <medusa/tree/static_tree.hpp>
