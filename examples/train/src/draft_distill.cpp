// SPDX-License-Identifier: Apache-2.0
#include <medusa_train/draft_distill.hpp>

#include "common.hpp"

#include <medusa/candidates.hpp>
#include <medusa/error.hpp>

#include <algorithm>
#include <cmath>

namespace medusa_train {

draft_fit_result fit_draft(dense_model& draft, std::span<const backbone_sequence> seqs, const teacher_table& teacher,
                           const draft_fit_options& o) {
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
  std::vector<sequence_state> states(o.batch_sequences);
  std::vector<std::vector<float>> z(o.batch_sequences);
  const auto st = detail::distill_loop(
      draft.params(), std::move(order), o, o.opt.weight_decay, 0xd4af7ull, [&](std::size_t s) { return seqs[s].tokens.size() - 1; },
      [&](std::size_t i, std::size_t s, std::size_t, float weight, std::span<float> grad) {
        // Forward, the KL of every position but the last, back into this sequence's buffer.
        const auto& tokens = seqs[s].tokens;
        const std::size_t n = tokens.size();
        draft.forward(tokens, states[i]);
        z[i].resize((n - 1) * V);
        draft.logits(states[i], 0, n - 1, z[i].data());
        detail::sequence_loss loss;
        for (std::size_t p = 0; p + 1 < n; ++p) {
          float* zr = z[i].data() + p * V;
          const auto row = teacher.row(s, p);
          loss.agree += medusa::argmax(std::span<const float>(zr, V)) == row.ids[0];
          loss.kl += backbone::kl_row(zr, V, row, weight);
        }
        draft.backward(states[i], n - 1, z[i].data(), grad.data());
        return loss;
      },
      detail::progress_of<draft_progress>(o));
  return detail::fit_result(res, st);
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
