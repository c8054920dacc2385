// SPDX-License-Identifier: Apache-2.0
#include <medusa_train/exit_distill.hpp>
#include <medusa_train/head_math.hpp>

#include "common.hpp"

#include <medusa/candidates.hpp>
#include <medusa/error.hpp>

#include <algorithm>
#include <cmath>

namespace medusa_train {

using detail::clock_type;
using detail::seconds_since;

namespace {

// z = C (W x) for `rows` states x ([rows][d]) into z ([rows][V]); y = W x kept for the backward.
void exit_logits(std::span<const float> w, const float* C, std::size_t V, std::size_t d, const float* x, std::size_t rows,
                 std::vector<float>& y, std::vector<float>& z) {
  y.resize(rows * d);
  z.resize(rows * V);
  detail::blas_gemm(false, true, rows, d, d, 1.0f, x, d, w.data(), d, 0.0f, y.data(), d);
  detail::blas_gemm(false, true, rows, V, d, 1.0f, y.data(), d, C, d, 0.0f, z.data(), V);
}

void check_shapes(std::size_t w_size, const medusa_llama::model& target, const feature_table& states) {
  const auto d = static_cast<std::size_t>(target.config().dim);
  if (w_size != d * d)
    throw medusa::invalid_input("exit: " + std::to_string(w_size) + " weights for a projection of width " + std::to_string(d));
  if (states.dim() != d)
    throw medusa::invalid_input("exit: states of width " + std::to_string(states.dim()) + " for a target of width " + std::to_string(d));
}

}  // namespace

std::vector<float> identity_exit(int dim) {
  const auto d = static_cast<std::size_t>(dim);
  std::vector<float> w(d * d, 0.0f);
  for (std::size_t i = 0; i < d; ++i) w[i * d + i] = 1.0f;
  return w;
}

draft_fit_result fit_exit(std::vector<float>& w, const medusa_llama::model& target, const feature_table& states,
                          std::span<const backbone_sequence> seqs, const teacher_table& teacher, const draft_fit_options& o) {
  const auto t0 = clock_type::now();
  const auto V = static_cast<std::size_t>(target.config().vocab_size), d = static_cast<std::size_t>(target.config().dim);
  check_shapes(w.size(), target, states);
  if (!(o.lr > 0)) throw medusa::invalid_input("exit: the learning rate must be positive");
  if (o.batch_sequences == 0) throw medusa::invalid_input("exit: batch_sequences must be positive");
  if (teacher.k() > V)
    throw medusa::invalid_input("exit: the teacher keeps " + std::to_string(teacher.k()) + " logits, the target has " + std::to_string(V) + " tokens");
  std::vector<std::size_t> order;
  for (std::size_t i = 0; i < seqs.size(); ++i)
    if (seqs[i].which == split::train && seqs[i].tokens.size() >= 2) order.push_back(i);
  draft_fit_result res;
  res.train_sequences = order.size();
  if (order.empty()) throw medusa::invalid_input("exit: no training sequence");
  const std::size_t S = o.batch_sequences;
  res.planned_steps =
      std::max<std::size_t>(1, static_cast<std::size_t>(std::ceil(o.epochs * static_cast<double>(order.size()) / static_cast<double>(S))));
  std::size_t total = o.max_steps > 0 ? std::min(res.planned_steps, o.max_steps) : res.planned_steps;

  const float* C = target.classifier();
  const std::size_t P = w.size();
  std::vector<float> m(P, 0.0f), v(P, 0.0f), g(P, 0.0f);
  std::vector<std::vector<float>> gbuf(S, std::vector<float>(P)), y(S), z(S), dy(S);
  std::vector<double> seq_kl(S);
  std::vector<std::size_t> seq_agree(S);
  medusa_llama::thread_pool pool(std::max(1, o.threads));
  auto pf = [&](std::size_t nb, const std::function<void(std::size_t)>& f) {
    pool.run(static_cast<int>(nb), [&](int c, int) { f(static_cast<std::size_t>(c)); });
  };
  optimizer_options no_decay = o.opt;
  no_decay.weight_decay = 0.0;

  detail::shuffled_batches batches(std::move(order), S, o.seed ^ 0xe817ull);
  detail::moving_average avg_kl, avg_agree;
  auto last_report = clock_type::now();
  detail::deadline_plan budget{o.deadline, o.reserve_seconds, 4, 10.0};
  for (std::size_t step = 0; step < total; ++step) {
    const auto batch = batches.next();
    const std::size_t nb = batch.size();
    std::size_t rows = 0;
    for (std::size_t i = 0; i < nb; ++i) rows += seqs[batch[i]].tokens.size() - 1;
    const float weight = 1.0f / static_cast<float>(rows);
    // Each sequence: logits of its positions, the KL's gradient in place, then dW = (Cᵀ dz) xᵀ.
    detail::per_sequence(pool, nb, [&](std::size_t i, std::size_t) {
      const std::size_t s = batch[i], n = seqs[s].tokens.size() - 1;
      const float* x = states.of(s);
      exit_logits(w, C, V, d, x, n, y[i], z[i]);
      double kl = 0;
      std::size_t agree = 0;
      for (std::size_t p = 0; p < n; ++p) {
        float* zr = z[i].data() + p * V;
        const auto row = teacher.row(s, p);
        agree += medusa::argmax(std::span<const float>(zr, V)) == row.ids[0];
        kl += backbone::kl_row(zr, V, row, weight);
      }
      seq_kl[i] = kl;
      seq_agree[i] = agree;
      dy[i].resize(n * d);
      detail::blas_gemm(false, false, n, d, V, 1.0f, z[i].data(), V, C, d, 0.0f, dy[i].data(), d);
      detail::blas_gemm(true, false, d, d, n, 1.0f, dy[i].data(), d, x, d, 0.0f, gbuf[i].data(), d);
    });
    const double clip = detail::clip_factor(detail::sum_gradients(gbuf, nb, g, pf), o.opt.clip_norm);
    optimizer_options sched = o.opt;
    sched.lr = o.lr;
    const double lr = learning_rate(sched, step, total);
    detail::adamw_update(w, g, m, v, step + 1, lr, no_decay, clip, pf);

    double kl = 0, agree = 0;
    for (std::size_t i = 0; i < nb; ++i) {
      kl += seq_kl[i] / static_cast<double>(rows);
      agree += static_cast<double>(seq_agree[i]) / static_cast<double>(rows);
      res.positions_seen += seqs[batch[i]].tokens.size() - 1;
    }
    avg_kl.add(kl);
    avg_agree.add(agree);
    res.steps = step + 1;
    const double elapsed = seconds_since(t0);
    if (budget.update(step, elapsed, total)) res.budget_limited = true;
    const bool last = step + 1 == total;
    if (o.on_progress && (last || seconds_since(last_report) >= o.progress_interval)) {
      last_report = clock_type::now();
      draft_progress pr;
      pr.step = step + 1;
      pr.total_steps = total;
      pr.kl = avg_kl.value();
      pr.agreement = avg_agree.value();
      pr.lr = lr;
      pr.elapsed = elapsed;
      pr.positions_per_second = static_cast<double>(res.positions_seen) / std::max(1e-9, elapsed);
      pr.eta = elapsed / static_cast<double>(step + 1) * static_cast<double>(total - step - 1);
      o.on_progress(pr);
    }
  }
  res.seconds = seconds_since(t0);
  res.final_kl = avg_kl.value();
  res.final_agreement = avg_agree.value();
  return res;
}

draft_quality measure_exit(std::span<const float> w, const medusa_llama::model& target, const feature_table& states,
                           std::span<const backbone_sequence> seqs, const teacher_table& teacher, int threads, std::size_t max_depth) {
  check_shapes(w.size(), target, states);
  const auto V = static_cast<std::size_t>(target.config().vocab_size), d = static_cast<std::size_t>(target.config().dim);
  std::vector<std::size_t> eval;
  for (std::size_t i = 0; i < seqs.size(); ++i)
    if (seqs[i].which == split::eval && seqs[i].tokens.size() > seqs[i].row0 + 1) eval.push_back(i);
  medusa_llama::thread_pool pool(std::max(1, threads));
  std::vector<std::vector<float>> y(static_cast<std::size_t>(pool.size())), z(y.size());
  std::vector<std::vector<char>> hits(eval.size());
  detail::per_sequence(pool, eval.size(), [&](std::size_t e, std::size_t tid) {
    const auto& sq = seqs[eval[e]];
    const std::size_t rows = sq.tokens.size() - 1 - sq.row0;
    exit_logits(w, target.classifier(), V, d, states.of(eval[e]) + sq.row0 * d, rows, y[tid], z[tid]);
    hits[e].resize(rows);
    for (std::size_t r = 0; r < rows; ++r)
      hits[e][r] = medusa::argmax(std::span<const float>(z[tid].data() + r * V, V)) == teacher.row(eval[e], sq.row0 + r).ids[0];
  });
  return draft_quality_of(hits, max_depth);
}

}  // namespace medusa_train
