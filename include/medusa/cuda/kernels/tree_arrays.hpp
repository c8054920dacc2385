// SPDX-License-Identifier: Apache-2.0
//! @file cuda/kernels/tree_arrays.hpp
//! A run-time tree as kernels read it: the tree's arrays packed into one `int` buffer that the
//! engine uploads once, and a view with the accessors of `static_tree`, so a kernel body is one
//! template for compile-time trees (passed by value, in the constant bank) and run-time trees.
//!
//! @code
//! auto t = medusa::tree::from_text("[[0],[0,0],[1]]");
//! std::vector<int> packed = medusa::cuda::pack_tree(t);   // copy to the device once
//! auto view = medusa::cuda::tree_arrays::over(t, device_ptr);  // what kernels take
//! @endcode
#pragma once

#include <medusa/config.hpp>
#include <medusa/tree/concepts.hpp>

#include <cstddef>
#include <vector>

MEDUSA_NAMESPACE_BEGIN
namespace cuda {

//! A tree read from a packed buffer (see `pack_tree`); same accessors as `static_tree`.
struct tree_arrays {
  int nodes = 0;       //!< number of nodes, root included
  int tree_depth = 0;  //!< longest path
  int leaves = 0;      //!< retrieve rows
  int k = 0;           //!< the tree's topk
  const int* data = nullptr;  //!< the packed buffer

  MEDUSA_HOST_DEVICE constexpr int num_nodes() const noexcept { return nodes; }
  MEDUSA_HOST_DEVICE constexpr int depth() const noexcept { return tree_depth; }
  MEDUSA_HOST_DEVICE constexpr int num_leaves() const noexcept { return leaves; }
  MEDUSA_HOST_DEVICE constexpr int topk() const noexcept { return k; }
  MEDUSA_HOST_DEVICE constexpr int parent(int u) const noexcept { return data[u]; }
  MEDUSA_HOST_DEVICE constexpr int node_depth(int u) const noexcept { return data[nodes + u]; }
  MEDUSA_HOST_DEVICE constexpr int rank(int u) const noexcept { return data[2 * nodes + u]; }
  MEDUSA_HOST_DEVICE constexpr int child_begin(int u) const noexcept { return data[3 * nodes + u]; }
  MEDUSA_HOST_DEVICE constexpr int child_count(int u) const noexcept { return data[4 * nodes + u]; }
  MEDUSA_HOST_DEVICE constexpr int max_rank(int d) const noexcept { return data[5 * nodes + d]; }
  MEDUSA_HOST_DEVICE constexpr int retrieve(int row, int col) const noexcept {
    return data[5 * nodes + tree_depth + 1 + row * (tree_depth + 1) + col];
  }

  //! The view of `t`'s shape over `packed`, a copy of `pack_tree(t)` (device memory for kernels).
  template <tree_like Tree>
  static tree_arrays over(const Tree& t, const int* packed) noexcept {
    return {t.num_nodes(), t.depth(), t.num_leaves(), t.topk(), packed};
  }
};

//! A compile-time tree in the form kernels take as a by-value parameter (it lands in the constant
//! bank): the arrays of `tree_arrays`, sized exactly, without the packed mask. `static_tree` itself
//! is larger than a kernel parameter may be for big trees and nvcc refuses it as a `__global__`
//! template argument; this copy is small (2.4 KB for a 64-node preset).
//! @tparam N nodes; @tparam R retrieve cells (`leaves × (depth + 1)`)
template <std::size_t N, std::size_t R>
struct fixed_tree {
  int tree_depth = 0;
  int leaves = 0;
  int k = 0;
  int parent_[N]{};
  int depth_[N]{};
  int rank_[N]{};
  int child_begin_[N]{};
  int child_count_[N]{};
  int max_rank_[N + 1]{};
  int retrieve_[R]{};

  MEDUSA_HOST_DEVICE constexpr int num_nodes() const noexcept { return static_cast<int>(N); }
  MEDUSA_HOST_DEVICE constexpr int depth() const noexcept { return tree_depth; }
  MEDUSA_HOST_DEVICE constexpr int num_leaves() const noexcept { return leaves; }
  MEDUSA_HOST_DEVICE constexpr int topk() const noexcept { return k; }
  MEDUSA_HOST_DEVICE constexpr int parent(int u) const noexcept { return parent_[u]; }
  MEDUSA_HOST_DEVICE constexpr int node_depth(int u) const noexcept { return depth_[u]; }
  MEDUSA_HOST_DEVICE constexpr int rank(int u) const noexcept { return rank_[u]; }
  MEDUSA_HOST_DEVICE constexpr int child_begin(int u) const noexcept { return child_begin_[u]; }
  MEDUSA_HOST_DEVICE constexpr int child_count(int u) const noexcept { return child_count_[u]; }
  MEDUSA_HOST_DEVICE constexpr int max_rank(int d) const noexcept { return max_rank_[d]; }
  MEDUSA_HOST_DEVICE constexpr int retrieve(int row, int col) const noexcept {
    return retrieve_[row * (tree_depth + 1) + col];
  }
};

//! The `fixed_tree` of a compile-time tree tag (`presets::tag<I>` or any type with a `static
//! constexpr` `static_tree` member named `tree`).
template <class Tag>
constexpr auto fixed_tree_of() {
  constexpr auto& t = Tag::tree;
  constexpr auto n = static_cast<std::size_t>(t.num_nodes());
  constexpr auto r = static_cast<std::size_t>(t.num_leaves()) * static_cast<std::size_t>(t.depth() + 1);
  fixed_tree<n, r> f{};
  f.tree_depth = t.depth();
  f.leaves = t.num_leaves();
  f.k = t.topk();
  for (std::size_t u = 0; u < n; ++u) {
    const int i = static_cast<int>(u);
    f.parent_[u] = t.parent(i);
    f.depth_[u] = t.node_depth(i);
    f.rank_[u] = t.rank(i);
    f.child_begin_[u] = t.child_begin(i);
    f.child_count_[u] = t.child_count(i);
  }
  for (int d = 0; d <= t.depth(); ++d) f.max_rank_[d] = t.max_rank(d);
  for (int p = 0; p < t.num_leaves(); ++p)
    for (int j = 0; j <= t.depth(); ++j) f.retrieve_[p * (t.depth() + 1) + j] = t.retrieve(p, j);
  return f;
}

//! Ints in `pack_tree(t)`.
template <tree_like Tree>
std::size_t packed_tree_size(const Tree& t) {
  return 5 * static_cast<std::size_t>(t.num_nodes()) + static_cast<std::size_t>(t.depth() + 1) +
         static_cast<std::size_t>(t.num_leaves()) * static_cast<std::size_t>(t.depth() + 1);
}

//! The arrays of `t` in `tree_arrays` order: parents, depths, ranks, child begins, child counts,
//! max ranks (depth + 1), retrieve rows (`[leaves][depth + 1]`, -1 padded).
template <tree_like Tree>
std::vector<int> pack_tree(const Tree& t) {
  std::vector<int> out;
  out.reserve(packed_tree_size(t));
  const int n = t.num_nodes();
  for (int u = 0; u < n; ++u) out.push_back(t.parent(u));
  for (int u = 0; u < n; ++u) out.push_back(t.node_depth(u));
  for (int u = 0; u < n; ++u) out.push_back(t.rank(u));
  for (int u = 0; u < n; ++u) out.push_back(t.child_begin(u));
  for (int u = 0; u < n; ++u) out.push_back(t.child_count(u));
  for (int d = 0; d <= t.depth(); ++d) out.push_back(t.max_rank(d));
  for (int p = 0; p < t.num_leaves(); ++p)
    for (int j = 0; j <= t.depth(); ++j) out.push_back(t.retrieve(p, j));
  return out;
}

}  // namespace cuda
MEDUSA_NAMESPACE_END
