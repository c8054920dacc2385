// SPDX-License-Identifier: Apache-2.0
//! @file medusa-accept.cpp
//! `medusa-accept [--input PATH]`: runs greedy or typical acceptance on one tree step given as
//! JSON (stdin without --input) and prints `{"best_path":…, "accept_length":…,
//! "accepted_nodes":[…]}`. The contract is in docs/tools.md. Bad input: exit 2
//! and one line on stderr. An absent "temperature" is 0.7 (`medusa::policy_options`).
#include <medusa/acceptance.hpp>
#include <medusa/dispatch.hpp>
#include <medusa/tree.hpp>

#include "tool_common.hpp"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

namespace {

using json = nlohmann::json;
using medusa_tools::usage_error;

// The deterministic policies of the tool contract.
using accept_policies = medusa::policy_list<medusa::greedy_policy, medusa::typical_policy>;

std::string read_all(const std::string& path) {
  if (path.empty()) {
    std::ostringstream ss;
    ss << std::cin.rdbuf();
    return std::move(ss).str();
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) throw usage_error("cannot open input file '" + path + "'");
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

const json& field(const json& obj, const char* name) {
  const auto it = obj.find(name);
  if (it == obj.end()) throw usage_error(fmt::format("missing field \"{}\"", name));
  return *it;
}

long long to_int(const json& v, const std::string& what) {
  if (v.is_number_integer()) return v.get<long long>();
  throw usage_error(what + " must be an integer, got " + v.dump());
}

int to_int32(const json& v, const std::string& what) {
  const long long x = to_int(v, what);
  if (x < std::numeric_limits<int>::min() || x > std::numeric_limits<int>::max())
    throw usage_error(what + " is out of range: " + std::to_string(x));
  return static_cast<int>(x);
}

float to_float(const json& v, const std::string& what) {
  if (!v.is_number()) throw usage_error(what + " must be a number, got " + v.dump());
  return static_cast<float>(v.get<double>());
}

std::vector<std::vector<int>> parse_choices(const json& c) {
  if (!c.is_array()) throw usage_error("\"choices\" must be a list of paths");
  std::vector<std::vector<int>> paths;
  paths.reserve(c.size());
  for (std::size_t i = 0; i < c.size(); ++i) {
    const json& p = c[i];
    if (!p.is_array()) throw usage_error(fmt::format("choices[{}] must be a list of ranks", i));
    std::vector<int> path;
    path.reserve(p.size());
    for (std::size_t j = 0; j < p.size(); ++j)
      path.push_back(to_int32(p[j], fmt::format("choices[{}][{}]", i, j)));
    paths.push_back(std::move(path));
  }
  return paths;
}

int run(const std::string& input_path) {
  const std::string text = read_all(input_path);
  json in;
  try {
    in = json::parse(text);
  } catch (const json::exception& e) {
    throw usage_error(std::string("malformed JSON input: ") + e.what());
  }
  if (!in.is_object()) throw usage_error("input must be one JSON object");

  medusa::tree_options opts;
  if (in.contains("topk")) opts.topk = to_int32(in["topk"], "\"topk\"");
  const medusa::tree t = medusa::tree::from_paths(parse_choices(field(in, "choices")), opts);
  const int n = t.num_nodes();

  const json& pol = field(in, "policy");
  if (!pol.is_string()) throw usage_error("\"policy\" must be \"greedy\" or \"typical\"");
  const std::string policy = pol.get<std::string>();
  medusa::policy_options popt;
  if (in.contains("temperature")) popt.temperature = to_float(in["temperature"], "\"temperature\"");
  if (in.contains("posterior_threshold"))
    popt.posterior_threshold = to_float(in["posterior_threshold"], "\"posterior_threshold\"");
  if (in.contains("posterior_alpha")) popt.posterior_alpha = to_float(in["posterior_alpha"], "\"posterior_alpha\"");
  // Checked before the (possibly large) logits are read.
  medusa::dispatch_policy(policy, popt, [](const auto&) {}, accept_policies{});

  const json& tokens_json = field(in, "node_tokens");
  if (!tokens_json.is_array()) throw usage_error("\"node_tokens\" must be a list of integers");
  if (tokens_json.size() != static_cast<std::size_t>(n))
    throw usage_error(fmt::format("\"node_tokens\" has {} entries, the tree has {} nodes",
                                  tokens_json.size(), n));
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(n));
  for (int u = 0; u < n; ++u)
    tokens[static_cast<std::size_t>(u)] = to_int32(tokens_json[static_cast<std::size_t>(u)], fmt::format("node_tokens[{}]", u));

  const json& rows = field(in, "node_logits");
  if (!rows.is_array()) throw usage_error("\"node_logits\" must be a list of rows");
  if (rows.size() != static_cast<std::size_t>(n))
    throw usage_error(fmt::format("\"node_logits\" has {} rows, the tree has {} nodes",
                                  rows.size(), n));
  if (!rows[0].is_array() || rows[0].empty())
    throw usage_error("node_logits[0] must be a non-empty list of numbers");
  const std::size_t vocab = rows[0].size();
  if (vocab > static_cast<std::size_t>(std::numeric_limits<int>::max()))
    throw usage_error("vocabulary too large");
  std::vector<float> logits(static_cast<std::size_t>(n) * vocab);
  for (std::size_t u = 0; u < rows.size(); ++u) {
    const json& row = rows[u];
    if (!row.is_array() || row.size() != vocab)
      throw usage_error(fmt::format("node_logits[{}] must be a list of {} numbers (row 0's length)",
                                    u, vocab));
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

  const medusa::verify_request req{.node_tokens = tokens, .logits = logits,
                                   .vocab = static_cast<int>(vocab)};
  medusa::acceptance_workspace ws(n, static_cast<int>(vocab));
  const medusa::verify_result r = medusa::dispatch_policy(
      policy, popt, [&](const auto& p) { return medusa::verify(t, req, p, ws); }, accept_policies{});
  std::string out = fmt::format("{{\"best_path\": {}, \"accept_length\": {}, \"accepted_nodes\": [",
                                r.best_row, r.accept_length);
  for (std::size_t j = 0; j < r.nodes().size(); ++j)
    out += fmt::format("{}{}", j ? ", " : "", r.nodes()[j]);
  out += "]}\n";
  std::fputs(out.c_str(), stdout);
  return medusa_tools::exit_ok;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Greedy or typical acceptance of one Medusa tree step (JSON in, JSON out)",
               "medusa-accept"};
  std::string input;
  app.add_option("--input", input, "JSON input file (default: stdin)");
  return medusa_tools::run_tool(app, argc, argv, [&] { return run(input); });
}
