// SPDX-License-Identifier: Apache-2.0
// `medusa-run --draft-tokens auto` (docs/tools.md): the chain length that decodes fastest on this
// machine, from the drafter's calibration (`calibration.json` beside it, written by
// `medusa-train --recipe draft` or `--recipe eagle`: expected tokens per step of chains of 1…8)
// and two costs measured here in a short warm-up: the target's step of k + 1 tokens and one pass
// of the drafter.
#pragma once

#include <medusa/decoder/step_cost.hpp>
#include <medusa/feature_draft.hpp>

#include <nlohmann/json.hpp>

#include "run/options.hpp"
#include "tool_common.hpp"

#include <algorithm>
#include <chrono>
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
  const std::string need =
      "--draft-tokens auto needs the calibration.json that medusa-train --recipe draft, eagle or exit writes beside the drafter";
  std::ifstream in(file);
  if (!in) throw medusa_tools::usage_error(need + " (" + file.string() + " is missing)");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw medusa_tools::usage_error(file.string() + " is not valid JSON: " + e.what());
  }
  const auto chain = j.find("chain_tokens_per_step");
  const std::string recipe = j.value("recipe", std::string());
  if ((recipe != "draft" && recipe != "eagle" && recipe != "exit") || chain == j.end() || !chain->is_array() || chain->empty())
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

//! Seconds of one single-row pass of a feature drafter after `context` rows (the median of ~0.1 s
//! of passes), on a scratch request (id −1) that is released after.
template <class Model>
double measure_feature_pass(Model& drafter, int context) {
  const int d = static_cast<int>(drafter.hidden_size());
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(context), 0), positions(static_cast<std::size_t>(context));
  for (int i = 0; i < context; ++i) positions[static_cast<std::size_t>(i)] = i;
  std::vector<float> features(static_cast<std::size_t>(context) * static_cast<std::size_t>(d), 0.1f),
      logits(static_cast<std::size_t>(drafter.vocab_size())), hidden(static_cast<std::size_t>(d));
  medusa::feature_batch b{.request = -1, .tokens = tokens, .features = features, .positions = positions,
                          .cache_length = 0, .logits = logits, .hidden = hidden};
  drafter.forward(b);
  std::vector<double> times;
  const auto start = std::chrono::steady_clock::now();
  b.tokens = std::span<const std::int32_t>(tokens).first(1);
  b.features = std::span<const float>(features).first(static_cast<std::size_t>(d));
  b.positions = std::span<const std::int32_t>(positions).subspan(static_cast<std::size_t>(context - 1), 1);
  b.cache_length = context - 1;
  while (times.size() < 5 || (times.size() < 1000 && std::chrono::steady_clock::now() - start < std::chrono::milliseconds(100))) {
    const auto t0 = std::chrono::steady_clock::now();
    drafter.forward(b);
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  drafter.release(-1);
  std::nth_element(times.begin(), times.begin() + static_cast<std::ptrdiff_t>(times.size() / 2), times.end());
  return times[times.size() / 2];
}

//! The chain length k of at most `chain.size()` drafts that maximises expected tokens per second,
//! chain[k−1] ÷ (step of k + 1 tokens + k drafter passes), with the target's steps measured on
//! `target` (its cache is overwritten: call before decoding) and `draft_pass` seconds a pass.
template <class Target>
draft_tokens_choice choose_draft_tokens_for(const std::vector<double>& chain, Target& target, double draft_pass, int context) {
  const int longest = static_cast<int>(chain.size());
  std::vector<int> rows;
  for (int n = 1; n <= longest + 1; ++n) rows.push_back(n);
  medusa::no_heads none;  // the step-cost measurement times the model's passes only
  const auto step = medusa::measure_step_cost(target, none, {.rows = rows, .context = context, .budget_seconds = 0.4});
  draft_tokens_choice c;
  double best = 0;
  nlohmann::json predicted = nlohmann::json::array();
  for (int k = 1; k <= longest; ++k) {
    const double seconds = step.seconds[static_cast<std::size_t>(k)] + k * draft_pass;
    const double speedup = chain[static_cast<std::size_t>(k - 1)] / seconds * step.seconds[0];
    predicted.push_back(speedup);
    if (speedup > best) best = speedup, c.tokens = k;
  }
  c.info = {{"chosen", c.tokens},
            {"predicted_speedup", best},
            {"predicted_speedups", predicted},
            {"target_step_seconds", step.seconds},
            {"draft_pass_seconds", draft_pass}};
  return c;
}

//! `choose_draft_tokens_for` with a draft model's pass measured on `draft` (its cache is
//! overwritten: call before decoding).
template <class Target, class Draft>
draft_tokens_choice choose_draft_tokens(const std::vector<double>& chain, Target& target, Draft& draft, int context) {
  medusa::no_heads none;
  const auto pass = medusa::measure_step_cost(draft, none, {.rows = {1}, .context = context, .budget_seconds = 0.1});
  return choose_draft_tokens_for(chain, target, pass.seconds[0], context);
}

}  // namespace medusa_run
