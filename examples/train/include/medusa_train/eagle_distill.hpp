// SPDX-License-Identifier: Apache-2.0
//! @file eagle_distill.hpp
//! Training an EAGLE-style feature drafter (`eagle_model`; docs/training.md, "EAGLE-style feature
//! drafters") on the target's own continuations. Row i of a sequence (input E t_{i+1} and the
//! target's feature f_i, uniform noise on f_i while training) minimises
//!
//!     KL(teacher_{i+1} ‖ softmax(W_cls g_i)) + reg · mean_j SmoothL1(g_i − f_{i+1})_j   (β = 1)
//!
//! averaged over every row i = 0…n−3 of a batch of sequences, the teacher being the target's top-k
//! distribution at position i+1 (`teacher_table`, as for the draft model). `measure_eagle` then
//! drafts chains autoregressively on held-out continuations, each depth on the previous one's
//! predicted feature, as a decoder would.
//!
//! @code
//! auto features = medusa_train::feature_table::compute(target_as_lora, seqs, threads);
//! medusa_train::eagle_model em(target, 0, seed);
//! auto r = medusa_train::fit_eagle(em, seqs, features, teacher, {.lr = 2e-3, .epochs = 4});
//! auto q = medusa_train::measure_eagle(em, seqs, features, teacher, threads);
//! @endcode
#pragma once

#include <medusa_train/eagle_model.hpp>
#include <medusa_train/medusa2.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <vector>

namespace medusa_train {

//! The target's final-normed hidden state (its classifier's input) at every position but the last
//! of every sequence, f32 in memory.
class feature_table {
 public:
  //! Runs the base model of `m` (adapters off) over every sequence on `threads` threads.
  static feature_table compute(const lora_model& m, std::span<const backbone_sequence> seqs, int threads);
  //! Features f_0…f_{n−2} of sequence `seq` ([n−1][d]).
  [[nodiscard]] const float* of(std::size_t seq) const noexcept { return rows_.data() + first_[seq] * d_; }
  //! Width.
  [[nodiscard]] std::size_t dim() const noexcept { return d_; }
  //! Root mean square of the features of the `split::train` sequences.
  [[nodiscard]] double rms(std::span<const backbone_sequence> seqs) const;

 private:
  std::size_t d_ = 0;
  std::vector<std::size_t> first_;  // per sequence: its first row
  std::vector<float> rows_;         // [rows][d]
};

//! Progress of `fit_eagle`.
struct eagle_progress {
  std::size_t step = 0;             //!< steps done
  std::size_t total_steps = 0;      //!< planned steps (after budget re-planning)
  double kl = 0;                    //!< smoothed KL(target ‖ drafter), nats per row
  double regression = 0;            //!< smoothed mean SmoothL1(g − f) per row
  double agreement = 0;             //!< smoothed share of rows with the target's argmax
  double lr = 0;                    //!< current learning rate
  double positions_per_second = 0;  //!< training rows per second
  double elapsed = 0;               //!< seconds since the start
  double eta = 0;                   //!< seconds left (estimate)
};

//! Options of `fit_eagle`.
struct eagle_fit_options {
  double lr = 2e-3;                 //!< peak learning rate
  double epochs = 4.0;              //!< passes over the training sequences
  double reg = 1.0;                 //!< weight of the feature regression
  double noise = 0.0;               //!< feature input noise: U(−noise, noise), absolute
  std::size_t batch_sequences = 8;  //!< sequences per optimiser step
  optimizer_options opt;            //!< β, ε, weight decay, clipping, warm-up (its `lr` is not used)
  std::uint64_t seed = 0;           //!< shuffling and noise
  int threads = 1;                  //!< sequences run in parallel on this many threads
  //! Stop by this time: the schedule is re-planned once after a few steps to end by then.
  std::optional<std::chrono::steady_clock::time_point> deadline;
  double reserve_seconds = 0;       //!< time to keep before the deadline
  std::size_t max_steps = 0;        //!< cap on steps (0 = none)
  double progress_interval = 0.5;   //!< seconds between progress callbacks
  std::function<void(const eagle_progress&)> on_progress;  //!< progress callback
};

//! What `fit_eagle` did.
struct eagle_fit_result {
  std::size_t steps = 0;            //!< optimiser steps
  std::size_t planned_steps = 0;    //!< steps the epochs asked for
  std::size_t train_sequences = 0;  //!< training sequences available (≥ 3 tokens)
  std::uint64_t positions_seen = 0; //!< rows processed
  double seconds = 0;               //!< wall time
  double final_kl = 0;              //!< smoothed KL at the end
  double final_regression = 0;      //!< smoothed regression loss at the end
  double final_agreement = 0;       //!< smoothed training agreement at the end
  bool budget_limited = false;      //!< the deadline shortened the run
};

//! Trains `em` on the `split::train` sequences against `teacher` and the target's `features`.
//! Throws `medusa::invalid_input` for a non-positive rate or batch, a negative regression weight
//! or noise, a teacher wider than the vocabulary, or no training sequence.
eagle_fit_result fit_eagle(eagle_model& em, std::span<const backbone_sequence> seqs, const feature_table& features,
                           const teacher_table& teacher, const eagle_fit_options& o);

//! How well a drafter predicts the target's greedy choices on held-out continuations.
struct eagle_quality {
  std::uint64_t positions = 0;  //!< continuation positions scored (chain starts)
  double agreement = 0;         //!< share where the first draft is the target's argmax
  //! acceptance[k]: P(draft k+1 accepted | drafts 1…k accepted), the chain drafted
  //! autoregressively (draft k+1 from draft k's token and predicted feature).
  std::vector<double> acceptance;
  //! chain_tokens[k]: expected tokens per step (1 + accepted drafts) of a chain of k+1 drafts.
  std::vector<double> chain_tokens;
  //! The same from runs of teacher-forced hits (every row on the target's true features): the
  //! upper estimate `measure_draft` makes for a draft model.
  std::vector<double> chain_tokens_teacher_forced;
  double regression = 0;        //!< mean SmoothL1(g − f) of the teacher-forced rows
};

//! Scores `em` on the `split::eval` sequences, at the positions `measure_draft` scores: from every
//! continuation position q ≥ 1 (the target has run the positions before q and chosen t_q), a chain
//! of up to `max_depth` drafts of t_{q+1}, t_{q+2}, …: the first from (E t_q, f_{q−1}), each next
//! from its predecessor's token and predicted feature (`eagle_model::extend`), each compared with
//! the target's argmax there (`teacher`'s best token). A chain stops at its first miss or at the
//! sequence's end.
[[nodiscard]] eagle_quality measure_eagle(const eagle_model& em, std::span<const backbone_sequence> seqs, const feature_table& features,
                                          const teacher_table& teacher, int threads, std::size_t max_depth = 8);

}  // namespace medusa_train
