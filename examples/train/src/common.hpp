// SPDX-License-Identifier: Apache-2.0
// Internals shared by the trainer's sources: the clock, a portable splitmix64 generator (std
// distributions differ between standard libraries), whole-file reads, and what a training loop
// keeps besides its parameters (the wall-clock budget, the averages its progress line shows).
#pragma once

#include <medusa_train/trainer.hpp>

#include <medusa/error.hpp>

#include <medusa_llama/thread_pool.hpp>

#include <cblas.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <exception>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <vector>

namespace medusa_train::detail {

using clock_type = std::chrono::steady_clock;

//! Where a file is written before it is renamed over `p` (same directory, so the rename is atomic):
//! `p.tmp-<pid>-<n>`, unique to this writer, so runs sharing a cache directory never write into
//! each other's file.
inline std::filesystem::path temp_beside(const std::filesystem::path& p) {
  static std::atomic<unsigned> next{0};
  return p.string() + ".tmp-" + std::to_string(::getpid()) + "-" + std::to_string(next++);
}

inline double seconds_since(clock_type::time_point t) { return std::chrono::duration<double>(clock_type::now() - t).count(); }

//! splitmix64 of `z`: one step of the generator, a good 64-bit hash of a counter.
inline std::uint64_t mix(std::uint64_t z) noexcept {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

__extension__ typedef unsigned __int128 u128;  // 64x64 -> 128-bit product for unbiased ranges

//! Uniform in [0, n) from 64 random bits (bias < 2^-40 for the sizes used here).
inline std::uint64_t below(std::uint64_t r, std::uint64_t n) noexcept { return static_cast<std::uint64_t>((static_cast<u128>(r) * n) >> 64); }

//! Uniform in [0, 1) from 64 random bits (53 of them).
inline double unit(std::uint64_t r) noexcept { return static_cast<double>(r >> 11) * 0x1.0p-53; }

//! A training loop's wall-clock budget: once the step time is known (after `warm_steps` steps or
//! `warm_seconds`), the planned total is cut once so that the schedule ends (lr → 0) by the
//! deadline minus `reserve` seconds; past that point the loop ends after the current step.
struct deadline_plan {
  std::optional<clock_type::time_point> deadline;
  double reserve = 0;
  std::size_t warm_steps = 8;
  double warm_seconds = 3.0;
  bool replanned = false;

  //! After 0-based `step`, `elapsed` seconds into the loop: updates `total`; true when it cut it.
  bool update(std::size_t step, double elapsed, std::size_t& total) {
    if (!deadline) return false;
    bool cut = false;
    const double left = std::chrono::duration<double>(*deadline - clock_type::now()).count() - reserve;
    if (!replanned && (step + 1 >= warm_steps || elapsed > warm_seconds)) {
      replanned = true;
      const double per_step = elapsed / static_cast<double>(step + 1);
      const auto fit_steps = step + 1 + static_cast<std::size_t>(left > 0 ? left / per_step : 0.0);
      if (fit_steps < total) {
        total = fit_steps > step + 2 ? fit_steps : step + 2;
        cut = true;
      }
    }
    if (left <= 0 && step + 1 < total) {
      total = step + 1;
      cut = true;
    }
    return cut;
  }
};

//! The whole file; throws `medusa::io_error` when it cannot be read.
inline std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) throw medusa::io_error("cannot read " + p.string());
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

//! A bias-corrected exponential moving average (weight 0.05 per step), for progress lines.
class moving_average {
 public:
  void add(double x) noexcept {
    sum_ = 0.95 * sum_ + 0.05 * x;
    weight_ = 0.95 * weight_ + 0.05;
  }
  [[nodiscard]] double value() const noexcept { return weight_ > 0 ? sum_ / weight_ : 0.0; }

 private:
  double sum_ = 0, weight_ = 0;
};

//! What a training loop's progress line shows: the averaged loss and each head's averaged
//! training top-1, and the report built from them.
struct training_meter {
  moving_average loss;
  std::vector<moving_average> top1;

  explicit training_meter(std::size_t heads) : top1(heads) {}

  //! One step: its loss and its heads' batch statistics.
  void add(double step_loss, const head_batch_stats& st) {
    loss.add(step_loss);
    for (std::size_t k = 0; k < top1.size(); ++k)
      top1[k].add(st.counted[k] ? static_cast<double>(st.top1[k]) / static_cast<double>(st.counted[k]) : 0.0);
  }
  //! The fields of `pr` every loop reports, after 0-based `step` of `total`.
  void report(fit_progress& pr, std::size_t step, std::size_t total, double lr, double elapsed, double positions_seen) const {
    pr.step = step + 1;
    pr.total_steps = total;
    pr.loss = loss.value();
    pr.head_top1.resize(top1.size());
    for (std::size_t k = 0; k < top1.size(); ++k) pr.head_top1[k] = top1[k].value();
    pr.lr = lr;
    pr.elapsed = elapsed;
    pr.positions_per_second = positions_seen / std::max(1e-9, elapsed);
    pr.eta = elapsed / static_cast<double>(step + 1) * static_cast<double>(total - step - 1);
  }
};

//! Mini-batches of `per_batch` items taken in epochs: at the start of each epoch the items are
//! shuffled (Fisher–Yates on a splitmix stream from `seed`), then taken in order; an epoch's last
//! batch may be shorter. `items` must not be empty.
class shuffled_batches {
 public:
  shuffled_batches(std::vector<std::size_t> items, std::size_t per_batch, std::uint64_t seed)
      : items_(std::move(items)), per_batch_(per_batch), stream_(seed), pos_(per_epoch()) {}

  //! Batches in one epoch.
  [[nodiscard]] std::size_t per_epoch() const noexcept { return (items_.size() + per_batch_ - 1) / per_batch_; }

  //! The next batch's items.
  std::span<const std::size_t> next() {
    if (pos_ >= per_epoch()) {
      for (std::size_t i = items_.size(); i > 1; --i) {
        stream_ = mix(stream_);
        std::swap(items_[i - 1], items_[static_cast<std::size_t>(below(stream_, i))]);
      }
      pos_ = 0;
    }
    const std::size_t b0 = pos_++ * per_batch_;
    return std::span<const std::size_t>(items_).subspan(b0, std::min(per_batch_, items_.size() - b0));
  }

 private:
  std::vector<std::size_t> items_;
  std::size_t per_batch_;
  std::uint64_t stream_;
  std::size_t pos_;
};

//! g = Σ_i buffers[i] over the first `n` per-sequence gradient buffers, summed in a fixed order (a
//! run does not depend on the threads' scheduling), in blocks of 65536 parameters run by
//! `pf(blocks, body)`; returns Σ g².
template <class ParallelFor>
double sum_gradients(const std::vector<std::vector<float>>& buffers, std::size_t n, std::vector<float>& g, ParallelFor&& pf) {
  constexpr std::size_t blk = 65536;
  const std::size_t P = g.size(), nblk = (P + blk - 1) / blk;
  std::vector<double> part(nblk);
  pf(nblk, [&](std::size_t c) {
    double sq = 0;
    for (std::size_t j = c * blk, e = std::min(P, j + blk); j < e; ++j) {
      float a = 0;
      for (std::size_t i = 0; i < n; ++i) a += buffers[i][j];
      g[j] = a;
      sq += static_cast<double>(a) * a;
    }
    part[c] = sq;
  });
  double sum = 0;
  for (double p : part) sum += p;
  return sum;
}

//! The factor that clips a gradient of norm √`squared_norm` to `clip_norm` (1 when it is below or
//! clipping is off).
inline double clip_factor(double squared_norm, double clip_norm) {
  const double norm = std::sqrt(squared_norm);
  return clip_norm > 0 && norm > clip_norm ? clip_norm / (norm + 1e-12) : 1.0;
}

//! Runs body(i, tid) for i < n on `pool`, one index per chunk (BLAS single-threaded meanwhile: the
//! sequences are the parallelism). The first error a job throws is rethrown here.
template <class F>
inline void per_sequence(medusa_llama::thread_pool& pool, std::size_t n, F&& body) {
  if (n == 0) return;
  openblas_set_num_threads(1);
  std::exception_ptr error;
  std::atomic_flag failed;
  pool.run(static_cast<int>(n), [&](int c, int tid) {
    try {
      body(static_cast<std::size_t>(c), static_cast<std::size_t>(tid));
    } catch (...) {
      if (!failed.test_and_set()) error = std::current_exception();
    }
  });
  if (error) std::rethrow_exception(error);
}

//! What one sequence of a distillation step adds: its loss terms (already weighted per row) and
//! the rows where the student's argmax is the teacher's.
struct sequence_loss {
  double kl = 0;
  double regression = 0;
  std::size_t agree = 0;
};

//! Where a distillation loop stands, for its progress callback and its result.
struct distill_status {
  std::size_t step = 0, total_steps = 0, planned_steps = 0;
  std::uint64_t positions_seen = 0;
  double kl = 0, regression = 0, agreement = 0;  // smoothed over the steps
  double lr = 0, elapsed = 0, positions_per_second = 0, eta = 0;
  bool budget_limited = false;
};

//! The optimisation loop the distillation recipes share (draft model, feature drafter, exit):
//! shuffled batches of `o.batch_sequences` of the `items` (sequence indices), `rows(seq)` trained
//! rows each; `body(slot, seq, step, weight, grad)` runs one sequence of the batch into its own
//! zeroed gradient buffer (`weight` = 1 / the batch's rows) and returns its `sequence_loss`; the
//! buffers are summed in a fixed order, clipped, and AdamW (`decay`, not `o.opt`'s, for the weight
//! decay) steps `params` on the warm-up + cosine schedule of `o.lr`, fitted to `o.deadline`.
//! `report(status, last)` after each step. Options: any of the recipes' (`lr`, `epochs`,
//! `batch_sequences`, `opt`, `seed`, `threads`, `deadline`, `reserve_seconds`, `max_steps`).
template <class Options, class Rows, class Body, class Report>
distill_status distill_loop(std::span<float> params, std::vector<std::size_t> items, const Options& o, double decay, std::uint64_t salt,
                            Rows&& rows, Body&& body, Report&& report) {
  const auto t0 = clock_type::now();
  distill_status st;
  const std::size_t S = o.batch_sequences;
  st.planned_steps =
      std::max<std::size_t>(1, static_cast<std::size_t>(std::ceil(o.epochs * static_cast<double>(items.size()) / static_cast<double>(S))));
  std::size_t total = o.max_steps > 0 ? std::min(st.planned_steps, o.max_steps) : st.planned_steps;
  const std::size_t P = params.size();
  std::vector<float> m(P, 0.0f), v(P, 0.0f), g(P, 0.0f);
  std::vector<std::vector<float>> gbuf(S, std::vector<float>(P));
  std::vector<sequence_loss> losses(S);
  medusa_llama::thread_pool pool(std::max(1, o.threads));
  auto pf = [&](std::size_t nb, const std::function<void(std::size_t)>& f) {
    pool.run(static_cast<int>(nb), [&](int c, int) { f(static_cast<std::size_t>(c)); });
  };
  optimizer_options step_opt = o.opt;
  step_opt.weight_decay = decay;
  shuffled_batches batches(std::move(items), S, o.seed ^ salt);
  moving_average avg_kl, avg_reg, avg_agree;
  deadline_plan budget{o.deadline, o.reserve_seconds, 4, 10.0};
  for (std::size_t step = 0; step < total; ++step) {
    const auto batch = batches.next();
    const std::size_t nb = batch.size();
    std::size_t batch_rows = 0;
    for (std::size_t i = 0; i < nb; ++i) batch_rows += rows(batch[i]);
    const float weight = 1.0f / static_cast<float>(batch_rows);
    per_sequence(pool, nb, [&](std::size_t i, std::size_t) {
      std::fill(gbuf[i].begin(), gbuf[i].end(), 0.0f);
      losses[i] = body(i, batch[i], step, weight, std::span<float>(gbuf[i]));
    });
    const double clip = clip_factor(sum_gradients(gbuf, nb, g, pf), o.opt.clip_norm);
    optimizer_options sched = o.opt;
    sched.lr = o.lr;
    st.lr = learning_rate(sched, step, total);
    adamw_update(params, g, m, v, step + 1, st.lr, step_opt, clip, pf);
    double kl = 0, reg = 0, agree = 0;
    for (std::size_t i = 0; i < nb; ++i) {
      kl += losses[i].kl / static_cast<double>(batch_rows);
      reg += losses[i].regression / static_cast<double>(batch_rows);
      agree += static_cast<double>(losses[i].agree) / static_cast<double>(batch_rows);
    }
    st.positions_seen += batch_rows;
    avg_kl.add(kl);
    avg_reg.add(reg);
    avg_agree.add(agree);
    st.step = step + 1;
    st.elapsed = seconds_since(t0);
    if (budget.update(step, st.elapsed, total)) st.budget_limited = true;
    st.total_steps = total;
    st.kl = avg_kl.value();
    st.regression = avg_reg.value();
    st.agreement = avg_agree.value();
    st.positions_per_second = static_cast<double>(st.positions_seen) / std::max(1e-9, st.elapsed);
    st.eta = st.elapsed / static_cast<double>(step + 1) * static_cast<double>(total - step - 1);
    report(st, step + 1 == total);
  }
  st.elapsed = seconds_since(t0);
  return st;
}

//! Calls `f` at most every `interval` seconds, and always for the last step: a loop's progress.
template <class F>
class progress_throttle {
 public:
  progress_throttle(double interval, F f) : interval_(interval), f_(std::move(f)) {}
  void operator()(const distill_status& st, bool last) {
    if (!last && seconds_since(last_) < interval_) return;
    last_ = clock_type::now();
    f_(st);
  }

 private:
  double interval_;
  F f_;
  clock_type::time_point last_ = clock_type::now();
};

//! A recipe's result (`draft_fit_result`, `eagle_fit_result`) from the loop's last status; `res`
//! holds what the recipe set itself (`train_sequences`).
template <class Result>
Result fit_result(Result res, const distill_status& st) {
  res.steps = st.step;
  res.planned_steps = st.planned_steps;
  res.positions_seen = st.positions_seen;
  res.seconds = st.elapsed;
  res.final_kl = st.kl;
  res.final_agreement = st.agreement;
  if constexpr (requires { res.final_regression; }) res.final_regression = st.regression;
  res.budget_limited = st.budget_limited;
  return res;
}

//! The loop's `report`: `o.on_progress` with a `Progress` (`draft_progress`, `eagle_progress`)
//! every `o.progress_interval` seconds and at the last step.
template <class Progress, class Options>
auto progress_of(const Options& o) {
  return progress_throttle(o.progress_interval, [&o](const distill_status& s) {
    if (!o.on_progress) return;
    Progress pr;
    pr.step = s.step;
    pr.total_steps = s.total_steps;
    pr.kl = s.kl;
    if constexpr (requires { pr.regression; }) pr.regression = s.regression;
    pr.agreement = s.agreement;
    pr.lr = s.lr;
    pr.elapsed = s.elapsed;
    pr.positions_per_second = s.positions_per_second;
    pr.eta = s.eta;
    o.on_progress(pr);
  });
}

}  // namespace medusa_train::detail
