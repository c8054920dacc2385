// SPDX-License-Identifier: Apache-2.0
//! @file decoder/options.hpp
//! Options, stop reasons, statistics and results of the decoding loops (`decoder`,
//! `batch_decoder`, `generate_vanilla`).
#pragma once

#include <medusa/config.hpp>
#include <medusa/error.hpp>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

MEDUSA_NAMESPACE_BEGIN

//! Limits and sampling settings of one request.
struct decode_options {
  int max_new_tokens = 256;     //!< stop after this many generated tokens (≥ 0)
  std::int32_t eos_token = -1;  //!< stop when this token is generated (not emitted); -1 = never
  int prefill_chunk = 512;      //!< prompt tokens per prefill forward (bounds activation memory); ≥ 1
  std::uint64_t seed = 0;       //!< Philox key of the sampling policies
  //! Prompt tokens whose keys and values are already in the request's cache at slots
  //! `[0, cached_prompt_tokens)`: the prefill starts after them. Resumes a request that failed
  //! (see `decode_result::cache_length`) or reuses a prefix the engine put in place. At most the
  //! prompt's length − 1: the last prompt token always runs, its logits choose the first token.
  int cached_prompt_tokens = 0;
};

//! Why a request ended.
enum class stop_reason : std::uint8_t {
  max_tokens,    //!< `max_new_tokens` reached
  eos,           //!< the EOS token was generated
  callback,      //!< the token callback returned false (e.g. a stop string matched)
  context_full,  //!< the context (`max_context()`, or the KV cache's capacity) has no slot left
  failed,        //!< an error specific to this request (batch_decoder; see `request_update::error`)
};

//! Name of a stop reason ("max_tokens", "eos", "callback", "context_full", "failed").
constexpr std::string_view to_string(stop_reason r) noexcept {
  switch (r) {
    case stop_reason::max_tokens: return "max_tokens";
    case stop_reason::eos: return "eos";
    case stop_reason::callback: return "callback";
    case stop_reason::context_full: return "context_full";
    case stop_reason::failed: return "failed";
  }
  return "?";
}

//! Where the time went (seconds, wall clock). In a batch these are the batch's phases: a
//! request's result carries the times of the steps it took part in.
struct phase_times {
  double prefill = 0;     //!< prompt forward passes
  double heads = 0;       //!< draft heads on the accepted hidden states
  double candidates = 0;  //!< top-k per head and gather into tree tokens
  double forward = 0;     //!< model forward passes after the prefill (tree or single-token)
  double accept = 0;      //!< acceptance policy
  double commit = 0;      //!< KV commit of the accepted paths
  double total = 0;       //!< the whole call (or the request's life in a batch)
};

//! Counters of one request.
struct decode_stats {
  int prompt_tokens = 0;  //!< tokens prefilled
  int new_tokens = 0;     //!< tokens emitted
  int steps = 0;          //!< forward passes after the prefill (tree steps + single-token steps)
  int tree_steps = 0;     //!< steps that ran the whole tree
  //! `accepted_histogram[a]`: tree steps that accepted `a` drafts (size depth + 1).
  std::vector<int> accepted_histogram;
  //! `accepted_at_depth[d-1]`: tree steps whose accepted path reached depth `d` (size depth).
  std::vector<int> accepted_at_depth;
  phase_times seconds;  //!< time split by phase

  //! Tokens emitted per forward pass after the prefill (1 for plain decoding).
  [[nodiscard]] double mean_accepted() const noexcept {
    return steps > 0 ? static_cast<double>(new_tokens) / steps : 0.0;
  }
  //! Generated tokens per second over the whole call.
  [[nodiscard]] double tokens_per_second() const noexcept {
    return seconds.total > 0 ? new_tokens / seconds.total : 0.0;
  }
};

//! Output of one request.
struct decode_result {
  std::vector<std::int32_t> tokens;  //!< generated tokens (prompt excluded, EOS excluded)
  stop_reason reason = stop_reason::max_tokens;
  decode_stats stats;
  //! Slots of the request's cache that hold valid keys and values when it ended: those of the
  //! prompt followed by `tokens` (and, after an accepted EOS or a step cut by `max_new_tokens`,
  //! of accepted tokens past the last one emitted). A failed step leaves none of its own slots
  //! counted, so a failed request resumes by joining again with `prompt + tokens` and
  //! `cached_prompt_tokens = min(cache_length, prompt.size() + tokens.size() - 1)`.
  int cache_length = 0;
};

//! Invalid arguments of a decoding call (over-long prompt, bad token ids, size mismatches,
//! unknown or duplicate request ids, a full batch).
class decode_error : public invalid_input {
 public:
  using invalid_input::invalid_input;
};

//! The model output a decoding step found unusable.
enum class model_output : std::uint8_t {
  logits,  //!< a logit row holds NaN or +Inf (or masks every token with -Inf)
  hidden,  //!< a hidden state the draft heads would read holds NaN or ±Inf
};

//! Name of a model output ("logits", "hidden").
constexpr std::string_view to_string(model_output o) noexcept {
  return o == model_output::logits ? "logits" : "hidden";
}

//! The model returned non-finite values for one request at one step, in a row the step reads (a
//! logit row acceptance or the next token's choice reads, the hidden state the next step starts
//! from): "request 3, step 17: non-finite logits from the model (node 5: logit 3 is NaN)". The
//! request ends with
//! `stop_reason::failed`; its cache holds `decode_result::cache_length` valid slots (none of the
//! failed step's), so it can be resumed (joined again with `cached_prompt_tokens`) or dropped.
class model_output_error : public decode_error {
 public:
  //! @param request the request's id; @param step 0 for the prefill, then 1, 2, ... per decoding
  //! step; @param output which output; @param detail where in it (row, index, value).
  model_output_error(int request, std::uint64_t step, model_output output, const std::string& detail)
      : decode_error("request " + std::to_string(request) + ", step " + std::to_string(step) + ": non-finite " +
                     std::string(to_string(output)) + " from the model (" + detail + ")"),
        request_(request), step_(step), output_(output) {}
  //! The request's id.
  [[nodiscard]] int request() const noexcept { return request_; }
  //! The step: 0 for the prefill, then 1, 2, ... for each decoding step of the request.
  [[nodiscard]] std::uint64_t step() const noexcept { return step_; }
  //! Which output was not finite.
  [[nodiscard]] model_output output() const noexcept { return output_; }

 private:
  int request_;
  std::uint64_t step_;
  model_output output_;
};

MEDUSA_NAMESPACE_END
