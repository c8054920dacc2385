// SPDX-License-Identifier: Apache-2.0
//! @file generate.hpp
//! Vanilla (non-speculative) decoding on an `engine`: greedy or temperature sampling, for tests,
//! benchmarks and as the baseline Medusa decoding is compared against.
//!
//! @code
//! medusa_llama::engine e(medusa_llama::model::load_llama2c("stories260K.bin"));
//! medusa_llama::llama2c_tokenizer tok("tok512.bin", e.config().vocab_size);
//! const int bos = 1;
//! auto g = medusa_llama::generate(e, {&bos, 1}, {.max_new_tokens = 200, .stop_tokens = {1}});
//! std::string text = tok.decode(g.tokens);
//! @endcode
#pragma once

#include <medusa_llama/engine.hpp>

#include <cstdint>
#include <random>
#include <span>
#include <vector>

namespace medusa_llama {

//! Index of the largest logit (the first on ties, as run.c). Throws `engine_error` when empty.
[[nodiscard]] int argmax(std::span<const float> logits);

//! Temperature sampler: temperature 0 is greedy (`argmax`), otherwise a draw from
//! softmax(logits / temperature) with a seeded generator.
class sampler {
 public:
  //! Throws `engine_error` (`bad_option`) for a negative or non-finite temperature.
  explicit sampler(float temperature = 0.0f, std::uint64_t seed = 0);
  //! Samples one token id.
  [[nodiscard]] int operator()(std::span<const float> logits);
  //! The temperature.
  [[nodiscard]] float temperature() const noexcept { return temperature_; }

 private:
  float temperature_;
  std::mt19937_64 rng_;
  std::vector<float> probs_;
};

//! Options of `generate`.
struct generate_options {
  int max_new_tokens = 256;      //!< tokens to generate at most
  float temperature = 0.0f;      //!< 0 = greedy
  std::uint64_t seed = 0;        //!< sampler seed
  std::vector<int> stop_tokens = {};  //!< generation ends (without emitting it) when one is sampled
};

//! Result of `generate`.
struct generation {
  std::vector<int> tokens;      //!< generated tokens (prompt excluded, stop token excluded)
  bool stopped = false;         //!< ended on a stop token
  double prefill_seconds = 0;   //!< wall time of the prompt's prefill (incl. first sample)
  double decode_seconds = 0;    //!< wall time of the remaining tokens
};

//! Resets the engine's cache, prefills `prompt` (non-empty) and decodes one token at a time until
//! `max_new_tokens`, a stop token, or the end of the cache / seq_len.
[[nodiscard]] generation generate(engine& e, std::span<const int> prompt, const generate_options& options);

}  // namespace medusa_llama
