// SPDX-License-Identifier: Apache-2.0
// A trained feature drafter decodes as it was trained: `medusa_llama::eagle_engine` over what
// `eagle_model` writes (`to_model()`, fc.bin) gives the trainer's logits and predicted features,
// whether the rows run in one pass, in chunks, or as a catch-up after kept slots; a drafted row
// after overwritten slots equals the trainer's `extend`; a draft tree's pass gives each node the
// outputs of its path's causal rows; requests keep their own caches; the projection file round-trips, and damaged ones are refused with errors that name the problem; the
// snippet of docs/decoder.md decodes on the example engine exactly as plain greedy decoding.
#include <medusa_train/dense_model.hpp>
#include <medusa_train/eagle_model.hpp>

#include <medusa_llama/eagle_engine.hpp>
#include <medusa_llama/engine.hpp>
#include <medusa_llama/errors.hpp>

#include <medusa/decoder.hpp>
#include <medusa/drafts.hpp>
#include <medusa/feature_draft.hpp>
#include <medusa/tree.hpp>

#include <doctest/doctest.h>

#include "stack_helpers.hpp"

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <unistd.h>

using namespace medusa_train;

namespace {

constexpr int vocab = 61, dim = 32;

medusa_llama::model random_target(medusa_llama::rope_style rope) {
  medusa_llama::model_config c;
  c.dim = dim;
  c.hidden_dim = 48;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.vocab_size = vocab;
  c.seq_len = 96;
  c.rope = rope;
  return dense_model(c, 3).to_model();
}

// A drafter whose every weight is random (not the identity-like start), so that a wrong input
// layout or a missing projection shows.
eagle_model random_drafter(const medusa_llama::model& target) {
  eagle_model em(target, 40, 9);
  std::mt19937 rng(4);
  std::normal_distribution<float> n(0.0f, 0.15f);
  for (float& w : em.params()) w += n(rng);
  return em;
}

std::vector<float> random_rows(std::size_t rows, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.2f, 1.2f);
  std::vector<float> f(rows * dim);
  for (float& x : f) x = u(rng);
  return f;
}

double max_rel(std::span<const float> a, std::span<const float> b) {
  REQUIRE(a.size() == b.size());
  double scale = 1e-6, diff = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    scale = std::max(scale, static_cast<double>(std::abs(b[i])));
    diff = std::max(diff, static_cast<double>(std::abs(a[i] - b[i])));
  }
  return diff / scale;
}

struct pass_out {
  std::vector<float> logits = std::vector<float>(vocab), hidden = std::vector<float>(dim);
};

// Rows [r0, r1) of (tokens, features) at positions r0… after r0 kept slots of `request`.
pass_out run_rows(medusa_llama::eagle_engine& e, int request, const std::vector<std::int32_t>& tokens, const std::vector<float>& f,
                  int r0, int r1) {
  std::vector<std::int32_t> pos;
  for (int i = r0; i < r1; ++i) pos.push_back(i);
  pass_out o;
  medusa::feature_batch b;
  b.request = request;
  b.tokens = std::span<const std::int32_t>(tokens).subspan(static_cast<std::size_t>(r0), static_cast<std::size_t>(r1 - r0));
  b.features = std::span<const float>(f).subspan(static_cast<std::size_t>(r0) * dim, static_cast<std::size_t>(r1 - r0) * dim);
  b.positions = pos;
  b.cache_length = r0;
  b.logits = o.logits;
  b.hidden = o.hidden;
  e.forward(b);
  return o;
}

}  // namespace

TEST_CASE("eagle_engine computes what eagle_model trained: one pass, chunks, catch-up, drafted rows, requests") {
  for (const auto rope : {medusa_llama::rope_style::adjacent_pairs, medusa_llama::rope_style::split_halves}) {
    CAPTURE(static_cast<int>(rope));
    const auto target = random_target(rope);
    const eagle_model em = random_drafter(target);
    const int m = 23;
    const auto tokens = stack_test::random_tokens(static_cast<std::size_t>(m), vocab, 5);
    const auto f = random_rows(static_cast<std::size_t>(m), 6);
    eagle_state st;
    em.forward(tokens, f.data(), st);
    std::vector<float> z(static_cast<std::size_t>(m) * vocab);
    em.logits(st, 0, static_cast<std::size_t>(m), z.data());
    auto last_logits = std::span<const float>(z).subspan(static_cast<std::size_t>(m - 1) * vocab, vocab);
    auto last_g = std::span<const float>(st.stack.hidden).subspan(static_cast<std::size_t>(m - 1) * dim, dim);

    std::vector<float> fc(em.fc().begin(), em.fc().end());
    medusa_llama::eagle_engine e(em.to_model(), fc, {.threads = 2, .max_rows = 8});  // 23 rows: three chunks
    CHECK(e.vocab_size() == vocab);
    CHECK(e.hidden_size() == dim);
    const pass_out whole = run_rows(e, 0, tokens, f, 0, m);
    CHECK(max_rel(whole.logits, last_logits) < 1e-4);
    CHECK(max_rel(whole.hidden, last_g) < 1e-4);

    // A second request, as a catch-up after 15 kept slots; the first request's cache is untouched.
    run_rows(e, 7, tokens, f, 0, 15);
    const pass_out caught_up = run_rows(e, 7, tokens, f, 15, m);
    CHECK(max_rel(caught_up.logits, last_logits) < 1e-4);
    CHECK(e.requests() == 2);

    // Drafting: predicted rows overwrite slots past 15; then a row at 15 with the real inputs
    // equals the trainer's row 15, and a drafted row after all m equals `extend`.
    const auto junk_f = random_rows(static_cast<std::size_t>(m), 8);
    const std::vector<std::int32_t> junk(static_cast<std::size_t>(m), 3);
    for (int i = 15; i < 18; ++i) run_rows(e, 0, junk, junk_f, i, i + 1);
    const pass_out redo = run_rows(e, 0, tokens, f, 15, 16);
    CHECK(max_rel(redo.logits, std::span<const float>(z).subspan(15 * vocab, vocab)) < 1e-4);
    run_rows(e, 0, tokens, f, 16, m);
    eagle_chain chain{eagle_model::keys(st), eagle_model::values(st), {}, {}};
    std::vector<float> g(dim), zl(vocab);
    em.extend(chain, 11, last_g.data(), g.data(), zl.data());
    std::vector<std::int32_t> next(static_cast<std::size_t>(m) + 1, 11);
    std::vector<float> next_f(static_cast<std::size_t>(m + 1) * dim);
    std::copy(last_g.begin(), last_g.end(), next_f.begin() + static_cast<std::ptrdiff_t>(m) * dim);
    const pass_out drafted = run_rows(e, 0, next, next_f, m, m + 1);
    CHECK(max_rel(drafted.logits, zl) < 1e-4);
    CHECK(max_rel(drafted.hidden, g) < 1e-4);
    e.release(0);
    e.release(7);
    CHECK(e.requests() == 0);
  }
}

TEST_CASE("eagle_engine runs a draft tree's pass: each node's outputs are those of the causal rows of its path") {
  const auto target = random_target(medusa_llama::rope_style::adjacent_pairs);
  const eagle_model em = random_drafter(target);
  std::vector<float> fc(em.fc().begin(), em.fc().end());
  medusa_llama::eagle_engine e(em.to_model(), fc, {.threads = 2, .max_rows = 16});
  const int kept = 11;
  const auto tokens = stack_test::random_tokens(40, vocab, 12);
  const auto f = random_rows(40, 13);
  // A tree of 7 nodes: root, two children, then [0,0], [0,1], [1,0], [0,0,0].
  const medusa::tree t = medusa::tree::from_paths({{0}, {1}, {0, 0}, {0, 1}, {1, 0}, {0, 0, 0}});
  const int T = t.num_nodes();
  // Node i's row: token tokens[kept + i], feature row kept + i, position kept + depth.
  std::vector<std::int32_t> node_tokens(tokens.begin() + kept, tokens.begin() + kept + T), pos;
  for (int i = 0; i < T; ++i) pos.push_back(kept + t.node_depth(i));
  const auto node_f = std::span<const float>(f).subspan(static_cast<std::size_t>(kept) * dim, static_cast<std::size_t>(T) * dim);
  // The tree's pass after the kept slots, the last `outputs` rows' outputs into `logits` / `hidden`.
  auto tree_pass = [&](std::vector<float>& logits, std::vector<float>& hidden, int outputs) {
    medusa::feature_batch b;
    b.tokens = node_tokens;
    b.features = node_f;
    b.positions = pos;
    b.cache_length = kept;
    b.logits = logits;
    b.hidden = hidden;
    b.tree_mask = t.mask_view();
    b.outputs = outputs;
    return b;
  };
  run_rows(e, 1, tokens, f, 0, kept);  // request 1 runs each node's path after the same kept slots
  for (const int outputs : {1, 3, T}) {
    CAPTURE(outputs);
    run_rows(e, 0, tokens, f, 0, kept);
    std::vector<float> logits(static_cast<std::size_t>(outputs) * vocab), hidden(static_cast<std::size_t>(outputs) * dim);
    e.forward(tree_pass(logits, hidden, outputs));
    for (int j = 0; j < outputs; ++j) {
      const int node = T - outputs + j;
      CAPTURE(node);
      // The kept rows, then the node's path root first, as causal rows.
      std::vector<int> path;
      for (int u = node; u >= 0; u = t.parent(u)) path.insert(path.begin(), u);
      std::vector<std::int32_t> ptokens(tokens.begin(), tokens.begin() + kept);
      std::vector<float> pfeat(f.begin(), f.begin() + kept * dim);
      for (const int u : path) {
        ptokens.push_back(node_tokens[static_cast<std::size_t>(u)]);
        pfeat.insert(pfeat.end(), node_f.begin() + u * dim, node_f.begin() + (u + 1) * dim);
      }
      const pass_out want = run_rows(e, 1, ptokens, pfeat, kept, static_cast<int>(ptokens.size()));
      CHECK(max_rel(std::span<const float>(logits).subspan(static_cast<std::size_t>(j) * vocab, vocab), want.logits) < 1e-5);
      CHECK(max_rel(std::span<const float>(hidden).subspan(static_cast<std::size_t>(j) * dim, dim), want.hidden) < 1e-5);
    }
  }
  // A tree pass must fit one pass of max_rows, and outputs lie in [1, T].
  medusa_llama::eagle_engine small(em.to_model(), fc, {.threads = 1, .max_rows = 4});
  std::vector<float> logits(vocab), hidden(dim);
  medusa::feature_batch b = tree_pass(logits, hidden, 1);
  CHECK_THROWS_WITH_AS(small.forward(b), doctest::Contains("exceeds max_rows 4"), medusa_llama::engine_error);
  b.outputs = 0;
  CHECK_THROWS_WITH_AS(e.forward(b), doctest::Contains("outputs for 0 of 7 rows"), medusa_llama::engine_error);
}

TEST_CASE("eagle_engine refuses bad shapes and arguments, and fc.bin files that are damaged") {
  const auto target = random_target(medusa_llama::rope_style::adjacent_pairs);
  const eagle_model em = random_drafter(target);
  const auto dir = std::filesystem::temp_directory_path() / ("medusa-eagle-engine-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  em.to_model().save_llama2c(dir / "model.bin");
  em.save_fc(dir / medusa_llama::eagle_fc_file);
  auto e = medusa_llama::eagle_engine::load(dir, target.config(), {.threads = 1});
  const std::vector<float> fc = medusa_llama::load_eagle_fc(dir / medusa_llama::eagle_fc_file, dim);
  CHECK(std::equal(fc.begin(), fc.end(), em.fc().begin(), em.fc().end()));

  auto other = target.config();
  other.dim = 48;
  CHECK_THROWS_WITH_AS(medusa_llama::eagle_engine::load(dir, other), doctest::Contains("target width 48"), medusa_llama::load_error);
  CHECK_THROWS_AS(medusa_llama::eagle_engine(target, fc), medusa_llama::engine_error);  // two layers
  CHECK_THROWS_AS(medusa_llama::eagle_engine(em.to_model(), std::vector<float>(10)), medusa_llama::engine_error);

  const auto tokens = stack_test::random_tokens(4, vocab, 1);
  const auto f = random_rows(4, 2);
  CHECK_THROWS_AS(run_rows(e, 0, std::vector<std::int32_t>{1, 2, vocab, 3}, f, 0, 4), medusa_llama::engine_error);
  CHECK_THROWS_AS(run_rows(e, 0, tokens, f, 94, 98), std::exception);  // past the context
  medusa::feature_batch short_features;
  std::vector<std::int32_t> pos = {0};
  short_features.tokens = std::span<const std::int32_t>(tokens).first(1);
  short_features.features = std::span<const float>(f).first(dim - 1);
  short_features.positions = pos;
  CHECK_THROWS_WITH_AS(e.forward(short_features), doctest::Contains("feature values"), medusa_llama::engine_error);

  auto bytes = [&] {
    std::ifstream in(dir / medusa_llama::eagle_fc_file, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }();
  auto write = [&](const std::string& s) {
    std::ofstream(dir / "bad.bin", std::ios::binary) << s;
    return dir / "bad.bin";
  };
  auto code_of = [&](const std::string& s) {
    try {
      (void)medusa_llama::load_eagle_fc(write(s), dim);
    } catch (const medusa_llama::load_error& err) {
      return err.code();
    }
    FAIL("a damaged file loaded");
    return medusa_llama::load_errc::open_failed;
  };
  CHECK(code_of(bytes.substr(0, 12)) == medusa_llama::load_errc::truncated);
  CHECK(code_of(bytes.substr(0, bytes.size() - 4)) == medusa_llama::load_errc::truncated);
  CHECK(code_of(bytes + "xxxx") == medusa_llama::load_errc::size_mismatch);
  CHECK(code_of("NOTMAGIC" + bytes.substr(8)) == medusa_llama::load_errc::bad_header);
  CHECK_THROWS_WITH_AS((void)medusa_llama::load_eagle_fc(dir / medusa_llama::eagle_fc_file, 48), doctest::Contains("48"),
                       medusa_llama::load_error);
  std::filesystem::remove_all(dir);
}

TEST_CASE("docs/decoder.md: the feature drafter's snippet decodes on the example engine exactly as plain greedy") {
  const auto target_weights = random_target(medusa_llama::rope_style::adjacent_pairs);
  const eagle_model em = random_drafter(target_weights);
  const auto dir = std::filesystem::temp_directory_path() / ("medusa-eagle-docs-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir / "eagle");
  em.to_model().save_llama2c(dir / "eagle" / "model.bin");
  em.save_fc(dir / "eagle" / medusa_llama::eagle_fc_file);
  medusa_llama::engine target(target_weights, {.threads = 2});
  const std::vector<std::int32_t> prompt = {1, 7, 30, 2, 9};
  medusa::decode_options opt;
  opt.max_new_tokens = 60;
  const auto plain = medusa::generate_vanilla(target, prompt, medusa::greedy_policy{}, opt);
  const auto out_dir = dir / "eagle";
  // --- docs/decoder.md, "A feature drafter (EAGLE-style)" ---
  medusa_llama::eagle_engine eagle_model = medusa_llama::eagle_engine::load(out_dir, target.config(),
                                                                            {.pool = &target.pool()});
  medusa::feature_draft_branch<medusa_llama::eagle_engine> eagle(eagle_model, target.vocab_size(),
                                                                 target.hidden_size(), {.max_tokens = 5});
  medusa::basic_step_drafter<medusa::feature_draft_branch<medusa_llama::eagle_engine>> drafts({.lookup = eagle}, 1);
  medusa::no_heads none;
  medusa::decoder dec(target, none, drafts, medusa::greedy_policy{});
  // ---
  const auto r = dec.generate(prompt, opt);
  CHECK(r.tokens == plain.tokens);
  CHECK(eagle.tokens_run() >= static_cast<std::int64_t>(prompt.size()));  // the prompt was caught up
  std::filesystem::remove_all(dir);
}

TEST_CASE("eagle_engine runs several requests' batches in one pass, each with the bits forward gives it") {
  const auto target = random_target(medusa_llama::rope_style::adjacent_pairs);
  const eagle_model em = random_drafter(target);
  std::vector<float> fc(em.fc().begin(), em.fc().end());
  medusa_llama::eagle_engine together(em.to_model(), fc, {.threads = 2, .max_rows = 16});
  medusa_llama::eagle_engine alone(em.to_model(), fc, {.threads = 2, .max_rows = 16});
  const auto tokens = stack_test::random_tokens(60, vocab, 21);
  const auto f = random_rows(60, 22);
  const medusa::tree t = medusa::tree::from_paths({{0}, {1}, {0, 0}, {0, 1}, {1, 0}, {0, 0, 0}});
  // Request 1: a catch-up of 5 rows; 2: a draft tree's pass after 11 kept slots, all outputs;
  // 3: one row after 9; 4: 20 rows, more than one pass holds (it runs alone, in chunks); 5: 6 rows
  // that no longer fit beside 1–3 and start the next pass.
  struct part {
    int request, kept, rows;
    bool tree;
  };
  const std::vector<part> parts = {{1, 0, 5, false}, {2, 11, t.num_nodes(), true}, {3, 9, 1, false}, {4, 0, 20, false}, {5, 3, 6, false}};
  std::vector<std::vector<std::int32_t>> pos(parts.size());
  std::vector<std::vector<float>> logits(parts.size()), hidden(parts.size()), want_logits(parts.size()), want_hidden(parts.size());
  std::vector<medusa::feature_batch> batches;
  for (std::size_t k = 0; k < parts.size(); ++k) {
    const part& p = parts[k];
    for (auto* e : {&together, &alone})
      if (p.kept > 0) run_rows(*e, p.request, tokens, f, 0, p.kept);
    for (int i = 0; i < p.rows; ++i) pos[k].push_back(p.kept + (p.tree ? t.node_depth(i) : i));
    const int outputs = p.tree ? p.rows : 1;
    for (auto* v : {&logits[k], &want_logits[k]}) v->assign(static_cast<std::size_t>(outputs) * vocab, 0.0f);
    for (auto* v : {&hidden[k], &want_hidden[k]}) v->assign(static_cast<std::size_t>(outputs) * dim, 0.0f);
    medusa::feature_batch b;
    b.request = p.request;
    b.tokens = std::span<const std::int32_t>(tokens).subspan(static_cast<std::size_t>(p.kept), static_cast<std::size_t>(p.rows));
    b.features = std::span<const float>(f).subspan(static_cast<std::size_t>(p.kept) * dim, static_cast<std::size_t>(p.rows) * dim);
    b.positions = pos[k];
    b.cache_length = p.kept;
    if (p.tree) b.tree_mask = t.mask_view();
    b.outputs = outputs;
    b.logits = want_logits[k];
    b.hidden = want_hidden[k];
    alone.forward(b);
    b.logits = logits[k];
    b.hidden = hidden[k];
    batches.push_back(b);
  }
  together.forward_batch(batches);
  for (std::size_t k = 0; k < parts.size(); ++k) {
    CAPTURE(parts[k].request);
    CHECK(logits[k] == want_logits[k]);
    CHECK(hidden[k] == want_hidden[k]);
  }
  // The caches were written as forward writes them: a next row after each batch agrees too.
  for (const part& p : {parts[0], parts[3]}) {
    CAPTURE(p.request);
    const pass_out a = run_rows(together, p.request, tokens, f, p.kept + p.rows, p.kept + p.rows + 1);
    const pass_out b = run_rows(alone, p.request, tokens, f, p.kept + p.rows, p.kept + p.rows + 1);
    CHECK(a.logits == b.logits);
  }
  batches[1].request = batches[0].request;
  CHECK_THROWS_WITH_AS(together.forward_batch(batches), doctest::Contains("request 1 appears twice"), medusa_llama::engine_error);
}
