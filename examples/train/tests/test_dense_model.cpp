// SPDX-License-Identifier: Apache-2.0
// The draft model trainer (medusa_train/dense_model.hpp, draft_distill.hpp): the dense model
// computes the engine's logits, its backward equals finite differences for every kind of weight,
// distillation brings a draft towards its teacher, and chain acceptance is counted from runs of hits.
#include <medusa_train/draft_distill.hpp>

#include <medusa_llama/engine.hpp>

#include <doctest/doctest.h>

#include "stack_helpers.hpp"

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

using namespace medusa_train;

namespace {

using stack_test::engine_logits;
using stack_test::random_tokens;
using stack_test::relative_diff;

medusa_llama::model_config tiny_config(medusa_llama::rope_style rope, int dim = 32, int layers = 2) {
  medusa_llama::model_config c;
  c.dim = dim;
  c.hidden_dim = dim + dim / 2;
  c.n_layers = layers;
  c.n_heads = 4;
  c.n_kv_heads = 4;
  c.vocab_size = 53;
  c.seq_len = 64;
  c.rope = rope;
  return c;
}

std::vector<float> dense_logits(const dense_model& dm, const std::vector<std::int32_t>& tokens) {
  sequence_state st;
  dm.forward(tokens, st);
  std::vector<float> z(tokens.size() * static_cast<std::size_t>(dm.config().vocab_size));
  dm.logits(st, 0, tokens.size(), z.data());
  return z;
}

}  // namespace

TEST_CASE("a dense model computes what the engine computes from its weights, and copies a model exactly") {
  for (auto rope : {medusa_llama::rope_style::adjacent_pairs, medusa_llama::rope_style::split_halves}) {
    const dense_model dm(tiny_config(rope), 3);
    const auto tokens = random_tokens(41, 53, 5);
    const auto ours = dense_logits(dm, tokens);
    INFO("rope " << static_cast<int>(rope));
    CHECK(relative_diff(ours, engine_logits(dm.to_model(), tokens)) < 2e-5);
    // A copy of a model has its weights and its logits.
    const auto m = medusa_llama::model::random(tiny_config(rope), 9, 0.2f);
    const dense_model copy(m);
    CHECK(relative_diff(dense_logits(copy, tokens), engine_logits(m, tokens)) < 2e-5);
    // Fresh weights are small and seeded: another seed, other logits.
    CHECK(relative_diff(dense_logits(dense_model(tiny_config(rope), 4), tokens), ours) > 1e-2);
  }
}

TEST_CASE("the dense model's backward matches finite differences for every kind of weight") {
  const auto m = medusa_llama::model::random(tiny_config(medusa_llama::rope_style::adjacent_pairs), 13, 0.3f);
  dense_model dm(m);
  const auto tokens = random_tokens(17, 53, 7);
  const std::size_t n = tokens.size(), V = 53, rows = n - 2;
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<float> w(rows * V);  // L = Σ w ⊙ logits of the first `rows` rows
  for (float& x : w) x = u(rng);
  auto loss = [&] {
    const auto z = dense_logits(dm, tokens);
    double s = 0;
    for (std::size_t i = 0; i < rows * V; ++i) s += static_cast<double>(w[i]) * z[i];
    return s;
  };
  sequence_state st;
  dm.forward(tokens, st);
  std::vector<float> grads(dm.params().size(), 0.0f);
  dm.backward(st, rows, w.data(), grads.data());
  // The largest gradient in each stretch of the flat layout: the embedding (classifier and input),
  // each block's norms and projections, the final norm.
  const auto& c = dm.config();
  const std::size_t d = 32, hid = 48, emb = V * d;
  std::vector<std::pair<std::size_t, std::size_t>> stretches{{0, emb}};
  std::size_t at = emb;
  for (int l = 0; l < c.n_layers; ++l)
    for (std::size_t size : {d, d * d, d * d, d * d, d * d, d, hid * d, d * hid, hid * d}) {
      stretches.emplace_back(at, at + size);
      at += size;
    }
  stretches.emplace_back(at, at + d);
  REQUIRE(at + d == dm.params().size());
  double worst = 0;
  for (auto [b0, b1] : stretches) {
    std::size_t best = b0;
    for (std::size_t i = b0; i < b1; ++i)
      if (std::fabs(grads[i]) > std::fabs(grads[best])) best = i;
    const float keep = dm.params()[best], h = 1e-2f;
    dm.params()[best] = keep + h;
    const double up = loss();
    dm.params()[best] = keep - h;
    const double down = loss();
    dm.params()[best] = keep;
    const double numeric = (up - down) / (2.0 * h);
    const double rel = std::fabs(numeric - grads[best]) / std::max(1e-3, std::fabs(numeric));
    INFO("parameter " << best << " (stretch from " << b0 << "): numeric " << numeric << " analytic " << grads[best]);
    CHECK(std::fabs(numeric) > 1e-3);  // a coordinate that matters
    CHECK(rel < 2e-2);
    worst = std::max(worst, rel);
  }
  MESSAGE("largest relative difference " << worst);
}

TEST_CASE("distillation brings a small draft towards its teacher, and chain acceptance follows the runs of hits") {
  // The teacher: a random model's own greedy continuations, so that the draft has something learnable.
  const auto target = medusa_llama::model::random(tiny_config(medusa_llama::rope_style::adjacent_pairs, 32, 2), 21, 1.0f);
  std::vector<backbone_sequence> seqs;
  {
    for (unsigned s = 0; s < 48; ++s) {
      backbone_sequence sq;
      sq.tokens = random_tokens(4, 53, 100 + s);
      sq.row0 = 3;
      sq.which = s % 8 == 0 ? split::eval : split::train;
      while (sq.tokens.size() < 40) {
        const auto z = engine_logits(target, sq.tokens);
        const std::span<const float> last(z.data() + (sq.tokens.size() - 1) * 53, 53);
        sq.tokens.push_back(static_cast<std::int32_t>(medusa::argmax(last)));
      }
      seqs.push_back(std::move(sq));
    }
  }
  const lora_model original(target, {.rank = 1, .alpha = 1, .dropout = 0}, 0);
  const auto teacher = teacher_table::compute(original, seqs, 8, 2);
  dense_model draft(tiny_config(medusa_llama::rope_style::adjacent_pairs, 32, 1), 5);
  // The fit is judged on the training sequences themselves (a random target's text generalises
  // little from 42 sequences): the same sequences, all marked held out for `measure_draft`.
  auto scored = seqs;
  for (auto& sq : scored) sq.which = split::eval;
  const auto before = measure_draft(draft, scored, teacher, 2, 4);
  draft_fit_options fo;
  fo.lr = 1e-2;
  fo.epochs = 60;
  fo.batch_sequences = 6;
  fo.threads = 2;
  std::vector<double> kls;
  fo.progress_interval = 0;
  fo.on_progress = [&](const draft_progress& p) { kls.push_back(p.kl); };
  const auto r = fit_draft(draft, seqs, teacher, fo);
  const auto after = measure_draft(draft, scored, teacher, 2, 4);
  REQUIRE(kls.size() == r.steps);
  CHECK(r.train_sequences == 42);
  CHECK(kls.back() < 0.6 * kls.front());
  CHECK(after.agreement > before.agreement + 0.1);
  MESSAGE("KL " << kls.front() << " -> " << kls.back() << ", agreement " << before.agreement << " -> " << after.agreement);
  // Chain figures: 48 sequences × 36 continuation positions; acceptance by depth and tokens per step agree.
  CHECK(after.positions == 48 * 36);
  CHECK(measure_draft(draft, seqs, teacher, 1, 4).positions == 6 * 36);  // the held-out split alone
  REQUIRE(after.acceptance.size() == 4);
  REQUIRE(after.chain_tokens.size() == 4);
  CHECK(after.acceptance[0] == doctest::Approx(after.agreement));
  double p = 1, tokens = 1;
  for (std::size_t k = 0; k < 4; ++k) {
    p *= after.acceptance[k];
    tokens += p;
    CHECK(after.chain_tokens[k] == doctest::Approx(tokens));
  }
  // The trained weights decode in the engine as they scored here.
  const auto& sq = seqs[0];
  CHECK(relative_diff(dense_logits(draft, sq.tokens), engine_logits(draft.to_model(), sq.tokens)) < 2e-5);
}

TEST_CASE("bad draft training input is refused with a message naming it") {
  dense_model dm(tiny_config(medusa_llama::rope_style::adjacent_pairs), 1);
  sequence_state st;
  CHECK_THROWS_WITH_AS(dm.forward(std::vector<std::int32_t>(65, 1), st), doctest::Contains("does not fit the context of 64"), medusa::invalid_input);
  CHECK_THROWS_WITH_AS(dm.forward(std::vector<std::int32_t>{1, 53}, st), doctest::Contains("token 53"), medusa::invalid_input);
  auto separate = tiny_config(medusa_llama::rope_style::adjacent_pairs);
  separate.shared_classifier = false;
  CHECK_THROWS_AS(dense_model(separate, 1), medusa::invalid_input);
  CHECK_THROWS_AS(dense_model(medusa_llama::model::random(separate, 2, 0.1f)), medusa::invalid_input);
  auto odd = tiny_config(medusa_llama::rope_style::adjacent_pairs);
  odd.n_heads = 5;  // 32 is not divisible by 5
  CHECK_THROWS_AS(dense_model(odd, 1), medusa_llama::load_error);
  const std::vector<backbone_sequence> none;
  const auto target = medusa_llama::model::random(tiny_config(medusa_llama::rope_style::adjacent_pairs), 3, 0.2f);
  std::vector<backbone_sequence> held_out_only{{random_tokens(8, 53, 1), 3, split::eval}};
  const auto teacher = teacher_table::compute(lora_model(target, {.rank = 1, .alpha = 1, .dropout = 0}, 0), held_out_only, 4, 1);
  CHECK_THROWS_WITH_AS(fit_draft(dm, held_out_only, teacher, {}), doctest::Contains("no training sequence"), medusa::invalid_input);
  draft_fit_options zero;
  zero.lr = 0;
  CHECK_THROWS_AS(fit_draft(dm, held_out_only, teacher, zero), medusa::invalid_input);
}
