// SPDX-License-Identifier: Apache-2.0
//! @file tree/static_tree.hpp
//! `static_tree<N>`: a tree compiled at compile time, a C++20 structural type usable as a template
//! argument so that kernels can be instantiated per tree shape. It answers the same questions as
//! the run-time `medusa::tree` (`tree_like`), with `constexpr MEDUSA_HOST_DEVICE` accessors and
//! the same spans.
//!
//! @code
//! #include <medusa/tree.hpp>
//! // from text (JSON or the Python literal)
//! constexpr auto a = medusa::static_tree_from<"[[0],[1],[0,0]]">;
//! // from a constexpr array of paths
//! constexpr medusa::tree_path paths[] = {{0}, {1}, {0, 0}};
//! constexpr auto b = medusa::static_tree_of<paths>;
//! static_assert(a == b && a.parent(3) == 1 && a.retrieve(0, 2) == 3);
//! @endcode
//!
//! An invalid tree is a compile error whose instantiation context reads
//! `medusa::invalid_static_tree<medusa::tree_errc::rank_out_of_range, 1, 10>`: the error code, the
//! input index of the offending path (-1 when no single path is to blame) and the offending value
//! (the rank, the depth, the node count, or the byte offset of malformed text).
#pragma once

#include <medusa/config.hpp>
#include <medusa/tree/compiler.hpp>
#include <medusa/tree/concepts.hpp>
#include <medusa/tree/errors.hpp>
#include <medusa/tree/mask.hpp>
#include <medusa/tree/options.hpp>
#include <medusa/tree/parse.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <iterator>
#include <span>
#include <string_view>

MEDUSA_NAMESPACE_BEGIN

//! A string usable as a template argument: `medusa::static_tree_from<"[[0],[1]]">`.
template <std::size_t N>
struct fixed_string {
  char data[N]{};  //!< the characters and the terminating NUL (public: structural type)
  //! From a string literal.
  constexpr fixed_string(const char (&s)[N]) noexcept {  // NOLINT: implicit on purpose
    for (std::size_t i = 0; i < N; ++i) data[i] = s[i];
  }
  //! The text without the terminating NUL.
  [[nodiscard]] constexpr std::string_view view() const noexcept { return {data, N - 1}; }
};

//! One path of a compile-time tree given as data: `medusa::tree_path{0, 2}` is "rank 0 of head 0,
//! then rank 2 of head 1". Holds up to `max_static_tree_depth` ranks; a longer path is reported
//! as `too_deep` when the tree is built.
struct tree_path {
  int ranks[max_static_tree_depth]{};  //!< the ranks (public: structural type)
  int length = 0;                      //!< number of ranks given (may exceed the capacity)

  constexpr tree_path() = default;
  //! From a list of ranks.
  constexpr tree_path(std::initializer_list<int> r) noexcept {  // NOLINT: implicit on purpose
    for (const int x : r) {
      if (length < max_static_tree_depth) ranks[length] = x;
      ++length;
    }
  }
};

//! A tree compiled at compile time: N nodes (root included), every buffer stored inline.
//!
//! A C++20 structural type: its members are public only so that it can be a template argument
//! (`template <auto Tree> requires medusa::tree_like<decltype(Tree)>`); use the accessors. Build
//! one with `static_tree_from<"...">`, `static_tree_of<paths>` or take a preset
//! (`<medusa/tree/presets.hpp>`).
//! @tparam N number of nodes, 2..256
template <std::size_t N>
struct static_tree {
  static_assert(N >= 2, "a tree needs at least one path besides the root");
  static_assert(N <= static_cast<std::size_t>(max_static_tree_nodes), "static_tree holds at most 256 nodes");
  //! 32-bit words per packed mask row.
  static constexpr int words = static_cast<int>((N + 31) / 32);

  int topk_ = 0;
  int depth_ = 0;
  int num_leaves_ = 0;
  int parent_[N]{};
  int rank_[N]{};
  int node_depth_[N]{};
  int tree_index_[N]{};
  int child_begin_[N]{};
  int child_count_[N]{};
  int leaf_[N]{};
  int depth_begin_[N + 1]{};
  int max_rank_[N + 1]{};
  std::uint32_t mask_[N * words]{};
  int retrieve_[N * (max_static_tree_depth + 1)]{};  // [num_leaves][depth + 1], -1 padded

  //! Number of nodes, root included.
  MEDUSA_HOST_DEVICE constexpr int num_nodes() const noexcept { return static_cast<int>(N); }
  //! Length of the longest path.
  MEDUSA_HOST_DEVICE constexpr int depth() const noexcept { return depth_; }
  //! Candidates per head used for `tree_index`.
  MEDUSA_HOST_DEVICE constexpr int topk() const noexcept { return topk_; }
  //! Number of leaves = rows of `retrieve`.
  MEDUSA_HOST_DEVICE constexpr int num_leaves() const noexcept { return num_leaves_; }
  //! Parent node; -1 for the root.
  MEDUSA_HOST_DEVICE constexpr int parent(int node) const noexcept { return parent_[node]; }
  //! Depth of the node (root 0); the model's position of its token is `L + node_depth(node)`.
  MEDUSA_HOST_DEVICE constexpr int node_depth(int node) const noexcept { return node_depth_[node]; }
  //! Last rank of the node's path; -1 for the root.
  MEDUSA_HOST_DEVICE constexpr int rank(int node) const noexcept { return rank_[node]; }
  //! Index into the flattened candidates `[root, top-K of head 0, top-K of head 1, ...]`.
  MEDUSA_HOST_DEVICE constexpr int tree_index(int node) const noexcept { return tree_index_[node]; }
  //! First child (children are contiguous, ascending rank); for a leaf, where children would go.
  MEDUSA_HOST_DEVICE constexpr int child_begin(int node) const noexcept { return child_begin_[node]; }
  //! Number of children.
  MEDUSA_HOST_DEVICE constexpr int child_count(int node) const noexcept { return child_count_[node]; }
  //! Nodes of depth d are [depth_begin(d), depth_begin(d+1)), d in [0, depth()+1].
  MEDUSA_HOST_DEVICE constexpr int depth_begin(int d) const noexcept { return depth_begin_[d]; }
  //! Largest rank at depth d (d in [1, depth()]; -1 for d = 0): head d-1 needs top-(max_rank(d)+1).
  MEDUSA_HOST_DEVICE constexpr int max_rank(int d) const noexcept { return max_rank_[d]; }
  //! Leaf node of retrieve row `row`.
  MEDUSA_HOST_DEVICE constexpr int leaf(int row) const noexcept { return leaf_[row]; }
  //! `retrieve_indices[row][col]`: the node at depth col on the row's root-to-leaf path, or -1.
  MEDUSA_HOST_DEVICE constexpr int retrieve(int row, int col) const noexcept {
    return retrieve_[row * (depth_ + 1) + col];
  }
  //! 32-bit words per packed mask row (= ceil(num_nodes / 32)).
  MEDUSA_HOST_DEVICE constexpr int words_per_row() const noexcept { return words; }
  //! Word `word` of the packed ancestor mask row `row` (bit j % 32 = mask(row, 32 * word + j % 32)).
  MEDUSA_HOST_DEVICE constexpr std::uint32_t packed_mask_word(int row, int word) const noexcept {
    return mask_[row * words + word];
  }
  //! True iff `key` is `query` or one of its ancestors (the root included).
  MEDUSA_HOST_DEVICE constexpr bool mask(int query, int key) const noexcept {
    return ((mask_[query * words + key / 32] >> (key % 32)) & 1u) != 0;
  }

  //! `parent` for every node.
  [[nodiscard]] constexpr std::span<const int> parents() const noexcept { return parent_; }
  //! Depth of every node (the reference's `position_ids`, before adding `L`).
  [[nodiscard]] constexpr std::span<const int> node_depths() const noexcept { return node_depth_; }
  //! Last rank of each node (-1 for the root).
  [[nodiscard]] constexpr std::span<const int> ranks() const noexcept { return rank_; }
  //! `tree_indices`.
  [[nodiscard]] constexpr std::span<const int> tree_indices() const noexcept { return tree_index_; }
  //! `retrieve_indices`, row-major `[num_leaves][depth + 1]`, -1 padded.
  [[nodiscard]] constexpr std::span<const int> retrieve_indices() const noexcept {
    return {retrieve_, static_cast<std::size_t>(num_leaves_ * (depth_ + 1))};
  }
  //! Packed ancestor mask, row-major `[num_nodes][words_per_row]`.
  [[nodiscard]] constexpr std::span<const std::uint32_t> packed_mask() const noexcept { return mask_; }
  //! The packed mask as the view attention and engines take.
  [[nodiscard]] constexpr tree_mask_view mask_view() const noexcept { return {mask_, words}; }
  //! `child_begin` for every node.
  [[nodiscard]] constexpr std::span<const int> child_begins() const noexcept { return child_begin_; }
  //! `child_count` for every node.
  [[nodiscard]] constexpr std::span<const int> child_counts() const noexcept { return child_count_; }
  //! `depth_begin`, `depth + 2` entries.
  [[nodiscard]] constexpr std::span<const int> depth_begins() const noexcept {
    return {depth_begin_, static_cast<std::size_t>(depth_ + 2)};
  }
  //! `max_rank`, `depth + 1` entries (entry 0 is -1).
  [[nodiscard]] constexpr std::span<const int> max_ranks() const noexcept {
    return {max_rank_, static_cast<std::size_t>(depth_ + 1)};
  }
  //! Leaf node of each retrieve row.
  [[nodiscard]] constexpr std::span<const int> leaves() const noexcept {
    return {leaf_, static_cast<std::size_t>(num_leaves_)};
  }

  friend constexpr bool operator==(const static_tree&, const static_tree&) = default;
};

static_assert(tree_like<static_tree<2>>);

//! The compile error of an invalid compile-time tree: the template arguments name the problem
//! (`tree_errc`), the input index of the offending path (-1 if none) and the offending value.
template <tree_errc Code, int PathIndex, long long Value>
struct invalid_static_tree {
  static_assert(Code != Code,
                "medusa: invalid compile-time tree: the template arguments of medusa::invalid_static_tree "
                "are the tree_errc, the input index of the offending path and the offending value");
};

//! The compile error of out-of-range `tree_options` given to a compile-time tree: the value and
//! the accepted range `[Lowest, Highest]` (the field is topk, then max_depth, then max_nodes).
template <long long Value, long long Lowest, long long Highest>
struct invalid_static_tree_options {
  static_assert(Value != Value,
                "medusa: tree_options out of range for a compile-time tree: the template arguments of "
                "medusa::invalid_static_tree_options are the value and the accepted range");
};

namespace detail {

// A compile-time build: the tree, or the fault that stopped it.
template <std::size_t N>
struct static_tree_build {
  static_tree<N> tree{};
  tree_fault fault{};
};

// Compiles paths (CSR) into a static_tree<N>; N = paths + 1 unless `f` already failed.
template <std::size_t N>
constexpr static_tree_build<N> build_static_tree(const path_list& in, tree_options o, tree_fault f) {
  static_tree_build<N> r;
  static_tree<N>& t = r.tree;
  o.max_nodes = std::min(o.max_nodes, max_static_tree_nodes);
  if (!f.failed) f = check_options(o);
  o.max_depth = std::min(o.max_depth, max_static_tree_depth);
  int depth = 0;
  if (!f.failed) f = validate_paths(in, o, depth);
  std::array<int, N - 1> order{};
  tree_out out = bind_outputs(t, order.data());
  if (!f.failed) f = compile_sorted(in, o, depth, out);
  if (f.failed) {
    r.fault = f;
    return r;
  }
  for (std::size_t d = static_cast<std::size_t>(depth) + 2; d <= N; ++d) t.depth_begin_[d] = static_cast<int>(N);
  t.topk_ = o.topk;
  t.depth_ = depth;
  t.num_leaves_ = out.num_leaves;
  write_retrieve(out, depth, t.retrieve_);
  return r;
}

// Tree text: counted first (sizes the tree type), then parsed into fixed arrays and compiled.
struct text_counts {
  int paths = 0;
  std::size_t ranks = 0;
  tree_fault fault{};
};

constexpr text_counts count_text(std::string_view text) {
  counting_sink c;
  const tree_fault f = parse_paths(text, c, max_static_tree_nodes - 1);
  return {c.paths, c.ranks, f};
}

constexpr std::size_t static_nodes(long long paths) {
  return paths < 1 ? 2 : paths >= max_static_tree_nodes ? max_static_tree_nodes : static_cast<std::size_t>(paths) + 1;
}

template <std::size_t N, std::size_t F>
constexpr static_tree_build<N> build_from_text(std::string_view text, tree_options o) {
  fixed_sink<N - 1, F> sink;
  const tree_fault f = parse_paths(text, sink, max_static_tree_nodes - 1);
  const path_list in{sink.flat.data(), sink.begin.data(), static_cast<int>(sink.np)};
  return build_static_tree<N>(in, o, f);
}

template <fixed_string Text, tree_options Opts>
struct text_tree {
  static constexpr text_counts counts = count_text(Text.view());
  static constexpr auto build = build_from_text<static_nodes(counts.paths), counts.ranks>(Text.view(), Opts);
};

// Paths given as data (an array of tree_path).
template <const auto& Paths, tree_options Opts>
struct path_array_tree {
  static constexpr std::size_t count = std::size(Paths);
  static constexpr std::size_t ranks = [] {
    std::size_t r = 0;
    for (const tree_path& p : Paths) r += static_cast<std::size_t>(std::min(p.length, max_static_tree_depth));
    return r;
  }();
  static constexpr std::size_t nodes = static_nodes(static_cast<long long>(count));
  static constexpr auto build = [] {
    std::array<int, (ranks > 0 ? ranks : 1)> flat{};
    std::array<int, count + 1> begin{};
    tree_fault f;
    std::size_t nf = 0;
    for (std::size_t k = 0; k < count; ++k) {
      const tree_path& p = Paths[k];
      if (!f.failed && p.length > max_static_tree_depth)
        f = fault(tree_errc::too_deep, static_cast<int>(k), p.length, max_static_tree_depth);
      for (int j = 0; j < std::min(p.length, max_static_tree_depth); ++j) flat[nf++] = p.ranks[j];
      begin[k + 1] = static_cast<int>(nf);
    }
    if (count + 1 > static_cast<std::size_t>(max_static_tree_nodes))
      f = fault(tree_errc::too_many_nodes, -1, static_cast<long long>(count) + 1, max_static_tree_nodes);
    const path_list in{flat.data(), begin.data(), static_cast<int>(std::min(count, nodes - 1))};
    return build_static_tree<nodes>(in, Opts, f);
  }();
};

// The tree of a successful build; a failed one instantiates the error type that names the fault.
template <const auto& Build>
constexpr auto checked_static_tree() {
  constexpr tree_fault f = Build.fault;
  if constexpr (f.failed && f.bad_options) {
    [[maybe_unused]] constexpr invalid_static_tree_options<f.value, f.lowest, f.other> error{};
  } else if constexpr (f.failed) {
    [[maybe_unused]] constexpr invalid_static_tree<f.code, f.path_index,
                                                   f.code == tree_errc::malformed_text
                                                       ? static_cast<long long>(f.offset)
                                                       : f.value>
        error{};
  }
  return Build.tree;
}

}  // namespace detail

//! The compile-time tree of a literal (JSON or Python form), e.g.
//! `constexpr auto t = medusa::static_tree_from<"[[0],[1],[0,0]]">;`.
template <fixed_string Text, tree_options Opts = tree_options{}>
inline constexpr auto static_tree_from = detail::checked_static_tree<detail::text_tree<Text, Opts>::build>();

//! The compile-time tree of a constexpr array of `tree_path` (a C array or a `std::array` with
//! static storage), e.g. `constexpr medusa::tree_path p[] = {{0}, {0, 0}};
//! constexpr auto t = medusa::static_tree_of<p>;`.
template <const auto& Paths, tree_options Opts = tree_options{}>
inline constexpr auto static_tree_of = detail::checked_static_tree<detail::path_array_tree<Paths, Opts>::build>();

MEDUSA_NAMESPACE_END
