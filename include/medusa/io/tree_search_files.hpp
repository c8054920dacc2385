// SPDX-License-Identifier: Apache-2.0
//! @file io/tree_search_files.hpp
//! The files of the tree search (docs/tree.md, "Choosing a tree"):
//! - `calibration.json` (`medusa-train` writes it beside the heads): version 1 holds per-head
//!   accuracies, version 2 adds path-conditional counts (`path_positions`, `path_counts`);
//! - step-cost curves (`medusa-run` measures and caches them; `medusa-tree optimize --cost`).
//!
//! @code
//! #include <medusa/io/tree_search_files.hpp>
//! auto cal = medusa::read_calibration("heads/calibration.json");
//! auto cost = medusa::parse_step_cost(R"({"format": "medusa-step-cost", "version": 1,
//!     "rows": [1, 8], "seconds": [0.001, 0.0015], "head_seconds": 5e-5, "overhead_seconds": 0})");
//! auto plan = medusa::optimize_tree(cal, cost);
//! @endcode
#pragma once

#include <medusa/config.hpp>
#include <medusa/error.hpp>
#include <medusa/io/json.hpp>
#include <medusa/tree/search.hpp>

#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

MEDUSA_NAMESPACE_BEGIN

namespace detail {
inline const json_value& member(const json_value& v, std::string_view name, std::string_view what) {
  const json_value* m = v.find(name);
  if (!m) throw invalid_input(std::string(what) + ": missing \"" + std::string(name) + "\"");
  return *m;
}
inline std::uint64_t unsigned_member(const json_value& v, std::string_view what) {
  const auto n = v.as_uint64();
  if (!n) throw invalid_input(std::string(what) + " must be a non-negative integer");
  return *n;
}
inline int small_int(const json_value& v, std::string_view what) {
  const std::uint64_t n = unsigned_member(v, what);
  if (n > 1u << 20) throw invalid_input(std::string(what) + " is too large (" + std::to_string(n) + ")");
  return static_cast<int>(n);
}
inline std::string read_small_file(const std::filesystem::path& path, std::string_view what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw io_error(std::string(what) + " " + path.string() + ": cannot open");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw io_error(std::string(what) + " " + path.string() + ": read error");
  return text;
}
//! `e`'s message without the "medusa: " prefix, to re-throw it with more context in front.
inline std::string bare_message(const std::exception& e) {
  const std::string m = e.what();
  return m.rfind("medusa: ", 0) == 0 ? m.substr(8) : m;
}
inline void check_format(const json_value& doc, std::string_view format, std::string_view what) {
  if (!doc.is_object()) throw invalid_input(std::string(what) + ": not a JSON object");
  const json_value& f = member(doc, "format", what);
  if (!f.is_string() || f.as_string() != format)
    throw invalid_input(std::string(what) + ": \"format\" is not \"" + std::string(format) + "\"");
}
}  // namespace detail

//! Parses `calibration.json` text. Version 2 files give path-conditional counts; version 1 files
//! (per-head accuracies only) give the independence model. Throws `invalid_input` (or
//! `json_error`) naming the member at fault.
[[nodiscard]] inline path_calibration parse_calibration(std::string_view text) {
  constexpr std::string_view what = "calibration";
  const json_value doc = parse_json(text);
  detail::check_format(doc, "medusa-calibration", what);
  const std::uint64_t version = detail::unsigned_member(detail::member(doc, "version", what), "calibration: \"version\"");
  if (version != 1 && version != 2)
    throw invalid_input("calibration: version " + std::to_string(version) + " is not supported (1 or 2)");
  if (version == 2) {
    const int heads = detail::small_int(detail::member(doc, "num_heads", what), "calibration: \"num_heads\"");
    const int topk = detail::small_int(detail::member(doc, "topk", what), "calibration: \"topk\"");
    const std::uint64_t positions =
        detail::unsigned_member(detail::member(doc, "path_positions", what), "calibration: \"path_positions\"");
    std::vector<std::pair<std::vector<int>, std::uint64_t>> counts;
    const json_value& list = detail::member(doc, "path_counts", what);
    if (!list.is_array()) throw invalid_input("calibration: \"path_counts\" must be an array");
    for (std::size_t i = 0; i < list.size(); ++i) {
      const std::string at = "calibration: path_counts[" + std::to_string(i) + "]";
      const json_value& e = list.as_array()[i];
      if (!e.is_array() || e.size() != 2 || !e.as_array()[0].is_array())
        throw invalid_input(at + " must be [[ranks...], count]");
      std::vector<int> path;
      for (const json_value& r : e.as_array()[0].as_array()) path.push_back(detail::small_int(r, at + " rank"));
      counts.emplace_back(std::move(path), detail::unsigned_member(e.as_array()[1], at + " count"));
    }
    auto cal = path_calibration::from_counts(heads, topk, positions, counts);
    if (const json_value* seqs = doc.find("recorded_paths")) {  // optional: the recorded decoding
      if (!seqs->is_array()) throw invalid_input("calibration: \"recorded_paths\" must be an array");
      path_calibration::recorded_sequences rec;
      for (const json_value& seq : seqs->as_array()) {
        if (!seq.is_array()) throw invalid_input("calibration: \"recorded_paths\" must hold arrays of paths");
        rec.emplace_back();
        for (const json_value& p : seq.as_array()) {
          if (!p.is_array()) throw invalid_input("calibration: a recorded path is not an array");
          rec.back().emplace_back();
          for (const json_value& r : p.as_array()) rec.back().back().push_back(detail::small_int(r, "calibration: a recorded rank"));
        }
      }
      cal.set_sequences(std::move(rec));
    }
    return cal;
  }
  const json_value& acc = detail::member(doc, "accuracy", what);
  if (!acc.is_array()) throw invalid_input("calibration: \"accuracy\" must be an array of arrays");
  std::vector<std::vector<double>> table;
  for (const json_value& row : acc.as_array()) {
    if (!row.is_array()) throw invalid_input("calibration: \"accuracy\" must be an array of arrays");
    table.emplace_back();
    for (const json_value& x : row.as_array()) {
      if (!x.is_number()) throw invalid_input("calibration: \"accuracy\" holds a non-number");
      table.back().push_back(x.as_number());
    }
  }
  return path_calibration::from_accuracy(std::move(table));
}

//! Reads and parses a calibration file (`parse_calibration`); `io_error` if it cannot be read.
[[nodiscard]] inline path_calibration read_calibration(const std::filesystem::path& path) {
  try {
    return parse_calibration(detail::read_small_file(path, "calibration"));
  } catch (const invalid_input& e) {
    throw invalid_input(path.string() + ": " + detail::bare_message(e));
  }
}

//! Parses a step-cost curve: `{"format": "medusa-step-cost", "version": 1, "rows": [...],
//! "seconds": [...], "head_seconds": x, "overhead_seconds": y}` (other members are kept by
//! writers for people, e.g. "key", and ignored). Throws `invalid_input` naming the problem.
[[nodiscard]] inline step_cost_curve parse_step_cost(std::string_view text) {
  constexpr std::string_view what = "step cost";
  const json_value doc = parse_json(text);
  detail::check_format(doc, "medusa-step-cost", what);
  if (detail::unsigned_member(detail::member(doc, "version", what), "step cost: \"version\"") != 1)
    throw invalid_input("step cost: only version 1 is supported");
  step_cost_curve c;
  const json_value& rows = detail::member(doc, "rows", what);
  const json_value& secs = detail::member(doc, "seconds", what);
  if (!rows.is_array() || !secs.is_array()) throw invalid_input("step cost: \"rows\" and \"seconds\" must be arrays");
  for (const json_value& r : rows.as_array()) c.rows.push_back(detail::small_int(r, "step cost: a step size"));
  for (const json_value& s : secs.as_array()) {
    if (!s.is_number()) throw invalid_input("step cost: \"seconds\" holds a non-number");
    c.seconds.push_back(s.as_number());
  }
  auto number = [&](std::string_view name) {
    const json_value& v = detail::member(doc, name, what);
    if (!v.is_number()) throw invalid_input("step cost: \"" + std::string(name) + "\" must be a number");
    return v.as_number();
  };
  c.head_seconds = number("head_seconds");
  c.overhead_seconds = number("overhead_seconds");
  c.validate();
  return c;
}

//! Reads and parses a step-cost file (`parse_step_cost`); `io_error` if it cannot be read.
[[nodiscard]] inline step_cost_curve read_step_cost(const std::filesystem::path& path) {
  try {
    return parse_step_cost(detail::read_small_file(path, "step cost"));
  } catch (const invalid_input& e) {
    throw invalid_input(path.string() + ": " + detail::bare_message(e));
  }
}

//! Counted calibration as `calibration.json` version 2 text (`parse_calibration` reads it back);
//! `accuracy[k][r]` is each head's own per-rank accuracy.
[[nodiscard]] inline std::string calibration_json(const path_counter& c) {
  std::vector<std::vector<double>> acc(static_cast<std::size_t>(c.heads()), std::vector<double>(static_cast<std::size_t>(c.topk())));
  for (int k = 0; k < c.heads(); ++k)
    for (int r = 0; r < c.topk(); ++r) acc[static_cast<std::size_t>(k)][static_cast<std::size_t>(r)] = c.accuracy(k, r);
  std::string j = "{\"format\": \"medusa-calibration\", \"version\": 2, \"num_heads\": " + std::to_string(c.heads()) +
                  ", \"topk\": " + std::to_string(c.topk()) + ", \"source\": \"decoding\", \"accuracy\": [";
  for (std::size_t k = 0; k < acc.size(); ++k) {
    j += k ? ", [" : "[";
    for (std::size_t r = 0; r < acc[k].size(); ++r) {
      char b[32];
      std::snprintf(b, sizeof b, "%s%.6f", r ? ", " : "", acc[k][r]);
      j += b;
    }
    j += "]";
  }
  j += "],\n \"path_positions\": " + std::to_string(c.positions()) + ", \"path_counts\": [";
  bool first = true;
  for (const auto& [path, count] : c.counts()) {
    j += first ? "\n  [" : ",\n  [";
    first = false;
    j += detail::path_text(path);
    j += ", ";
    j += std::to_string(count);
    j += ']';
  }
  j += "],\n \"recorded_paths\": [";  // the recorded decoding, replayed by optimize_tree
  for (std::size_t s = 0; s < c.sequences().size(); ++s) {
    j += s ? ",\n  [" : "\n  [";
    for (std::size_t t = 0; t < c.sequences()[s].size(); ++t) {
      if (t) j += ',';
      j += detail::path_text(c.sequences()[s][t]);
    }
    j += ']';
  }
  j += "]}\n";
  return j;
}

//! A step-cost curve as JSON text that `parse_step_cost` reads back; `key` (may be empty) names
//! what it was measured on.
[[nodiscard]] inline std::string step_cost_json(const step_cost_curve& c, std::string_view key = {}) {
  auto num = [](double v) {
    char b[40];
    std::snprintf(b, sizeof b, "%.9g", v);
    return std::string(b);
  };
  std::string j = "{\"format\": \"medusa-step-cost\", \"version\": 1";
  if (!key.empty()) j += ", \"key\": " + json_quote(key);
  j += ", \"rows\": [";
  for (std::size_t i = 0; i < c.rows.size(); ++i) j += (i ? ", " : "") + std::to_string(c.rows[i]);
  j += "], \"seconds\": [";
  for (std::size_t i = 0; i < c.seconds.size(); ++i) j += (i ? ", " : "") + num(c.seconds[i]);
  j += "], \"head_seconds\": " + num(c.head_seconds) + ", \"overhead_seconds\": " + num(c.overhead_seconds) + "}\n";
  return j;
}

MEDUSA_NAMESPACE_END
