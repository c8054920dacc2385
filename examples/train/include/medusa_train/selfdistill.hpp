// SPDX-License-Identifier: Apache-2.0
//! @file selfdistill.hpp
//! Self-distillation data (docs/training.md): the frozen base model continues prompts with its own
//! greedy (or sampled) decoding, and every generated position's final-normed hidden state and the
//! model's own tokens go to a `distill_cache`.
//!
//! Prompts come from a prompt file (one per line) or are cut from text/code files under a corpus
//! directory. Files (or lines) are split into train and held-out sets by a hash of their name (or
//! line index), so the held-out set does not depend on the seed.
//!
//! Greedy continuations are generated with *prompt-lookup drafting*: the tokens that followed the
//! last occurrence of the current n-gram in the context are verified in one causal batch, and
//! the longest prefix that equals the model's argmax is kept together with the hidden states of
//! that batch. The output is the model's greedy continuation (up to float rounding between
//! batched and single-token kernels); small models loop, so this is several times faster than
//! one forward per token. Sampled continuations (temperature > 0) use one token per forward.
//!
//! @code
//! auto prompts = medusa_train::prompt_set::from_corpus("/usr/lib/python3.11", 0.1);
//! medusa_train::distill_options o;
//! o.tokens = 60000;
//! medusa_train::distill_cache_writer w("c.bin", 384, 2048, medusa::weight_dtype::bf16, key.hash);
//! auto st = medusa_train::generate_distill(engine, *tok, prompts, o, w);
//! w.finish();
//! @endcode
#pragma once

#include <medusa_train/distill_cache.hpp>

#include <medusa_llama/engine.hpp>
#include <medusa_llama/tokenizer.hpp>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace medusa_train {

//! Where prompts come from, split into train and held-out parts.
class prompt_set {
 public:
  //! Every text/code file under `dir` (recursively; known source/text extensions, no NUL byte in
  //! the first 4 KiB, at most 8 MiB), sorted; a file is held out when the hash of its relative
  //! path falls in the `eval_fraction` share (at least one file is held out when there are two).
  //! Throws `medusa::invalid_input` when the directory has no usable file.
  static prompt_set from_corpus(const std::filesystem::path& dir, double eval_fraction = 0.1);
  //! Non-empty lines of `file` (the escapes `\n`, `\t`, `\\` are decoded); every 10th line (or
  //! the `eval_fraction` share) is held out. Throws `medusa::invalid_input` when it has none.
  static prompt_set from_file(const std::filesystem::path& file, double eval_fraction = 0.1);

  //! True for a corpus directory.
  [[nodiscard]] bool is_corpus() const noexcept { return corpus_; }
  //! Corpus root (corpus only).
  [[nodiscard]] const std::filesystem::path& root() const noexcept { return root_; }
  //! Corpus files of a split (corpus only).
  [[nodiscard]] const std::vector<std::filesystem::path>& files(split s) const noexcept { return s == split::train ? train_files_ : eval_files_; }
  //! Prompt lines of a split (prompt file only).
  [[nodiscard]] const std::vector<std::string>& lines(split s) const noexcept { return s == split::train ? train_lines_ : eval_lines_; }
  //! Whether split `s` has any prompt source.
  [[nodiscard]] bool has(split s) const noexcept { return corpus_ ? !files(s).empty() : !lines(s).empty(); }
  //! Every corpus file (both splits), sorted: for the cache key.
  [[nodiscard]] std::vector<std::filesystem::path> all_files() const;

  //! Prompt number `index` of split `s` (corpus: a random file and cut point drawn from
  //! `seed`/`index`; lines: line `index` modulo the count), BOS first, between `min_len` and
  //! `max_len` tokens when the text is long enough (at least 2 tokens).
  [[nodiscard]] std::vector<int> prompt(split s, std::uint64_t index, std::uint64_t seed, const medusa_llama::tokenizer& tok,
                                        int min_len, int max_len) const;

 private:
  bool corpus_ = false;
  std::filesystem::path root_;
  std::vector<std::filesystem::path> train_files_, eval_files_;
  std::vector<std::string> train_lines_, eval_lines_;
};

//! Progress of `generate_distill`.
struct distill_progress {
  std::uint64_t rows = 0;         //!< positions stored
  std::uint64_t target_rows = 0;  //!< the token budget
  std::uint64_t sequences = 0;    //!< sequences done
  double tokens_per_second = 0;   //!< generated tokens per second
  double elapsed = 0;             //!< seconds
  double eta = 0;                 //!< seconds left (estimate)
};

//! Options of `generate_distill`.
struct distill_options {
  std::uint64_t tokens = 60000;  //!< positions to store (train + held-out)
  double eval_fraction = 0.1;    //!< share of positions from held-out prompts
  int prompt_min = 16;           //!< prompt tokens (incl. BOS), lower bound
  int prompt_max = 64;           //!< prompt tokens, upper bound
  int gen_len = 192;             //!< tokens generated per prompt (fewer at EOS or end of context)
  float temperature = 0.0f;      //!< 0 = greedy
  std::uint64_t seed = 0;        //!< prompt choice and sampling
  int draft = 12;                //!< prompt-lookup draft length (greedy only; 0 = off)
  int ngram = 3;                 //!< longest n-gram matched for drafting (tries n..1)
  std::optional<std::chrono::steady_clock::time_point> deadline;  //!< stop early by then
  double progress_interval = 0.5;                                 //!< seconds between callbacks
  std::function<void(const distill_progress&)> on_progress;      //!< progress callback
};

//! What `generate_distill` did. The counts of the data (`sequences`, `rows`, `train_rows`,
//! `eval_rows`) include the records a resumed run reused; the rest is this call's work.
struct distill_stats {
  std::uint64_t sequences = 0;   //!< records written
  std::uint64_t rows = 0;        //!< positions written
  std::uint64_t train_rows = 0;  //!< positions of train sequences
  std::uint64_t eval_rows = 0;   //!< positions of held-out sequences
  std::uint64_t reused_sequences = 0;  //!< records copied from the cache resumed (0 without one)
  std::uint64_t reused_rows = 0;       //!< their positions: `rows - reused_rows` were generated
  std::uint64_t forwards = 0;    //!< model forward calls (prefill chunks excluded)
  std::uint64_t drafted = 0;     //!< draft tokens verified
  std::uint64_t accepted = 0;    //!< draft tokens accepted
  double seconds = 0;            //!< wall time
  bool deadline_hit = false;     //!< stopped by the deadline
};

//! Generates continuations until `opt.tokens` positions are stored (or the deadline) and writes
//! them to `out` (the caller calls `out.finish()`). With `resume` (the records of an earlier call
//! with the same model, prompts and options that the deadline cut short), those records are
//! copied to `out` first and generation goes on after them: the result is byte for byte what one
//! uninterrupted call writes (a deadline only ever stops between sequences, and each sequence
//! depends only on its place in the order). Throws `medusa::invalid_input` for bad options or a
//! `resume` of another shape; whatever the engine throws.
distill_stats generate_distill(medusa_llama::engine& e, const medusa_llama::tokenizer& tok, const prompt_set& prompts,
                               const distill_options& opt, distill_cache_writer& out, const distill_cache* resume = nullptr);

//! Draft tokens for prompt-lookup decoding: the (at most `max_draft`) tokens that followed the
//! most recent earlier occurrence of the last n tokens of `ctx`, trying n = `ngram` down to 1.
[[nodiscard]] std::vector<int> lookup_draft(std::span<const int> ctx, int ngram, int max_draft);

}  // namespace medusa_train
