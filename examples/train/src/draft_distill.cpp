// SPDX-License-Identifier: Apache-2.0
#include <medusa_train/draft_distill.hpp>

#include "common.hpp"

#include <medusa/candidates.hpp>
#include <medusa/error.hpp>

#include <algorithm>
#include <cmath>

namespace medusa_train {

using detail::clock_type;
using detail::seconds_since;

draft_fit_result fit_draft(dense_model& draft, std::span<const backbone_sequence> seqs, const teacher_table& teacher,
                           const draft_fit_options& o) {
  const auto t0 = clock_type::now();
  const auto V = static_cast<std::size_t>(draft.config().vocab_size);
  if (!(o.lr > 0)) throw medusa::invalid_input("draft: the learning rate must be positive");
  if (o.batch_sequences == 0) throw medusa::invalid_input("draft: batch_sequences must be positive");
  if (teacher.k() > V) throw medusa::invalid_input("draft: the teacher keeps " + std::to_string(teacher.k()) + " logits, the draft has " +
                                                   std::to_string(V) + " tokens");
  std::vector<std::size_t> order;
  for (std::size_t i = 0; i < seqs.size(); ++i)
    if (seqs[i].which == split::train && seqs[i].tokens.size() >= 2) order.push_back(i);
  draft_fit_result res;
  res.train_sequences = order.size();
  if (order.empty()) throw medusa::invalid_input("draft: no training sequence");
  for (std::size_t i : order)
    for (std::int32_t t : seqs[i].tokens)
      if (t < 0 || static_cast<std::size_t>(t) >= V)
        throw medusa::invalid_input("draft: token " + std::to_string(t) + " of the data is outside the draft's vocabulary of " + std::to_string(V));
  const std::size_t S = o.batch_sequences;
  res.planned_steps = std::max<std::size_t>(1, static_cast<std::size_t>(std::ceil(o.epochs * static_cast<double>(order.size()) / static_cast<double>(S))));
  std::size_t total = o.max_steps > 0 ? std::min(res.planned_steps, o.max_steps) : res.planned_steps;

  const std::size_t P = draft.params().size();
  std::vector<float> m(P, 0.0f), v(P, 0.0f), g(P, 0.0f);
  std::vector<std::vector<float>> gbuf(S, std::vector<float>(P));
  std::vector<sequence_state> states(S);
  std::vector<std::vector<float>> z(S);
  std::vector<double> seq_kl(S);
  std::vector<std::size_t> seq_agree(S);
  medusa_llama::thread_pool pool(std::max(1, o.threads));
  auto pf = [&](std::size_t nb, const std::function<void(std::size_t)>& f) {
    pool.run(static_cast<int>(nb), [&](int c, int) { f(static_cast<std::size_t>(c)); });
  };

  detail::shuffled_batches batches(std::move(order), S, o.seed ^ 0xd4af7ull);
  detail::moving_average avg_kl, avg_agree;
  auto last_report = clock_type::now();
  detail::deadline_plan budget{o.deadline, o.reserve_seconds, 4, 10.0};
  for (std::size_t step = 0; step < total; ++step) {
    const auto batch = batches.next();
    const std::size_t nb = batch.size();
    std::size_t rows = 0;
    for (std::size_t i = 0; i < nb; ++i) rows += seqs[batch[i]].tokens.size() - 1;
    const float weight = 1.0f / static_cast<float>(rows);

    // Each sequence: forward, the KL of every position but the last, back into its own buffer.
    detail::per_sequence(pool, nb, [&](std::size_t i, std::size_t) {
      const std::size_t s = batch[i];
      const auto& tokens = seqs[s].tokens;
      const std::size_t n = tokens.size();
      auto& st = states[i];
      draft.forward(tokens, st);
      z[i].resize((n - 1) * V);
      draft.logits(st, 0, n - 1, z[i].data());
      double kl = 0;
      std::size_t agree = 0;
      for (std::size_t p = 0; p + 1 < n; ++p) {
        float* zr = z[i].data() + p * V;
        const auto row = teacher.row(s, p);
        agree += medusa::argmax(std::span<const float>(zr, V)) == row.ids[0];
        kl += backbone::kl_row(zr, V, row, weight);
      }
      seq_kl[i] = kl;
      seq_agree[i] = agree;
      std::fill(gbuf[i].begin(), gbuf[i].end(), 0.0f);
      draft.backward(st, n - 1, z[i].data(), gbuf[i].data());
    });
    const double clip = detail::clip_factor(detail::sum_gradients(gbuf, nb, g, pf), o.opt.clip_norm);
    optimizer_options sched = o.opt;
    sched.lr = o.lr;
    const double lr = learning_rate(sched, step, total);
    detail::adamw_update(draft.params(), g, m, v, step + 1, lr, o.opt, clip, pf);

    double kl = 0, agree = 0;
    for (std::size_t i = 0; i < nb; ++i) {
      kl += seq_kl[i] / static_cast<double>(rows);
      agree += static_cast<double>(seq_agree[i]) / static_cast<double>(rows);
      res.positions_seen += seqs[batch[i]].tokens.size();
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

draft_quality measure_draft(const dense_model& draft, std::span<const backbone_sequence> seqs, const teacher_table& teacher,
                            int threads, std::size_t max_depth) {
  const auto V = static_cast<std::size_t>(draft.config().vocab_size);
  std::vector<std::size_t> eval;
  for (std::size_t i = 0; i < seqs.size(); ++i)
    if (seqs[i].which == split::eval && seqs[i].tokens.size() > seqs[i].row0 + 1) eval.push_back(i);
  medusa_llama::thread_pool pool(std::max(1, threads));
  std::vector<sequence_state> states(static_cast<std::size_t>(pool.size()));
  std::vector<std::vector<float>> z(states.size());
  // Per sequence: whether the draft hits each continuation position.
  std::vector<std::vector<char>> hits(eval.size());
  detail::per_sequence(pool, eval.size(), [&](std::size_t e, std::size_t tid) {
    const auto& sq = seqs[eval[e]];
    const std::size_t n = sq.tokens.size(), rows = n - 1 - sq.row0;
    draft.forward(sq.tokens, states[tid]);
    z[tid].resize(rows * V);
    draft.logits(states[tid], sq.row0, rows, z[tid].data());
    hits[e].resize(rows);
    for (std::size_t r = 0; r < rows; ++r)
      hits[e][r] = medusa::argmax(std::span<const float>(z[tid].data() + r * V, V)) == teacher.row(eval[e], sq.row0 + r).ids[0];
  });
  return draft_quality_of(hits, max_depth);
}

draft_quality draft_quality_of(const std::vector<std::vector<char>>& hits, std::size_t max_depth) {
  draft_quality q;
  std::vector<std::uint64_t> at_least(max_depth + 1, 0);  // positions whose run of hits is ≥ k
  std::uint64_t agree = 0;
  for (const auto& h : hits) {
    std::size_t run = 0;  // hits from position r on, computed backwards
    for (std::size_t r = h.size(); r-- > 0;) {
      run = h[r] ? run + 1 : 0;
      agree += h[r] != 0;
      ++q.positions;
      for (std::size_t k = 0; k <= std::min(run, max_depth); ++k) ++at_least[k];
    }
  }
  if (q.positions == 0) return q;
  q.agreement = static_cast<double>(agree) / static_cast<double>(q.positions);
  double tokens = 1;
  for (std::size_t k = 1; k <= max_depth; ++k) {
    q.acceptance.push_back(at_least[k - 1] ? static_cast<double>(at_least[k]) / static_cast<double>(at_least[k - 1]) : 0.0);
    tokens += static_cast<double>(at_least[k]) / static_cast<double>(q.positions);
    q.chain_tokens.push_back(tokens);
  }
  return q;
}

}  // namespace medusa_train
