// SPDX-License-Identifier: Apache-2.0
// What medusa-run prints: the streamed text, one JSON line per run or request, the figures of a
// run and of a many-prompt run.
#pragma once

#include <medusa/decoder.hpp>

#include <medusa_llama/tokenizer.hpp>

#include <nlohmann/json.hpp>

#include "run/options.hpp"

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace medusa_run {

// Streams decoded text of generated tokens to stdout (unless quiet).
class text_sink {
 public:
  text_sink(const medusa_llama::tokenizer& tok, int prev, bool print) : tok_(tok), prev_(prev), print_(print) {}
  void operator()(std::int32_t token) {
    std::string piece = tok_.decode_piece(prev_, token);
    prev_ = token;
    text_ += piece;
    if (print_) {
      std::fwrite(piece.data(), 1, piece.size(), stdout);
      std::fflush(stdout);
    }
  }
  [[nodiscard]] const std::string& text() const noexcept { return text_; }

 private:
  const medusa_llama::tokenizer& tok_;
  int prev_;
  bool print_;
  std::string text_;
};

struct run_report {
  std::string mode;
  medusa::decode_result result;
  std::string text;
  nlohmann::json tree;  // the tree of a Medusa run (null for plain decoding)
};

// One mode of a --prompts-file run: every request's result, and the wall time of the whole batch.
struct batch_report {
  std::string mode;
  std::vector<medusa::decode_result> results;
  std::vector<std::string> texts;
  double seconds = 0;
  int steps = 0;  // batch steps
  [[nodiscard]] long tokens() const {
    long n = 0;
    for (const auto& r : results) n += r.stats.new_tokens;
    return n;
  }
  [[nodiscard]] double tokens_per_second() const { return seconds > 0 ? static_cast<double>(tokens()) / seconds : 0.0; }
  // Tokens per forward pass of a request, over all requests.
  [[nodiscard]] double mean_accepted() const {
    long steps_all = 0;
    for (const auto& r : results) steps_all += r.stats.steps;
    return steps_all > 0 ? static_cast<double>(tokens()) / static_cast<double>(steps_all) : 0.0;
  }
};

nlohmann::json to_json(const run_report& r);
nlohmann::json to_json(const batch_report& r);

// One JSON line. Generated text may cut a UTF-8 sequence between tokens (or hold byte tokens
// that are not UTF-8): such bytes print as U+FFFD instead of failing the run.
std::string json_line(const nlohmann::json& j);

// The process's peak resident set so far, in bytes (0 if the system does not say): what --json
// reports as peak_rss_bytes.
std::int64_t peak_rss_bytes();

// Medusa tokens/s over plain tokens/s (0 when plain decoding produced nothing).
double speedup_of(double plain_tps, double medusa_tps);

// " (predicted N.NNx)" when the tree search chose the tree (its model is greedy acceptance).
std::string predicted_note(const nlohmann::json& info);

// The output of a many-prompt run (--prompts-file, or --device cuda): with --json one line per
// request and mode, then `summary` completed with each mode's figures and, for two modes, whether
// the tokens are identical and the speedup; else each request's text (of the last mode) and the
// figures on stderr. `greedy`: differing tokens are an error (exit 1). `note` follows the speedup.
int report_batch(const run_args& a, const std::vector<batch_report>& reports, std::size_t requests, int batch,
                 nlohmann::json summary, bool greedy, const std::string& note);

}  // namespace medusa_run
