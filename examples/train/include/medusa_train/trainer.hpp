// SPDX-License-Identifier: Apache-2.0
//! @file trainer.hpp
//! Medusa-1 head training on the CPU (docs/training.md): parameters initialised as the reference
//! recipe does (ResBlock W = 0, bias uniform in ±1/√d, projections = copies of lm_head), AdamW
//! with warm-up and cosine decay, global-norm gradient clipping, mini-batches of positions drawn
//! from a self-distillation cache, a wall-clock budget, and evaluation (per-head top-1/top-5 and
//! the calibration table `acc[k][r]`).
//!
//! @code
//! auto cache = medusa_train::distill_cache::open("cache.bin");
//! medusa_train::head_trainer t({cache.hidden_size(), cache.vocab_size(), 4, 1}, lm_head, 1, 2);
//! medusa_train::fit_options fo;
//! fo.epochs = 2;
//! auto fit = medusa_train::fit(t, cache, fo);
//! auto cal = medusa_train::evaluate(t, cache, medusa_train::split::eval);
//! medusa::save_heads("out", t.weights().view());
//! @endcode
#pragma once

#include <medusa_train/distill_cache.hpp>
#include <medusa_train/head_math.hpp>

#include <medusa/io/head_checkpoint.hpp>
#include <medusa/tree/search.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace medusa_llama {
class thread_pool;
}

namespace medusa_train {

//! AdamW and schedule settings.
struct optimizer_options {
  double lr = 1e-3;              //!< peak learning rate
  double beta1 = 0.9;            //!< Adam β1
  double beta2 = 0.999;          //!< Adam β2
  double eps = 1e-8;             //!< Adam ε
  double weight_decay = 0.0;     //!< decoupled weight decay (reference recipe: none)
  double clip_norm = 1.0;        //!< global gradient-norm clip (0 = off)
  double warmup_fraction = 0.05; //!< linear warm-up over this share of the steps
  double min_lr_fraction = 0.0;  //!< cosine floor as a share of `lr`
};

//! Learning rate at 0-based `step` of `total`: linear warm-up, then cosine to the floor.
[[nodiscard]] double learning_rate(const optimizer_options& o, std::size_t step, std::size_t total);

namespace detail {
//! One AdamW step (`t` ≥ 1 counts steps) of `p` from gradients `g` × `grad_scale`, moments `m`,
//! `v`; `pf(blocks, body)` runs body(b) for blocks of 65536 parameters.
void adamw_update(std::span<float> p, std::span<const float> g, std::span<float> m, std::span<float> v, std::size_t t, double lr,
                  const optimizer_options& o, double grad_scale,
                  const std::function<void(std::size_t, const std::function<void(std::size_t)>&)>& pf);
}  // namespace detail

//! The heads being trained: f32 parameters (the `medusa::head_weights` arena), gradients, Adam
//! moments, a thread pool for row-wise work. BLAS threads are set from `threads` too.
class head_trainer {
 public:
  //! Heads of `shape` initialised from `lm_head` [V][d] (projections) with ResBlock W = 0 and
  //! biases uniform in ±1/√d from `seed`. `threads` ≥ 1 is used for BLAS and row-wise work.
  head_trainer(const head_shape& shape, const float* lm_head, std::uint64_t seed, int threads);
  //! Heads that continue from trained ones (`--init-heads`): per-head projections of any dtype,
  //! converted to f32. Throws `medusa::invalid_input` for shared-projection heads.
  head_trainer(const medusa::head_weights& init, int threads);
  ~head_trainer();
  head_trainer(const head_trainer&) = delete;
  head_trainer& operator=(const head_trainer&) = delete;

  //! Sizes.
  [[nodiscard]] const head_shape& shape() const noexcept { return shape_; }
  //! The weights (f32), ready for `view()` / `medusa::save_heads`.
  [[nodiscard]] const medusa::head_weights& weights() const noexcept { return weights_; }
  //! Flat parameters (layout of head_math.hpp).
  [[nodiscard]] std::span<float> params() noexcept;
  //! Flat parameters (read-only).
  [[nodiscard]] std::span<const float> params() const noexcept;
  //! Adam steps taken.
  [[nodiscard]] std::size_t steps() const noexcept { return t_; }

  //! One optimiser step on a batch: loss and gradient, clipping, AdamW at learning rate `lr`.
  head_batch_stats step(const float* x, std::size_t batch, const std::int32_t* targets, std::span<const float> head_weights,
                        double lr, const optimizer_options& opt);
  //! Zeroes the gradients and accumulates those of a batch (no update); adds d loss / d x to
  //! `dx` ([batch][d]) when not null. The objective's head weights are `head_weights`.
  head_batch_stats accumulate(const float* x, std::size_t batch, const std::int32_t* targets, std::span<const float> head_weights,
                              float* dx = nullptr);
  //! Σ g² of the current gradients (summed in a fixed order).
  [[nodiscard]] double grad_squared_norm();
  //! One AdamW update from the current gradients scaled by `grad_scale` (clipping), at `lr`.
  void apply(double lr, const optimizer_options& opt, double grad_scale);
  //! Loss only (no update).
  head_batch_stats loss(const float* x, std::size_t batch, const std::int32_t* targets, std::span<const float> head_weights);
  //! Head logits `[batch][K][V]`.
  void logits(const float* x, std::size_t batch, float* out);
  //! Threads of the trainer's pool (and of BLAS when it runs the heads).
  [[nodiscard]] int threads() const noexcept;
  //! Runs `body(i)` for i < n on the trainer's threads (rows in contiguous chunks).
  void parallel_for(std::size_t n, const std::function<void(std::size_t)>& body);
  //! Gradient norm of the last `step` before clipping.
  [[nodiscard]] double last_grad_norm() const noexcept { return grad_norm_; }

 private:
  // Gradients, moments, the pool and BLAS threads for the weights in place (checks their layout).
  void start(int threads);

  head_shape shape_;
  medusa::head_weights weights_;
  std::vector<float> grads_, m_, v_;
  head_workspace<float> ws_;
  std::unique_ptr<medusa_llama::thread_pool> pool_;
  std::size_t t_ = 0;
  double grad_norm_ = 0;
};

//! What `fit` reports while it runs (and at the end).
struct fit_progress {
  std::size_t step = 0;          //!< steps done
  std::size_t total_steps = 0;   //!< planned steps (after budget re-planning)
  double loss = 0;               //!< smoothed loss
  std::vector<double> head_top1; //!< smoothed training top-1 per head
  double lr = 0;                 //!< current learning rate
  double positions_per_second = 0; //!< training positions per second
  double elapsed = 0;            //!< seconds since `fit` started
  double eta = 0;                //!< seconds left (estimate)
};

//! Options of `fit`.
struct fit_options {
  std::size_t batch = 256;       //!< positions per mini-batch
  double epochs = 2.0;           //!< passes over the training positions (fractional allowed)
  float decay = 0.8f;            //!< head k has loss weight decay^k (1 = unweighted, the reference)
  optimizer_options opt;         //!< AdamW and schedule
  std::uint64_t seed = 0;        //!< shuffling seed
  //! Stop training by this time (steady clock); the cosine schedule is re-planned once after a
  //! few steps so that it ends by then. Unset = no limit (fully deterministic).
  std::optional<std::chrono::steady_clock::time_point> deadline;
  double reserve_seconds = 0;    //!< time to keep free before the deadline (evaluation, saving)
  std::size_t max_steps = 0;     //!< cap on steps (0 = none)
  double progress_interval = 0.5;  //!< seconds between progress callbacks
  std::function<void(const fit_progress&)> on_progress;  //!< called periodically and at the end
};

//! Result of `fit`.
struct fit_result {
  std::size_t steps = 0;           //!< optimiser steps taken
  std::size_t planned_steps = 0;   //!< steps the data and epochs asked for
  std::size_t train_positions = 0; //!< training positions available (rows with a head-0 target)
  std::size_t positions_seen = 0;  //!< rows processed (steps × batch, last batch smaller)
  double seconds = 0;              //!< wall time
  double final_loss = 0;           //!< smoothed loss at the end
  bool budget_limited = false;     //!< the deadline shortened the run
};

//! Trains `t` on the `split::train` sequences of `data`. Throws `medusa::invalid_input` when the
//! data has no training position or does not match the heads' d and V.
fit_result fit(head_trainer& t, const distill_cache& data, const fit_options& opt);

//! Accuracy of the heads against the model's own tokens (calibration table, docs/training.md).
struct calibration {
  std::size_t num_heads = 0;                   //!< K
  std::size_t topk = 10;                       //!< ranks counted
  std::vector<std::uint64_t> positions;        //!< per head: positions with a target t+2+k
  std::vector<std::vector<std::uint64_t>> hits; //!< [K][topk]: rank-r token == target
  std::vector<double> mean_loss;               //!< per head: mean CE on these positions
  std::uint64_t base_positions = 0;            //!< positions checked for lm_head agreement
  std::uint64_t base_hits = 0;                 //!< argmax(lm_head(h_t)) == token t+1 (data sanity)
  std::size_t sequences = 0;                   //!< sequences evaluated
  //! Path-conditional counts: of `path_positions` positions, how many had the drafts of each path
  //! right (the ranks of the targets of heads 0, 1, ..., up to the first rank ≥ topk).
  std::uint64_t path_positions = 0;
  std::map<std::vector<int>, std::uint64_t> path_counts;

  //! acc[k][r] = hits / positions (0 when there are no positions).
  [[nodiscard]] double acc(std::size_t k, std::size_t r) const;
  //! Σ_{r<n} acc[k][r]: top-n accuracy of head k.
  [[nodiscard]] double top(std::size_t k, std::size_t n) const;
  //! The calibration the tree search consumes: the path counts (the independence model of the
  //! accuracy table when no path was counted).
  [[nodiscard]] medusa::path_calibration paths() const;
};

//! Evaluates the heads on the sequences of `which` split (every position with a target).
//! `lm_head` [V][d] (optional) also measures how often the base argmax equals the stored next
//! token (≈ 1 for greedy data; lower for sampled data or bf16 caches).
calibration evaluate(head_trainer& t, const distill_cache& data, split which, std::size_t topk = 10,
                     const float* lm_head = nullptr, std::size_t batch = 256);

//! Calibration as JSON text (format in docs/training.md). `meta` is inserted as extra fields
//! (a JSON object's members, e.g. `"model": "..."`), may be empty.
[[nodiscard]] std::string calibration_json(const calibration& c, const std::string& meta_members = {});

//! The best tree of `nodes` nodes (root included) under the path-conditional calibration:
//! the `nodes − 1` most probable paths, none deeper than `max_depth` (docs/training.md).
[[nodiscard]] std::vector<std::vector<int>> best_tree(const calibration& c, std::size_t nodes, std::size_t max_depth = 5);

}  // namespace medusa_train
