// SPDX-License-Identifier: Apache-2.0
#include <medusa_train/medusa2.hpp>

#include "common.hpp"

#include <medusa_llama/thread_pool.hpp>

#include <medusa/candidates.hpp>
#include <medusa/error.hpp>

#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>

namespace medusa_train {

namespace {

using detail::clock_type;
using detail::mix;
using detail::per_sequence;
using detail::seconds_since;

// First row of each sequence's teacher rows (one per position but the last), and the total last.
std::vector<std::size_t> teacher_rows(std::span<const backbone_sequence> seqs) {
  std::vector<std::size_t> first(seqs.size() + 1, 0);
  for (std::size_t i = 0; i < seqs.size(); ++i) first[i + 1] = first[i] + (seqs[i].tokens.empty() ? 0 : seqs[i].tokens.size() - 1);
  return first;
}

// log Σ exp(z) in double.
double log_sum_exp(const float* z, std::size_t V) {
  float mx = z[0];
  for (std::size_t v = 1; v < V; ++v) mx = std::max(mx, z[v]);
  double s = 0;
  for (std::size_t v = 0; v < V; ++v) s += std::exp(static_cast<double>(z[v] - mx));
  return static_cast<double>(mx) + std::log(s);
}

constexpr char teacher_magic[8] = {'M', 'D', 'T', 'E', 'A', 'C', 'H', '2'};

}  // namespace

// ---------------------------------------------------------------------------------------------
// sequences

std::vector<backbone_sequence> cache_sequences(const distill_cache& data, const prompt_set& prompts, const medusa_llama::tokenizer& tok,
                                               std::uint64_t seed, int prompt_min, int prompt_max) {
  std::vector<backbone_sequence> out;
  out.reserve(data.size());
  std::uint64_t index[2] = {0, 0};
  for (std::size_t r = 0; r < data.size(); ++r) {
    const auto& rec = data[r];
    const auto which = rec.which;
    const auto prompt = prompts.prompt(which, index[static_cast<int>(which)]++, seed, tok, prompt_min, prompt_max);
    if (prompt.size() != rec.prompt_len || rec.tokens.empty() || prompt.back() != rec.tokens[0])
      throw medusa::invalid_input("medusa2: cache record " + std::to_string(r) + " does not continue the prompt it was cut from "
                                  "(the cache was generated from other prompts or options)");
    backbone_sequence s;
    s.tokens.assign(prompt.begin(), prompt.end());
    s.tokens.insert(s.tokens.end(), rec.tokens.begin() + 1, rec.tokens.end());
    s.row0 = prompt.size() - 1;
    s.which = which;
    out.push_back(std::move(s));
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// teacher

teacher_table teacher_table::compute(const lora_model& m, std::span<const backbone_sequence> seqs, std::size_t k, int threads) {
  const auto V = static_cast<std::size_t>(m.base().config().vocab_size);
  if (k == 0 || k > V) throw medusa::invalid_input("medusa2: teacher top-k " + std::to_string(k) + " is outside [1, V = " + std::to_string(V) + "]");
  teacher_table t;
  t.k_ = k;
  t.first_ = teacher_rows(seqs);
  t.ids_.resize(t.first_.back() * k);
  t.logits_.resize(t.first_.back() * k);
  t.log_norm_.resize(t.first_.back());
  medusa_llama::thread_pool pool(std::max(1, threads));
  std::vector<sequence_state> states(static_cast<std::size_t>(pool.size()));
  std::vector<std::vector<float>> z(states.size());
  per_sequence(pool, seqs.size(), [&](std::size_t i, std::size_t tid) {
    const std::size_t n = seqs[i].tokens.size();
    if (n < 2) return;
    auto& st = states[tid];
    m.forward(seqs[i].tokens, st, {.train = false, .adapters = false});
    z[tid].resize((n - 1) * V);
    m.logits(st, 0, n - 1, z[tid].data());
    for (std::size_t p = 0; p + 1 < n; ++p) {
      const std::size_t row = t.first_[i] + p;
      const float* zr = z[tid].data() + p * V;
      const std::span<std::int32_t> ids(t.ids_.data() + row * k, k);
      medusa::top_k(std::span<const float>(zr, V), ids);  // best first, equal logits by ascending id
      for (std::size_t j = 0; j < k; ++j) t.logits_[row * k + j] = zr[ids[j]];
      t.log_norm_[row] = static_cast<float>(log_sum_exp(zr, V));
    }
  });
  return t;
}

backbone::teacher_row teacher_table::row(std::size_t seq, std::size_t pos) const {
  const std::size_t r = first_[seq] + pos;
  return {std::span<const std::int32_t>(ids_).subspan(r * k_, k_), std::span<const float>(logits_).subspan(r * k_, k_), log_norm_[r]};
}

void teacher_table::save(const std::filesystem::path& path) const {
  const auto tmp = detail::temp_beside(path);
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) throw medusa::io_error("cannot create " + tmp.string());
  const std::uint64_t head[3] = {k_, first_.size() - 1, first_.back()};
  bool ok = std::fwrite(teacher_magic, 1, 8, f) == 8 && std::fwrite(head, sizeof head, 1, f) == 1 &&
            std::fwrite(ids_.data(), sizeof(std::int32_t), ids_.size(), f) == ids_.size() &&
            std::fwrite(logits_.data(), sizeof(float), logits_.size(), f) == logits_.size() &&
            std::fwrite(log_norm_.data(), sizeof(float), log_norm_.size(), f) == log_norm_.size();
  ok = (std::fclose(f) == 0) && ok;
  std::error_code ec;
  if (!ok) {
    std::filesystem::remove(tmp, ec);
    throw medusa::io_error("cannot write " + tmp.string() + " (disk full?)");
  }
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::error_code ignored;
    std::filesystem::remove(tmp, ignored);
    throw medusa::io_error("cannot rename " + tmp.string() + ": " + ec.message());
  }
}

std::optional<teacher_table> teacher_table::load(const std::filesystem::path& path, std::span<const backbone_sequence> seqs, std::size_t k) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return std::nullopt;
  teacher_table t;
  t.k_ = k;
  t.first_ = teacher_rows(seqs);
  char magic[8];
  std::uint64_t head[3];
  const bool header = std::fread(magic, 1, 8, f) == 8 && std::fread(head, sizeof head, 1, f) == 1;
  if (!header || std::memcmp(magic, teacher_magic, 8) != 0 || head[0] != k || head[1] != seqs.size() || head[2] != t.first_.back()) {
    std::fclose(f);
    return std::nullopt;
  }
  t.ids_.resize(t.first_.back() * k);
  t.logits_.resize(t.ids_.size());
  t.log_norm_.resize(t.first_.back());
  const bool body = std::fread(t.ids_.data(), sizeof(std::int32_t), t.ids_.size(), f) == t.ids_.size() &&
                    std::fread(t.logits_.data(), sizeof(float), t.logits_.size(), f) == t.logits_.size() &&
                    std::fread(t.log_norm_.data(), sizeof(float), t.log_norm_.size(), f) == t.log_norm_.size();
  std::fclose(f);
  if (!body) throw medusa::io_error("teacher table " + path.string() + " is truncated");
  return t;
}

// ---------------------------------------------------------------------------------------------
// joint training

joint_result fit_joint(lora_model& lm, head_trainer& heads, std::span<const backbone_sequence> seqs, const teacher_table& teacher,
                       const joint_options& o) {
  const auto t0 = clock_type::now();
  const auto& cfg = lm.base().config();
  const std::size_t d = static_cast<std::size_t>(cfg.dim), V = static_cast<std::size_t>(cfg.vocab_size), K = heads.shape().K;
  if (!(o.heads_lr > 0) || !(o.backbone_lr > 0))
    throw medusa::invalid_input("medusa2: learning rates must be positive");
  if (!(o.backbone_lr < o.heads_lr))
    throw medusa::invalid_input("medusa2: the backbone learning rate (" + std::to_string(o.backbone_lr) + ") must be below the heads' (" +
                                std::to_string(o.heads_lr) + ")");
  if (heads.shape().d != d || heads.shape().V != V)
    throw medusa::invalid_input("medusa2: heads of d=" + std::to_string(heads.shape().d) + " V=" + std::to_string(heads.shape().V) +
                                " do not fit the model (d=" + std::to_string(d) + " V=" + std::to_string(V) + ")");
  if (o.batch_sequences == 0) throw medusa::invalid_input("medusa2: batch_sequences must be positive");
  if (!(o.heads_coefficient >= 0)) throw medusa::invalid_input("medusa2: the heads' loss coefficient must be >= 0");
  std::vector<std::size_t> order;
  for (std::size_t i = 0; i < seqs.size(); ++i)
    if (seqs[i].which == split::train && seqs[i].tokens.size() >= 2) order.push_back(i);
  joint_result res;
  res.train_sequences = order.size();
  if (order.empty()) throw medusa::invalid_input("medusa2: no training sequence");
  const std::size_t S = o.batch_sequences;
  res.planned_steps = std::max<std::size_t>(1, static_cast<std::size_t>(std::ceil(o.epochs * static_cast<double>(order.size()) / static_cast<double>(S))));
  std::size_t total = o.max_steps > 0 ? std::min(res.planned_steps, o.max_steps) : res.planned_steps;

  std::vector<float> hw(K);
  for (std::size_t k = 0; k < K; ++k)
    hw[k] = static_cast<float>(o.heads_coefficient * std::pow(static_cast<double>(o.decay), static_cast<double>(k)));
  const std::size_t P = lm.params().size();
  std::vector<float> m(P, 0.0f), v(P, 0.0f), g(P, 0.0f);
  std::vector<std::vector<float>> gbuf(S, std::vector<float>(P));
  std::vector<sequence_state> states(S);
  std::vector<std::vector<float>> dh(S), z(S);
  std::vector<double> seq_kl(S);
  std::vector<float> X, dX;
  std::vector<std::int32_t> targets;
  medusa_llama::thread_pool pool(heads.threads());
  auto pf = [&](std::size_t nb, const std::function<void(std::size_t)>& f) { heads.parallel_for(nb, f); };

  detail::shuffled_batches batches(std::move(order), S, o.seed ^ 0x3e5d05a2ull);
  std::size_t t_adam = 0;
  detail::training_meter meter(K);
  detail::moving_average avg_kl, avg_head;
  joint_progress pr;
  auto last_report = clock_type::now();
  detail::deadline_plan budget{o.deadline, o.reserve_seconds, 4, 10.0};
  for (std::size_t step = 0; step < total; ++step) {
    const auto batch = batches.next();
    const std::size_t nb = batch.size();
    std::size_t kl_rows = 0;
    for (std::size_t i = 0; i < nb; ++i) kl_rows += seqs[batch[i]].tokens.size() - 1;
    const float kl_weight = 1.0f / static_cast<float>(kl_rows);

    // A: forward with dropout, the KL term and its gradient at the classifier's input.
    per_sequence(pool, nb, [&](std::size_t i, std::size_t) {
      const auto& sq = seqs[batch[i]];
      const std::size_t n = sq.tokens.size();
      auto& st = states[i];
      lm.forward(sq.tokens, st, {.train = true, .adapters = true, .seed = mix(o.seed ^ mix(step * 1000003ull + i))});
      z[i].resize((n - 1) * V);
      lm.logits(st, 0, n - 1, z[i].data());
      double kl = 0;
      for (std::size_t p = 0; p + 1 < n; ++p) kl += backbone::kl_row(z[i].data() + p * V, V, teacher.row(batch[i], p), kl_weight);
      seq_kl[i] = kl;
      dh[i].assign(n * d, 0.0f);
      lm.classifier_backward(n - 1, z[i].data(), dh[i].data());
    });

    // B: the heads on every row with a head-0 target (t + 2 < n), all sequences in one batch.
    std::size_t R = 0;
    for (std::size_t i = 0; i < nb; ++i) {
      const auto& sq = seqs[batch[i]];
      if (sq.tokens.size() > sq.row0 + 2) R += sq.tokens.size() - 2 - sq.row0;
    }
    X.resize(R * d);
    dX.assign(R * d, 0.0f);
    targets.resize(R * K);
    for (std::size_t i = 0, r = 0; i < nb; ++i) {
      const auto& sq = seqs[batch[i]];
      const std::size_t n = sq.tokens.size();
      for (std::size_t t = sq.row0; t + 2 < n; ++t, ++r) {
        std::copy_n(states[i].hidden.data() + t * d, d, X.data() + r * d);
        for (std::size_t k = 0; k < K; ++k) targets[r * K + k] = t + k + 2 < n ? sq.tokens[t + k + 2] : ignore_index;
      }
    }
    openblas_set_num_threads(heads.threads());
    const auto hs = heads.accumulate(X.data(), R, targets.data(), hw, dX.data());
    for (std::size_t i = 0, r = 0; i < nb; ++i) {
      const auto& sq = seqs[batch[i]];
      for (std::size_t t = sq.row0; t + 2 < sq.tokens.size(); ++t, ++r)
        for (std::size_t j = 0; j < d; ++j) dh[i][t * d + j] += dX[r * d + j];
    }

    // C: back through the backbone, each sequence into its own buffer; summed in a fixed order.
    per_sequence(pool, nb, [&](std::size_t i, std::size_t) {
      std::fill(gbuf[i].begin(), gbuf[i].end(), 0.0f);
      lm.backward(states[i], dh[i].data(), gbuf[i].data());
    });
    const double sqn = heads.grad_squared_norm() + detail::sum_gradients(gbuf, nb, g, pf);
    const double clip = detail::clip_factor(sqn, o.opt.clip_norm);
    optimizer_options sched = o.opt;
    sched.lr = o.heads_lr;
    const double lr_heads = learning_rate(sched, step, total);
    const double lr_backbone = lr_heads * (o.backbone_lr / o.heads_lr);
    heads.apply(lr_heads, o.opt, clip);
    detail::adamw_update(lm.params(), g, m, v, ++t_adam, lr_backbone, o.opt, clip, pf);

    double kl = 0;
    for (std::size_t i = 0; i < nb; ++i) {
      kl += seq_kl[i] / static_cast<double>(kl_rows);
      res.positions_seen += seqs[batch[i]].tokens.size();
    }
    double head_loss = 0;
    for (std::size_t k = 0; k < K; ++k) head_loss += std::pow(static_cast<double>(o.decay), static_cast<double>(k)) * hs.head_loss[k];
    res.steps = step + 1;
    meter.add(kl + o.heads_coefficient * head_loss, hs);
    avg_kl.add(kl);
    avg_head.add(head_loss);
    const double elapsed = seconds_since(t0);
    if (budget.update(step, elapsed, total)) res.budget_limited = true;
    const bool last = step + 1 == total;
    if (o.on_progress && (last || seconds_since(last_report) >= o.progress_interval)) {
      last_report = clock_type::now();
      meter.report(pr, step, total, lr_heads, elapsed, static_cast<double>(res.positions_seen));
      pr.kl = avg_kl.value();
      pr.head_loss = avg_head.value();
      o.on_progress(pr);
    }
  }
  openblas_set_num_threads(heads.threads());
  res.seconds = seconds_since(t0);
  res.final_kl = avg_kl.value();
  res.final_head_loss = avg_head.value();
  return res;
}

// ---------------------------------------------------------------------------------------------
// quality

adapted_quality measure_quality(const lora_model& lm, std::span<const backbone_sequence> seqs, std::span<const std::vector<std::int32_t>> texts,
                                int threads) {
  const auto V = static_cast<std::size_t>(lm.base().config().vocab_size);
  medusa_llama::thread_pool pool(std::max(1, threads));
  const std::size_t T = static_cast<std::size_t>(pool.size());
  struct part {
    std::uint64_t positions = 0, agree = 0, text_tokens = 0;
    double kl = 0, nll_orig = 0, nll_adapted = 0;
  };
  std::vector<std::size_t> eval;
  for (std::size_t i = 0; i < seqs.size(); ++i)
    if (seqs[i].which == split::eval && seqs[i].tokens.size() >= 2) eval.push_back(i);
  // Per item (not per thread) so that the sums do not depend on scheduling.
  std::vector<part> parts(eval.size() + texts.size());
  std::vector<sequence_state> sa(T), so(T);
  std::vector<std::vector<float>> za(T), zo(T);
  per_sequence(pool, parts.size(), [&](std::size_t i, std::size_t tid) {
    const bool is_text = i >= eval.size();
    std::span<const std::int32_t> toks = is_text ? std::span<const std::int32_t>(texts[i - eval.size()]) : std::span<const std::int32_t>(seqs[eval[i]].tokens);
    const std::size_t n = toks.size();
    if (n < 2) return;
    lm.forward(toks, sa[tid], {.train = false, .adapters = true});
    lm.forward(toks, so[tid], {.train = false, .adapters = false});
    za[tid].resize((n - 1) * V);
    zo[tid].resize((n - 1) * V);
    lm.logits(sa[tid], 0, n - 1, za[tid].data());
    lm.logits(so[tid], 0, n - 1, zo[tid].data());
    part& p = parts[i];
    for (std::size_t t = 0; t + 1 < n; ++t) {
      const float* a = za[tid].data() + t * V;
      const float* b = zo[tid].data() + t * V;
      const double la = log_sum_exp(a, V), lb = log_sum_exp(b, V);
      if (is_text) {
        const auto y = static_cast<std::size_t>(toks[t + 1]);
        p.nll_adapted += la - a[y];
        p.nll_orig += lb - b[y];
        ++p.text_tokens;
      } else {
        double kl = 0;
        for (std::size_t v = 0; v < V; ++v) {
          const double lpb = b[v] - lb;
          kl += std::exp(lpb) * (lpb - (a[v] - la));
        }
        p.kl += kl;
        p.agree += medusa::argmax(std::span<const float>(a, V)) == medusa::argmax(std::span<const float>(b, V));
        ++p.positions;
      }
    }
  });
  openblas_set_num_threads(static_cast<int>(T));
  adapted_quality q;
  part sum;
  for (const auto& p : parts) {
    sum.positions += p.positions;
    sum.agree += p.agree;
    sum.kl += p.kl;
    sum.text_tokens += p.text_tokens;
    sum.nll_orig += p.nll_orig;
    sum.nll_adapted += p.nll_adapted;
  }
  q.positions = sum.positions;
  q.agreement = sum.positions ? static_cast<double>(sum.agree) / static_cast<double>(sum.positions) : 0;
  q.mean_kl = sum.positions ? sum.kl / static_cast<double>(sum.positions) : 0;
  q.text_tokens = sum.text_tokens;
  if (sum.text_tokens) {
    q.perplexity_original = std::exp(sum.nll_orig / static_cast<double>(sum.text_tokens));
    q.perplexity_adapted = std::exp(sum.nll_adapted / static_cast<double>(sum.text_tokens));
  }
  return q;
}

}  // namespace medusa_train
