// SPDX-License-Identifier: Apache-2.0
//! @file tree/runtime_tree.hpp
//! `medusa::tree`: a tree compiled at run time from paths, text, a file or a preset name. It owns
//! its buffers and hands them out as spans (up to `tree_options::max_nodes` nodes, 4096 by
//! default, 16384 at most).
//!
//! @code
//! #include <medusa/tree.hpp>
//! auto t = medusa::tree::preset("mc_sim_7b_63");
//! auto rows = t.retrieve_indices();           // [num_leaves][depth + 1], -1 padded
//! bool sees_root = t.mask(5, 0);              // true: every node attends to the root
//! @endcode
#pragma once

#include <medusa/config.hpp>
#include <medusa/error.hpp>
#include <medusa/tree/compiler.hpp>
#include <medusa/tree/concepts.hpp>
#include <medusa/tree/errors.hpp>
#include <medusa/tree/mask.hpp>
#include <medusa/tree/options.hpp>
#include <medusa/tree/parse.hpp>
#include <medusa/tree/preset_table.hpp>

#include <climits>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

MEDUSA_NAMESPACE_BEGIN

//! A tree compiled at run time; owns every buffer of the tree compiler (docs/tree.md).
class tree {
 public:
  //! Compiles a list of paths (any order). Throws `tree_error` (checks in the order of
  //! docs/tree.md, Errors) or `invalid_input` for out-of-range options.
  static tree from_paths(const std::vector<std::vector<int>>& paths, tree_options opts = {}) {
    std::vector<int> flat, begin{0};
    begin.reserve(paths.size() + 1);
    for (const auto& p : paths) {
      flat.insert(flat.end(), p.begin(), p.end());
      if (flat.size() > static_cast<std::size_t>(INT_MAX / 2))
        throw tree_error(tree_errc::too_many_nodes, "tree: paths hold too many ranks");
      begin.push_back(static_cast<int>(flat.size()));
    }
    return compile_or_throw(flat, begin, opts, {});
  }

  //! Compiles tree text: JSON or Python literal (see `parse_tree_text`), or a preset name.
  static tree from_text(std::string_view text, tree_options opts = {}) {
    if (const auto name = trimmed(text); !name.empty() && is_name_start(name.front()))
      return from_text_impl(preset_text(name), opts);
    return from_text_impl(text, opts);
  }

  //! Reads a file holding tree text and compiles it (see `from_text`). Throws `io_error` if the
  //! file cannot be read.
  static tree from_file(const std::filesystem::path& file, tree_options opts = {}) {
    std::ifstream in(file, std::ios::binary);
    if (!in) throw io_error("cannot open tree file '" + file.string() + "'");
    std::string text;
    char buf[65536];
    while (in.read(buf, sizeof buf) || in.gcount() > 0) {
      text.append(buf, static_cast<std::size_t>(in.gcount()));
      if (text.size() > (std::size_t{64} << 20)) throw io_error("tree file '" + file.string() + "' is larger than 64 MiB");
    }
    if (in.bad()) throw io_error("cannot read tree file '" + file.string() + "'");
    return from_text(text, opts);
  }

  //! One of the nine reference presets by name (see `preset_names()`); topk 10.
  static tree preset(std::string_view name) { return from_text_impl(preset_text(name), {}); }

  //! Non-throwing form of `from_paths` for tree errors: empty on failure, `*code` set if given.
  //! (Out-of-range options still throw `invalid_input`; allocation failure throws.)
  static std::optional<tree> try_from_paths(const std::vector<std::vector<int>>& paths, tree_options opts = {},
                                            tree_errc* code = nullptr) {
    try {
      return from_paths(paths, opts);
    } catch (const tree_error& e) {
      if (code) *code = e.code();
      return std::nullopt;
    }
  }

  //! Non-throwing form of `from_text` for tree errors.
  static std::optional<tree> try_from_text(std::string_view text, tree_options opts = {}, tree_errc* code = nullptr) {
    try {
      return from_text(text, opts);
    } catch (const tree_error& e) {
      if (code) *code = e.code();
      return std::nullopt;
    }
  }

  //! Number of nodes, root included.
  [[nodiscard]] int num_nodes() const noexcept { return n_; }
  //! Length of the longest path.
  [[nodiscard]] int depth() const noexcept { return depth_; }
  //! Candidates per head used for `tree_index`.
  [[nodiscard]] int topk() const noexcept { return topk_; }
  //! Number of leaves = rows of `retrieve_indices`.
  [[nodiscard]] int num_leaves() const noexcept { return static_cast<int>(leaf_.size()); }
  //! Parent node; -1 for the root.
  [[nodiscard]] int parent(int node) const noexcept { return parent_[static_cast<std::size_t>(node)]; }
  //! Depth of the node (root 0); the model's position of its token is `L + node_depth(node)`.
  [[nodiscard]] int node_depth(int node) const noexcept { return node_depth_[static_cast<std::size_t>(node)]; }
  //! Last rank of the node's path; -1 for the root.
  [[nodiscard]] int rank(int node) const noexcept { return rank_[static_cast<std::size_t>(node)]; }
  //! `tree_indices[node]`: root 0, else `1 + topk * (depth - 1) + rank`.
  [[nodiscard]] int tree_index(int node) const noexcept { return tree_index_[static_cast<std::size_t>(node)]; }
  //! First child (children are contiguous, ascending rank); for a leaf, where children would go.
  [[nodiscard]] int child_begin(int node) const noexcept { return child_begin_[static_cast<std::size_t>(node)]; }
  //! Number of children.
  [[nodiscard]] int child_count(int node) const noexcept { return child_count_[static_cast<std::size_t>(node)]; }
  //! Nodes of depth d are [depth_begin(d), depth_begin(d+1)), d in [0, depth()+1].
  [[nodiscard]] int depth_begin(int d) const noexcept { return depth_begin_[static_cast<std::size_t>(d)]; }
  //! Largest rank at depth d (d in [1, depth()]; -1 for d = 0).
  [[nodiscard]] int max_rank(int d) const noexcept { return max_rank_[static_cast<std::size_t>(d)]; }
  //! Leaf node of retrieve row `row`.
  [[nodiscard]] int leaf(int row) const noexcept { return leaf_[static_cast<std::size_t>(row)]; }
  //! `retrieve_indices[row][col]`, -1 past the leaf.
  [[nodiscard]] int retrieve(int row, int col) const noexcept {
    return retrieve_[static_cast<std::size_t>(row) * static_cast<std::size_t>(depth_ + 1) + static_cast<std::size_t>(col)];
  }
  //! 32-bit words per packed mask row (= ceil(num_nodes / 32)).
  [[nodiscard]] int words_per_row() const noexcept { return words_; }
  //! Word `word` of packed mask row `row` (LSB first).
  [[nodiscard]] std::uint32_t packed_mask_word(int row, int word) const noexcept {
    return mask_[static_cast<std::size_t>(row) * static_cast<std::size_t>(words_) + static_cast<std::size_t>(word)];
  }
  //! True iff `key` is `query` or one of its ancestors.
  [[nodiscard]] bool mask(int query, int key) const noexcept {
    return ((packed_mask_word(query, key / 32) >> (key % 32)) & 1u) != 0;
  }

  //! `parent` for every node.
  [[nodiscard]] std::span<const int> parents() const noexcept { return parent_; }
  //! Depth of every node (the reference's `node_depth_ids`, before adding `L`).
  [[nodiscard]] std::span<const int> node_depths() const noexcept { return node_depth_; }
  //! Last rank of each node (-1 for the root).
  [[nodiscard]] std::span<const int> ranks() const noexcept { return rank_; }
  //! `tree_indices`.
  [[nodiscard]] std::span<const int> tree_indices() const noexcept { return tree_index_; }
  //! `retrieve_indices`, row-major `[num_leaves][depth + 1]`, -1 padded.
  [[nodiscard]] std::span<const int> retrieve_indices() const noexcept { return retrieve_; }
  //! Packed ancestor mask, row-major `[num_nodes][words_per_row]`.
  [[nodiscard]] std::span<const std::uint32_t> packed_mask() const noexcept { return mask_; }
  //! The packed mask as the view attention and engines take.
  [[nodiscard]] tree_mask_view mask_view() const noexcept { return {mask_, words_}; }
  //! `child_begin` for every node.
  [[nodiscard]] std::span<const int> child_begins() const noexcept { return child_begin_; }
  //! `child_count` for every node.
  [[nodiscard]] std::span<const int> child_counts() const noexcept { return child_count_; }
  //! `depth_begin`, `depth + 2` entries.
  [[nodiscard]] std::span<const int> depth_begins() const noexcept { return depth_begin_; }
  //! `max_rank`, `depth + 1` entries (entry 0 is -1).
  [[nodiscard]] std::span<const int> max_ranks() const noexcept { return max_rank_; }
  //! Leaf node of each retrieve row.
  [[nodiscard]] std::span<const int> leaves() const noexcept { return leaf_; }
  //! The paths in canonical order (node i >= 1 is `sorted_paths()[i-1]`), root excluded.
  [[nodiscard]] const std::vector<std::vector<int>>& sorted_paths() const noexcept { return sorted_; }

 private:
  template <class Tree>
  friend constexpr detail::tree_out detail::bind_outputs(Tree& t, int* order);
  tree() = default;

  static constexpr bool is_name_start(char c) noexcept {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
  }
  static std::string_view trimmed(std::string_view s) noexcept {
    while (!s.empty() && detail::is_space(s.front())) s.remove_prefix(1);
    while (!s.empty() && detail::is_space(s.back())) s.remove_suffix(1);
    return s;
  }

  static tree from_text_impl(std::string_view text, const tree_options& opts) {
    if (const auto f = detail::check_options(opts); f.failed) detail::throw_fault(f, nullptr, {});
    if (text.size() > (std::size_t{1} << 30))
      throw tree_error(tree_errc::malformed_text, "tree text: larger than 1 GiB");
    std::vector<int> flat, begin{0};
    detail::vector_sink sink{flat, begin};
    const detail::tree_fault f = detail::parse_paths(text, sink, opts.max_nodes - 1);
    if (f.failed) detail::throw_fault(f, nullptr, text);
    return compile_or_throw(flat, begin, opts, text);
  }

  static tree compile_or_throw(const std::vector<int>& flat, const std::vector<int>& begin, const tree_options& opts,
                               std::string_view text) {
    const detail::path_list in{flat.data(), begin.data(), static_cast<int>(begin.size()) - 1};
    int depth = 0;
    detail::tree_fault f = detail::validate_paths(in, opts, depth);
    if (f.failed) detail::throw_fault(f, &in, text);
    tree t;
    const int N = in.count + 1;
    const auto n = static_cast<std::size_t>(N);
    t.n_ = N;
    t.depth_ = depth;
    t.topk_ = opts.topk;
    t.words_ = (N + 31) / 32;
    std::vector<int> order(n - 1);
    t.parent_.resize(n);
    t.rank_.resize(n);
    t.node_depth_.resize(n);
    t.tree_index_.resize(n);
    t.child_begin_.resize(n);
    t.child_count_.resize(n);
    t.leaf_.resize(n);
    t.depth_begin_.resize(static_cast<std::size_t>(depth) + 2);
    t.max_rank_.resize(static_cast<std::size_t>(depth) + 1);
    t.mask_.assign(n * static_cast<std::size_t>(t.words_), 0u);
    detail::tree_out out = detail::bind_outputs(t, order.data());
    f = detail::compile_sorted(in, opts, depth, out);
    if (f.failed) detail::throw_fault(f, &in, text);
    t.leaf_.resize(static_cast<std::size_t>(out.num_leaves));
    t.retrieve_.resize(t.leaf_.size() * (static_cast<std::size_t>(depth) + 1));
    detail::write_retrieve(out, depth, t.retrieve_.data());
    t.sorted_.resize(n - 1);
    for (std::size_t i = 0; i + 1 < n; ++i) {
      const int k = order[i];
      t.sorted_[i].assign(in.data(k), in.data(k) + in.len(k));
    }
    return t;
  }

  int n_ = 0;
  int depth_ = 0;
  int topk_ = 0;
  int words_ = 0;
  std::vector<int> parent_, rank_, node_depth_, tree_index_, child_begin_, child_count_, leaf_;
  std::vector<int> depth_begin_, max_rank_, retrieve_;
  std::vector<std::uint32_t> mask_;
  std::vector<std::vector<int>> sorted_;
};

static_assert(tree_like<tree>);

MEDUSA_NAMESPACE_END
