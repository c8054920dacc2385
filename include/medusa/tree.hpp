// SPDX-License-Identifier: Apache-2.0
//! @file tree.hpp
//! The Medusa tree compiler: paths ("medusa_choices") in, every buffer of the reference out.
//!
//! A tree is a list of paths of ranks (`[a, b]` = the rank-a token of head 0, then the rank-b
//! token of head 1); the root is implicit. The compiler sorts the paths by `(length, path)`, numbers
//! the nodes in that order (root = 0) and derives `parent`, `position_ids`, `tree_indices`,
//! `retrieve_indices`, the ancestor mask and a few helpers of our own (spec §2). Two types give
//! the same answers through one interface, the `tree_like` concept:
//!
//! * `medusa::tree`: built at run time from paths, text (JSON or Python literal) or a preset name;
//!   owns its buffers and exposes them as spans (up to `tree_options::max_nodes` nodes, 4096 by
//!   default, 16384 at most).
//! * `medusa::static_tree<N>`: built at compile time, a C++20 structural type usable as a
//!   template argument so kernels can be instantiated per tree shape (up to 256 nodes); its
//!   accessors are `constexpr MEDUSA_HOST_DEVICE`. The nine presets as compile-time trees
//!   (`medusa::presets::mc_sim_7b_63`, ...) are in `<medusa/tree/presets.hpp>`, kept apart
//!   because evaluating them costs every including translation unit about 0.3 s.
//!
//! @code
//! #include <medusa/tree.hpp>
//! // compile time: a preset, or any literal tree
//! constexpr auto demo = medusa::static_tree_from<"[[0],[1],[0,0]]">;
//! static_assert(demo.parent(3) == 1 && demo.retrieve(0, 2) == 3);
//! // run time
//! auto t = medusa::tree::from_text("[(0,), (1,), (0, 0)]");
//! bool same = medusa::same_shape(t, demo);  // true
//! @endcode
//!
//! Everything here uses only the standard library. Invalid trees throw `medusa::tree_error`
//! (a `medusa::invalid_input`) with a `tree_errc` code, checked in the fixed order of spec §2.4.
#pragma once

#include <medusa/config.hpp>
#include <medusa/error.hpp>

#include <algorithm>
#include <array>
#include <climits>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

MEDUSA_NAMESPACE_BEGIN

//! Candidates per head assumed by `tree_indices` (the reference's hard-coded constant).
inline constexpr int default_topk = 10;
//! Default cap on the path length (number of heads a tree may use).
inline constexpr int default_max_depth = 16;
//! Default cap on the number of nodes (root included) of a run-time `tree`.
inline constexpr int default_max_nodes = 4096;
//! Largest `tree_options::max_nodes` accepted (the packed mask of such a tree is 32 MiB).
inline constexpr int max_tree_nodes = 16384;
//! Largest `static_tree<N>`.
inline constexpr int max_static_tree_nodes = 256;
//! Largest accepted `tree_options::topk` (keeps `tree_indices` far from int overflow).
inline constexpr int max_tree_topk = 1 << 20;
//! Largest accepted `tree_options::max_depth`.
inline constexpr int max_tree_depth = max_tree_nodes;

//! What is wrong with a tree (spec §2.4); also the order in which problems are detected.
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
class tree_error : public invalid_input {
 public:
  //! @param code what is wrong; @param path_index input index of the offending path, or -1.
  tree_error(tree_errc code, int path_index, const std::string& what)
      : invalid_input(what), code_(code), path_index_(path_index) {}
  //! The kind of problem.
  [[nodiscard]] tree_errc code() const noexcept { return code_; }
  //! Input index (0-based) of the offending path; -1 when no single path is to blame.
  [[nodiscard]] int path_index() const noexcept { return path_index_; }

 private:
  tree_errc code_;
  int path_index_;
};

//! Parameters of the tree compiler. A structural type, so it can also be a template argument.
struct tree_options {
  int topk = default_topk;            //!< candidates per head (K); ranks must be in [0, topk)
  int max_depth = default_max_depth;  //!< longest path allowed (heads available)
  int max_nodes = default_max_nodes;  //!< most nodes allowed, root included (run-time trees)
};

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

//! A type that answers the tree questions of spec §2.2 (satisfied by `tree`, `static_tree<N>`).
//! Node ids are 0..num_nodes()-1 in canonical order (root 0); accessors have no bounds checks.
template <class T>
concept tree_like = requires(const T& t, int i) {
  { t.num_nodes() } -> std::convertible_to<int>;
  { t.depth() } -> std::convertible_to<int>;
  { t.topk() } -> std::convertible_to<int>;
  { t.num_leaves() } -> std::convertible_to<int>;
  { t.parent(i) } -> std::convertible_to<int>;
  { t.position(i) } -> std::convertible_to<int>;
  { t.rank(i) } -> std::convertible_to<int>;
  { t.tree_index(i) } -> std::convertible_to<int>;
  { t.child_begin(i) } -> std::convertible_to<int>;
  { t.child_count(i) } -> std::convertible_to<int>;
  { t.depth_begin(i) } -> std::convertible_to<int>;
  { t.max_rank(i) } -> std::convertible_to<int>;
  { t.retrieve(i, i) } -> std::convertible_to<int>;
  { t.mask(i, i) } -> std::convertible_to<bool>;
  { t.words_per_row() } -> std::convertible_to<int>;
  { t.packed_mask_word(i, i) } -> std::same_as<std::uint32_t>;
};

namespace detail {

// ---- faults: what the constexpr core reports; formatted into a tree_error at run time -------
struct tree_fault {
  bool failed = false;
  bool bad_options = false;   // tree_options out of range (reported as plain invalid_input)
  tree_errc code = tree_errc::empty_tree;
  int path_index = -1;        // input index of the offending path
  long long value = 0;        // rank / depth / node count / length of the missing prefix
  long long other = -1;       // first occurrence (duplicates), limit (too_many_nodes, options)
  long long lowest = 0;       // options: smallest accepted value
  std::size_t offset = 0;     // malformed text: byte offset
  const char* reason = "";    // malformed text / bad options: what went wrong
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

// ---- parsing: JSON `[[0],[0,0]]` or Python `[(0,), (0, 0)]`; no recursion, no allocation -----
// The sink receives push(rank) for each rank and end_path() after each path.
constexpr bool is_space(char c) noexcept { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }
constexpr bool is_digit(char c) noexcept { return c >= '0' && c <= '9'; }

template <class Sink>
constexpr tree_fault parse_paths(std::string_view s, Sink& sink, int max_paths) {
  const std::size_t n = s.size();
  std::size_t i = 0;
  auto malformed = [&](std::size_t at, const char* why) {
    tree_fault f = fault(tree_errc::malformed_text, -1);
    f.offset = at;
    f.reason = why;
    return f;
  };
  auto skip_ws = [&] {
    while (i < n && is_space(s[i])) ++i;
  };
  if (n >= 3 && s[0] == '\xEF' && s[1] == '\xBB' && s[2] == '\xBF') i = 3;  // UTF-8 BOM
  skip_ws();
  if (i == n) return malformed(i, "empty text; expected a list of paths such as [[0],[1],[0,0]]");
  if (s[i] != '[' && s[i] != '(') return malformed(i, "expected '[' to open the list of paths");
  const bool outer_tuple = s[i] == '(';
  const char outer_close = outer_tuple ? ')' : ']';
  ++i;
  int count = 0;
  bool trailing_comma = false;
  skip_ws();
  while (true) {
    if (i == n) return malformed(i, "unexpected end of text: the list of paths is not closed");
    if (s[i] == outer_close) {
      ++i;
      break;
    }
    if (s[i] != '[' && s[i] != '(') return malformed(i, "expected a path such as [0,1]");
    if (count >= max_paths) {
      tree_fault f = fault(tree_errc::too_many_nodes, count, -1, max_paths + 1LL);
      return f;
    }
    const bool tuple = s[i] == '(';
    const char close = tuple ? ')' : ']';
    ++i;
    skip_ws();
    int len = 0;
    bool path_trailing = false;
    while (true) {
      if (i == n) return malformed(i, "unexpected end of text inside a path");
      if (s[i] == close && (len == 0 || path_trailing)) {
        ++i;
        break;
      }
      // a rank: -?(0|[1-9][0-9]*), no fraction, no exponent
      const std::size_t start = i;
      bool neg = false;
      if (s[i] == '-') {
        neg = true;
        ++i;
      }
      if (i == n || !is_digit(s[i])) return malformed(start, "expected an integer rank");
      if (s[i] == '0' && i + 1 < n && is_digit(s[i + 1])) return malformed(start, "leading zero in a rank");
      long long v = 0;
      while (i < n && is_digit(s[i])) {
        v = v * 10 + (s[i] - '0');
        if (v > 2147483648LL) return malformed(start, "rank does not fit in a 32-bit integer");
        ++i;
      }
      if (i < n && (s[i] == '.' || s[i] == 'e' || s[i] == 'E'))
        return malformed(start, "ranks must be integers");
      if (neg) v = -v;
      if (v > INT_MAX) return malformed(start, "rank does not fit in a 32-bit integer");
      sink.push(static_cast<int>(v));
      ++len;
      path_trailing = false;
      skip_ws();
      if (i == n) return malformed(i, "unexpected end of text inside a path");
      if (s[i] == ',') {
        ++i;
        skip_ws();
        path_trailing = true;
        continue;
      }
      if (s[i] == close) {
        ++i;
        break;
      }
      return malformed(i, tuple ? "expected ',' or ')' inside a path" : "expected ',' or ']' inside a path");
    }
    if (tuple && len == 1 && !path_trailing) {
      // Python: (0) is the integer 0, not a tuple
      return malformed(i - 1, "a one-element tuple needs a trailing comma, as in (0,)");
    }
    sink.end_path();
    ++count;
    trailing_comma = false;
    skip_ws();
    if (i == n) return malformed(i, "unexpected end of text: the list of paths is not closed");
    if (s[i] == ',') {
      ++i;
      trailing_comma = true;
      skip_ws();
      continue;
    }
    if (s[i] == outer_close) {
      ++i;
      break;
    }
    return malformed(i, outer_tuple ? "expected ',' or ')' after a path" : "expected ',' or ']' after a path");
  }
  if (outer_tuple && count == 1 && !trailing_comma)
    return malformed(i - 1, "a one-element tuple needs a trailing comma, as in ((0,),)");
  skip_ws();
  if (i != n) return malformed(i, "unexpected text after the list of paths");
  return tree_fault{};
}

struct counting_sink {
  int paths = 0;
  std::size_t ranks = 0;
  constexpr void push(int) noexcept { ++ranks; }
  constexpr void end_path() noexcept { ++paths; }
};

struct vector_sink {
  std::vector<int>& flat;
  std::vector<int>& begin;  // starts as {0}
  void push(int r) { flat.push_back(r); }
  void end_path() { begin.push_back(static_cast<int>(flat.size())); }
};

template <std::size_t P, std::size_t F>
struct fixed_sink {
  std::array<int, (F > 0 ? F : 1)> flat{};
  std::array<int, P + 1> begin{};
  std::size_t nf = 0;
  std::size_t np = 0;
  constexpr void push(int r) { flat[nf++] = r; }
  constexpr void end_path() { begin[++np] = static_cast<int>(nf); }
};

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

// Steps (1) and (2) of spec §2.4 (and the node limit); sets depth.
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
  int* position = nullptr;     // [N]
  int* tree_index = nullptr;   // [N]
  int* child_begin = nullptr;  // [N]
  int* child_count = nullptr;  // [N]
  int* leaf = nullptr;         // [N] leaf node of each retrieve row
  int* depth_begin = nullptr;  // [depth + 2]
  int* max_rank = nullptr;     // [depth + 1]
  std::uint32_t* mask = nullptr;  // [N * W], zero-filled by the caller
  int num_leaves = 0;
};

// Steps (3) and (4) of spec §2.4, then every buffer. `depth` comes from validate_paths.
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
  out.position[0] = 0;
  out.tree_index[0] = 0;
  for (int i = 1; i < N; ++i) {
    const int len = in.len(order[i - 1]);
    out.position[i] = len;
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

inline std::string printable(std::string_view s, std::size_t max_len) {
  std::string r;
  for (std::size_t i = 0; i < s.size() && i < max_len; ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    r += (c >= 0x20 && c < 0x7f) ? static_cast<char>(c) : '?';
  }
  if (s.size() > max_len) r += "...";
  return r;
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
  throw tree_error(f.code, f.path_index, msg);
}

// A compile-time tree that fails to compile ends up calling this non-constexpr function; the
// compiler's note shows its arguments: the code, the input index of the path and the value.
inline void invalid_static_tree(tree_errc, int /*path_index*/, long long /*value*/) {}

template <std::size_t N>
struct static_tree_builder;

}  // namespace detail

//! A tree compiled at compile time: N nodes (root included), every buffer stored inline.
//!
//! A C++20 structural type: its members are public only so that it can be a template argument
//! (`template <auto Tree> requires medusa::tree_like<decltype(Tree)>`); use the accessors. Build
//! one with `static_tree_from<"...">` or use `medusa::presets`.
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
  int position_[N]{};
  int tree_index_[N]{};
  int child_begin_[N]{};
  int child_count_[N]{};
  int leaf_[N]{};
  int depth_begin_[N + 1]{};
  int max_rank_[N + 1]{};
  std::uint32_t mask_[N * words]{};

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
  //! Depth of the node (root 0); the model's position is `L + position(node)`.
  MEDUSA_HOST_DEVICE constexpr int position(int node) const noexcept { return position_[node]; }
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
    int node = leaf_[row];
    int d = position_[node];
    if (col > d) return -1;
    for (; d > col; --d) node = parent_[node];
    return node;
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

  friend constexpr bool operator==(const static_tree&, const static_tree&) = default;
};

namespace detail {

template <std::size_t N>
struct static_tree_builder {
  template <std::size_t F>
  static constexpr static_tree<N> build(std::string_view text, tree_options o) {
    constexpr std::size_t P = N - 1;
    fixed_sink<P, F> sink;
    if (o.max_nodes > max_static_tree_nodes) o.max_nodes = max_static_tree_nodes;
    tree_fault f = parse_paths(text, sink, o.max_nodes - 1);
    const path_list in{sink.flat.data(), sink.begin.data(), static_cast<int>(sink.np)};
    int depth = 0;
    if (!f.failed) f = validate_paths(in, o, depth);
    static_tree<N> t{};
    std::array<int, P> order{};
    tree_out out;
    out.order = order.data();
    out.parent = t.parent_;
    out.rank = t.rank_;
    out.position = t.position_;
    out.tree_index = t.tree_index_;
    out.child_begin = t.child_begin_;
    out.child_count = t.child_count_;
    out.leaf = t.leaf_;
    out.depth_begin = t.depth_begin_;
    out.max_rank = t.max_rank_;
    out.mask = t.mask_;
    if (!f.failed) f = compile_sorted(in, o, depth, out);
    if (f.failed) {
      invalid_static_tree(f.code, f.path_index, f.value);
      return t;
    }
    for (std::size_t d = static_cast<std::size_t>(depth) + 2; d <= N; ++d) t.depth_begin_[d] = static_cast<int>(N);
    t.topk_ = o.topk;
    t.depth_ = depth;
    t.num_leaves_ = out.num_leaves;
    return t;
  }
};

constexpr counting_sink count_text(std::string_view text) {
  counting_sink c;
  const tree_fault f = parse_paths(text, c, max_static_tree_nodes);
  if (f.failed) invalid_static_tree(f.code, f.path_index, static_cast<long long>(f.offset));
  return c;
}

}  // namespace detail

//! The compile-time tree of a literal (JSON or Python form), e.g.
//! `constexpr auto t = medusa::static_tree_from<"[[0],[1],[0,0]]">;`.
//! An invalid tree is a compile error (a call to `detail::invalid_static_tree(code, path, value)`).
template <fixed_string Text, tree_options Opts = tree_options{}>
inline constexpr auto static_tree_from =
    detail::static_tree_builder<static_cast<std::size_t>(detail::count_text(Text.view()).paths) + 1>::template build<
        detail::count_text(Text.view()).ranks>(Text.view(), Opts);

// ---- presets ---------------------------------------------------------------------------------
namespace detail::preset_text {
// Appendix A of the spec, verbatim (source order of the reference's medusa_choices.py).
inline constexpr fixed_string mc_sim_7b_63 =
    "[[0],[0,0],[1],[0,1],[2],[0,0,0],[1,0],[0,2],[3],[0,3],[4],[0,4],[2,0],[0,5],[0,0,1],[5],[0,6],"
    "[6],[0,7],[0,1,0],[1,1],[7],[0,8],[0,0,2],[3,0],[0,9],[8],[9],[1,0,0],[0,2,0],[1,2],[0,0,3],"
    "[4,0],[2,1],[0,0,4],[0,0,5],[0,0,0,0],[0,1,1],[0,0,6],[0,3,0],[5,0],[1,3],[0,0,7],[0,0,8],"
    "[0,0,9],[6,0],[0,4,0],[1,4],[7,0],[0,1,2],[2,0,0],[3,1],[2,2],[8,0],[0,5,0],[1,5],[1,0,1],"
    "[0,2,1],[9,0],[0,6,0],[0,0,0,1],[1,6],[0,7,0]]";
inline constexpr fixed_string vicuna_7b_stage2 =
    "[[0],[0,0],[1],[0,1],[0,0,0],[1,0],[2],[0,2],[0,0,1],[0,3],[3],[0,1,0],[2,0],[4],[0,0,2],[0,4],"
    "[1,1],[1,0,0],[0,0,0,0],[5],[0,0,3],[0,5],[0,2,0],[3,0],[0,1,1],[0,6],[6],[0,7],[0,0,4],[4,0],"
    "[1,2],[0,8],[7],[0,3,0],[0,0,0,1],[0,0,5],[2,1],[0,0,6],[1,0,1],[0,0,1,0],[2,0,0],[5,0],[0,9],"
    "[0,1,2],[8],[0,4,0],[0,2,1],[1,3],[0,0,7],[0,0,0,2],[0,0,8],[1,1,0],[0,1,0,0],[6,0],[9],[0,1,3],"
    "[0,0,0,3],[1,0,2],[0,5,0],[3,1],[0,0,2,0],[7,0],[1,4]]";
inline constexpr fixed_string vicuna_7b_stage1_ablation =
    "[[0],[0,0],[1],[0,0,0],[0,1],[1,0],[2],[0,2],[0,0,1],[3],[0,3],[0,1,0],[2,0],[0,0,2],[0,4],[4],"
    "[0,0,0,0],[1,0,0],[1,1],[0,0,3],[0,2,0],[0,5],[5],[3,0],[0,1,1],[0,6],[6],[0,0,4],[1,2],"
    "[0,0,0,1],[4,0],[0,0,5],[0,7],[0,8],[0,3,0],[0,0,1,0],[1,0,1],[7],[2,0,0],[0,0,6],[2,1],[0,1,2],"
    "[5,0],[0,2,1],[0,9],[0,0,0,2],[0,4,0],[8],[1,3],[0,0,7],[0,1,0,0],[1,1,0],[6,0],[9],[0,0,8],"
    "[0,0,9],[0,5,0],[0,0,2,0],[1,0,2],[0,1,3],[0,0,0,3],[3,0,0],[3,1]]";
inline constexpr fixed_string vicuna_7b_stage1 =
    "[[0],[0,0],[1],[2],[0,1],[1,0],[3],[0,2],[4],[0,0,0],[0,3],[5],[2,0],[0,4],[6],[0,5],[1,1],"
    "[0,0,1],[7],[3,0],[0,6],[8],[9],[0,1,0],[0,7],[0,8],[4,0],[0,0,2],[1,2],[0,9],[2,1],[5,0],"
    "[1,0,0],[0,0,3],[1,3],[0,2,0],[0,1,1],[0,0,4],[6,0],[1,4],[0,0,5],[2,2],[0,3,0],[3,1],[0,0,6],"
    "[7,0],[1,5],[1,0,1],[2,0,0],[0,0,7],[8,0],[0,0,0,0],[4,1],[0,1,2],[0,4,0],[9,0],[0,2,1],[2,3],"
    "[1,6],[0,0,8],[0,5,0],[3,2],[5,1]]";
inline constexpr fixed_string vicuna_13b_stage2 =
    "[[0],[0,0],[1],[0,0,0],[0,1],[1,0],[2],[0,2],[0,0,1],[0,1,0],[3],[0,3],[2,0],[0,0,2],[0,0,0,0],"
    "[0,4],[1,0,0],[1,1],[4],[0,0,3],[0,5],[0,2,0],[5],[3,0],[0,1,1],[0,6],[0,0,4],[0,0,0,1],[0,7],"
    "[0,0,5],[1,2],[0,0,1,0],[0,3,0],[1,0,1],[4,0],[0,0,6],[0,8],[2,0,0],[0,9],[6],[7],[2,1],[5,0],"
    "[0,1,2],[0,0,0,2],[8],[0,4,0],[0,1,0,0],[0,2,1],[0,0,7],[1,1,0],[1,3],[0,0,2,0],[9],[0,0,8],"
    "[0,5,0],[0,0,0,3],[0,0,9],[0,1,3],[1,0,2],[0,0,1,1],[3,0,0],[1,0,0,0]]";
inline constexpr fixed_string vicuna_13b_stage1 =
    "[[0],[0,0],[1],[0,1],[2],[1,0],[0,0,0],[0,2],[3],[0,3],[4],[2,0],[0,4],[0,0,1],[0,5],[5],[1,1],"
    "[0,1,0],[6],[0,6],[0,0,2],[7],[3,0],[8],[0,7],[0,8],[1,0,0],[0,0,3],[4,0],[1,2],[9],[0,9],[2,1],"
    "[0,2,0],[0,0,4],[1,3],[0,1,1],[0,0,5],[5,0],[0,3,0],[0,0,0,0],[0,0,6],[6,0],[1,4],[2,0,0],"
    "[0,1,2],[3,1],[0,4,0],[1,0,1],[2,2],[0,0,7],[1,5],[7,0],[0,0,8],[8,0],[0,5,0],[0,0,9],[0,2,1],"
    "[1,1,0],[0,1,3],[4,1],[2,3],[1,6]]";
inline constexpr fixed_string vicuna_33b_stage2 =
    "[[0],[0,0],[1],[0,1],[0,0,0],[1,0],[2],[0,2],[0,0,1],[0,3],[3],[0,1,0],[2,0],[0,4],[4],[0,0,2],"
    "[1,1],[1,0,0],[0,5],[5],[0,0,0,0],[0,0,3],[3,0],[0,2,0],[0,6],[0,1,1],[6],[0,0,4],[0,7],[7],"
    "[1,2],[4,0],[8],[0,3,0],[0,0,5],[0,0,0,1],[0,8],[2,1],[0,9],[1,0,1],[2,0,0],[0,0,6],[5,0],"
    "[0,0,1,0],[1,3],[0,1,2],[0,4,0],[0,0,7],[0,2,1],[9],[1,1,0],[0,0,0,2],[6,0],[0,0,8],[0,1,0,0],"
    "[7,0],[0,1,3],[0,5,0],[1,4],[0,0,9],[3,1],[1,0,2],[2,2]]";
inline constexpr fixed_string vicuna_33b_stage1 =
    "[[0],[1],[0,0],[2],[0,1],[3],[1,0],[4],[0,2],[5],[0,3],[0,0,0],[6],[0,4],[2,0],[7],[1,1],[0,5],"
    "[3,0],[8],[9],[0,6],[0,7],[0,0,1],[1,2],[4,0],[0,1,0],[0,8],[0,9],[2,1],[0,0,2],[5,0],[1,3],"
    "[0,0,3],[1,0,0],[1,4],[6,0],[0,2,0],[3,1],[2,2],[0,0,4],[7,0],[0,1,1],[1,5],[4,1],[0,0,5],"
    "[0,3,0],[9,0],[8,0],[1,6],[0,0,6],[2,3],[0,1,2],[3,2],[0,4,0],[2,0,0],[1,7],[1,0,1],[0,0,7],"
    "[5,1],[2,4],[0,0,8],[0,2,1]]";
inline constexpr fixed_string zephyr_stage2 =
    "[[0],[0,0],[1],[0,1],[2],[0,0,0],[1,0],[0,2],[3],[0,3],[4],[2,0],[0,0,1],[0,4],[5],[0,5],[0,1,0],"
    "[1,1],[6],[0,0,2],[3,0],[0,6],[7],[0,7],[0,8],[0,0,3],[1,0,0],[0,9],[0,2,0],[1,2],[4,0],[8],[9],"
    "[2,1],[0,1,1],[0,0,4],[0,0,0,0],[5,0],[0,3,0],[1,3],[0,0,5],[0,0,6],[6,0],[2,0,0],[1,0,1],"
    "[0,1,2],[0,4,0],[1,4],[3,1],[2,2],[0,0,7],[7,0],[0,2,1],[0,0,8],[0,1,3],[0,5,0],[1,5],[0,0,9],"
    "[1,1,0],[0,0,0,1],[0,0,1,0],[4,1],[2,3]]";
}  // namespace detail::preset_text


namespace detail {
struct preset_entry {
  std::string_view name;
  std::string_view text;
};
inline constexpr std::array<preset_entry, 9> preset_table{{
    {"mc_sim_7b_63", preset_text::mc_sim_7b_63.view()},
    {"vicuna_7b_stage2", preset_text::vicuna_7b_stage2.view()},
    {"vicuna_7b_stage1_ablation", preset_text::vicuna_7b_stage1_ablation.view()},
    {"vicuna_7b_stage1", preset_text::vicuna_7b_stage1.view()},
    {"vicuna_13b_stage2", preset_text::vicuna_13b_stage2.view()},
    {"vicuna_13b_stage1", preset_text::vicuna_13b_stage1.view()},
    {"vicuna_33b_stage2", preset_text::vicuna_33b_stage2.view()},
    {"vicuna_33b_stage1", preset_text::vicuna_33b_stage1.view()},
    {"zephyr_stage2", preset_text::zephyr_stage2.view()},
}};
inline constexpr std::array<std::string_view, 9> preset_name_list{
    "mc_sim_7b_63",      "vicuna_7b_stage2",  "vicuna_7b_stage1_ablation", "vicuna_7b_stage1", "vicuna_13b_stage2",
    "vicuna_13b_stage1", "vicuna_33b_stage2", "vicuna_33b_stage1",         "zephyr_stage2"};

constexpr bool contains_nocase(std::string_view hay, std::string_view needle) noexcept {
  auto lower = [](char c) { return (c >= 'A' && c <= 'Z') ? static_cast<char>(c - 'A' + 'a') : c; };
  if (needle.size() > hay.size()) return false;
  for (std::size_t i = 0; i + needle.size() <= hay.size(); ++i) {
    std::size_t j = 0;
    while (j < needle.size() && lower(hay[i + j]) == needle[j]) ++j;
    if (j == needle.size()) return true;
  }
  return false;
}
}  // namespace detail

//! Names of the nine presets, in the order of spec §3.
constexpr std::span<const std::string_view> preset_names() noexcept { return detail::preset_name_list; }

//! The `choices` text (JSON) of a preset, verbatim from the reference; throws `tree_error`
//! (`unknown_preset`) for an unknown name.
inline std::string_view preset_text(std::string_view name) {
  for (const auto& e : detail::preset_table)
    if (e.name == name) return e.text;
  std::string msg = "unknown tree preset '" + detail::printable(name, 64) + "'; known presets:";
  for (std::size_t i = 0; i < detail::preset_name_list.size(); ++i)
    msg += (i ? ", " : " ") + std::string(detail::preset_name_list[i]);
  throw tree_error(tree_errc::unknown_preset, -1, msg);
}

//! Result of `preset_for_model`.
struct preset_choice {
  std::string_view name;  //!< the preset to use
  bool matched;           //!< false when no rule matched and the fallback `mc_sim_7b_63` was chosen (warn)
};

//! The reference's automatic choice from a base model name (case-insensitive): vicuna + 7b/13b/33b
//! -> `vicuna_*_stage2`, zephyr -> `zephyr_stage2`, else `mc_sim_7b_63` with `matched == false`.
//! Never applied silently by the library.
constexpr preset_choice preset_for_model(std::string_view model_name) noexcept {
  using detail::contains_nocase;
  if (contains_nocase(model_name, "vicuna")) {
    if (contains_nocase(model_name, "7b")) return {"vicuna_7b_stage2", true};
    if (contains_nocase(model_name, "13b")) return {"vicuna_13b_stage2", true};
    if (contains_nocase(model_name, "33b")) return {"vicuna_33b_stage2", true};
  }
  if (contains_nocase(model_name, "zephyr")) return {"zephyr_stage2", true};
  return {"mc_sim_7b_63", false};
}

//! Parses tree text (JSON `[[0],[0,0]]` or Python `[(0,), (0, 0)]`, whitespace anywhere, trailing
//! commas allowed) into paths without validating them. Throws `tree_error` (`malformed_text` with
//! the offset, or `too_many_nodes` past `max_nodes - 1` paths).
inline std::vector<std::vector<int>> parse_tree_text(std::string_view text, int max_nodes = max_tree_nodes) {
  std::vector<int> flat, begin{0};
  detail::vector_sink sink{flat, begin};
  if (text.size() > (std::size_t{1} << 30)) {
    throw tree_error(tree_errc::malformed_text, -1, "tree text: larger than 1 GiB");
  }
  const detail::tree_fault f = detail::parse_paths(text, sink, std::clamp(max_nodes, 2, max_tree_nodes) - 1);
  if (f.failed) detail::throw_fault(f, nullptr, text);
  std::vector<std::vector<int>> paths(begin.size() - 1);
  for (std::size_t k = 0; k + 1 < begin.size(); ++k) paths[k].assign(flat.begin() + begin[k], flat.begin() + begin[k + 1]);
  return paths;
}

//! A tree compiled at run time; owns every buffer of spec §2.2.
//!
//! @code
//! auto t = medusa::tree::preset("mc_sim_7b_63");
//! auto rows = t.retrieve_indices();           // [num_leaves][depth + 1], -1 padded
//! bool sees_root = t.mask(5, 0);              // true: every node attends to the root
//! @endcode
class tree {
 public:
  //! Compiles a list of paths (any order). Throws `tree_error` (spec §2.4 order) or
  //! `invalid_input` for out-of-range options.
  static tree from_paths(const std::vector<std::vector<int>>& paths, tree_options opts = {}) {
    std::vector<int> flat, begin{0};
    begin.reserve(paths.size() + 1);
    for (const auto& p : paths) {
      flat.insert(flat.end(), p.begin(), p.end());
      if (flat.size() > static_cast<std::size_t>(INT_MAX / 2))
        throw tree_error(tree_errc::too_many_nodes, -1, "tree: paths hold too many ranks");
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
  //! Depth of the node (root 0).
  [[nodiscard]] int position(int node) const noexcept { return position_[static_cast<std::size_t>(node)]; }
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
  //! `position_ids` (node depths).
  [[nodiscard]] std::span<const int> positions() const noexcept { return position_; }
  //! Last rank of each node (-1 for the root).
  [[nodiscard]] std::span<const int> ranks() const noexcept { return rank_; }
  //! `tree_indices`.
  [[nodiscard]] std::span<const int> tree_indices() const noexcept { return tree_index_; }
  //! `retrieve_indices`, row-major `[num_leaves][depth + 1]`, -1 padded.
  [[nodiscard]] std::span<const int> retrieve_indices() const noexcept { return retrieve_; }
  //! Packed ancestor mask, row-major `[num_nodes][words_per_row]`.
  [[nodiscard]] std::span<const std::uint32_t> packed_mask() const noexcept { return mask_; }
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
      throw tree_error(tree_errc::malformed_text, -1, "tree text: larger than 1 GiB");
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
    t.position_.resize(n);
    t.tree_index_.resize(n);
    t.child_begin_.resize(n);
    t.child_count_.resize(n);
    t.leaf_.resize(n);
    t.depth_begin_.resize(static_cast<std::size_t>(depth) + 2);
    t.max_rank_.resize(static_cast<std::size_t>(depth) + 1);
    t.mask_.assign(n * static_cast<std::size_t>(t.words_), 0u);
    detail::tree_out out;
    out.order = order.data();
    out.parent = t.parent_.data();
    out.rank = t.rank_.data();
    out.position = t.position_.data();
    out.tree_index = t.tree_index_.data();
    out.child_begin = t.child_begin_.data();
    out.child_count = t.child_count_.data();
    out.leaf = t.leaf_.data();
    out.depth_begin = t.depth_begin_.data();
    out.max_rank = t.max_rank_.data();
    out.mask = t.mask_.data();
    f = detail::compile_sorted(in, opts, depth, out);
    if (f.failed) detail::throw_fault(f, &in, text);
    t.leaf_.resize(static_cast<std::size_t>(out.num_leaves));
    const auto cols = static_cast<std::size_t>(depth) + 1;
    t.retrieve_.assign(t.leaf_.size() * cols, -1);
    for (std::size_t r = 0; r < t.leaf_.size(); ++r) {
      int node = t.leaf_[r];
      for (int d = t.position_[static_cast<std::size_t>(node)]; d >= 0; --d) {
        t.retrieve_[r * cols + static_cast<std::size_t>(d)] = node;
        node = t.parent_[static_cast<std::size_t>(node)];
      }
    }
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
  std::vector<int> parent_, rank_, position_, tree_index_, child_begin_, child_count_, leaf_;
  std::vector<int> depth_begin_, max_rank_, retrieve_;
  std::vector<std::uint32_t> mask_;
  std::vector<std::vector<int>> sorted_;
};

static_assert(tree_like<tree>);
static_assert(tree_like<static_tree<2>>);

// ---- generic helpers over any tree_like --------------------------------------------------------

//! First child of `node`, or -1 for a leaf.
template <tree_like T>
MEDUSA_HOST_DEVICE constexpr int first_child(const T& t, int node) noexcept {
  return t.child_count(node) > 0 ? t.child_begin(node) : -1;
}

//! The next child of the same parent (one rank up), or -1 for the last child and the root.
template <tree_like T>
MEDUSA_HOST_DEVICE constexpr int next_sibling(const T& t, int node) noexcept {
  return (node > 0 && node + 1 < t.num_nodes() && t.parent(node + 1) == t.parent(node)) ? node + 1 : -1;
}

//! True iff `ancestor` is `node` or one of its ancestors (same as `t.mask(node, ancestor)`).
template <tree_like T>
MEDUSA_HOST_DEVICE constexpr bool is_ancestor_or_self(const T& t, int ancestor, int node) noexcept {
  while (node > ancestor) node = t.parent(node);
  return node == ancestor;
}

//! True iff both trees have the same nodes, ranks and topk (hence identical buffers). Use it to
//! map a run-time tree onto a compile-time instantiation.
template <tree_like A, tree_like B>
constexpr bool same_shape(const A& a, const B& b) noexcept {
  if (a.num_nodes() != b.num_nodes() || a.topk() != b.topk() || a.depth() != b.depth()) return false;
  for (int i = 0; i < a.num_nodes(); ++i)
    if (a.parent(i) != b.parent(i) || a.rank(i) != b.rank(i)) return false;
  return true;
}

//! Writes the dense mask `[num_nodes][num_nodes]` (row = query, 1 = may attend) as values of V
//! (e.g. `float` for the reference's `[1,1,N,N]` tensor). Throws `invalid_input` if `out` is too small.
template <tree_like T, class V>
void write_dense_mask(const T& t, std::span<V> out) {
  const auto n = static_cast<std::size_t>(t.num_nodes());
  if (out.size() < n * n)
    throw invalid_input("write_dense_mask: buffer holds " + std::to_string(out.size()) + " values, needs " +
                        std::to_string(n * n));
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t j = 0; j < n; ++j)
      out[i * n + j] = static_cast<V>(t.mask(static_cast<int>(i), static_cast<int>(j)) ? 1 : 0);
}

//! Bytes of one request's FlashInfer full-row stream: ceil(N * (L + N) / 8).
constexpr std::size_t full_row_stream_bytes(int num_nodes, int prefix_len) noexcept {
  const auto n = static_cast<std::size_t>(num_nodes < 0 ? 0 : num_nodes);
  const auto l = static_cast<std::size_t>(prefix_len < 0 ? 0 : prefix_len);
  return (n * (l + n) + 7) / 8;
}

//! Writes the FlashInfer `MaskMode::kCustom` stream of one request (spec §2.2 item 2): the
//! row-major `N x (L + N)` boolean matrix (prefix columns 1, then the tree mask), packed 8 bits
//! per byte, bit b of byte k = element 8k + b. Writes exactly `full_row_stream_bytes(N, L)` bytes
//! (unused high bits of the last byte are 0). Throws `invalid_input` for L < 0 or a short buffer.
//! @return the number of bytes written
template <tree_like T>
std::size_t write_full_row_stream(const T& t, int prefix_len, std::span<std::uint8_t> out) {
  if (prefix_len < 0) throw invalid_input("full-row stream: prefix length " + std::to_string(prefix_len) + " < 0");
  const std::size_t bytes = full_row_stream_bytes(t.num_nodes(), prefix_len);
  if (out.size() < bytes)
    throw invalid_input("full-row stream: buffer holds " + std::to_string(out.size()) + " bytes, needs " +
                        std::to_string(bytes));
  std::fill(out.begin(), out.begin() + static_cast<std::ptrdiff_t>(bytes), std::uint8_t{0});
  const auto n = static_cast<std::size_t>(t.num_nodes());
  const auto l = static_cast<std::size_t>(prefix_len);
  std::size_t e = 0;  // element index
  for (std::size_t i = 0; i < n; ++i) {
    // prefix columns: all ones; whole bytes at once
    std::size_t c = 0;
    for (; c < l && ((e + c) & 7) != 0; ++c) out[(e + c) >> 3] |= static_cast<std::uint8_t>(1u << ((e + c) & 7));
    if (const std::size_t full = (l - c) / 8; full > 0) {
      std::fill_n(out.begin() + static_cast<std::ptrdiff_t>((e + c) >> 3), full, std::uint8_t{0xFF});
      c += full * 8;
    }
    for (; c < l; ++c) out[(e + c) >> 3] |= static_cast<std::uint8_t>(1u << ((e + c) & 7));
    e += l;
    // only ancestors (j <= i) can be set
    for (std::size_t j = 0; j <= i; ++j)
      if (t.mask(static_cast<int>(i), static_cast<int>(j)))
        out[(e + j) >> 3] |= static_cast<std::uint8_t>(1u << ((e + j) & 7));
    e += n;
  }
  return bytes;
}

//! Batched full-row stream: request b (prefix length `prefix_lens[b]`) starts on a fresh byte at
//! `indptr[b]`; `indptr[B]` = total bytes. `indptr` needs B + 1 entries.
//! @return the total number of bytes written
template <tree_like T>
std::size_t write_full_row_stream_batch(const T& t, std::span<const int> prefix_lens, std::span<std::uint8_t> out,
                                        std::span<std::int64_t> indptr) {
  if (indptr.size() < prefix_lens.size() + 1)
    throw invalid_input("full-row stream: indptr holds " + std::to_string(indptr.size()) + " entries, needs " +
                        std::to_string(prefix_lens.size() + 1));
  std::size_t off = 0;
  for (std::size_t b = 0; b < prefix_lens.size(); ++b) {
    indptr[b] = static_cast<std::int64_t>(off);
    if (off > out.size()) throw invalid_input("full-row stream: output buffer too small");
    off += write_full_row_stream(t, prefix_lens[b], out.subspan(off));
  }
  indptr[prefix_lens.size()] = static_cast<std::int64_t>(off);
  return off;
}

MEDUSA_NAMESPACE_END
