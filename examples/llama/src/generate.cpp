// SPDX-License-Identifier: Apache-2.0
#include <medusa_llama/generate.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>

namespace medusa_llama {

int argmax(std::span<const float> logits) {
  if (logits.empty()) throw engine_error(engine_errc::bad_output, "argmax of empty logits");
  std::size_t best = 0;
  for (std::size_t i = 1; i < logits.size(); ++i)
    if (logits[i] > logits[best]) best = i;
  return static_cast<int>(best);
}

sampler::sampler(float temperature, std::uint64_t seed) : temperature_(temperature), rng_(seed) {
  if (!(temperature >= 0.0f) || !std::isfinite(temperature))
    throw engine_error(engine_errc::bad_option, "temperature " + std::to_string(temperature) + " must be finite and ≥ 0");
}

int sampler::operator()(std::span<const float> logits) {
  if (temperature_ == 0.0f) return argmax(logits);
  if (logits.empty()) throw engine_error(engine_errc::bad_output, "sampling from empty logits");
  probs_.resize(logits.size());
  const float mx = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (std::size_t i = 0; i < logits.size(); ++i) {
    probs_[i] = std::exp((logits[i] - mx) / temperature_);
    sum += probs_[i];
  }
  if (!(sum > 0) || !std::isfinite(sum)) throw engine_error(engine_errc::bad_output, "logits are not finite");
  double r = std::uniform_real_distribution<double>(0.0, sum)(rng_);
  for (std::size_t i = 0; i < probs_.size(); ++i) {
    r -= probs_[i];
    if (r < 0) return static_cast<int>(i);
  }
  return static_cast<int>(probs_.size() - 1);
}

generation generate(engine& e, std::span<const int> prompt, const generate_options& o) {
  if (o.max_new_tokens < 0) throw engine_error(engine_errc::bad_option, "max_new_tokens " + std::to_string(o.max_new_tokens) + " is negative");
  using clock = std::chrono::steady_clock;
  generation g;
  sampler sample(o.temperature, o.seed);
  std::vector<float> logits(static_cast<std::size_t>(e.config().vocab_size));
  e.truncate(0);
  const auto t0 = clock::now();
  e.prefill(prompt, 0, logits, {});
  int pos = static_cast<int>(prompt.size());
  const int limit = std::min(e.capacity(), e.config().seq_len);
  auto t1 = clock::now();
  bool first = true;
  while (static_cast<int>(g.tokens.size()) < o.max_new_tokens) {
    const int next = sample(logits);
    if (first) {
      t1 = clock::now();
      first = false;
    }
    if (std::find(o.stop_tokens.begin(), o.stop_tokens.end(), next) != o.stop_tokens.end()) {
      g.stopped = true;
      break;
    }
    g.tokens.push_back(next);
    if (static_cast<int>(g.tokens.size()) == o.max_new_tokens || pos >= limit) break;
    e.decode(next, pos, logits);
    ++pos;
  }
  const auto t2 = clock::now();
  g.prefill_seconds = std::chrono::duration<double>(t1 - t0).count();
  g.decode_seconds = std::chrono::duration<double>(t2 - t1).count();
  return g;
}

}  // namespace medusa_llama
