// SPDX-License-Identifier: Apache-2.0
// `medusa-run --draft-tokens auto` (docs/tools.md): the chain length that decodes fastest on this
// machine, from the draft's calibration (`calibration.json` beside it, written by
// `medusa-train --recipe draft`: expected tokens per step of chains of 1…8) and two costs measured
// here in a short warm-up: the target's step of k + 1 tokens and one pass of the draft.
#pragma once

#include <medusa/decoder/step_cost.hpp>

#include <nlohmann/json.hpp>

#include "run/options.hpp"
#include "tool_common.hpp"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace medusa_run {

//! Longest chain `--draft-tokens auto` considers.
inline constexpr std::size_t max_auto_draft_tokens = 16;

//! The expected tokens per step of greedy chains of 1, 2, … drafts (at most
//! `max_auto_draft_tokens`), from `calibration.json` beside the draft model (or in its directory).
//! Throws `usage_error` naming the file when it is missing or is not a draft's calibration.
inline std::vector<double> draft_chain_calibration(const std::string& draft_model) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path p(draft_model);
  const fs::path file = (fs::is_directory(p, ec) ? p : p.parent_path()) / "calibration.json";
  const std::string need = "--draft-tokens auto needs the calibration.json that medusa-train --recipe draft writes beside the draft model";
  std::ifstream in(file);
  if (!in) throw medusa_tools::usage_error(need + " (" + file.string() + " is missing)");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw medusa_tools::usage_error(file.string() + " is not valid JSON: " + e.what());
  }
  const auto chain = j.find("chain_tokens_per_step");
  if (j.value("recipe", std::string()) != "draft" || chain == j.end() || !chain->is_array() || chain->empty())
    throw medusa_tools::usage_error(need + " (" + file.string() + " has no \"chain_tokens_per_step\" of a draft)");
  std::vector<double> out;
  for (const auto& v : *chain) {
    if (!v.is_number() || !(v.get<double>() >= 1.0) || v.get<double>() > 1e6)
      throw medusa_tools::usage_error(file.string() + ": chain_tokens_per_step holds a value that is not a number >= 1");
    if (out.size() < max_auto_draft_tokens) out.push_back(v.get<double>());
  }
  return out;
}

//! What `choose_draft_tokens` chose, and from what.
struct draft_tokens_choice {
  int tokens = 1;
  nlohmann::json info;
};

//! The chain length k of at most `chain.size()` drafts that maximises expected tokens per second,
//! chain[k−1] ÷ (step of k + 1 tokens + k draft passes), with both costs measured on `target` and
//! `draft` (their caches are overwritten: call before decoding).
template <class Target, class Draft>
draft_tokens_choice choose_draft_tokens(const std::vector<double>& chain, Target& target, Draft& draft, int context) {
  const int longest = static_cast<int>(chain.size());
  std::vector<int> rows;
  for (int n = 1; n <= longest + 1; ++n) rows.push_back(n);
  medusa::no_heads none;  // the step-cost measurement times the model's passes only
  const auto step = medusa::measure_step_cost(target, none, {.rows = rows, .context = context, .budget_seconds = 0.4});
  const auto pass = medusa::measure_step_cost(draft, none, {.rows = {1}, .context = context, .budget_seconds = 0.1});
  draft_tokens_choice c;
  double best = 0;
  nlohmann::json predicted = nlohmann::json::array();
  for (int k = 1; k <= longest; ++k) {
    const double seconds = step.seconds[static_cast<std::size_t>(k)] + k * pass.seconds[0];
    const double speedup = chain[static_cast<std::size_t>(k - 1)] / seconds * step.seconds[0];
    predicted.push_back(speedup);
    if (speedup > best) best = speedup, c.tokens = k;
  }
  c.info = {{"chosen", c.tokens},
            {"predicted_speedup", best},
            {"predicted_speedups", predicted},
            {"target_step_seconds", step.seconds},
            {"draft_pass_seconds", pass.seconds[0]}};
  return c;
}

}  // namespace medusa_run
