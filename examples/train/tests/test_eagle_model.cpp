// SPDX-License-Identifier: Apache-2.0
// The EAGLE-style feature drafter (medusa_train/eagle_model.hpp, eagle_distill.hpp): its forward
// equals a plain-loop computation of the specification, one drafted row at a time equals the
// whole-sequence forward, its backward equals finite differences, a short fit lowers the loss,
// the chain figures are consistent, and fc.bin has its documented layout.
#include <medusa_train/eagle_distill.hpp>

#include <doctest/doctest.h>

#include "stack_helpers.hpp"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <vector>

using namespace medusa_train;

namespace {

using stack_test::engine_logits;
using stack_test::random_tokens;
using stack_test::relative_diff;

constexpr int vocab = 53;

medusa_llama::model_config tiny_config(medusa_llama::rope_style rope, int kv_heads = 4, bool shared = true) {
  medusa_llama::model_config c;
  c.dim = 32;
  c.hidden_dim = 48;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = kv_heads;
  c.vocab_size = vocab;
  c.seq_len = 64;
  c.rope = rope;
  c.shared_classifier = shared;
  return c;
}

std::vector<float> random_features(std::size_t rows, std::size_t d, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.5f, 1.5f);
  std::vector<float> f(rows * d);
  for (float& x : f) x = u(rng);
  return f;
}

// The specification in plain loops, in double: for each row i, u = [E t_i ; f_i], x = W_fc u, one
// Llama block (RoPE at position i, causal attention), final RMSNorm → g; z = W_cls g.
struct reference_out {
  std::vector<double> g, z;
};

reference_out reference(const eagle_model& em, const std::vector<std::int32_t>& tokens, const std::vector<float>& f) {
  const auto m = em.to_model();
  const auto& c = em.config();
  const std::size_t n = tokens.size(), d = 32, hd = d / 4, H = 4, KVH = static_cast<std::size_t>(c.n_kv_heads), kv = KVH * hd,
                    hid = static_cast<std::size_t>(c.hidden_dim), V = vocab;
  const auto& w = m.layer(0);
  const auto fc = em.fc();
  auto matvec = [](const float* W, std::size_t out, std::size_t in, const std::vector<double>& x) {
    std::vector<double> y(out, 0.0);
    for (std::size_t o = 0; o < out; ++o)
      for (std::size_t i = 0; i < in; ++i) y[o] += static_cast<double>(W[o * in + i]) * x[i];
    return y;
  };
  auto rmsnorm = [&](const std::vector<double>& x, const float* wt) {
    double ss = 0;
    for (double v : x) ss += v * v;
    const double r = 1.0 / std::sqrt(ss / static_cast<double>(x.size()) + static_cast<double>(c.rms_eps));
    std::vector<double> y(x.size());
    for (std::size_t j = 0; j < x.size(); ++j) y[j] = x[j] * r * static_cast<double>(wt[j]);
    return y;
  };
  auto rope = [&](std::vector<double>& v, std::size_t heads, std::size_t pos) {
    for (std::size_t h = 0; h < heads; ++h)
      for (std::size_t i = 0; i < hd / 2; ++i) {
        const double angle = static_cast<double>(pos) * std::pow(static_cast<double>(c.rope_theta), -2.0 * static_cast<double>(i) / static_cast<double>(hd));
        const bool adjacent = c.rope == medusa_llama::rope_style::adjacent_pairs;
        const std::size_t a = h * hd + (adjacent ? 2 * i : i), b = h * hd + (adjacent ? 2 * i + 1 : i + hd / 2);
        const double x0 = v[a], x1 = v[b];
        v[a] = x0 * std::cos(angle) - x1 * std::sin(angle);
        v[b] = x0 * std::sin(angle) + x1 * std::cos(angle);
      }
  };
  std::vector<std::vector<double>> xs(n), qs(n), ks(n), vs(n);
  for (std::size_t i = 0; i < n; ++i) {
    std::vector<double> u(2 * d);
    for (std::size_t j = 0; j < d; ++j) {
      u[j] = m.token_embedding()[static_cast<std::size_t>(tokens[i]) * d + j];
      u[d + j] = f[i * d + j];
    }
    xs[i] = matvec(fc.data(), d, 2 * d, u);
    const auto xn = rmsnorm(xs[i], w.rms_att);
    qs[i] = matvec(w.wq, d, d, xn);
    ks[i] = matvec(w.wk, kv, d, xn);
    vs[i] = matvec(w.wv, kv, d, xn);
    rope(qs[i], H, i);
    rope(ks[i], KVH, i);
  }
  reference_out out;
  for (std::size_t i = 0; i < n; ++i) {
    std::vector<double> att(d, 0.0);
    for (std::size_t h = 0; h < H; ++h) {
      const std::size_t g = h / (H / KVH);
      std::vector<double> s(i + 1);
      double mx = -1e300, sum = 0;
      for (std::size_t t = 0; t <= i; ++t) {
        s[t] = 0;
        for (std::size_t j = 0; j < hd; ++j) s[t] += qs[i][h * hd + j] * ks[t][g * hd + j];
        s[t] /= std::sqrt(static_cast<double>(hd));
        mx = std::max(mx, s[t]);
      }
      for (auto& v : s) sum += (v = std::exp(v - mx));
      for (std::size_t t = 0; t <= i; ++t)
        for (std::size_t j = 0; j < hd; ++j) att[h * hd + j] += s[t] / sum * vs[t][g * hd + j];
    }
    auto x = xs[i];
    const auto o = matvec(w.wo, d, d, att);
    for (std::size_t j = 0; j < d; ++j) x[j] += o[j];
    const auto xn = rmsnorm(x, w.rms_ffn);
    const auto a = matvec(w.w1, hid, d, xn), b = matvec(w.w3, hid, d, xn);
    std::vector<double> hh(hid);
    for (std::size_t j = 0; j < hid; ++j) hh[j] = a[j] / (1.0 + std::exp(-a[j])) * b[j];
    const auto down = matvec(w.w2, d, hid, hh);
    for (std::size_t j = 0; j < d; ++j) x[j] += down[j];
    const auto g = rmsnorm(x, m.rms_final());
    const auto z = matvec(m.classifier(), V, d, g);
    out.g.insert(out.g.end(), g.begin(), g.end());
    out.z.insert(out.z.end(), z.begin(), z.end());
  }
  return out;
}

double max_rel(const std::vector<float>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double diff = 0, scale = 1e-30;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::fabs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::fabs(b[i]));
  }
  return diff / scale;
}

// Trains the drafter's block weights a little off their initial values, so that every path matters.
void perturb(eagle_model& em, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-0.15f, 0.15f);
  for (float& p : em.params()) p += u(rng);
}

}  // namespace

TEST_CASE("the drafter computes the specification: fc on [E t ; f], one Llama block, final norm, the target's classifier") {
  struct variant {
    medusa_llama::rope_style rope;
    int kv_heads;
    bool shared;
    int hidden;
  };
  for (const auto& v : {variant{medusa_llama::rope_style::adjacent_pairs, 4, true, 0}, variant{medusa_llama::rope_style::split_halves, 2, true, 40},
                        variant{medusa_llama::rope_style::adjacent_pairs, 1, false, 24}}) {
    INFO("rope " << static_cast<int>(v.rope) << ", kv heads " << v.kv_heads << ", shared " << v.shared << ", hidden " << v.hidden);
    const auto target = medusa_llama::model::random(tiny_config(v.rope, v.kv_heads, v.shared), 5, 0.3f);
    eagle_model em(target, v.hidden, 11);
    perturb(em, 3);
    CHECK(em.config().n_layers == 1);
    CHECK(em.config().hidden_dim == (v.hidden ? v.hidden : 48));
    const auto tokens = random_tokens(23, vocab, 9);
    const auto f = random_features(tokens.size(), 32, 4);
    eagle_state st;
    em.forward(tokens, f.data(), st);
    std::vector<float> z(tokens.size() * vocab);
    em.logits(st, 0, tokens.size(), z.data());
    const auto ref = reference(em, tokens, f);
    CHECK(max_rel(st.stack.hidden, ref.g) < 2e-5);
    CHECK(max_rel(z, ref.z) < 2e-5);
    // The engine model it writes holds the target's embedding and classifier, tied as the target's.
    const auto m = em.to_model();
    CHECK(m.config().shared_classifier == v.shared);
    CHECK(std::memcmp(m.token_embedding(), target.token_embedding(), sizeof(float) * vocab * 32) == 0);
    CHECK(std::memcmp(m.classifier(), target.classifier(), sizeof(float) * vocab * 32) == 0);

    // One row at a time after a forward's prefix: the same g and logits as the whole forward.
    const std::size_t p = 9;
    eagle_chain chain{eagle_model::keys(st).first(p * static_cast<std::size_t>(em.config().kv_dim())),
                      eagle_model::values(st).first(p * static_cast<std::size_t>(em.config().kv_dim())), {}, {}};
    std::vector<float> g(32), zr(vocab);
    for (std::size_t i = p; i < tokens.size(); ++i) {
      em.extend(chain, tokens[i], f.data() + i * 32, g.data(), zr.data());
      INFO("row " << i);
      CHECK(relative_diff(g, std::vector<float>(st.stack.hidden.begin() + static_cast<long>(i * 32), st.stack.hidden.begin() + static_cast<long>(i * 32 + 32))) < 2e-5);
      CHECK(relative_diff(zr, std::vector<float>(z.begin() + static_cast<long>(i * vocab), z.begin() + static_cast<long>((i + 1) * vocab))) < 2e-5);
    }
  }
}

TEST_CASE("the drafter's backward matches finite differences for W_fc, the block's weights and the final norm") {
  const auto target = medusa_llama::model::random(tiny_config(medusa_llama::rope_style::adjacent_pairs, 2), 13, 0.3f);
  eagle_model em(target, 0, 2);
  perturb(em, 8);
  const auto tokens = random_tokens(15, vocab, 7);
  const auto f = random_features(tokens.size(), 32, 6);
  const std::size_t n = tokens.size(), d = 32, rows = n - 2;
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1, 1);
  // L = Σ wz ⊙ logits + Σ wg ⊙ g over the first `rows` rows.
  std::vector<float> wz(rows * vocab), wg(rows * d);
  for (float& x : wz) x = u(rng);
  for (float& x : wg) x = u(rng);
  auto loss = [&] {
    eagle_state st;
    em.forward(tokens, f.data(), st);
    std::vector<float> z(n * vocab);
    em.logits(st, 0, n, z.data());
    double s = 0;
    for (std::size_t i = 0; i < rows * vocab; ++i) s += static_cast<double>(wz[i]) * z[i];
    for (std::size_t i = 0; i < rows * d; ++i) s += static_cast<double>(wg[i]) * st.stack.hidden[i];
    return s;
  };
  eagle_state st;
  em.forward(tokens, f.data(), st);
  std::vector<float> grads(em.params().size(), 0.0f);
  em.backward(st, rows, wz.data(), wg.data(), grads.data());
  // Stretches of the flat layout: W_fc's token and feature halves, each block piece, the final norm.
  const std::size_t hid = 48, kv = 16;
  std::vector<std::pair<std::size_t, std::size_t>> stretches;
  for (std::size_t r = 0; r < 4; ++r) {  // rows of W_fc: d token entries, then d feature entries
    stretches.emplace_back(r * 2 * d, r * 2 * d + d);
    stretches.emplace_back(r * 2 * d + d, (r + 1) * 2 * d);
  }
  std::size_t at = 2 * d * d;
  for (std::size_t size : {d, d * d, kv * d, kv * d, d * d, d, hid * d, d * hid, hid * d}) {
    stretches.emplace_back(at, at + size);
    at += size;
  }
  stretches.emplace_back(at, at + d);
  REQUIRE(at + d == em.params().size());
  double worst = 0;
  for (auto [b0, b1] : stretches) {
    std::size_t best = b0;
    for (std::size_t i = b0; i < b1; ++i)
      if (std::fabs(grads[i]) > std::fabs(grads[best])) best = i;
    const float keep = em.params()[best], h = 1e-2f;
    em.params()[best] = keep + h;
    const double up = loss();
    em.params()[best] = keep - h;
    const double down = loss();
    em.params()[best] = keep;
    const double numeric = (up - down) / (2.0 * h);
    const double rel = std::fabs(numeric - grads[best]) / std::max(1e-3, std::fabs(numeric));
    INFO("parameter " << best << " (stretch from " << b0 << "): numeric " << numeric << " analytic " << grads[best]);
    CHECK(std::fabs(numeric) > 1e-3);
    CHECK(rel < 2e-2);
    worst = std::max(worst, rel);
  }
  MESSAGE("largest relative difference " << worst);
}

TEST_CASE("a short fit lowers the drafter's loss, and its chain figures are consistent") {
  const auto target = medusa_llama::model::random(tiny_config(medusa_llama::rope_style::adjacent_pairs), 21, 1.0f);
  std::vector<backbone_sequence> seqs;
  for (unsigned s = 0; s < 48; ++s) {
    backbone_sequence sq;
    sq.tokens = random_tokens(4, vocab, 100 + s);
    sq.row0 = 3;
    sq.which = s % 8 == 0 ? split::eval : split::train;
    while (sq.tokens.size() < 40) {
      const auto z = engine_logits(target, sq.tokens);
      const std::span<const float> last(z.data() + (sq.tokens.size() - 1) * vocab, vocab);
      sq.tokens.push_back(static_cast<std::int32_t>(medusa::argmax(last)));
    }
    seqs.push_back(std::move(sq));
  }
  const lora_model original(target, {.rank = 1, .alpha = 1, .dropout = 0}, 0);
  const auto teacher = teacher_table::compute(original, seqs, 8, 2);
  const auto features = feature_table::compute(original, seqs, 2);
  // The features are the target's final-normed states: its classifier's input.
  {
    sequence_state st;
    original.forward(seqs[1].tokens, st, {.train = false, .adapters = false});
    CHECK(std::memcmp(features.of(1), st.hidden.data(), sizeof(float) * 32 * (seqs[1].tokens.size() - 1)) == 0);
  }
  CHECK(features.rms(seqs) > 0);
  eagle_model em(target, 0, 5);
  auto scored = seqs;  // judged on the training sequences themselves, all marked held out
  for (auto& sq : scored) sq.which = split::eval;
  const auto before = measure_eagle(em, scored, features, teacher, 2, 4);
  eagle_fit_options fo;
  fo.lr = 3e-3;
  fo.epochs = 30;
  fo.batch_sequences = 6;
  fo.threads = 2;
  fo.noise = 0.05 * features.rms(seqs);
  std::vector<double> kls, regs;
  fo.progress_interval = 0;
  fo.on_progress = [&](const eagle_progress& p) {
    kls.push_back(p.kl);
    regs.push_back(p.regression);
  };
  const auto r = fit_eagle(em, seqs, features, teacher, fo);
  const auto after = measure_eagle(em, scored, features, teacher, 2, 4);
  REQUIRE(kls.size() == r.steps);
  CHECK(r.train_sequences == 42);
  CHECK(r.positions_seen == r.steps * 6 * 38);  // 7 batches of 6; 38 rows per 40-token sequence
  CHECK(kls.back() < 0.6 * kls.front());
  CHECK(regs.back() < regs.front());
  CHECK(after.agreement > before.agreement + 0.1);
  CHECK(after.regression < before.regression);
  MESSAGE("KL " << kls.front() << " -> " << kls.back() << ", regression " << regs.front() << " -> " << regs.back() << ", agreement "
                << before.agreement << " -> " << after.agreement);
  // 48 sequences × 36 continuation positions (as measure_draft scores); the held-out split: 6.
  CHECK(after.positions == 48 * 36);
  CHECK(measure_eagle(em, seqs, features, teacher, 1, 4).positions == 6 * 36);
  REQUIRE(after.acceptance.size() == 4);
  REQUIRE(after.chain_tokens.size() == 4);
  REQUIRE(after.chain_tokens_teacher_forced.size() == 4);
  CHECK(after.acceptance[0] == doctest::Approx(after.agreement));
  // Depth 1 is teacher-forced either way.
  CHECK(after.chain_tokens[0] == doctest::Approx(after.chain_tokens_teacher_forced[0]));
  double p = 1, tokens = 1;
  for (std::size_t k = 0; k < 4; ++k) {
    CHECK(after.acceptance[k] >= 0);
    CHECK(after.acceptance[k] <= 1);
    p *= after.acceptance[k];
    tokens += p;
    CHECK(after.chain_tokens[k] == doctest::Approx(tokens));
    if (k) CHECK(after.chain_tokens[k] >= after.chain_tokens[k - 1]);
  }
  MESSAGE("chains of 1..4: " << after.chain_tokens[0] << " " << after.chain_tokens[1] << " " << after.chain_tokens[2] << " " << after.chain_tokens[3]
                             << " (teacher-forced " << after.chain_tokens_teacher_forced[3] << ")");
}

TEST_CASE("fc.bin holds the magic, version, shape and W_fc row-major") {
  const auto target = medusa_llama::model::random(tiny_config(medusa_llama::rope_style::adjacent_pairs), 2, 0.2f);
  eagle_model em(target, 0, 1);
  const std::filesystem::path path = std::filesystem::path(MEDUSA_TEST_TMPDIR) / "eagle-fc.bin";
  em.save_fc(path);
  std::ifstream in(path, std::ios::binary);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  REQUIRE(bytes.size() == 8 + 12 + 4 * 32 * 64);
  CHECK(std::string(bytes.data(), 8) == "MEDUSAFC");
  std::int32_t head[3];
  std::memcpy(head, bytes.data() + 8, sizeof head);
  CHECK(head[0] == 1);
  CHECK(head[1] == 64);
  CHECK(head[2] == 32);
  CHECK(std::memcmp(bytes.data() + 20, em.fc().data(), 4 * 32 * 64) == 0);
  // A fresh drafter passes the features through: W_fc's feature half is about the identity.
  CHECK(em.fc()[0 * 64 + 32 + 0] == doctest::Approx(1.0).epsilon(0.1));
  CHECK(std::fabs(em.fc()[0 * 64 + 32 + 1]) < 0.05);
}

TEST_CASE("bad drafter input is refused with a message naming it") {
  const auto target = medusa_llama::model::random(tiny_config(medusa_llama::rope_style::adjacent_pairs), 3, 0.2f);
  CHECK_THROWS_AS(eagle_model(target, -1, 1), medusa::invalid_input);
  eagle_model em(target, 0, 1);
  eagle_state st;
  const auto f = random_features(65, 32, 1);
  CHECK_THROWS_WITH_AS(em.forward(std::vector<std::int32_t>(65, 1), f.data(), st), doctest::Contains("does not fit the context of 64"),
                       medusa::invalid_input);
  CHECK_THROWS_WITH_AS(em.forward(std::vector<std::int32_t>{1, 53}, f.data(), st), doctest::Contains("token 53"), medusa::invalid_input);
  std::vector<backbone_sequence> held_out_only{{random_tokens(8, vocab, 1), 3, split::eval}};
  const lora_model original(target, {.rank = 1, .alpha = 1, .dropout = 0}, 0);
  const auto teacher = teacher_table::compute(original, held_out_only, 4, 1);
  const auto features = feature_table::compute(original, held_out_only, 1);
  CHECK_THROWS_WITH_AS(fit_eagle(em, held_out_only, features, teacher, {}), doctest::Contains("no training sequence"), medusa::invalid_input);
  eagle_fit_options bad;
  bad.lr = 0;
  CHECK_THROWS_AS(fit_eagle(em, held_out_only, features, teacher, bad), medusa::invalid_input);
  bad.lr = 1e-3;
  bad.noise = -1;
  CHECK_THROWS_AS(fit_eagle(em, held_out_only, features, teacher, bad), medusa::invalid_input);
}
