// SPDX-License-Identifier: Apache-2.0
//! @file tree/parse.hpp
//! Tree text: JSON `[[0],[0,0]]` or the Python literal `[(0,), (0, 0)]`, whitespace anywhere,
//! trailing commas allowed. The parser is constexpr (compile-time trees use it), non-recursive,
//! bounded and allocation-free; a sink receives the ranks.
#pragma once

#include <medusa/config.hpp>
#include <medusa/tree/compiler.hpp>
#include <medusa/tree/errors.hpp>
#include <medusa/tree/options.hpp>

#include <algorithm>
#include <array>
#include <climits>
#include <cstddef>
#include <string_view>
#include <vector>

MEDUSA_NAMESPACE_BEGIN

namespace detail {

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

}  // namespace detail

//! Parses tree text into paths without validating them. Throws `tree_error` (`malformed_text`
//! with the offset, or `too_many_nodes` past `max_nodes - 1` paths).
inline std::vector<std::vector<int>> parse_tree_text(std::string_view text, int max_nodes = max_tree_nodes) {
  if (text.size() > (std::size_t{1} << 30)) throw tree_error(tree_errc::malformed_text, "tree text: larger than 1 GiB");
  std::vector<int> flat, begin{0};
  detail::vector_sink sink{flat, begin};
  const detail::tree_fault f = detail::parse_paths(text, sink, std::clamp(max_nodes, 2, max_tree_nodes) - 1);
  if (f.failed) detail::throw_fault(f, nullptr, text);
  std::vector<std::vector<int>> paths(begin.size() - 1);
  for (std::size_t k = 0; k + 1 < begin.size(); ++k) paths[k].assign(flat.begin() + begin[k], flat.begin() + begin[k + 1]);
  return paths;
}

MEDUSA_NAMESPACE_END
