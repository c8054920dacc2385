// SPDX-License-Identifier: Apache-2.0
//! @file medusa-accept.cpp
//! `medusa-accept [--input PATH]`: runs greedy or typical acceptance on one tree step given as
//! JSON (stdin without --input) and prints `{"best_path":…, "accept_length":…,
//! "accepted_nodes":[…]}`. The contract is in docs/tools.md. Bad input: exit 2
//! and one line on stderr. An absent "temperature" is 0.7 (`medusa::policy_options`). The input
//! is read by accept_input.hpp (shared with the fuzzer).
#include <medusa/acceptance.hpp>
#include <medusa/dispatch.hpp>

#include "accept_input.hpp"
#include "tool_common.hpp"

#include <fmt/format.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <sstream>
#include <string>

namespace {

using medusa_tools::usage_error;

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

int run(const std::string& input_path) {
  const medusa_tools::accept_input in = medusa_tools::parse_accept_input(read_all(input_path));
  const medusa::verify_request req{.node_tokens = in.tokens, .logits = in.logits, .vocab = in.vocab};
  medusa::acceptance_workspace ws(in.tree.num_nodes(), in.vocab);
  const medusa::verify_result r = medusa::dispatch_policy(
      in.policy, in.options, [&](const auto& p) { return medusa::verify(in.tree, req, p, ws); },
      medusa_tools::accept_policies{});
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
