// SPDX-License-Identifier: Apache-2.0
//! @file medusa2.hpp
//! Medusa-2: the heads and a LoRA-adapted backbone trained jointly by self-distillation
//! (docs/training.md, "Medusa-2"). The objective of a batch of sequences is
//!
//!     L = KL(original ‖ adapted) + λ0 · Σ_k decay^k · CE(head_k(h_t), y_{t+k+2})
//!
//! with the KL averaged over every position and each head's cross-entropy averaged over the
//! positions that have its target. The original model's distribution is its top-k logits at each
//! position (`teacher_table`), computed once and kept beside the self-distillation cache. The
//! heads and the adapters have their own AdamW learning rates (heads higher) on one schedule and
//! one global gradient-norm clip.
//!
//! @code
//! auto seqs = medusa_train::cache_sequences(cache, prompts, *tok, seed, 16, 64);
//! medusa_train::lora_model lm(model, {}, seed);
//! auto teacher = medusa_train::teacher_table::compute(lm, seqs, 32, threads);
//! medusa_train::joint_options jo;
//! auto r = medusa_train::fit_joint(lm, heads, seqs, teacher, jo);
//! auto q = medusa_train::measure_quality(lm, held_out, texts, threads);
//! @endcode
#pragma once

#include <medusa_train/lora_model.hpp>
#include <medusa_train/selfdistill.hpp>
#include <medusa_train/trainer.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <span>
#include <vector>

namespace medusa_train {

//! One sequence of backbone training: its whole token sequence and where the cache's rows start.
struct backbone_sequence {
  std::vector<std::int32_t> tokens;  //!< prompt, then the model's continuation
  std::size_t row0 = 0;              //!< position of the cache record's row 0 (prompt length − 1)
  split which = split::train;        //!< train or held out
};

//! The token sequences of a cache's records: each prompt is cut again as `generate_distill` cut
//! it (same prompt set, seed and lengths) and checked against the record. Throws
//! `medusa::invalid_input` when a record does not match its prompt (the cache was made from
//! other prompts).
[[nodiscard]] std::vector<backbone_sequence> cache_sequences(const distill_cache& data, const prompt_set& prompts,
                                                             const medusa_llama::tokenizer& tok, std::uint64_t seed,
                                                             int prompt_min, int prompt_max);

//! The original model's top-k logits and the log-normaliser of its whole row, at every position
//! but the last of every sequence (the KL keeps the rest of the vocabulary as one bucket).
class teacher_table {
 public:
  //! Runs the base model of `m` (adapters off) over every sequence on `threads` threads.
  static teacher_table compute(const lora_model& m, std::span<const backbone_sequence> seqs, std::size_t k, int threads);
  //! Reads a table written by `save`; nothing when the file is missing or made for other
  //! sequences (its row counts or `k` differ). Throws `medusa::io_error` for a corrupt file.
  static std::optional<teacher_table> load(const std::filesystem::path& path, std::span<const backbone_sequence> seqs, std::size_t k);
  //! Writes the table (to `path.tmp`, renamed when complete).
  void save(const std::filesystem::path& path) const;

  //! The teacher at position `pos` < n − 1 of sequence `seq`.
  [[nodiscard]] backbone::teacher_row row(std::size_t seq, std::size_t pos) const;
  //! Logits kept per position.
  [[nodiscard]] std::size_t k() const noexcept { return k_; }

 private:
  std::size_t k_ = 0;
  std::vector<std::size_t> first_;  // per sequence: its first row
  std::vector<std::int32_t> ids_;   // [rows][k]
  std::vector<float> logits_;       // [rows][k]
  std::vector<float> log_norm_;     // [rows]: log Σ exp over the whole vocabulary
};

//! Progress of `fit_joint` (the `fit_progress` fields, plus the KL term).
struct joint_progress : fit_progress {
  double kl = 0;         //!< smoothed self-distillation KL (nats per position)
  double head_loss = 0;  //!< smoothed Σ_k decay^k CE_k
};

//! Options of `fit_joint`.
struct joint_options {
  double heads_lr = 2e-3;           //!< peak learning rate of the heads
  double backbone_lr = 1e-4;        //!< peak learning rate of the adapters (must be below the heads')
  double heads_coefficient = 0.2;   //!< λ0
  float decay = 0.8f;               //!< head k's weight decay^k
  double epochs = 1.0;              //!< passes over the training sequences
  std::size_t batch_sequences = 8;  //!< sequences per optimiser step
  optimizer_options opt;            //!< β, ε, weight decay, clipping, warm-up (its `lr` is not used)
  std::uint64_t seed = 0;           //!< shuffling and dropout
  //! Stop by this time: the schedule is re-planned once after a few steps to end by then.
  std::optional<std::chrono::steady_clock::time_point> deadline;
  double reserve_seconds = 0;       //!< time to keep before the deadline
  std::size_t max_steps = 0;        //!< cap on steps (0 = none)
  double progress_interval = 0.5;   //!< seconds between progress callbacks
  std::function<void(const joint_progress&)> on_progress;  //!< progress callback
};

//! What `fit_joint` did.
struct joint_result {
  std::size_t steps = 0;            //!< optimiser steps
  std::size_t planned_steps = 0;    //!< steps the epochs asked for
  std::size_t train_sequences = 0;  //!< training sequences available
  std::uint64_t positions_seen = 0; //!< positions processed
  double seconds = 0;               //!< wall time
  double final_kl = 0;              //!< smoothed KL at the end
  double final_head_loss = 0;       //!< smoothed head loss at the end
  bool budget_limited = false;      //!< the deadline shortened the run
};

//! Trains the adapters of `lm` and the heads of `heads` jointly on the `split::train` sequences.
//! Throws `medusa::invalid_input` for a backbone rate not below the heads' rate, heads of another
//! width or vocabulary, or no training sequence.
joint_result fit_joint(lora_model& lm, head_trainer& heads, std::span<const backbone_sequence> seqs, const teacher_table& teacher,
                       const joint_options& o);

//! The adapted model against the original on held-out data.
struct adapted_quality {
  std::uint64_t positions = 0;       //!< held-out positions compared
  double agreement = 0;              //!< share where argmax(adapted) == argmax(original)
  double mean_kl = 0;                //!< mean KL(original ‖ adapted) over the full vocabulary, nats
  std::uint64_t text_tokens = 0;     //!< tokens of held-out text scored for perplexity
  double perplexity_original = 0;    //!< exp(mean NLL) of the text under the original model
  double perplexity_adapted = 0;     //!< the same under the adapted model
};

//! Compares `lm` with and without its adapters on the `split::eval` sequences of `seqs`
//! (agreement, KL), and scores `texts` (token sequences of held-out text, BOS first) for perplexity.
[[nodiscard]] adapted_quality measure_quality(const lora_model& lm, std::span<const backbone_sequence> seqs,
                                              std::span<const std::vector<std::int32_t>> texts, int threads);

}  // namespace medusa_train
