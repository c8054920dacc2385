// SPDX-License-Identifier: Apache-2.0
//! @file draft_distill.hpp
//! Distilling a small draft model from the target (docs/training.md, "Draft models"): the
//! draft's every weight is trained on the target's own continuations to minimise
//!
//!     L = KL(target ‖ draft)
//!
//! averaged over every position of the sequences, with the target's distribution kept as its
//! top-k logits (`teacher_table`, as in Medusa-2). Then `measure_draft` says how long a greedy
//! chain of drafts the target accepts on held-out continuations.
//!
//! @code
//! auto seqs = medusa_train::cache_sequences(cache, prompts, *tok, seed, 16, 64);
//! auto teacher = medusa_train::teacher_table::compute(target_as_lora, seqs, 32, threads);
//! medusa_train::dense_model draft(draft_config, seed);
//! auto r = medusa_train::fit_draft(draft, seqs, teacher, {.lr = 3e-3, .epochs = 4});
//! auto q = medusa_train::measure_draft(draft, seqs, teacher, threads);
//! std::printf("a chain of 4 gives %.2f tokens per step\n", q.chain_tokens[3]);
//! @endcode
#pragma once

#include <medusa_train/dense_model.hpp>
#include <medusa_train/medusa2.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <vector>

namespace medusa_train {

//! Progress of `fit_draft`.
struct draft_progress {
  std::size_t step = 0;             //!< steps done
  std::size_t total_steps = 0;      //!< planned steps (after budget re-planning)
  double kl = 0;                    //!< smoothed KL(target ‖ draft), nats per position
  double agreement = 0;             //!< smoothed share of positions where the draft's argmax is the target's
  double lr = 0;                    //!< current learning rate
  double positions_per_second = 0;  //!< training positions per second
  double elapsed = 0;               //!< seconds since the start
  double eta = 0;                   //!< seconds left (estimate)
};

//! Options of `fit_draft`.
struct draft_fit_options {
  double lr = 3e-3;                 //!< peak learning rate
  double epochs = 4.0;              //!< passes over the training sequences
  std::size_t batch_sequences = 8;  //!< sequences per optimiser step
  optimizer_options opt;            //!< β, ε, weight decay, clipping, warm-up (its `lr` is not used)
  std::uint64_t seed = 0;           //!< shuffling
  int threads = 1;                  //!< sequences run in parallel on this many threads
  //! Stop by this time: the schedule is re-planned once after a few steps to end by then.
  std::optional<std::chrono::steady_clock::time_point> deadline;
  double reserve_seconds = 0;       //!< time to keep before the deadline
  std::size_t max_steps = 0;        //!< cap on steps (0 = none)
  double progress_interval = 0.5;   //!< seconds between progress callbacks
  std::function<void(const draft_progress&)> on_progress;  //!< progress callback
};

//! What `fit_draft` did.
struct draft_fit_result {
  std::size_t steps = 0;            //!< optimiser steps
  std::size_t planned_steps = 0;    //!< steps the epochs asked for
  std::size_t train_sequences = 0;  //!< training sequences available
  std::uint64_t positions_seen = 0; //!< positions processed
  double seconds = 0;               //!< wall time
  double final_kl = 0;              //!< smoothed KL at the end
  double final_agreement = 0;       //!< smoothed training agreement at the end
  bool budget_limited = false;      //!< the deadline shortened the run
};

//! Trains every weight of `draft` on the `split::train` sequences against `teacher`. Throws
//! `medusa::invalid_input` for a draft of another vocabulary than the teacher's ids allow, a
//! non-positive rate or batch, or no training sequence.
draft_fit_result fit_draft(dense_model& draft, std::span<const backbone_sequence> seqs, const teacher_table& teacher,
                           const draft_fit_options& o);

//! How well a draft predicts the target's greedy choices (held out, teacher-forced).
struct draft_quality {
  std::uint64_t positions = 0;        //!< continuation positions scored
  double agreement = 0;               //!< share where the draft's argmax is the target's argmax
  //! acceptance[k]: P(draft k+1 accepted | drafts 1…k accepted) for a greedy chain.
  std::vector<double> acceptance;
  //! chain_tokens[k]: expected tokens per step (1 + accepted drafts) of a chain of k+1 drafts.
  std::vector<double> chain_tokens;
};

//! The quality of a draft from its hits: `hits[s][r]` whether its argmax is the target's at
//! continuation position r of held-out sequence s. A chain that starts at a position accepts the
//! hits that follow it without a miss; chains of up to `max_depth` drafts.
[[nodiscard]] draft_quality draft_quality_of(const std::vector<std::vector<char>>& hits, std::size_t max_depth);

//! Scores `draft` on the `split::eval` sequences: at every position of a continuation whether the
//! draft's argmax is the target's (`teacher`'s best token there, computed on the same sequences),
//! and from the runs of consecutive hits, the acceptance of greedy chains up to `max_depth`
//! drafts (on greedy continuations, a chain that starts at a position accepts exactly the hits
//! that follow it without a miss; on sampled ones this is the same measure of the text).
[[nodiscard]] draft_quality measure_draft(const dense_model& draft, std::span<const backbone_sequence> seqs,
                                          const teacher_table& teacher, int threads, std::size_t max_depth = 8);

}  // namespace medusa_train
