// SPDX-License-Identifier: Apache-2.0
// Private: greedy decoding of a batch with the whole step on the device: the engine's prefill (a
// ragged forward on the host's request), then the library's `medusa::cuda::device_step` around
// the engine's forward (forward_core::run over the step's pass). The step, its smaller trees and
// plain steps near the context's end, the stop rules and the statuses are the library's.
#pragma once

#include <medusa/cuda/device_step.hpp>
#include <medusa/heads.hpp>
#include <medusa/tree.hpp>

#include "engine_state.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace medusa_llama::cuda_detail {

struct device_decode_stats {
  medusa::cuda::device_step_stats step;
  double prefill_seconds = 0;
  double decode_seconds = 0;  // capture, steps and downloads
};

template <class Exec, class T>
class device_decoder {
 public:
  // Medusa decoding with `heads` (at least the tree's depth; the first depth are used) over `tree`;
  // with `heads` null, plain decoding (the tree is ignored).
  device_decoder(engine_state<Exec, T>& eng, const medusa::tree* tree, const medusa::head_stack<>* heads)
      : eng_(eng), step_(make_step(eng, tree, heads)) {}

  [[nodiscard]] bool medusa() const noexcept { return step_.medusa(); }
  [[nodiscard]] const device_decode_stats& stats() const noexcept { return stats_; }

  // Decodes `prompts` (requests 0..B-1 of the engine) for up to `max_new_tokens` each, greedily.
  // `eos_token` ends a request unemitted; `stop_token` ends it after it is emitted (-1: none).
  std::vector<medusa::cuda::device_request_result> generate(std::span<const std::vector<std::int32_t>> prompts,
                                                            int max_new_tokens, int eos_token, int stop_token = -1) {
    using clock = std::chrono::steady_clock;
    const int B = static_cast<int>(prompts.size());
    const model_config& c = eng_.config();
    if (B < 1 || B > eng_.limits().max_requests)
      throw engine_error(engine_errc::bad_batch, std::to_string(B) + " prompts for an engine of " +
                                                     std::to_string(eng_.limits().max_requests) + " requests");
    if (max_new_tokens < 1) throw engine_error(engine_errc::bad_option, "max_new_tokens must be at least 1");
    const int N = step_.rows_per_request();
    if (B * N > eng_.limits().max_tokens)
      throw engine_error(engine_errc::bad_batch, std::to_string(B) + " requests of " + std::to_string(N) +
                                                     " tree tokens exceed max_tokens " + std::to_string(eng_.limits().max_tokens));
    stats_ = {};
    std::vector<int> length(sz(B));
    for (int b = 0; b < B; ++b) {
      const auto& p = prompts[sz(b)];
      if (p.empty()) throw engine_error(engine_errc::bad_batch, "request " + std::to_string(b) + ": empty prompt", b);
      if (static_cast<int>(p.size()) > eng_.max_context())
        throw engine_error(engine_errc::bad_batch, "request " + std::to_string(b) + ": a prompt of " +
                                                       std::to_string(p.size()) + " tokens for a context of " +
                                                       std::to_string(eng_.max_context()), b);
      length[sz(b)] = static_cast<int>(p.size());
      eng_.release(b, 0);
      // Every slot a step may write, up to the context's end: rows of a step past it go unwritten.
      eng_.reserve(b, std::min(eng_.max_context(), length[sz(b)] + max_new_tokens + N + 1));
    }
    // Prefill: every prompt in one ragged forward, each request's last row.
    const auto t0 = clock::now();
    std::vector<std::int32_t> tokens, positions;
    std::vector<int> requests, indptr{0}, lengths(sz(B), 0);
    for (int b = 0; b < B; ++b) {
      const auto& p = prompts[sz(b)];
      tokens.insert(tokens.end(), p.begin(), p.end());
      for (std::size_t i = 0; i < p.size(); ++i) positions.push_back(static_cast<std::int32_t>(i));
      requests.push_back(b);
      indptr.push_back(static_cast<int>(tokens.size()));
    }
    std::vector<float> logits(sz(B) * sz(c.vocab_size)), hidden(sz(B) * sz(c.dim));
    medusa::ragged_batch rb;
    rb.requests = requests;
    rb.qo_indptr = indptr;
    rb.tokens = tokens;
    rb.positions = positions;
    rb.cache_lengths = lengths;
    rb.last_row_only = true;
    rb.logits = logits;
    rb.hidden = hidden;
    eng_.forward(rb);
    std::vector<std::int32_t> first(sz(B));
    for (int b = 0; b < B; ++b) first[sz(b)] = argmax(std::span<const float>(logits).subspan(sz(b) * sz(c.vocab_size), sz(c.vocab_size)));
    stats_.prefill_seconds = std::chrono::duration<double>(clock::now() - t0).count();

    // The step's view of the cache: the block tables of requests 0..B-1, on the device.
    const auto t1 = clock::now();
    std::vector<std::int32_t> tables;
    eng_.table_rows(requests, tables);
    d_tables_ = buffer<Exec>(eng_.executor(), std::max<std::size_t>(tables.size(), 1) * 4);
    eng_.executor().upload(d_tables_.template as<void>(), tables.data(), tables.size() * 4);
    const medusa::cuda::kernels::batch_kv kv = eng_.kv_for(d_tables_.template as<const std::int32_t>());
    const medusa::cuda::device_decode_options opt{.max_new_tokens = max_new_tokens, .max_context = eng_.max_context(),
                                                  .eos_token = eos_token};
    auto forward = [&](const medusa::cuda::step_pass& p) {
      pass_desc d;
      d.tokens = p.batch * p.rows_per_request;
      d.batch = p.batch;
      d.max_tokens_per_request = p.rows_per_request;
      d.token_ids = p.tokens;
      d.positions = p.positions;
      d.qo_indptr = p.qo_indptr;
      d.cache_lengths = p.cache_lengths;
      d.kv = kv;
      d.out_rows = d.tokens;
      d.logits = p.logits;
      if (p.tree_mask != nullptr) {
        d.mask = medusa::cuda::kernels::attention_mask_kind::tree;
        d.tree_mask = p.tree_mask;
        d.words_per_row = p.words_per_row;
      }
      d.hidden = p.hidden;
      eng_.core().run(d);
    };
    auto on_token = [stop_token](int, std::int32_t token) { return token != stop_token; };
    auto results = step_.generate({first, length, hidden}, kv, opt, forward, on_token);
    stats_.step = step_.stats();
    stats_.decode_seconds = std::chrono::duration<double>(clock::now() - t1).count();
    for (int b = 0; b < B; ++b) eng_.release(b, 0);
    return results;
  }

 private:
  static medusa::cuda::device_step<Exec, T> make_step(engine_state<Exec, T>& eng, const medusa::tree* tree,
                                                      const medusa::head_stack<>* heads) {
    if (heads == nullptr) return medusa::cuda::device_step<Exec, T>(eng.executor(), eng.config().vocab_size);
    if (tree == nullptr) throw engine_error(engine_errc::bad_option, "device decoding with heads needs a tree");
    try {
      return medusa::cuda::device_step<Exec, T>(eng.executor(), *tree, *heads);
    } catch (const medusa::invalid_input& e) {
      throw engine_error(engine_errc::bad_option, e.what());
    }
  }

  // Lowest id of the largest logit, as medusa::greedy_policy picks.
  static std::int32_t argmax(std::span<const float> row) {
    std::size_t best = 0;
    for (std::size_t i = 1; i < row.size(); ++i)
      if (row[i] > row[best]) best = i;
    return static_cast<std::int32_t>(best);
  }

  engine_state<Exec, T>& eng_;
  medusa::cuda::device_step<Exec, T> step_;
  device_decode_stats stats_;
  buffer<Exec> d_tables_;
};

}  // namespace medusa_llama::cuda_detail
