// SPDX-License-Identifier: Apache-2.0
// Medusa head training (examples/train): the backward pass against finite differences in double,
// a synthetic task the heads must learn, the self-distillation cache (format, reuse, misses),
// determinism of a whole run, and lossless decoding with the trained heads — all on data and
// models made here (a random Llama model and a byte-level tokenizer).
#include <medusa_llama/packed_heads.hpp>
#include <medusa_train/pipeline.hpp>
#include <medusa_train/trainer.hpp>

#include <medusa/decoder.hpp>
#include <medusa/io/head_checkpoint.hpp>
#include <medusa/io/tree_search_files.hpp>
#include <medusa/tree.hpp>

#include <medusa_llama/engine.hpp>
#include <medusa_llama/model.hpp>

#include <doctest/doctest.h>

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace fs = std::filesystem;
using medusa_train::head_shape;

namespace {

fs::path scratch(const std::string& name) {
  const fs::path p = fs::path(MEDUSA_TEST_TMPDIR) / ("train_" + name);
  std::error_code ec;
  fs::remove_all(p, ec);
  fs::create_directories(p);
  return p;
}

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

// ---- gradient check ---------------------------------------------------------------------------

double loss_at(const head_shape& s, const std::vector<double>& p, const std::vector<double>& x, std::size_t B,
               const std::vector<std::int32_t>& y, const std::vector<double>& w) {
  medusa_train::head_workspace<double> ws;
  return medusa_train::head_loss_grad<double>(s, p.data(), nullptr, x.data(), B, y.data(), w.data(), ws).loss;
}

void gradient_check(std::size_t L) {
  const head_shape s{6, 7, 2, L};
  const std::size_t B = 5;
  std::mt19937 rng(static_cast<unsigned>(11 + L));
  std::normal_distribution<double> n(0.0, 1.0);
  std::vector<double> p(s.num_params()), x(B * s.d), w{1.0, 0.8};
  for (auto& v : p) v = 0.5 * n(rng);
  for (auto& v : x) v = n(rng);
  std::vector<std::int32_t> y(B * s.K);
  for (std::size_t i = 0; i < y.size(); ++i) y[i] = static_cast<std::int32_t>(rng() % s.V);
  y[3] = medusa_train::ignore_index;  // row 1, head 1 has no target
  y[8] = medusa_train::ignore_index;  // row 4, head 0
  std::vector<double> g(s.num_params(), 0.0);
  medusa_train::head_workspace<double> ws;
  const auto st = medusa_train::head_loss_grad<double>(s, p.data(), g.data(), x.data(), B, y.data(), w.data(), ws);
  CHECK(st.counted[0] == 4);
  CHECK(st.counted[1] == 4);
  CHECK(std::isfinite(st.loss));
  double max_err = 0;
  const double h = 1e-6;
  for (std::size_t i = 0; i < p.size(); ++i) {
    auto q = p;
    q[i] = p[i] + h;
    const double up = loss_at(s, q, x, B, y, w);
    q[i] = p[i] - h;
    const double down = loss_at(s, q, x, B, y, w);
    const double fd = (up - down) / (2 * h);
    max_err = std::max(max_err, std::fabs(fd - g[i]) / std::max(1.0, std::fabs(fd)));
  }
  CHECK(max_err < 1e-6);
  // Accumulation: a second call adds the same gradient again.
  auto g2 = g;
  (void)medusa_train::head_loss_grad<double>(s, p.data(), g2.data(), x.data(), B, y.data(), w.data(), ws);
  for (std::size_t i = 0; i < g.size(); i += 7) CHECK(g2[i] == doctest::Approx(2 * g[i]).epsilon(1e-12));
}

// ---- synthetic data ---------------------------------------------------------------------------

// Sequences over V tokens where token t+1 = (5·token t + 3) mod V, so every head's target is a
// fixed function of the current token; hidden states are a fixed random embedding of the token.
fs::path synthetic_cache(const fs::path& dir, std::size_t d, std::size_t V, medusa::weight_dtype dt) {
  std::mt19937 rng(3);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> emb(V * d);
  for (auto& v : emb) v = n(rng);
  const fs::path file = dir / "synthetic.bin";
  medusa_train::distill_cache_writer w(file, d, V, dt, 42);
  for (int seq = 0; seq < 60; ++seq) {
    std::vector<std::int32_t> tok(24);
    tok[0] = static_cast<std::int32_t>(rng() % V);
    for (std::size_t i = 1; i < tok.size(); ++i) tok[i] = static_cast<std::int32_t>((5 * static_cast<std::size_t>(tok[i - 1]) + 3) % V);
    std::vector<float> hid(tok.size() * d);
    for (std::size_t i = 0; i < tok.size(); ++i)
      for (std::size_t e = 0; e < d; ++e) hid[i * d + e] = emb[static_cast<std::size_t>(tok[i]) * d + e];
    w.add(tok, hid, seq % 6 == 5 ? medusa_train::split::eval : medusa_train::split::train, 3);
  }
  CHECK(w.records() == 60);
  CHECK(w.rows() == 60 * 24);
  return w.finish();
}

// ---- a tiny random Llama model and a byte-level llama2.c tokenizer ---------------------------

struct tiny_assets {
  fs::path model, tokenizer, corpus;
};

tiny_assets make_assets(const fs::path& dir) {
  tiny_assets a;
  medusa_llama::model_config c;
  c.dim = 32;
  c.hidden_dim = 64;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.vocab_size = 259;
  c.seq_len = 160;
  a.model = dir / "model.bin";
  medusa_llama::model::random(c, 5, 0.5f).save_llama2c(a.model);
  // <unk>, <s>, </s>, then the 256 byte pieces <0xXX> (ids 3..258).
  a.tokenizer = dir / "tokenizer.bin";
  std::ofstream t(a.tokenizer, std::ios::binary);
  auto put_i32 = [&](std::int32_t v) { t.write(reinterpret_cast<const char*>(&v), 4); };
  auto put_piece = [&](const std::string& s) {
    const float score = 0.0f;
    t.write(reinterpret_cast<const char*>(&score), 4);
    put_i32(static_cast<std::int32_t>(s.size()));
    t.write(s.data(), static_cast<std::streamsize>(s.size()));
  };
  put_i32(8);
  put_piece("<unk>");
  put_piece("\n<s>\n");
  put_piece("\n</s>\n");
  for (int b = 0; b < 256; ++b) {
    char buf[8];
    std::snprintf(buf, sizeof buf, "<0x%02X>", b);
    put_piece(buf);
  }
  t.close();
  a.corpus = dir / "corpus";
  fs::create_directories(a.corpus / "sub");
  std::ofstream(a.corpus / "a.py") << "def add(a, b):\n    return a + b\n\n\nclass Stack:\n    def push(self, x):\n        self.items.append(x)\n";
  std::ofstream(a.corpus / "b.txt") << "The quick brown fox jumps over the lazy dog.\nPack my box with five dozen liquor jugs.\n";
  std::ofstream(a.corpus / "sub" / "c.py") << "import os\nimport sys\n\nfor i in range(10):\n    print(i, os.getcwd())\n";
  std::ofstream(a.corpus / "sub" / "d.md") << "# Title\n\nSome *markdown* text with a [link](http://example.com).\n";
  std::ofstream(a.corpus / "blob.bin") << std::string("\0\1\2binary", 9);  // skipped (extension, NUL)
  return a;
}

medusa_train::run_options tiny_options(const tiny_assets& a, const fs::path& out) {
  medusa_train::run_options o;
  o.model = a.model;
  o.tokenizer = a.tokenizer;
  o.corpus = a.corpus;
  o.out = out;
  o.heads = 3;
  o.layers = 1;
  o.tokens = 600;
  o.gen_len = 40;
  o.prompt_min = 4;
  o.prompt_max = 12;
  o.eval_fraction = 0.25;
  o.epochs = 1;
  o.batch = 64;
  o.threads = 2;
  o.seed = 7;
  return o;
}

}  // namespace

TEST_CASE("head backward pass matches finite differences (double), L = 0, 1, 2") {
  for (std::size_t L : {0u, 1u, 2u}) {
    CAPTURE(L);
    gradient_check(L);
  }
}

TEST_CASE("head_logits equals the forward inside head_loss_grad and medusa::head_stack") {
  const head_shape s{8, 11, 3, 2};
  std::mt19937 rng(4);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> lm(s.V * s.d);
  for (auto& v : lm) v = n(rng);
  medusa_train::head_trainer t(s, lm.data(), 9, 1);
  for (auto& v : t.params()) v = 0.3f * n(rng);
  std::vector<float> x(4 * s.d), ours(4 * s.K * s.V), lib(ours.size());
  for (auto& v : x) v = n(rng);
  t.logits(x.data(), 4, ours.data());
  medusa::portable_gemm<> g;
  t.weights().view().forward(g, x, 4, lib);
  for (std::size_t i = 0; i < ours.size(); ++i) CHECK(ours[i] == doctest::Approx(lib[i]).epsilon(1e-4));
}

TEST_CASE("initialisation follows the training recipe: W = 0, |b| <= 1/sqrt(d), U = lm_head") {
  const head_shape s{16, 10, 2, 1};
  std::vector<float> lm(s.V * s.d);
  for (std::size_t i = 0; i < lm.size(); ++i) lm[i] = static_cast<float>(i % 13) - 6.0f;
  medusa_train::head_trainer t(s, lm.data(), 1, 1);
  const auto p = t.params();
  for (std::size_t i = 0; i < s.w_size(); ++i) CHECK(p[i] == 0.0f);
  bool nonzero = false;
  for (std::size_t i = s.w_size(); i < s.w_size() + s.b_size(); ++i) {
    CHECK(std::fabs(p[i]) <= 0.25f);
    nonzero = nonzero || p[i] != 0.0f;
  }
  CHECK(nonzero);
  for (std::size_t k = 0; k < s.K; ++k) CHECK(std::memcmp(p.data() + s.u_offset(k), lm.data(), 4 * lm.size()) == 0);
}

TEST_CASE("learning-rate schedule: linear warm-up then cosine to the floor") {
  medusa_train::optimizer_options o;
  o.lr = 1e-3;
  o.warmup_fraction = 0.1;
  CHECK(medusa_train::learning_rate(o, 0, 100) == doctest::Approx(1e-4));
  CHECK(medusa_train::learning_rate(o, 9, 100) == doctest::Approx(1e-3));
  CHECK(medusa_train::learning_rate(o, 10, 100) == doctest::Approx(1e-3));
  CHECK(medusa_train::learning_rate(o, 55, 100) == doctest::Approx(5e-4).epsilon(0.02));
  CHECK(medusa_train::learning_rate(o, 100, 100) == doctest::Approx(0.0));
  o.min_lr_fraction = 0.1;
  CHECK(medusa_train::learning_rate(o, 100, 100) == doctest::Approx(1e-4));
}

TEST_CASE("synthetic task: heads learn a deterministic next-token rule to >= 95%") {
  const auto dir = scratch("synthetic");
  const std::size_t d = 32, V = 32;
  for (auto dt : {medusa::weight_dtype::f32, medusa::weight_dtype::bf16}) {
    CAPTURE(medusa::to_string(dt));
    const auto file = synthetic_cache(dir, d, V, dt);
    const auto data = medusa_train::distill_cache::open(file);
    CHECK(data.size() == 60);
    CHECK(data.key_hash() == 42);
    CHECK(data.dtype() == dt);
    std::mt19937 rng(8);
    std::normal_distribution<float> n(0.0f, 0.2f);
    std::vector<float> lm(V * d);
    for (auto& v : lm) v = n(rng);
    medusa_train::head_trainer t({d, V, 3, 1}, lm.data(), 1, 2);
    const auto before = medusa_train::evaluate(t, data, medusa_train::split::eval);
    medusa_train::fit_options fo;
    fo.batch = 64;
    fo.epochs = 30;
    fo.opt.lr = 1e-2;
    const auto r = medusa_train::fit(t, data, fo);
    CHECK(r.train_positions == 50 * 22);
    const auto cal = medusa_train::evaluate(t, data, medusa_train::split::eval, 10, lm.data());
    CHECK(cal.sequences == 10);
    REQUIRE(cal.positions.size() == 3);
    CHECK(cal.positions[0] == 10 * 22);
    CHECK(cal.positions[2] == 10 * 20);  // head 2 needs t+4
    for (std::size_t k = 0; k < 3; ++k) {
      CAPTURE(k);
      CHECK(before.top(k, 1) < 0.5);
      CHECK(cal.top(k, 1) >= 0.95);
      double sum = 0;
      for (std::size_t rk = 0; rk < 10; ++rk) sum += cal.acc(k, rk);
      CHECK(sum <= 1.0 + 1e-12);
    }
    const std::string js = medusa_train::calibration_json(cal);
    CHECK(js.find("\"accuracy\"") != std::string::npos);
    CHECK(js.find("\"num_heads\": 3") != std::string::npos);
    // Path counts: every position with a head-0 target is counted once, a path never more often
    // than its prefix, and the head-0 rank-0 path as often as head 0's top-1 hits.
    CHECK(js.find("\"version\": 2") != std::string::npos);
    CHECK(cal.path_positions == cal.positions[0]);
    CHECK(cal.path_counts.at({0}) == cal.hits[0][0]);
    const auto pc = medusa::parse_calibration(js);
    CHECK(pc.conditional());
    CHECK(pc.probability(std::vector<int>{0}) == doctest::Approx(cal.top(0, 1)));
    // The best tree starts with the best path and stays prefix-closed (it compiles).
    const auto paths = medusa_train::best_tree(cal, 11, 3);
    CHECK(!paths.empty());
    CHECK(paths.size() <= 10);
    CHECK(paths[0] == std::vector<int>{0});
    CHECK_NOTHROW((void)medusa::tree::from_paths(paths));
  }
}

TEST_CASE("distill cache: corrupt, truncated and incomplete files are rejected") {
  const auto dir = scratch("cache_errors");
  const auto file = synthetic_cache(dir, 8, 16, medusa::weight_dtype::bf16);
  const std::string good = slurp(file);
  auto write = [&](const std::string& bytes) {
    std::ofstream(dir / "bad.bin", std::ios::binary) << bytes;
    return dir / "bad.bin";
  };
  CHECK_THROWS_AS((void)medusa_train::distill_cache::open(write(good.substr(0, good.size() - 3))), medusa::io_error);
  CHECK_THROWS_AS((void)medusa_train::distill_cache::open(write(good.substr(0, 40))), medusa::io_error);
  std::string bad = good;
  bad[0] = 'X';
  CHECK_THROWS_AS((void)medusa_train::distill_cache::open(write(bad)), medusa::io_error);
  bad = good;
  bad[48] = 0;  // complete flag
  CHECK_THROWS_AS((void)medusa_train::distill_cache::open(write(bad)), medusa::io_error);
  CHECK_FALSE(medusa_train::distill_cache::peek_key(dir / "bad.bin").has_value());
  bad = good;
  bad[64 + 16] = static_cast<char>(0xff);  // first token of the first record becomes negative/huge
  bad[64 + 19] = static_cast<char>(0x7f);
  CHECK_THROWS_AS((void)medusa_train::distill_cache::open(write(bad)), medusa::io_error);
  CHECK_THROWS_AS((void)medusa_train::distill_cache::open(dir / "missing.bin"), medusa::io_error);
  // An unfinished writer leaves nothing behind.
  {
    medusa_train::distill_cache_writer w(dir / "unfinished.bin", 8, 16, medusa::weight_dtype::f32, 1);
    const std::int32_t tok[2] = {1, 2};
    std::vector<float> h(16);
    w.add(tok, h, medusa_train::split::train, 1);
    CHECK_THROWS_AS(w.add(tok, std::span<const float>(h).first(3), medusa_train::split::train, 1), medusa::invalid_input);
  }
  for (const auto& e : fs::directory_iterator(dir)) CHECK(e.path().filename().string().find("unfinished") == std::string::npos);
}

TEST_CASE("distill cache: a file's key follows its bytes, not its path or modification time") {
  const auto dir = scratch("cache_key");
  const std::string bytes(3u << 20, 'a');  // more than one read block
  std::ofstream(dir / "model.bin", std::ios::binary) << bytes;
  const auto key = [](const fs::path& f) { return medusa_train::cache_key_builder().add_file("model", f).build(); };
  const medusa_train::cache_key first = key(dir / "model.bin");
  fs::create_directories(dir / "copy");
  fs::copy_file(dir / "model.bin", dir / "copy" / "model.bin");
  fs::last_write_time(dir / "copy" / "model.bin", fs::last_write_time(dir / "model.bin") - std::chrono::hours(5));
  CHECK(key(dir / "copy" / "model.bin").hash == first.hash);
  std::string changed = bytes;
  changed[2u << 20] = 'b';  // one byte, in the third block
  std::ofstream(dir / "copy" / "model.bin", std::ios::binary | std::ios::trunc) << changed;
  CHECK(key(dir / "copy" / "model.bin").hash != first.hash);
  std::ofstream(dir / "copy" / "model.bin", std::ios::binary | std::ios::trunc) << bytes.substr(1);
  CHECK(key(dir / "copy" / "model.bin").hash != first.hash);
  CHECK_THROWS_AS((void)key(dir / "missing.bin"), medusa::io_error);
}

TEST_CASE("lookup drafting proposes what followed the last n-gram") {
  const std::vector<int> ctx{1, 5, 6, 7, 8, 2, 5, 6};
  CHECK(medusa_train::lookup_draft(ctx, 2, 3) == std::vector<int>{7, 8, 2});
  CHECK(medusa_train::lookup_draft(ctx, 2, 1) == std::vector<int>{7});
  CHECK(medusa_train::lookup_draft(std::vector<int>{1, 2, 3}, 3, 4).empty());
  CHECK(medusa_train::lookup_draft(ctx, 2, 0).empty());
}

TEST_CASE("whole run on a tiny model: cache reuse and misses, determinism, lossless decoding") {
  const auto dir = scratch("run");
  const auto a = make_assets(dir);
  const auto o = tiny_options(a, dir / "out1");
  const auto r1 = medusa_train::run_training(o, {});
  CHECK_FALSE(r1.cache_hit);
  CHECK(r1.distill.rows == 600);
  CHECK(r1.distill.eval_rows > 0);
  CHECK(r1.distill.train_rows > r1.distill.eval_rows);
  CHECK(r1.cal.base_positions > 0);
  CHECK(static_cast<double>(r1.cal.base_hits) >= 0.97 * static_cast<double>(r1.cal.base_positions));  // greedy data
  CHECK(fs::exists(dir / "out1" / "medusa_heads.safetensors"));
  CHECK(fs::exists(dir / "out1" / "config.json"));
  const std::string cal = slurp(dir / "out1" / "calibration.json");
  CHECK(cal.find("\"medusa-calibration\"") != std::string::npos);
  CHECK(fs::exists(r1.cache_file));

  // Same inputs, same cache directory: a hit, and bit-identical weights (same seed and threads).
  auto o2 = o;
  o2.out = dir / "out2";
  o2.cache_dir = dir / "out1" / "cache";
  const auto r2 = medusa_train::run_training(o2, {});
  CHECK(r2.cache_hit);
  CHECK(r2.cache_file == r1.cache_file);
  CHECK(r2.distill.rows == 0);
  CHECK(slurp(dir / "out1" / "medusa_heads.safetensors") == slurp(dir / "out2" / "medusa_heads.safetensors"));

  // --heads-dtype f16: the same training, the file holds its weights rounded to f16 in half the bytes.
  {
    auto o7 = o2;
    o7.out = dir / "out7";
    o7.heads_dtype = medusa::weight_dtype::f16;
    CHECK(medusa_train::run_training(o7, {}).cache_hit);
    CHECK(slurp(dir / "out7" / "medusa_heads.safetensors").size() * 10 <
          slurp(dir / "out2" / "medusa_heads.safetensors").size() * 6);
    auto f16 = medusa::load_heads(dir / "out7");
    medusa::head_load_options to_f16;
    to_f16.dtype = medusa::weight_dtype::f16;
    auto rounded = medusa::load_heads(dir / "out2", to_f16);
    REQUIRE(f16.heads.dtype() == medusa::weight_dtype::f16);
    REQUIRE(rounded.heads.dtype() == medusa::weight_dtype::f16);
    for (std::size_t h = 0; h < f16.heads.num_heads(); ++h) {
      const auto a = f16.heads.projection_bytes(h), b = rounded.heads.projection_bytes(h);
      CHECK(std::equal(a.begin(), a.end(), b.begin(), b.end()));
      const auto wa = f16.heads.resblock_weight_bytes(h, 0), wb = rounded.heads.resblock_weight_bytes(h, 0);
      CHECK(std::equal(wa.begin(), wa.end(), wb.begin(), wb.end()));
    }
  }

  // Regenerated data with the same seed is the same data: identical weights without the cache.
  auto o3 = o;
  o3.out = dir / "out3";
  const auto r3 = medusa_train::run_training(o3, {});
  CHECK_FALSE(r3.cache_hit);
  CHECK(r3.key.hash == r1.key.hash);
  CHECK(slurp(r3.cache_file) == slurp(r1.cache_file));
  CHECK(slurp(dir / "out1" / "medusa_heads.safetensors") == slurp(dir / "out3" / "medusa_heads.safetensors"));

  // Changed inputs miss: another seed, another budget, an edited corpus file.
  auto o4 = o2;
  o4.seed = 8;
  CHECK(medusa_train::run_training(o4, {}).cache_hit == false);
  auto o5 = o2;
  o5.tokens = 500;
  CHECK(medusa_train::run_training(o5, {}).cache_hit == false);
  std::ofstream(a.corpus / "b.txt", std::ios::app) << "One more line.\n";
  const auto r6 = medusa_train::run_training(o2, {});
  CHECK_FALSE(r6.cache_hit);
  CHECK(r6.key.hash != r1.key.hash);

  // The saved directory loads with the checkpoint loader and decodes losslessly.
  medusa::head_load_options lo;
  lo.hidden_size = 32;
  lo.vocab_size = 259;
  auto loaded = medusa::load_heads(dir / "out1", lo);
  CHECK(loaded.heads.num_heads() == 3);
  CHECK(loaded.heads.num_layers() == 1);
  CHECK(loaded.warnings.empty());
  medusa_llama::engine m(medusa_llama::model::load_llama2c(a.model), {.threads = 1});
  medusa_llama::packed_heads runner(m, loaded.heads.view());
  medusa::decode_options dopt;
  dopt.max_new_tokens = 60;
  const std::vector<std::int32_t> prompt{1, 103, 104, 105};
  const auto plain = medusa::generate_vanilla(m, prompt, medusa::greedy_policy{}, dopt);
  for (const auto& tr : {medusa::tree::from_paths({{0}, {0, 0}, {0, 0, 0}}), medusa::tree::from_paths({{0}, {1}, {0, 0}, {0, 1}, {1, 0}, {0, 0, 0}})}) {
    medusa::decoder dec(m, runner, tr, medusa::greedy_policy{});
    const auto out = dec.generate(prompt, dopt);
    CHECK(out.tokens == plain.tokens);
    CHECK(out.stats.steps <= plain.stats.steps);
  }
}

TEST_CASE("a budget-cut data cache is continued by the next run: the same data and heads as one uninterrupted run") {
  const auto dir = scratch("resume");
  const auto a = make_assets(dir);
  // The uninterrupted run: the reference data and heads.
  const auto full = medusa_train::run_training(tiny_options(a, dir / "full"), {});
  REQUIRE_FALSE(full.distill.deadline_hit);
  const std::string full_data = slurp(full.cache_file);
  const std::string full_heads = slurp(dir / "full" / "medusa_heads.safetensors");

  // A run whose budget ends after its second sequence: the progress callback (after every
  // sequence) sleeps past the data deadline (60 % of the budget from the run's start, which was
  // before this call), so the cut falls there whatever the machine's speed.
  auto o = tiny_options(a, dir / "cut");
  o.cache_dir = dir / "cache";
  o.budget_seconds = 1.0;
  medusa_train::run_events ev;
  ev.progress_interval = 0;
  ev.on_distill = [](const medusa_train::distill_progress& p) {
    if (p.sequences == 2) std::this_thread::sleep_for(std::chrono::milliseconds(700));
  };
  const auto cut = medusa_train::run_training(o, ev);
  REQUIRE(cut.distill.deadline_hit);
  CHECK(cut.distill.sequences == 2);
  CHECK(cut.cache_file.filename().string().ends_with(".partial.bin"));
  CHECK_FALSE(fs::exists(o.cache_dir / full.cache_file.filename()));  // never under the complete name
  const std::string partial = slurp(cut.cache_file);
  const auto partial_bytes = fs::file_size(cut.cache_file);
  CHECK(full_data.compare(64, partial_bytes - 64, partial, 64, partial_bytes - 64) == 0);  // the same records so far

  // The next run with the same settings and no budget continues the partial data.
  o.budget_seconds = 0;
  o.out = dir / "resumed";
  std::vector<std::string> lines;
  ev = {};
  ev.log = [&](const std::string& s) { lines.push_back(s); };
  const auto resumed = medusa_train::run_training(o, ev);
  CHECK_FALSE(resumed.cache_hit);
  CHECK_FALSE(resumed.distill.deadline_hit);
  CHECK(resumed.distill.reused_sequences == 2);
  CHECK(resumed.distill.reused_rows == cut.distill.rows);
  CHECK(resumed.distill.rows == full.distill.rows);
  CHECK(resumed.distill.sequences == full.distill.sequences);
  CHECK(resumed.distill.rows - resumed.distill.reused_rows < full.distill.rows);  // generated less
  CHECK(std::count_if(lines.begin(), lines.end(), [](const std::string& l) { return l.starts_with("resuming "); }) == 1);
  CHECK(resumed.cache_file == o.cache_dir / full.cache_file.filename());
  CHECK(slurp(resumed.cache_file) == full_data);
  CHECK(slurp(dir / "resumed" / "medusa_heads.safetensors") == full_heads);
  CHECK_FALSE(fs::exists(cut.cache_file));  // superseded
  for (const auto& e : fs::directory_iterator(o.cache_dir)) CHECK(e.path().filename().string().find(".tmp") == std::string::npos);

  // A damaged or foreign partial file is reported and replaced, never trusted and never a crash.
  const auto partial_path = cut.cache_file;
  auto run_with_partial = [&](const std::string& bytes, const char* expect) {
    CAPTURE(expect);
    fs::remove(resumed.cache_file);
    std::ofstream(partial_path, std::ios::binary) << bytes;
    lines.clear();
    o.out = dir / "again";
    const auto r = medusa_train::run_training(o, ev);
    CHECK(r.distill.reused_sequences == 0);
    CHECK(std::count_if(lines.begin(), lines.end(), [&](const std::string& l) {
            return l.find("not reused") != std::string::npos && l.find(expect) != std::string::npos;
          }) == 1);
    CHECK(slurp(r.cache_file) == full_data);
    CHECK_FALSE(fs::exists(partial_path));
  };
  run_with_partial(partial.substr(0, partial.size() - 5), "truncated");
  run_with_partial(partial.substr(0, 30), "truncated");
  std::string other = partial;
  other[40] = static_cast<char>(other[40] ^ 1);  // the key hash of other settings
  run_with_partial(other, "other settings");
  std::string corrupt = partial;
  corrupt[64] = static_cast<char>(0xff);  // a record's row count
  corrupt[67] = static_cast<char>(0x7f);
  run_with_partial(corrupt, "record 0");
}

TEST_CASE("bad options are typed errors") {
  const auto dir = scratch("bad");
  const auto a = make_assets(dir);
  auto o = tiny_options(a, dir / "out");
  o.heads = 0;
  CHECK_THROWS_AS((void)medusa_train::run_training(o, {}), medusa::invalid_input);
  o = tiny_options(a, dir / "out");
  o.prompts = dir / "prompts.txt";  // both --prompts and --corpus
  CHECK_THROWS_AS((void)medusa_train::run_training(o, {}), medusa::invalid_input);
  o = tiny_options(a, dir / "out");
  o.corpus = dir / "nothing-here";
  CHECK_THROWS_AS((void)medusa_train::run_training(o, {}), medusa::invalid_input);
  o = tiny_options(a, dir / "out");
  o.corpus.clear();
  o.prompts = dir / "prompts.txt";
  std::ofstream(o.prompts) << "\n   \n";
  CHECK_THROWS_AS((void)medusa_train::run_training(o, {}), medusa::invalid_input);
  o = tiny_options(a, dir / "a-file");
  std::ofstream(o.out) << "not a directory";
  CHECK_THROWS_WITH_AS((void)medusa_train::run_training(o, {}), doctest::Contains("exists and is not a directory"), medusa::invalid_input);
  CHECK(slurp(o.out) == "not a directory");
  const head_shape s{4, 5, 1, 0};
  std::vector<float> lm(20, 0.0f), x(4, 1.0f), w{1.0f};
  medusa_train::head_trainer t(s, lm.data(), 0, 1);
  const std::int32_t y = 5;  // outside [0, V)
  CHECK_THROWS_AS((void)t.loss(x.data(), 1, &y, w), medusa::invalid_input);
}

// ---- Medusa-2 -----------------------------------------------------------------------------------

namespace {

medusa_train::run_options tiny_medusa2(const tiny_assets& a, const fs::path& out) {
  auto o = tiny_options(a, out);
  o.what = medusa_train::recipe::medusa2;
  o.lora = {.rank = 4, .alpha = 8, .dropout = 0.05};
  o.joint_epochs = 2;
  o.batch_sequences = 4;
  o.heads_lr = 3e-3;
  o.backbone_lr = 1e-3;
  o.teacher_topk = 8;
  return o;
}

}  // namespace

TEST_CASE("Medusa-2 on a tiny model: byte-identical reruns, merged model and adapter, lossless decoding") {
  const auto dir = scratch("medusa2");
  const auto a = make_assets(dir);
  const auto r1 = medusa_train::run_training(tiny_medusa2(a, dir / "m2a"), {});
  CHECK(r1.fit.steps > 0);    // the heads-only stage ran
  CHECK(r1.joint.steps >= 2);  // then the joint one
  CHECK(r1.joint.train_sequences > 0);
  CHECK(r1.quality.positions > 0);
  CHECK(r1.quality.text_tokens > 0);
  CHECK(r1.quality.mean_kl > 0);  // the adapters moved the model …
  CHECK(r1.quality.agreement > 0.8);  // … and it still mostly agrees with the original
  CHECK(std::isfinite(r1.quality.perplexity_adapted));
  for (const char* f : {"medusa_heads.safetensors", "config.json", "calibration.json", "tree-6.json", "model/model.bin", "model/tokenizer.bin",
                        "adapter/adapter_model.safetensors", "adapter/adapter_config.json"})
    CHECK_MESSAGE(fs::exists(dir / "m2a" / f), f);
  CHECK(slurp(dir / "m2a" / "model" / "model.bin") != slurp(a.model));
  const std::string cal = slurp(dir / "m2a" / "calibration.json");
  CHECK(cal.find("\"recipe\": \"medusa2\"") != std::string::npos);
  CHECK(cal.find("\"agreement\"") != std::string::npos);
  // No temporary directory is left beside the output.
  for (const auto& e : fs::directory_iterator(dir)) CHECK(e.path().filename().string().find(".tmp-") == std::string::npos);

  // The adapter: 2 layers × 7 projections × (A, B), PEFT names and shapes.
  const auto ad = medusa::safetensors_file::open(dir / "m2a" / "adapter" / "adapter_model.safetensors");
  CHECK(ad.tensors().size() == 2 * 7 * 2);
  const auto* qa = ad.find("base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight");
  REQUIRE(qa != nullptr);
  CHECK(qa->shape == std::vector<std::uint64_t>{4, 32});
  const auto* db = ad.find("base_model.model.model.layers.0.mlp.down_proj.lora_B.weight");
  REQUIRE(db != nullptr);
  CHECK(db->shape == std::vector<std::uint64_t>{32, 4});
  CHECK(slurp(dir / "m2a" / "adapter" / "adapter_config.json").find("\"r\": 4") != std::string::npos);

  // Same seed and threads, data generated again: byte-identical outputs.
  const auto r2 = medusa_train::run_training(tiny_medusa2(a, dir / "m2b"), {});
  CHECK_FALSE(r2.cache_hit);
  for (const char* f : {"medusa_heads.safetensors", "model/model.bin", "adapter/adapter_model.safetensors"})
    CHECK_MESSAGE(slurp(dir / "m2a" / f) == slurp(dir / "m2b" / f), f);

  // The merged model and its heads decode losslessly: Medusa output == the merged model's greedy output.
  medusa::head_load_options lo;
  lo.hidden_size = 32;
  lo.vocab_size = 259;
  auto loaded = medusa::load_heads(dir / "m2a", lo);
  medusa_llama::engine m(medusa_llama::model::load_llama2c(dir / "m2a" / "model" / "model.bin"), {.threads = 1});
  medusa_llama::packed_heads runner(m, loaded.heads.view());
  medusa::decode_options dopt;
  dopt.max_new_tokens = 60;
  for (const std::vector<std::int32_t>& prompt : {std::vector<std::int32_t>{1, 103, 104, 105}, std::vector<std::int32_t>{1, 40, 90}}) {
    const auto plain = medusa::generate_vanilla(m, prompt, medusa::greedy_policy{}, dopt);
    medusa::decoder dec(m, runner, medusa::tree::from_paths({{0}, {1}, {0, 0}, {0, 1}, {1, 0}, {0, 0, 0}}), medusa::greedy_policy{});
    const auto out = dec.generate(prompt, dopt);
    CHECK(out.tokens == plain.tokens);
  }

  // --init-heads: the heads-only stage is skipped, the heads continue from the given ones.
  auto o3 = tiny_medusa2(a, dir / "m2c");
  o3.init_heads = dir / "m2a";
  o3.cache_dir = dir / "m2a" / "cache";
  const auto r3 = medusa_train::run_training(o3, {});
  CHECK(r3.cache_hit);
  CHECK(r3.fit.steps == 0);
  CHECK(r3.joint.steps > 0);
}

TEST_CASE("Medusa-2 bad input: one clear error and nothing written") {
  const auto dir = scratch("medusa2_bad");
  const auto a = make_assets(dir);
  const auto out = dir / "out";
  auto expect_error = [&](const medusa_train::run_options& o, const std::string& text) {
    INFO("expected: " << text);
    CHECK_THROWS_WITH_AS((void)medusa_train::run_training(o, {}), doctest::Contains(text.c_str()), medusa::invalid_input);
    CHECK_FALSE(fs::exists(out));
  };
  auto o = tiny_medusa2(a, out);
  o.lora.rank = 0;
  expect_error(o, "--lora-rank 0 is outside [1, d = 32]");
  o.lora.rank = 33;
  expect_error(o, "--lora-rank 33 is outside [1, d = 32]");
  o = tiny_medusa2(a, out);
  o.backbone_lr = 5e-3;
  o.heads_lr = 2e-3;
  expect_error(o, "--backbone-lr 0.005 must be below --heads-lr 0.002");
  o.backbone_lr = 2e-3;  // equal is refused too
  expect_error(o, "must be below --heads-lr");
  // Heads of another model (d = 16) for --init-heads.
  const auto other = medusa::head_weights::initialize(16, 259, 3, 1, medusa::projection_kind::per_head, medusa::weight_dtype::f32, {}, 1);
  medusa::save_heads(dir / "other-heads", other.view());
  o = tiny_medusa2(a, out);
  o.init_heads = dir / "other-heads";
  expect_error(o, "holds heads for d=16 V=259, the model has d=32 V=259");
  const auto other_v = medusa::head_weights::initialize(32, 300, 3, 1, medusa::projection_kind::per_head, medusa::weight_dtype::f32, {}, 1);
  medusa::save_heads(dir / "other-vocab", other_v.view());
  o.init_heads = dir / "other-vocab";
  expect_error(o, "d=32 V=300");
}

TEST_CASE("a full disk fails the run with an I/O error and leaves the previous output as it was") {
  const auto dir = scratch("full_disk");
  const auto a = make_assets(dir);
  auto o = tiny_medusa2(a, dir / "out");
  o.cache_dir = dir / "cache";
  (void)medusa_train::run_training(o, {});  // the data, the teacher and a first output
  const std::string heads_before = slurp(dir / "out" / "medusa_heads.safetensors");
  const std::string model_before = slurp(dir / "out" / "model" / "model.bin");
  REQUIRE(model_before.size() > 40000);
  // Every file may now hold at most 32 KiB (the cache is read, not written): writing the heads
  // and the merged model fails as on a full disk.
  auto before = std::signal(SIGXFSZ, SIG_IGN);
  rlimit old{};
  REQUIRE(getrlimit(RLIMIT_FSIZE, &old) == 0);
  rlimit small = old;
  small.rlim_cur = 32 * 1024;
  REQUIRE(setrlimit(RLIMIT_FSIZE, &small) == 0);
  o.seed = o.seed;  // same inputs: the caches are hits
  bool threw = false;
  try {
    (void)medusa_train::run_training(o, {});
  } catch (const medusa::io_error& e) {  // medusa_llama::load_error is one too
    threw = true;
    MESSAGE("error: " << std::string(e.what()));
  }
  setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, before);
  CHECK(threw);
  CHECK(slurp(dir / "out" / "medusa_heads.safetensors") == heads_before);
  CHECK(slurp(dir / "out" / "model" / "model.bin") == model_before);
  for (const auto& e : fs::directory_iterator(dir)) CHECK(e.path().filename().string().find(".tmp-") == std::string::npos);
}
