// SPDX-License-Identifier: Apache-2.0
//! @file accept_input.hpp
//! The JSON input of `medusa-accept` (docs/tools.md): one tree step — `choices`, `topk`, `policy`
//! and its options, `node_tokens`, `node_logits` — read and checked into the tree, the policy and
//! the flat logits that `medusa::verify` takes. Shared by the tool and its fuzzer, so both run the
//! same checks in the same order with the same messages.
#pragma once

#include <medusa/acceptance.hpp>
#include <medusa/dispatch.hpp>
#include <medusa/tree.hpp>

#include "tool_common.hpp"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace medusa_tools {

//! The deterministic policies of the tool contract.
using accept_policies = medusa::policy_list<medusa::greedy_policy, medusa::typical_policy>;

//! One parsed tree step.
struct accept_input {
  medusa::tree tree;                  //!< compiled from "choices" with "topk"
  std::string policy;                 //!< "greedy" or "typical" (checked)
  medusa::policy_options options;     //!< "temperature", "posterior_threshold", "posterior_alpha"
  std::vector<std::int32_t> tokens;   //!< "node_tokens", one per node
  std::vector<float> logits;          //!< "node_logits", [num_nodes][vocab] row-major
  int vocab = 0;                      //!< length of every logit row
};

namespace detail {

using json = nlohmann::json;

inline const json& accept_field(const json& obj, const char* name) {
  const auto it = obj.find(name);
  if (it == obj.end()) throw usage_error(fmt::format("missing field \"{}\"", name));
  return *it;
}

inline long long accept_int(const json& v, const std::string& what) {
  if (v.is_number_integer()) return v.get<long long>();
  throw usage_error(what + " must be an integer, got " + v.dump());
}

inline int accept_int32(const json& v, const std::string& what) {
  const long long x = accept_int(v, what);
  if (x < std::numeric_limits<int>::min() || x > std::numeric_limits<int>::max())
    throw usage_error(what + " is out of range: " + std::to_string(x));
  return static_cast<int>(x);
}

inline float accept_float(const json& v, const std::string& what) {
  if (!v.is_number()) throw usage_error(what + " must be a number, got " + v.dump());
  return static_cast<float>(v.get<double>());
}

inline std::vector<std::vector<int>> accept_choices(const json& c) {
  if (!c.is_array()) throw usage_error("\"choices\" must be a list of paths");
  std::vector<std::vector<int>> paths;
  paths.reserve(c.size());
  for (std::size_t i = 0; i < c.size(); ++i) {
    const json& p = c[i];
    if (!p.is_array()) throw usage_error(fmt::format("choices[{}] must be a list of ranks", i));
    std::vector<int> path;
    path.reserve(p.size());
    for (std::size_t j = 0; j < p.size(); ++j)
      path.push_back(accept_int32(p[j], fmt::format("choices[{}][{}]", i, j)));
    paths.push_back(std::move(path));
  }
  return paths;
}

}  // namespace detail

//! Parses the tool's JSON input. Throws `usage_error` for malformed or inconsistent input and the
//! library's `tree_error` / `invalid_input` for a bad tree or policy options; the policy is checked
//! before the (possibly large) logits are read.
inline accept_input parse_accept_input(const std::string& text) {
  using detail::json;
  json in;
  try {
    in = json::parse(text);
  } catch (const json::exception& e) {
    throw usage_error(std::string("malformed JSON input: ") + e.what());
  }
  if (!in.is_object()) throw usage_error("input must be one JSON object");

  medusa::tree_options opts;
  if (in.contains("topk")) opts.topk = detail::accept_int32(in["topk"], "\"topk\"");
  medusa::tree t = medusa::tree::from_paths(detail::accept_choices(detail::accept_field(in, "choices")), opts);
  const int n = t.num_nodes();

  const json& pol = detail::accept_field(in, "policy");
  if (!pol.is_string()) throw usage_error("\"policy\" must be \"greedy\" or \"typical\"");
  std::string policy = pol.get<std::string>();
  medusa::policy_options popt;
  if (in.contains("temperature")) popt.temperature = detail::accept_float(in["temperature"], "\"temperature\"");
  if (in.contains("posterior_threshold"))
    popt.posterior_threshold = detail::accept_float(in["posterior_threshold"], "\"posterior_threshold\"");
  if (in.contains("posterior_alpha"))
    popt.posterior_alpha = detail::accept_float(in["posterior_alpha"], "\"posterior_alpha\"");
  // Checked before the (possibly large) logits are read.
  medusa::dispatch_policy(policy, popt, [](const auto&) {}, accept_policies{});

  const json& tokens_json = detail::accept_field(in, "node_tokens");
  if (!tokens_json.is_array()) throw usage_error("\"node_tokens\" must be a list of integers");
  if (tokens_json.size() != static_cast<std::size_t>(n))
    throw usage_error(fmt::format("\"node_tokens\" has {} entries, the tree has {} nodes", tokens_json.size(), n));
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(n));
  for (int u = 0; u < n; ++u)
    tokens[static_cast<std::size_t>(u)] =
        detail::accept_int32(tokens_json[static_cast<std::size_t>(u)], fmt::format("node_tokens[{}]", u));

  const json& rows = detail::accept_field(in, "node_logits");
  if (!rows.is_array()) throw usage_error("\"node_logits\" must be a list of rows");
  if (rows.size() != static_cast<std::size_t>(n))
    throw usage_error(fmt::format("\"node_logits\" has {} rows, the tree has {} nodes", rows.size(), n));
  if (!rows[0].is_array() || rows[0].empty()) throw usage_error("node_logits[0] must be a non-empty list of numbers");
  const std::size_t vocab = rows[0].size();
  if (vocab > static_cast<std::size_t>(std::numeric_limits<int>::max())) throw usage_error("vocabulary too large");
  std::vector<float> logits(static_cast<std::size_t>(n) * vocab);
  for (std::size_t u = 0; u < rows.size(); ++u) {
    const json& row = rows[u];
    if (!row.is_array() || row.size() != vocab)
      throw usage_error(fmt::format("node_logits[{}] must be a list of {} numbers (row 0's length)", u, vocab));
    float* dst = logits.data() + u * vocab;
    const auto& arr = row.get_ref<const json::array_t&>();
    for (std::size_t i = 0; i < vocab; ++i) {
      const json& x = arr[i];
      switch (x.type()) {
        case json::value_t::number_float: dst[i] = static_cast<float>(x.get_ref<const json::number_float_t&>()); break;
        case json::value_t::number_integer: dst[i] = static_cast<float>(x.get_ref<const json::number_integer_t&>()); break;
        case json::value_t::number_unsigned: dst[i] = static_cast<float>(x.get_ref<const json::number_unsigned_t&>()); break;
        default: throw usage_error(fmt::format("node_logits[{}][{}] is not a number", u, i));
      }
    }
  }
  return accept_input{std::move(t), std::move(policy), popt, std::move(tokens), std::move(logits), static_cast<int>(vocab)};
}

}  // namespace medusa_tools
