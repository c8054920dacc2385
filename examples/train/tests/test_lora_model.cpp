// SPDX-License-Identifier: Apache-2.0
// The LoRA-adapted backbone of Medusa-2 (medusa_train/lora_model.hpp): its forward equals the
// engine's, its backward equals finite differences through the whole stack, and the merged model
// computes what the adapters compute.
#include <medusa_train/lora_model.hpp>

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

medusa_llama::model_config tiny_config(medusa_llama::rope_style rope, bool shared) {
  medusa_llama::model_config c;
  c.dim = 32;
  c.hidden_dim = 48;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;  // GQA
  c.vocab_size = 53;
  c.seq_len = 40;
  c.rope = rope;
  c.shared_classifier = shared;
  return c;
}

// Every B random (a fresh adapter has B = 0 and computes the base model exactly).
void randomize_b(lora_model& lm, float scale, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-scale, scale);
  const auto& c = lm.base().config();
  for (std::size_t l = 0; l < static_cast<std::size_t>(c.n_layers); ++l)
    for (int p = 0; p < static_cast<int>(projections_per_layer); ++p) {
      const auto ll = lm.adapter(l, static_cast<projection>(p));
      float* B = lm.params().data() + lm.offset(l, static_cast<projection>(p)) + ll.rank * ll.in;
      for (std::size_t i = 0; i < ll.out * ll.rank; ++i) B[i] = u(rng);
    }
}

std::vector<float> all_logits(const lora_model& lm, const std::vector<std::int32_t>& tokens, const forward_options& fo) {
  sequence_state st;
  lm.forward(tokens, st, fo);
  std::vector<float> z(tokens.size() * static_cast<std::size_t>(lm.base().config().vocab_size));
  lm.logits(st, 0, tokens.size(), z.data());
  return z;
}

}  // namespace

TEST_CASE("a fresh adapter computes the engine's logits (both RoPE pairings, GQA, tied and separate classifiers)") {
  for (auto rope : {medusa_llama::rope_style::adjacent_pairs, medusa_llama::rope_style::split_halves})
    for (bool shared : {true, false}) {
      const auto m = medusa_llama::model::random(tiny_config(rope, shared), 11, 0.2f);
      const lora_model lm(m, {.rank = 4, .alpha = 8, .dropout = 0.0}, 3);
      const auto tokens = random_tokens(37, 53, 5);
      const auto ours = all_logits(lm, tokens, {.train = false, .adapters = true});
      const auto engine = engine_logits(m, tokens);
      INFO("rope " << static_cast<int>(rope) << " shared " << shared);
      CHECK(relative_diff(ours, engine) < 2e-5);
      // Adapters off gives the same (B = 0), and a different seed of A changes nothing either.
      CHECK(relative_diff(all_logits(lm, tokens, {.adapters = false}), engine) < 2e-5);
    }
}

TEST_CASE("the merged model computes the adapted model (within 1e-5)") {
  for (auto rope : {medusa_llama::rope_style::adjacent_pairs, medusa_llama::rope_style::split_halves}) {
    const auto m = medusa_llama::model::random(tiny_config(rope, false), 12, 0.2f);
    lora_model lm(m, {.rank = 8, .alpha = 16, .dropout = 0.05}, 4);
    randomize_b(lm, 0.1f, 9);
    const auto tokens = random_tokens(33, 53, 6);
    const auto adapted = all_logits(lm, tokens, {.train = false, .adapters = true});
    const auto base = all_logits(lm, tokens, {.train = false, .adapters = false});
    CHECK(relative_diff(adapted, base) > 1e-2);  // the adapters matter
    const auto merged = lm.merged();
    CHECK(relative_diff(engine_logits(merged, tokens), adapted) < 1e-5);
    CHECK(relative_diff(all_logits(lora_model(merged, {.rank = 1, .alpha = 1, .dropout = 0}, 1), tokens, {.adapters = false}), adapted) < 1e-5);
  }
}

TEST_CASE("backward through the whole stack matches finite differences (adapters, dropout on)") {
  for (auto rope : {medusa_llama::rope_style::adjacent_pairs, medusa_llama::rope_style::split_halves}) {
    const auto m = medusa_llama::model::random(tiny_config(rope, true), 13, 0.3f);
    lora_model lm(m, {.rank = 4, .alpha = 8, .dropout = 0.1}, 5);
    randomize_b(lm, 0.2f, 10);
    const auto tokens = random_tokens(19, 53, 7);
    const auto& c = m.config();
    const std::size_t n = tokens.size(), d = static_cast<std::size_t>(c.dim);
    std::mt19937 rng(3);
    std::uniform_real_distribution<float> u(-1, 1);
    std::vector<float> w(n * d);  // L = Σ w ⊙ hidden
    for (float& x : w) x = u(rng);
    const forward_options fo{.train = true, .adapters = true, .seed = 77};  // the same dropout masks every time
    auto loss = [&] {
      sequence_state st;
      lm.forward(tokens, st, fo);
      double s = 0;
      for (std::size_t i = 0; i < n * d; ++i) s += static_cast<double>(w[i]) * st.hidden[i];
      return s;
    };
    sequence_state st;
    lm.forward(tokens, st, fo);
    std::vector<float> grads(lm.params().size(), 0.0f);
    lm.backward(st, w.data(), grads.data());
    // The coordinates with the largest gradients of every projection of every block (float
    // differences need a large signal), with a central difference of step h.
    int checked = 0;
    double worst = 0;
    for (std::size_t l = 0; l < static_cast<std::size_t>(c.n_layers); ++l)
      for (int p = 0; p < static_cast<int>(projections_per_layer); ++p) {
        const auto ll = lm.adapter(l, static_cast<projection>(p));
        const std::size_t off = lm.offset(l, static_cast<projection>(p)), count = ll.rank * (ll.in + ll.out);
        for (int part = 0; part < 2; ++part) {  // A, then B
          const std::size_t b0 = off + (part ? ll.rank * ll.in : 0), b1 = part ? off + count : off + ll.rank * ll.in;
          std::size_t best = b0;
          for (std::size_t i = b0; i < b1; ++i)
            if (std::fabs(grads[i]) > std::fabs(grads[best])) best = i;
          const float keep = lm.params()[best], h = 1e-2f;
          lm.params()[best] = keep + h;
          const double up = loss();
          lm.params()[best] = keep - h;
          const double down = loss();
          lm.params()[best] = keep;
          const double numeric = (up - down) / (2.0 * h);
          const double rel = std::fabs(numeric - grads[best]) / std::max(1e-3, std::fabs(numeric));
          INFO("layer " << l << " " << module_name(static_cast<projection>(p)) << (part ? " B" : " A") << ": numeric " << numeric
                        << " analytic " << grads[best]);
          CHECK(rel < 2e-2);
          worst = std::max(worst, rel);
          ++checked;
        }
      }
    CHECK(checked == 2 * 2 * 7);
    MESSAGE("largest relative difference " << worst);
  }
}

TEST_CASE("bad LoRA settings are refused with a message naming them") {
  const auto m = medusa_llama::model::random(tiny_config(medusa_llama::rope_style::adjacent_pairs, true), 14, 0.2f);
  CHECK_THROWS_WITH_AS(lora_model(m, {.rank = 0}, 1), doctest::Contains("rank 0"), medusa::invalid_input);
  CHECK_THROWS_WITH_AS(lora_model(m, {.rank = 33}, 1), doctest::Contains("rank 33 is outside [1, d = 32]"), medusa::invalid_input);
  CHECK_THROWS_AS(lora_model(m, {.rank = 4, .alpha = 0}, 1), medusa::invalid_input);
  CHECK_THROWS_AS(lora_model(m, {.rank = 4, .alpha = 8, .dropout = 1.0}, 1), medusa::invalid_input);
  lora_model lm(m, {.rank = 4, .alpha = 8, .dropout = 0}, 1);
  sequence_state st;
  CHECK_THROWS_AS(lm.forward(std::vector<std::int32_t>(41, 1), st, {}), medusa::invalid_input);  // longer than seq_len
  CHECK_THROWS_AS(lm.forward(std::vector<std::int32_t>{1, 53}, st, {}), medusa::invalid_input);  // token outside V
  lm.forward(std::vector<std::int32_t>{1, 2}, st, {.adapters = false});
  std::vector<float> g(lm.params().size()), dh(2 * 32);
  CHECK_THROWS_AS(lm.backward(st, dh.data(), g.data()), medusa::invalid_input);
}

TEST_CASE("the self-distillation loss through the classifier and the stack matches finite differences") {
  const auto m = medusa_llama::model::random(tiny_config(medusa_llama::rope_style::split_halves, false), 15, 0.3f);
  lora_model lm(m, {.rank = 4, .alpha = 8, .dropout = 0.0}, 6);
  randomize_b(lm, 0.2f, 11);
  const auto tokens = random_tokens(13, 53, 8);
  const std::size_t n = tokens.size(), d = 32, V = 53, k = 5;
  // A teacher: top-5 of another random row per position, with its normaliser.
  std::mt19937 rng(4);
  std::uniform_real_distribution<float> u(-3, 3);
  std::vector<std::int32_t> ids((n - 1) * k);
  std::vector<float> tl((n - 1) * k), lnorm(n - 1);
  for (std::size_t p = 0; p + 1 < n; ++p) {
    std::vector<float> row(V);
    for (float& x : row) x = u(rng);
    double s = 0;
    for (float x : row) s += std::exp(static_cast<double>(x));
    lnorm[p] = static_cast<float>(std::log(s));
    for (std::size_t i = 0; i < k; ++i) {
      ids[p * k + i] = static_cast<std::int32_t>((p * 7 + i * 11) % V);
      tl[p * k + i] = row[static_cast<std::size_t>(ids[p * k + i])];
    }
  }
  auto teacher = [&](std::size_t p) {
    return backbone::teacher_row{std::span<const std::int32_t>(ids).subspan(p * k, k), std::span<const float>(tl).subspan(p * k, k), lnorm[p]};
  };
  auto loss_and_grad = [&](std::vector<float>* grads) {
    sequence_state st;
    lm.forward(tokens, st, {.train = true});
    std::vector<float> z((n - 1) * V);
    lm.logits(st, 0, n - 1, z.data());
    double kl = 0;
    for (std::size_t p = 0; p + 1 < n; ++p) kl += backbone::kl_row(z.data() + p * V, V, teacher(p), 1.0f);
    if (grads) {
      std::vector<float> dh(n * d, 0.0f);
      lm.classifier_backward(n - 1, z.data(), dh.data());
      lm.backward(st, dh.data(), grads->data());
    }
    return kl;
  };
  std::vector<float> grads(lm.params().size(), 0.0f);
  loss_and_grad(&grads);
  int checked = 0;
  for (int p = 0; p < static_cast<int>(projections_per_layer); ++p) {
    const auto ll = lm.adapter(1, static_cast<projection>(p));
    const std::size_t b0 = lm.offset(1, static_cast<projection>(p)) + ll.rank * ll.in, b1 = b0 + ll.rank * ll.out;
    std::size_t best = b0;
    for (std::size_t i = b0; i < b1; ++i)
      if (std::fabs(grads[i]) > std::fabs(grads[best])) best = i;
    const float keep = lm.params()[best], h = 1e-2f;
    lm.params()[best] = keep + h;
    const double up = loss_and_grad(nullptr);
    lm.params()[best] = keep - h;
    const double down = loss_and_grad(nullptr);
    lm.params()[best] = keep;
    const double numeric = (up - down) / (2.0 * h);
    INFO(module_name(static_cast<projection>(p)) << " B: numeric " << numeric << " analytic " << grads[best]);
    CHECK(std::fabs(numeric - grads[best]) <= 2e-2 * std::max(1e-3, std::fabs(numeric)));
    ++checked;
  }
  CHECK(checked == 7);
}
