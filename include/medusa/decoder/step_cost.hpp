// SPDX-License-Identifier: Apache-2.0
//! @file decoder/step_cost.hpp
//! Measures an engine's step-cost curve (`step_cost_curve`, tree/search.hpp): the forward time of
//! a step of N tokens for several N, and the time of the draft heads, on the model and heads that
//! will decode. `optimize_tree` turns it and a calibration into the best tree for this machine.
//!
//! The forward passes run at slots `[context, context + N)` after a prefill of `context` tokens
//! in the request's cache, and write K/V there: measure before decoding into that cache (or on a
//! request id that is free), never in the middle of a request.
//!
//! @code
//! medusa::step_cost_curve cost = medusa::measure_step_cost(engine, heads, {.rows = {1, 2, 4, 8, 16}});
//! auto plan = medusa::optimize_tree(calibration, cost, {.max_nodes = 16});
//! @endcode
#pragma once

#include <medusa/config.hpp>
#include <medusa/decoder.hpp>
#include <medusa/decoder/model.hpp>
#include <medusa/error.hpp>
#include <medusa/tree/search.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

MEDUSA_NAMESPACE_BEGIN

//! What `measure_step_cost` measures, and how long it may take.
struct step_cost_options {
  std::vector<int> rows = {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64};  //!< step sizes, ascending, first 1
  int context = 128;            //!< committed tokens the steps attend to (clamped to the cache)
  int repeats = 10;             //!< rounds over every size at most; the fastest time of each is kept
  double budget_seconds = 0.5;  //!< no new round starts after this (a tenth goes to warming up)
  int request = 0;              //!< the request id whose cache is used (batch models)
};

namespace detail {
inline double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace detail

//! Measures a batch model's step-cost curve on request `opt.request` and the draft heads' cost
//! per head: a warm-up, then rounds over every size until `repeats` rounds or the budget (one
//! round at least: a model whose steps are slow takes longer than the budget), the fastest time
//! of each size, made non-decreasing in the step size. Throws `invalid_input` on bad options (sizes not
//! ascending from 1, a context that leaves no room for the largest step) and whatever the model
//! or heads throw.
template <batch_decoder_model Model, draft_heads Heads>
step_cost_curve measure_step_cost(Model& model, Heads& heads, const step_cost_options& opt) {
  {
    step_cost_curve shape{.rows = opt.rows, .seconds = std::vector<double>(opt.rows.size(), 1.0)};
    shape.validate();
  }
  if (opt.repeats < 1) throw invalid_input("step cost: repeats must be >= 1, got " + std::to_string(opt.repeats));
  const int max_rows = opt.rows.back();
  const int capacity = detail::request_context(model, opt.request);
  const int context = std::min(opt.context, capacity - max_rows);
  if (context < 1)
    throw invalid_input("step cost: a " + std::to_string(max_rows) + "-token step does not fit a cache of " +
                        std::to_string(capacity) + " slots");
  if constexpr (kv_reserving_model<Model>) model.reserve(opt.request, context + max_rows);

  const int vocab = model.vocab_size(), hidden = model.hidden_size();
  const auto rows_max = static_cast<std::size_t>(std::max(context, max_rows));
  std::vector<std::int32_t> tokens(rows_max), positions(rows_max);
  std::vector<float> logits(static_cast<std::size_t>(max_rows) * static_cast<std::size_t>(vocab));
  std::vector<float> states(static_cast<std::size_t>(max_rows) * static_cast<std::size_t>(hidden));
  const int request = opt.request;
  auto run = [&](int n, int cache_length, bool last_only) {
    for (int i = 0; i < n; ++i) {
      tokens[static_cast<std::size_t>(i)] = (i * 7 + 1) % vocab;
      positions[static_cast<std::size_t>(i)] = cache_length + i;
    }
    const std::size_t out_rows = last_only ? 1 : static_cast<std::size_t>(n);
    // Causal within the step: a chain costs what a tree of as many nodes does.
    detail::forward_request(model, request, std::span<const std::int32_t>(tokens.data(), static_cast<std::size_t>(n)),
                            std::span<const std::int32_t>(positions.data(), static_cast<std::size_t>(n)), cache_length,
                            last_only, std::span<float>(logits.data(), out_rows * static_cast<std::size_t>(vocab)),
                            std::span<float>(states.data(), out_rows * static_cast<std::size_t>(hidden)));
  };
  run(context, 0, true);  // the prefix the steps attend to; also warms caches and threads

  // Warm-up: threads spun up, weights and the prefix in cache, frequency settled.
  const double warm_until = detail::now_seconds() + opt.budget_seconds * 0.1;
  do run(opt.rows.back(), context, false);
  while (detail::now_seconds() < warm_until);

  // Rounds over every size, so that drift (frequency, other processes) hits all sizes alike; the
  // fastest time of each size is kept. At least one round; more while the budget lasts. The heads
  // run right after each forward, as in decoding: the forward has pushed their weights out of the
  // caches, which a loop over the heads alone would hide.
  const int num_heads = heads.num_heads();
  std::vector<float> head_logits(static_cast<std::size_t>(std::max(num_heads, 1)) * static_cast<std::size_t>(vocab));
  auto time_heads = [&] {
    const double t0 = detail::now_seconds();
    heads.forward(std::span<const float>(states.data(), static_cast<std::size_t>(hidden)),
                  std::span<float>(head_logits.data(), static_cast<std::size_t>(num_heads) * static_cast<std::size_t>(vocab)));
    return detail::now_seconds() - t0;
  };
  if (num_heads > 0) (void)time_heads();  // the first call may size buffers
  step_cost_curve curve;
  curve.rows = opt.rows;
  curve.seconds.assign(opt.rows.size(), std::numeric_limits<double>::infinity());
  double head_best = std::numeric_limits<double>::infinity();
  const double start = detail::now_seconds();
  for (int round = 0; round < opt.repeats; ++round) {
    if (round > 0 && detail::now_seconds() - start > opt.budget_seconds) break;
    for (std::size_t i = 0; i < opt.rows.size(); ++i) {
      const double t0 = detail::now_seconds();
      run(opt.rows[i], context, false);
      curve.seconds[i] = std::min(curve.seconds[i], std::max(detail::now_seconds() - t0, 1e-9));
      if (num_heads > 0) head_best = std::min(head_best, time_heads());
    }
  }
  // A larger step never costs less: what looks cheaper is noise.
  for (std::size_t i = 1; i < curve.seconds.size(); ++i) curve.seconds[i] = std::max(curve.seconds[i], curve.seconds[i - 1]);
  if (num_heads > 0) curve.head_seconds = head_best / num_heads;
  if constexpr (kv_releasing_model<Model>) model.release(opt.request, 0);
  return curve;
}

//! The same for a single-request model (`decoder_model`); its cache is overwritten.
template <decoder_model Model, draft_heads Heads>
  requires(!batch_decoder_model<Model>)
step_cost_curve measure_step_cost(Model& model, Heads& heads, const step_cost_options& opt) {
  detail::single_request_model<Model> one(model);
  step_cost_options o = opt;
  o.request = 0;
  return measure_step_cost(one, heads, o);
}

MEDUSA_NAMESPACE_END
