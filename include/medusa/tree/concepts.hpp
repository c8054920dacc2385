// SPDX-License-Identifier: Apache-2.0
//! @file tree/concepts.hpp
//! What a tree is to the rest of the library, in three nested concepts, and the questions any
//! tree answers through them.
//!
//! * `tree_topology`: node count and parents; enough to check and commit an accepted path.
//! * `masked_tree`: adds the packed ancestor mask; enough for tree attention.
//! * `tree_like`: every buffer of the tree compiler (docs/tree.md); what candidates, acceptance
//!   and the decoder need. `medusa::tree` and `medusa::static_tree<N>` satisfy it.
//!
//! Node ids are `0..num_nodes()-1` in canonical order (root 0); accessors have no bounds checks.
#pragma once

#include <medusa/config.hpp>

#include <concepts>
#include <cstdint>

MEDUSA_NAMESPACE_BEGIN

//! Node count and parents (`parent(0) == -1`; a parent id is smaller than its child's).
template <class T>
concept tree_topology = requires(const T& t, int i) {
  { t.num_nodes() } -> std::convertible_to<int>;
  { t.parent(i) } -> std::convertible_to<int>;
};

//! A `tree_topology` with its packed ancestor mask: `words_per_row()` 32-bit words per node,
//! bit `j % 32` of word `j / 32` of row `i` set iff node `j` is `i` or one of its ancestors.
template <class T>
concept masked_tree = tree_topology<T> && requires(const T& t, int i) {
  { t.words_per_row() } -> std::convertible_to<int>;
  { t.packed_mask_word(i, i) } -> std::same_as<std::uint32_t>;
  { t.mask(i, i) } -> std::convertible_to<bool>;
};

//! The whole interface of a compiled tree (see docs/tree.md for each buffer).
template <class T>
concept tree_like = masked_tree<T> && requires(const T& t, int i) {
  { t.depth() } -> std::convertible_to<int>;
  { t.topk() } -> std::convertible_to<int>;
  { t.num_leaves() } -> std::convertible_to<int>;
  { t.node_depth(i) } -> std::convertible_to<int>;
  { t.rank(i) } -> std::convertible_to<int>;
  { t.tree_index(i) } -> std::convertible_to<int>;
  { t.child_begin(i) } -> std::convertible_to<int>;
  { t.child_count(i) } -> std::convertible_to<int>;
  { t.depth_begin(i) } -> std::convertible_to<int>;
  { t.max_rank(i) } -> std::convertible_to<int>;
  { t.leaf(i) } -> std::convertible_to<int>;
  { t.retrieve(i, i) } -> std::convertible_to<int>;
};

//! First child of `node`, or -1 for a leaf.
template <tree_like T>
MEDUSA_HOST_DEVICE constexpr int first_child(const T& t, int node) noexcept {
  return t.child_count(node) > 0 ? t.child_begin(node) : -1;
}

//! The next child of the same parent (one rank up), or -1 for the last child and the root.
template <tree_topology T>
MEDUSA_HOST_DEVICE constexpr int next_sibling(const T& t, int node) noexcept {
  return (node > 0 && node + 1 < t.num_nodes() && t.parent(node + 1) == t.parent(node)) ? node + 1 : -1;
}

//! True iff `ancestor` is `node` or one of its ancestors (same as `t.mask(node, ancestor)`).
template <tree_topology T>
MEDUSA_HOST_DEVICE constexpr bool is_ancestor_or_self(const T& t, int ancestor, int node) noexcept {
  while (node > ancestor) node = t.parent(node);
  return node == ancestor;
}

//! True iff both trees have the same nodes, ranks and topk (hence identical buffers). Use it to
//! map a run-time tree onto a compile-time instantiation (`medusa::dispatch_tree` does).
template <tree_like A, tree_like B>
constexpr bool same_shape(const A& a, const B& b) noexcept {
  if (a.num_nodes() != b.num_nodes() || a.topk() != b.topk() || a.depth() != b.depth()) return false;
  for (int i = 0; i < a.num_nodes(); ++i)
    if (a.parent(i) != b.parent(i) || a.rank(i) != b.rank(i)) return false;
  return true;
}

//! Writes the model positions of the tree tokens after `committed_length` cached tokens:
//! `out[u] = committed_length + node_depth(u)` for every node (`out` holds `num_nodes()` values).
template <tree_like T, class Int>
MEDUSA_HOST_DEVICE constexpr void write_node_positions(const T& t, int committed_length, Int* out) noexcept {
  for (int u = 0; u < t.num_nodes(); ++u) out[u] = static_cast<Int>(committed_length + t.node_depth(u));
}

MEDUSA_NAMESPACE_END
