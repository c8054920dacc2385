// SPDX-License-Identifier: Apache-2.0
// What the tests of the trainable stacks (lora_model, dense_model) share: random token sequences,
// the engine's logits of a sequence, and the relative difference of two logit arrays.
#pragma once

#include <medusa_llama/engine.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace stack_test {

inline std::vector<std::int32_t> random_tokens(std::size_t n, int vocab, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<std::int32_t> t(n);
  for (auto& x : t) x = static_cast<std::int32_t>(rng() % static_cast<unsigned>(vocab));
  return t;
}

// Logits of every position through the engine (one causal batch from position 0).
inline std::vector<float> engine_logits(const medusa_llama::model& m, const std::vector<std::int32_t>& tokens) {
  medusa_llama::engine_options eo;
  eo.threads = 1;
  eo.max_batch = 64;
  medusa_llama::engine e(m, eo);
  std::vector<int> toks(tokens.begin(), tokens.end()), pos(tokens.size());
  for (std::size_t i = 0; i < pos.size(); ++i) pos[i] = static_cast<int>(i);
  std::vector<float> logits(tokens.size() * static_cast<std::size_t>(m.config().vocab_size));
  medusa::forward_batch b;
  b.tokens = toks;
  b.positions = pos;
  b.cache_length = 0;
  b.logits = logits;
  e.forward(b);
  return logits;
}

// max |a − b| ÷ max |b|.
inline double relative_diff(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double diff = 0, scale = 1e-30;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, static_cast<double>(std::fabs(a[i] - b[i])));
    scale = std::max(scale, static_cast<double>(std::fabs(b[i])));
  }
  return diff / scale;
}

}  // namespace stack_test
