// SPDX-License-Identifier: Apache-2.0
#include <medusa_train/exit_distill.hpp>
#include <medusa_train/head_math.hpp>

#include "common.hpp"

#include <medusa/candidates.hpp>
#include <medusa/error.hpp>

#include <algorithm>
#include <cmath>

namespace medusa_train {

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
  const float* C = target.classifier();
  std::vector<std::vector<float>> y(o.batch_sequences), z(o.batch_sequences), dy(o.batch_sequences);
  // No weight decay: it would pull W from the identity to zero.
  const auto st = detail::distill_loop(
      w, std::move(order), o, 0.0, 0xe817ull, [&](std::size_t s) { return seqs[s].tokens.size() - 1; },
      [&](std::size_t i, std::size_t s, std::size_t, float weight, std::span<float> grad) {
        // Logits of the sequence's positions, the KL's gradient in place, then dW = (Cᵀ dz) xᵀ.
        const std::size_t n = seqs[s].tokens.size() - 1;
        const float* x = states.of(s);
        exit_logits(w, C, V, d, x, n, y[i], z[i]);
        detail::sequence_loss loss;
        for (std::size_t p = 0; p < n; ++p) {
          float* zr = z[i].data() + p * V;
          const auto row = teacher.row(s, p);
          loss.agree += medusa::argmax(std::span<const float>(zr, V)) == row.ids[0];
          loss.kl += backbone::kl_row(zr, V, row, weight);
        }
        dy[i].resize(n * d);
        detail::blas_gemm(false, false, n, d, V, 1.0f, z[i].data(), V, C, d, 0.0f, dy[i].data(), d);
        detail::blas_gemm(true, false, d, d, n, 1.0f, dy[i].data(), d, x, d, 0.0f, grad.data(), d);
        return loss;
      },
      detail::progress_of<draft_progress>(o));
  return detail::fit_result(res, st);
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
