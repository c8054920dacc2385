// SPDX-License-Identifier: Apache-2.0
//! @file tree/errors.hpp
//! What can be wrong with a tree: `tree_errc`, `tree_error`, and the fault record that the
//! constexpr compiler core returns instead of throwing.
#pragma once

#include <medusa/config.hpp>
#include <medusa/error.hpp>

#include <cstddef>
#include <string>
#include <string_view>

MEDUSA_NAMESPACE_BEGIN

//! What is wrong with a tree; also the order in which problems are detected (docs/tree.md).
enum class tree_errc {
  empty_tree,         //!< no paths at all
  empty_path,         //!< a path `[]` (the root is implicit)
  rank_out_of_range,  //!< a rank `< 0` or `>= topk`
  too_deep,           //!< a path longer than `max_depth`
  duplicate_path,     //!< the same path twice (the second occurrence is reported)
  not_prefix_closed,  //!< a proper prefix of a path is missing (the message names it)
  too_many_nodes,     //!< more nodes than `max_nodes` (or than a `static_tree` can hold)
  malformed_text,     //!< text that is not a list of lists of integers (the message says where)
  unknown_preset,     //!< a preset name that does not exist
};

//! The enumerator's name, e.g. `"rank_out_of_range"`.
constexpr std::string_view to_string(tree_errc code) noexcept {
  switch (code) {
    case tree_errc::empty_tree: return "empty_tree";
    case tree_errc::empty_path: return "empty_path";
    case tree_errc::rank_out_of_range: return "rank_out_of_range";
    case tree_errc::too_deep: return "too_deep";
    case tree_errc::duplicate_path: return "duplicate_path";
    case tree_errc::not_prefix_closed: return "not_prefix_closed";
    case tree_errc::too_many_nodes: return "too_many_nodes";
    case tree_errc::malformed_text: return "malformed_text";
    case tree_errc::unknown_preset: return "unknown_preset";
  }
  return "unknown";
}

//! An invalid tree. `what()` names the offending path, e.g.
//! `medusa: tree path #12 [3,10]: rank 10 >= topk 10` (paths are numbered from 0 in input order).
class tree_error : public coded_error<tree_errc> {
 public:
  //! @param code what is wrong; @param what the message; @param path_index input index of the
  //! offending path, or -1.
  using coded_error::coded_error;
  //! Input index (0-based) of the offending path; -1 when no single path is to blame.
  [[nodiscard]] int path_index() const noexcept { return index(); }
};

namespace detail {

// What the constexpr core reports; formatted into a tree_error at run time, shown as template
// arguments at compile time (tree/static_tree.hpp).
struct tree_fault {
  bool failed = false;
  bool bad_options = false;  // tree_options out of range (reported as plain invalid_input)
  tree_errc code = tree_errc::empty_tree;
  int path_index = -1;     // input index of the offending path
  long long value = 0;     // rank / depth / node count / length of the missing prefix / offset
  long long other = -1;    // first occurrence (duplicates), limit (too_many_nodes, options)
  long long lowest = 0;    // options: smallest accepted value
  std::size_t offset = 0;  // malformed text: byte offset
  const char* reason = "";  // malformed text / bad options: what went wrong
};

constexpr tree_fault fault(tree_errc code, int path_index, long long value = 0, long long other = -1) {
  tree_fault f;
  f.failed = true;
  f.code = code;
  f.path_index = path_index;
  f.value = value;
  f.other = other;
  return f;
}

// At most `max_len` bytes of `s` for a message, non-printable bytes as '?'.
inline std::string printable(std::string_view s, std::size_t max_len) {
  std::string r;
  for (std::size_t i = 0; i < s.size() && i < max_len; ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    r += (c >= 0x20 && c < 0x7f) ? static_cast<char>(c) : '?';
  }
  if (s.size() > max_len) r += "...";
  return r;
}

}  // namespace detail

MEDUSA_NAMESPACE_END
