// SPDX-License-Identifier: Apache-2.0
// medusa-run's three ways to decode, once the options are checked and the model is loaded: one
// prompt on the CPU engine, many prompts --batch at a time on the CPU batch engine, and the GPU
// engine. Each is its own translation unit (each instantiates the decoders it runs).
#pragma once

#include <medusa/dispatch/policy.hpp>
#include <medusa/tree.hpp>

#include <medusa_llama/load.hpp>

#include "run/options.hpp"
#include "run/setup.hpp"

#include <cstdint>
#include <optional>
#include <vector>

namespace medusa_run {

// One prompt (--prompt, --prompt-file): streamed text or one JSON line per mode.
int run_single(const run_args& a, medusa_llama::loaded_model& lm, const std::vector<std::int32_t>& prompt,
               std::optional<medusa::tree> tree, const auto_inputs& ain, const medusa::head_weights& head_w,
               const medusa::policy_options& popt);

// --prompts-file: every prompt, --batch at a time (continuous batching).
int run_batched(const run_args& a, medusa_llama::loaded_model& lm, const std::vector<std::vector<std::int32_t>>& prompts,
                const std::optional<medusa::tree>& tree, const auto_inputs& ain, const medusa::head_weights& head_w,
                const medusa::policy_options& popt);

// --device cuda: greedy decoding with the whole step on the device.
int run_cuda(const run_args& a, medusa_llama::loaded_model& lm, const std::vector<std::vector<std::int32_t>>& prompts,
             std::optional<medusa::tree> tree, const auto_inputs& ain, const medusa::head_weights& head_w);

}  // namespace medusa_run
