// SPDX-License-Identifier: Apache-2.0
//! @file exit_distill.hpp
//! Distilling an exit projection for self-speculative decoding (docs/training.md, "An exit for
//! self-speculation"): the draft is the target's first k layers, its final norm and its
//! classifier C; one linear layer W between the norm and the classifier (logits = C · W · x, x the
//! final-normed state after layer k) is trained, from the identity, to minimise
//!
//!     L = KL(target ‖ softmax(C · W · x))
//!
//! over every position of the target's own continuations (`teacher_table`). Everything else stays
//! the target's. `measure_exit` scores the draft's greedy chains on held-out continuations.
//!
//! @code
//! const lora_model first(target.first_layers(k), {.rank = 1, .alpha = 1, .dropout = 0}, 0);
//! auto x = medusa_train::feature_table::compute(first, seqs, threads);   // normed layer-k states
//! std::vector<float> w = medusa_train::identity_exit(target.config().dim);
//! auto r = medusa_train::fit_exit(w, target, x, seqs, teacher, {.lr = 1e-3, .epochs = 2});
//! auto q = medusa_train::measure_exit(w, target, x, seqs, teacher, threads);
//! @endcode
#pragma once

#include <medusa_train/draft_distill.hpp>
#include <medusa_train/eagle_distill.hpp>

#include <medusa_llama/model.hpp>

#include <cstddef>
#include <span>
#include <vector>

namespace medusa_train {

//! The identity `[dim][dim]`: the exit before training, the plain first layers.
[[nodiscard]] std::vector<float> identity_exit(int dim);

//! Trains `w` (`[dim][dim]`, y = W x) on the `split::train` sequences: row p of `states` (the
//! final-normed state after the draft's layers at position p) should give the target's
//! distribution at p (`teacher.row(s, p)`) through `target`'s classifier. Options and result as
//! `fit_draft`'s (`batch_sequences`, `opt` with its `clip_norm`; no weight decay: it would pull W
//! from the identity to zero). Throws `medusa::invalid_input` for a `w` or `states` of another width,
//! a teacher with more ids than the vocabulary, a non-positive rate or batch, or no training sequence.
draft_fit_result fit_exit(std::vector<float>& w, const medusa_llama::model& target, const feature_table& states,
                          std::span<const backbone_sequence> seqs, const teacher_table& teacher, const draft_fit_options& o);

//! Scores the exit on the `split::eval` continuations as `measure_draft` scores a draft: the
//! share of positions where argmax(C · W · x) is the target's, and the greedy chains' acceptance
//! (a token-level draft whose drafts were accepted has seen the real tokens, so the runs of hits
//! are its chains).
[[nodiscard]] draft_quality measure_exit(std::span<const float> w, const medusa_llama::model& target, const feature_table& states,
                                         std::span<const backbone_sequence> seqs, const teacher_table& teacher, int threads,
                                         std::size_t max_depth = 8);

}  // namespace medusa_train
