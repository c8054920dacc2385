// SPDX-License-Identifier: Apache-2.0
#include <medusa_train/eagle_distill.hpp>

#include "common.hpp"

#include <medusa/candidates.hpp>
#include <medusa/error.hpp>

#include <algorithm>
#include <cmath>

namespace medusa_train {


namespace detail {

//! mean_j SmoothL1(g_j − f_j) (β = 1); writes its gradient × `weight` into `dg` when not null.
inline double smooth_l1_row(const float* g, const float* f, std::size_t d, float weight, float* dg) {
  double loss = 0;
  for (std::size_t j = 0; j < d; ++j) {
    const float e = g[j] - f[j], a = std::fabs(e);
    loss += a < 1.0f ? 0.5 * static_cast<double>(e) * e : static_cast<double>(a) - 0.5;
    if (dg) dg[j] = std::clamp(e, -1.0f, 1.0f) * weight / static_cast<float>(d);
  }
  return loss / static_cast<double>(d);
}

//! From per-start chain lengths (hits in a row, capped at `max_depth`): acceptance by depth and
//! the expected tokens per step of chains of 1…max_depth drafts.
inline void chain_figures(const std::vector<std::uint64_t>& at_least, std::uint64_t starts, std::vector<double>& acceptance,
                          std::vector<double>& chain_tokens) {
  double tokens = 1;
  for (std::size_t k = 1; k < at_least.size(); ++k) {
    acceptance.push_back(at_least[k - 1] ? static_cast<double>(at_least[k]) / static_cast<double>(at_least[k - 1]) : 0.0);
    tokens += static_cast<double>(at_least[k]) / static_cast<double>(starts);
    chain_tokens.push_back(tokens);
  }
}

}  // namespace detail

feature_table feature_table::compute(const lora_model& m, std::span<const backbone_sequence> seqs, int threads) {
  feature_table t;
  t.d_ = static_cast<std::size_t>(m.base().config().dim);
  t.first_.assign(seqs.size() + 1, 0);
  for (std::size_t i = 0; i < seqs.size(); ++i) t.first_[i + 1] = t.first_[i] + (seqs[i].tokens.empty() ? 0 : seqs[i].tokens.size() - 1);
  t.rows_.resize(t.first_.back() * t.d_);
  medusa_llama::thread_pool pool(std::max(1, threads));
  std::vector<sequence_state> states(static_cast<std::size_t>(pool.size()));
  detail::per_sequence(pool, seqs.size(), [&](std::size_t i, std::size_t tid) {
    const std::size_t n = seqs[i].tokens.size();
    if (n < 2) return;
    m.forward(seqs[i].tokens, states[tid], {.train = false, .adapters = false});
    std::copy_n(states[tid].hidden.data(), (n - 1) * t.d_, t.rows_.data() + t.first_[i] * t.d_);
  });
  return t;
}

double feature_table::rms(std::span<const backbone_sequence> seqs) const {
  double sum = 0;
  std::uint64_t count = 0;
  for (std::size_t s = 0; s < seqs.size(); ++s) {
    if (seqs[s].which != split::train) continue;
    for (std::size_t j = first_[s] * d_; j < first_[s + 1] * d_; ++j) sum += static_cast<double>(rows_[j]) * rows_[j];
    count += (first_[s + 1] - first_[s]) * d_;
  }
  return count ? std::sqrt(sum / static_cast<double>(count)) : 0.0;
}

eagle_fit_result fit_eagle(eagle_model& em, std::span<const backbone_sequence> seqs, const feature_table& features, const teacher_table& teacher,
                           const eagle_fit_options& o) {
  const auto V = static_cast<std::size_t>(em.config().vocab_size), d = static_cast<std::size_t>(em.config().dim);
  if (!(o.lr > 0)) throw medusa::invalid_input("eagle: the learning rate must be positive");
  if (o.batch_sequences == 0) throw medusa::invalid_input("eagle: batch_sequences must be positive");
  if (!(o.reg >= 0) || !(o.noise >= 0)) throw medusa::invalid_input("eagle: the regression weight and the noise must be >= 0");
  if (teacher.k() > V) throw medusa::invalid_input("eagle: the teacher keeps " + std::to_string(teacher.k()) + " logits, the target has " +
                                                   std::to_string(V) + " tokens");
  if (features.dim() != d) throw medusa::invalid_input("eagle: features of width " + std::to_string(features.dim()) + " for a drafter of width " +
                                                       std::to_string(d));
  // Row i needs t_{i+2}: sequences of 3 tokens or more.
  std::vector<std::size_t> order;
  for (std::size_t i = 0; i < seqs.size(); ++i)
    if (seqs[i].which == split::train && seqs[i].tokens.size() >= 3) order.push_back(i);
  eagle_fit_result res;
  res.train_sequences = order.size();
  if (order.empty()) throw medusa::invalid_input("eagle: no training sequence");
  std::vector<eagle_state> states(o.batch_sequences);
  std::vector<std::vector<float>> z(o.batch_sequences), dg(o.batch_sequences);
  const auto st = detail::distill_loop(
      em.params(), std::move(order), o, o.opt.weight_decay, 0xea61eull, [&](std::size_t s) { return seqs[s].tokens.size() - 2; },
      [&](std::size_t i, std::size_t s, std::size_t step, float weight, std::span<float> grad) {
        const auto& tokens = seqs[s].tokens;
        const std::size_t rs = tokens.size() - 2;  // rows 0…n−3: (E t_{i+1}, f_i) → t_{i+2}, f_{i+1}
        const float* f = features.of(s);
        auto& st = states[i];
        const eagle_forward_options fo{static_cast<float>(o.noise), detail::mix(detail::mix(o.seed ^ 0x401ce) + step) ^ s};
        em.forward(std::span(tokens).subspan(1, rs), f, st, fo);
        z[i].resize(rs * V);
        dg[i].resize(rs * d);
        em.logits(st, 0, rs, z[i].data());
        const float reg_weight = static_cast<float>(o.reg) * weight;
        detail::sequence_loss loss;
        for (std::size_t r = 0; r < rs; ++r) {
          float* zr = z[i].data() + r * V;
          const auto row = teacher.row(s, r + 1);
          loss.agree += medusa::argmax(std::span<const float>(zr, V)) == row.ids[0];
          loss.kl += backbone::kl_row(zr, V, row, weight);
          loss.regression += detail::smooth_l1_row(st.stack.hidden.data() + r * d, f + (r + 1) * d, d, reg_weight, dg[i].data() + r * d);
        }
        em.backward(st, rs, z[i].data(), dg[i].data(), grad.data());
        return loss;
      },
      detail::progress_of<eagle_progress>(o));
  return detail::fit_result(res, st);
}

eagle_quality measure_eagle(const eagle_model& em, std::span<const backbone_sequence> seqs, const feature_table& features,
                            const teacher_table& teacher, int threads, std::size_t max_depth) {
  const auto V = static_cast<std::size_t>(em.config().vocab_size), d = static_cast<std::size_t>(em.config().dim);
  const auto kv = static_cast<std::size_t>(em.config().kv_dim());
  std::vector<std::size_t> eval;
  for (std::size_t i = 0; i < seqs.size(); ++i)
    if (seqs[i].which == split::eval && seqs[i].tokens.size() >= 3 && seqs[i].tokens.size() > seqs[i].row0 + 1) eval.push_back(i);
  medusa_llama::thread_pool pool(std::max(1, threads));
  const auto T = static_cast<std::size_t>(pool.size());
  std::vector<eagle_state> states(T);
  std::vector<std::vector<float>> z(T), gz(T);
  // Per sequence and start: drafts accepted in a row, autoregressive and teacher-forced.
  std::vector<std::vector<std::uint8_t>> run_ar(eval.size()), run_tf(eval.size());
  std::vector<double> reg(eval.size());
  detail::per_sequence(pool, eval.size(), [&](std::size_t e, std::size_t tid) {
    const std::size_t s = eval[e];
    const auto& tokens = seqs[s].tokens;
    const std::size_t n = tokens.size(), rs = n - 2;
    const float* f = features.of(s);
    auto& st = states[tid];
    em.forward(std::span(tokens).subspan(1, rs), f, st);
    z[tid].resize(rs * V);
    em.logits(st, 0, rs, z[tid].data());
    auto best = [&](std::size_t pos) { return teacher.row(s, pos).ids[0]; };
    // Row r predicts t_{r+2}: the target's choice at position r + 1.
    const std::size_t r0 = std::max<std::size_t>(seqs[s].row0, 1) - 1;
    std::vector<char> hit(rs);
    for (std::size_t r = 0; r < rs; ++r) hit[r] = medusa::argmax(std::span<const float>(z[tid].data() + r * V, V)) == best(r + 1);
    auto& ar = run_ar[e];
    auto& tf = run_tf[e];
    ar.assign(rs - r0, 0);
    tf.assign(rs - r0, 0);
    std::size_t run = 0;
    for (std::size_t r = rs; r-- > r0;) {
      run = hit[r] ? run + 1 : 0;
      tf[r - r0] = static_cast<std::uint8_t>(std::min(run, max_depth));
    }
    double rg = 0;
    for (std::size_t r = r0; r < rs; ++r) rg += detail::smooth_l1_row(st.stack.hidden.data() + r * d, f + (r + 1) * d, d, 0.0f, nullptr);
    reg[e] = rg;
    std::vector<float> g(d), g_next(d);
    gz[tid].resize(V);
    for (std::size_t r = r0; r < rs; ++r) {
      if (!hit[r]) continue;
      // Draft 1 is row r's; each next drafts from the previous token and predicted feature.
      eagle_chain chain{eagle_model::keys(st).first((r + 1) * kv), eagle_model::values(st).first((r + 1) * kv), {}, {}};
      std::int32_t token = best(r + 1);
      std::copy_n(st.stack.hidden.data() + r * d, d, g.data());
      std::size_t accepted = 1;
      while (accepted < max_depth && r + accepted + 1 <= n - 2) {
        em.extend(chain, token, g.data(), g_next.data(), gz[tid].data());
        const auto next = static_cast<std::int32_t>(medusa::argmax(std::span<const float>(gz[tid])));
        if (next != best(r + accepted + 1)) break;
        token = next;
        g.swap(g_next);
        ++accepted;
      }
      ar[r - r0] = static_cast<std::uint8_t>(accepted);
    }
  });
  eagle_quality q;
  std::vector<std::uint64_t> at_ar(max_depth + 1, 0), at_tf(max_depth + 1, 0);
  double reg_sum = 0;
  for (std::size_t e = 0; e < eval.size(); ++e) {
    reg_sum += reg[e];
    for (std::size_t i = 0; i < run_ar[e].size(); ++i) {
      ++q.positions;
      for (std::size_t k = 0; k <= run_ar[e][i]; ++k) ++at_ar[k];
      for (std::size_t k = 0; k <= run_tf[e][i]; ++k) ++at_tf[k];
    }
  }
  if (q.positions == 0) return q;
  q.agreement = static_cast<double>(at_ar[1]) / static_cast<double>(q.positions);
  q.regression = reg_sum / static_cast<double>(q.positions);
  std::vector<double> unused;
  detail::chain_figures(at_ar, q.positions, q.acceptance, q.chain_tokens);
  detail::chain_figures(at_tf, q.positions, unused, q.chain_tokens_teacher_forced);
  return q;
}

}  // namespace medusa_train
