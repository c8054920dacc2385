// SPDX-License-Identifier: Apache-2.0
// The exit projection of self-speculation (exit_distill.hpp, exit_projection.hpp): the identity
// exit scores as the plain first layers do; a short fit lowers the KL and raises the agreement with
// the target, and its chain figures are consistent; the folded draft (`self_draft`) computes
// C · W · x with the target's first layers; exit.bin round-trips and damaged files, widths and
// layer counts that do not fit are refused with errors that name them.
#include <medusa_train/exit_distill.hpp>

#include <medusa_llama/errors.hpp>
#include <medusa_llama/exit_projection.hpp>

#include <medusa/candidates.hpp>

#include <doctest/doctest.h>

#include "stack_helpers.hpp"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include <unistd.h>

using namespace medusa_train;

namespace {

using stack_test::engine_logits;
using stack_test::random_tokens;

constexpr int vocab = 53, dim = 32;

medusa_llama::model random_target() {
  medusa_llama::model_config c;
  c.dim = dim;
  c.hidden_dim = 48;
  c.n_layers = 3;
  c.n_heads = 4;
  c.n_kv_heads = 4;
  c.vocab_size = vocab;
  c.seq_len = 64;
  return medusa_llama::model::random(c, 31, 1.0f);
}

// Greedy continuations of the target: what medusa-train distils on.
std::vector<backbone_sequence> greedy_sequences(const medusa_llama::model& target, int count) {
  std::vector<backbone_sequence> seqs;
  for (int s = 0; s < count; ++s) {
    backbone_sequence sq;
    sq.tokens = random_tokens(4, vocab, 300 + static_cast<unsigned>(s));
    sq.row0 = 3;
    sq.which = s % 8 == 0 ? split::eval : split::train;
    while (sq.tokens.size() < 40) {
      const auto z = engine_logits(target, sq.tokens);
      sq.tokens.push_back(static_cast<std::int32_t>(
          medusa::argmax(std::span<const float>(z.data() + (sq.tokens.size() - 1) * vocab, vocab))));
    }
    seqs.push_back(std::move(sq));
  }
  return seqs;
}

std::filesystem::path scratch(const std::string& name) {
  return std::filesystem::path(MEDUSA_TEST_TMPDIR) / (name + "-" + std::to_string(::getpid()));
}

}  // namespace

TEST_CASE("a short fit of the exit raises the first layers' agreement with the target") {
  const auto target = random_target();
  const auto seqs = greedy_sequences(target, 48);
  const lora_model original(target, {.rank = 1, .alpha = 1, .dropout = 0}, 0);
  const auto teacher = teacher_table::compute(original, seqs, 8, 2);
  const lora_model first(target.first_layers(1), {.rank = 1, .alpha = 1, .dropout = 0}, 0);
  const auto states = feature_table::compute(first, seqs, 2);
  auto scored = seqs;  // judged on the training sequences themselves, all marked held out
  for (auto& sq : scored) sq.which = split::eval;
  auto w = identity_exit(dim);
  const auto before = measure_exit(w, target, states, scored, teacher, 2, 4);

  // The identity exit is the plain first layer: its hits are argmax(C · x) against the teacher.
  {
    std::uint64_t hits = 0, positions = 0;
    for (std::size_t s = 0; s < scored.size(); ++s)
      for (std::size_t p = scored[s].row0; p + 1 < scored[s].tokens.size(); ++p, ++positions) {
        std::vector<float> z(vocab, 0.0f);
        const float* x = states.of(s) + p * dim;
        for (int v = 0; v < vocab; ++v)
          for (int j = 0; j < dim; ++j) z[static_cast<std::size_t>(v)] += target.classifier()[v * dim + j] * x[j];
        hits += medusa::argmax(std::span<const float>(z)) == teacher.row(s, p).ids[0];
      }
    CHECK(before.positions == positions);
    CHECK(before.agreement == doctest::Approx(static_cast<double>(hits) / static_cast<double>(positions)).epsilon(1e-3));
  }

  draft_fit_options fo;
  fo.lr = 3e-3;
  fo.epochs = 30;
  fo.batch_sequences = 6;
  fo.threads = 2;
  fo.opt.weight_decay = 0.5;  // ignored: decay would pull the exit from the identity to zero
  std::vector<double> kls;
  fo.progress_interval = 0;
  fo.on_progress = [&](const draft_progress& p) { kls.push_back(p.kl); };
  const auto r = fit_exit(w, target, states, seqs, teacher, fo);
  const auto after = measure_exit(w, target, states, scored, teacher, 2, 4);
  REQUIRE(kls.size() == r.steps);
  CHECK(r.train_sequences == 42);
  CHECK(kls.back() < 0.8 * kls.front());
  CHECK(after.agreement > before.agreement + 0.05);
  MESSAGE("KL " << kls.front() << " -> " << kls.back() << ", agreement " << before.agreement << " -> " << after.agreement);
  REQUIRE(after.chain_tokens.size() == 4);
  double p = 1, tokens = 1;
  for (std::size_t k = 0; k < 4; ++k) {
    p *= after.acceptance[k];
    tokens += p;
    CHECK(after.chain_tokens[k] == doctest::Approx(tokens));
  }

  // The folded draft computes C · W · x: its greedy tokens are the trained exit's.
  const auto draft = medusa_llama::self_draft(target, {1, dim, w});
  CHECK(draft.config().n_layers == 1);
  CHECK_FALSE(draft.config().shared_classifier);
  CHECK(draft.token_embedding() == target.token_embedding());
  std::uint64_t same = 0, total = 0;
  for (std::size_t s = 0; s < 6; ++s) {
    const auto z = engine_logits(draft, seqs[s].tokens);
    for (std::size_t q = 0; q + 1 < seqs[s].tokens.size(); ++q, ++total) {
      std::vector<float> y(dim, 0.0f), ref(vocab, 0.0f);
      const float* x = states.of(s) + q * dim;
      for (int i = 0; i < dim; ++i)
        for (int j = 0; j < dim; ++j) y[static_cast<std::size_t>(i)] += w[static_cast<std::size_t>(i * dim + j)] * x[j];
      for (int v = 0; v < vocab; ++v)
        for (int i = 0; i < dim; ++i) ref[static_cast<std::size_t>(v)] += target.classifier()[v * dim + i] * y[static_cast<std::size_t>(i)];
      const std::span<const float> row(z.data() + q * vocab, vocab);
      double diff = 0, scale = 1e-6;
      for (int v = 0; v < vocab; ++v) {
        diff = std::max(diff, static_cast<double>(std::fabs(row[static_cast<std::size_t>(v)] - ref[static_cast<std::size_t>(v)])));
        scale = std::max(scale, static_cast<double>(std::fabs(ref[static_cast<std::size_t>(v)])));
      }
      CHECK(diff / scale < 1e-3);
      same += medusa::argmax(row) == medusa::argmax(std::span<const float>(ref));
    }
  }
  CHECK(same >= total - 2);  // near-ties aside
}

TEST_CASE("exit.bin round-trips, and damaged files, widths and layer counts are refused by name") {
  const auto target = random_target();
  std::vector<float> w = identity_exit(dim);
  w[5] = 0.25f;
  const auto dir = scratch("exit");
  std::filesystem::create_directories(dir);
  const auto path = dir / medusa_llama::exit_projection_file;
  medusa_llama::save_exit_projection(path, {2, dim, w});
  const auto e = medusa_llama::load_exit_projection(path);
  CHECK(e.layers == 2);
  CHECK(e.dim == dim);
  CHECK(e.w == w);
  CHECK_THROWS_AS(medusa_llama::save_exit_projection(path, {2, dim, std::vector<float>(10)}), medusa::invalid_input);

  std::ifstream in(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto refused = [&](const std::string& content, const char* what) {
    CAPTURE(what);
    const auto bad = dir / "bad.bin";
    std::ofstream(bad, std::ios::binary) << content;
    CHECK_THROWS_WITH_AS(medusa_llama::load_exit_projection(bad), doctest::Contains(what), medusa_llama::load_error);
  };
  refused(bytes.substr(0, 12), "inside its 20-byte header");
  refused("MEDUSAFC" + bytes.substr(8), "no MEDUSAEX magic");
  refused(bytes.substr(0, 8) + std::string("\x02\0\0\0", 4) + bytes.substr(12), "version 2");
  refused(bytes.substr(0, 100), "ends before its weights do");
  refused(bytes + "x", "longer than its header says");
  std::string nan = bytes;
  const float q = std::nanf("");
  std::memcpy(nan.data() + 20 + 4 * 7, &q, 4);
  refused(nan, "weight 7 is not finite");
  CHECK_THROWS_WITH_AS(medusa_llama::load_exit_projection(dir / "missing.bin"), doctest::Contains("cannot open"), medusa_llama::load_error);

  CHECK_THROWS_WITH_AS(medusa_llama::self_draft(target, {3, dim, w}), doctest::Contains("before the last"), medusa_llama::load_error);
  CHECK_THROWS_WITH_AS(medusa_llama::self_draft(target, {1, 16, identity_exit(16)}), doctest::Contains("width 16"),
                       medusa_llama::load_error);
  CHECK_THROWS_WITH_AS(target.with_classifier(std::vector<float>(7)), doctest::Contains("53 x 32"), medusa_llama::load_error);
  std::filesystem::remove_all(dir);
}
