// SPDX-License-Identifier: Apache-2.0
// medusa-run's options, as the command line sets them, and the policies it offers.
#pragma once

#include <medusa/acceptance.hpp>
#include <medusa/dispatch/policy.hpp>

#include <medusa_llama/cuda_engine.hpp>
#include <medusa_llama/packed_heads.hpp>

#include "tool_common.hpp"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace medusa_run {

using medusa_tools::usage_error;

enum class run_mode { vanilla, medusa, both };

struct run_args {
  std::string model, tokenizer, heads, tree = "auto", policy = "greedy", prompt, prompt_file, prompts_file;
  int max_nodes = 64;                                    // --tree auto: largest tree considered
  std::string step_cost_file, step_cost_out, cost_cache;  // --tree auto: the step-cost curve
  std::string calibration;                               // --tree auto: default calibration.json beside the heads
  int lookup = 0;                                        // lookup branch of up to N tokens (0 = off)
  int lookup_min = 2, lookup_max = 4;                    // n-gram sizes matched
  bool dynamic = false;                                  // per-step dynamic trees of the chosen size
  std::string draft_model;                               // a draft model proposing chains (--draft-model)
  int self_draft_layers = 0;                             // the target's first k layers as the draft (0 = off)
  std::string eagle;                                     // a feature drafter's directory (--eagle)
  std::string exit;                                      // a trained exit's directory: self-speculation (--exit)
  int draft_tokens = 4;                                  // the draft's chain length (a tree's depth)
  int draft_nodes = 0;                                   // > 0: the drafter grows trees of this many nodes
  int draft_topk = 4;                                    // a draft tree's children a node
  double draft_min_prob = 0.0;                           // a draft tree's nodes below this joint probability: left out
  std::optional<int> draft_expand;                       // a draft tree's nodes expanded a depth (unset: draft_topk)
  [[nodiscard]] int draft_expanded() const { return draft_expand.value_or(draft_topk); }
  bool draft_tokens_auto = false;                        // --draft-tokens auto: chosen from calibration and costs
  std::vector<double> draft_chain;                       // --draft-tokens auto: the draft's calibration (read once)
  bool draft_alone = false;                              // the step's tree is the draft's chain (and lookup) only
  // Whether a drafter with chains was asked for (--draft-model, --self-draft-layers or --eagle).
  [[nodiscard]] bool drafted() const { return !draft_model.empty() || self_draft_layers != 0 || !eagle.empty() || !exit.empty(); }
  // Nodes the per-step drafts add to a step's tree beyond the heads': a draft tree's and the
  // lookup's, or the longer of the lookup's and the drafter's chain.
  [[nodiscard]] int draft_rows() const {
    return draft_nodes > 0 ? draft_nodes + lookup : std::max(lookup, drafted() ? draft_tokens : 0);
  }
  // Rows of a draft tree's pass: the root and at most `draft_expanded()` nodes a depth.
  [[nodiscard]] int draft_pass_rows() const { return 1 + draft_expanded() * draft_tokens; }
  std::string calibrate_out;                             // write path counts of the greedy outputs here
  std::optional<int> batch;  // requests at once with --prompts-file (default 1)
  run_mode mode = run_mode::medusa;
  std::optional<float> temperature;  // unset: the policy's default
  float top_p = 1.0f;
  std::uint64_t seed = 0;
  int max_new_tokens = 256;
  int threads = 0;
  std::optional<medusa_llama::weight_format> weights;  // unset (auto): what the model file stores
  std::optional<medusa_llama::weight_format> classifier_weights;  // unset: the engine's rule
  std::optional<medusa_llama::weight_format> draft_weights;       // the drafter's; unset: the target engine's
  int draft_threads = 0;  // --draft-threads: the drafter's own threads (inline at 1); 0: the target's pool
  medusa_llama::weight_format head_weights = medusa_llama::weight_format::int8;
  bool json = false;
  std::string device = "cpu";                                             // cpu | cuda
  medusa::dtype precision = medusa::dtype::bf16;  // --device cuda
  std::string cuda_gemm = "library";                                      // --cuda-gemm library|invariant|fast
};

// The policies medusa-run offers (speculative_policy verifies a draft model's sampled chains
// against their rows: --draft-alone; draft_sampling_policy draws the drafts from the heads' softmax).
using run_policies = medusa::policy_list<medusa::greedy_policy, medusa::typical_policy, medusa::rejection_policy,
                                         medusa::speculative_policy, medusa::draft_sampling_policy>;

}  // namespace medusa_run
