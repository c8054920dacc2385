// SPDX-License-Identifier: Apache-2.0
// End to end on the real pycode-15m model (skips when MEDUSA_SHARED_DIR has no models): train
// heads by self-distillation with a small budget, save, load the directory back with the head
// checkpoint loader, and decode: greedy Medusa output must equal plain greedy output.
// The sanitizer runs give it less work, every stage and check kept (the asan test preset):
// MEDUSA_TRAIN_TEST_TOKENS=N caps the positions of self-distillation data of each run,
// MEDUSA_TRAIN_TEST_TEXTS=N the held-out texts of the Medusa-2 perplexity, and
// MEDUSA_E2E_NEW_TOKENS=N the new tokens of each lossless decoding (as in test_medusa_e2e).
#include <medusa_llama/packed_heads.hpp>
#include <medusa_train/pipeline.hpp>

#include <medusa/decoder.hpp>
#include <medusa/io/head_checkpoint.hpp>
#include <medusa/tree.hpp>

#include <medusa_llama/engine.hpp>
#include <medusa_llama/model.hpp>
#include <medusa_llama/tokenizer.hpp>


#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

namespace fs = std::filesystem;

namespace {

// `wanted`, or the positive integer in the environment variable `name` when that is smaller.
template <class T>
T capped(const char* name, T wanted) {
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0') return wanted;
  const long long cap = std::atoll(env);
  REQUIRE_MESSAGE(cap > 0, name << " must be a positive integer, not " << env);
  return std::min(wanted, static_cast<T>(cap));
}

}  // namespace

TEST_CASE("pycode-15m: train with a small budget, reload, decode losslessly") {
  const fs::path model_dir = fs::path(MEDUSA_SHARED_DIR) / "models" / "pycode-15m";
  const fs::path corpus = "/usr/lib/python3.11";
  if (!fs::exists(model_dir / "model.bin") || !fs::exists(model_dir / "tokenizer.bin") || !fs::is_directory(corpus)) {
    MESSAGE("skipped: " << (model_dir / "model.bin").string() << " or " << corpus.string() << " is absent");
    return;
  }
  const fs::path out = fs::path(MEDUSA_TEST_TMPDIR) / "train_integration";
  std::error_code ec;
  fs::remove_all(out, ec);

  medusa_train::run_options o;
  o.model = model_dir / "model.bin";
  o.corpus = corpus;
  o.out = out;
  o.heads = 4;
  o.layers = 1;
  o.tokens = capped<std::uint64_t>("MEDUSA_TRAIN_TEST_TOKENS", 4000);
  o.gen_len = 128;
  o.epochs = 2;
  o.threads = 2;
  o.seed = 1;
  o.budget_seconds = 50;
  const auto r = medusa_train::run_training(o, {});
  CHECK(r.cache_rows > 0);
  CHECK(r.fit.steps > 0);
  REQUIRE(r.cal.num_heads == 4);
  CHECK(r.cal.positions[0] > 0);
  // Greedy self-distillation data: the base lm_head reproduces the stored next token.
  CHECK(static_cast<double>(r.cal.base_hits) >= 0.95 * static_cast<double>(r.cal.base_positions));
  // Even a short run learns something beyond chance (1/2048) for head 0.
  CHECK(r.cal.top(0, 5) > 0.05);
  MESSAGE("head top-1: " << r.cal.top(0, 1) << " " << r.cal.top(1, 1) << " " << r.cal.top(2, 1) << " " << r.cal.top(3, 1));

  medusa::head_load_options lo;
  lo.hidden_size = 384;
  lo.vocab_size = 2048;
  lo.min_heads = 4;
  auto loaded = medusa::load_heads(out, lo);
  CHECK(loaded.warnings.empty());
  CHECK(loaded.heads.num_layers() == 1);
  medusa_llama::engine m(medusa_llama::model::load_llama2c(model_dir / "model.bin"), {.threads = 2});
  medusa_llama::packed_heads runner(m, loaded.heads.view());
  medusa_llama::llama2c_tokenizer tok(model_dir / "tokenizer.bin", 2048, false);
  medusa::decode_options dopt;
  dopt.max_new_tokens = capped("MEDUSA_E2E_NEW_TOKENS", 64);
  dopt.eos_token = tok.eos_id();
  for (const char* text : {"import os\nimport sys\n\n\ndef main():\n", "class Stack:\n    def __init__(self):\n        self.items = []\n"}) {
    const auto ids = tok.encode(text, true, false);
    const std::vector<std::int32_t> prompt(ids.begin(), ids.end());
    const auto plain = medusa::generate_vanilla(m, prompt, medusa::greedy_policy{}, dopt);
    double steps = 0, toks = 0;
    for (const auto& tr : {medusa::tree::preset("mc_sim_7b_63"), medusa::tree::from_paths({{0}, {1}, {0, 0}, {0, 0, 0}})}) {
      medusa::decoder dec(m, runner, tr, medusa::greedy_policy{});
      const auto res = dec.generate(prompt, dopt);
      CHECK(res.tokens == plain.tokens);
      steps += res.stats.steps;
      toks += res.stats.new_tokens;
    }
    MESSAGE("tokens per step: " << toks / steps);
    CHECK(toks / steps > 1.0);
  }
}

TEST_CASE("pycode-15m Medusa-2: train with a small budget, reload the merged model and heads, decode losslessly") {
  const fs::path model_dir = fs::path(MEDUSA_SHARED_DIR) / "models" / "pycode-15m";
  const fs::path corpus = "/usr/lib/python3.11";
  if (!fs::exists(model_dir / "model.bin") || !fs::exists(model_dir / "tokenizer.bin") || !fs::is_directory(corpus)) {
    MESSAGE("skipped: " << (model_dir / "model.bin").string() << " or " << corpus.string() << " is absent");
    return;
  }
  const fs::path out = fs::path(MEDUSA_TEST_TMPDIR) / "train_integration_medusa2";
  std::error_code ec;
  fs::remove_all(out, ec);
  medusa_train::run_options o;
  o.what = medusa_train::recipe::medusa2;
  o.model = model_dir / "model.bin";
  o.corpus = corpus;
  o.out = out;
  o.tokens = capped<std::uint64_t>("MEDUSA_TRAIN_TEST_TOKENS", 3000);
  o.gen_len = 128;
  o.epochs = 1;
  o.joint_epochs = 1;
  o.threads = 2;
  o.seed = 1;
  o.budget_seconds = 90;
  o.perplexity_texts = capped("MEDUSA_TRAIN_TEST_TEXTS", o.perplexity_texts);
  const auto r = medusa_train::run_training(o, {});
  CHECK(r.joint.steps > 0);
  CHECK(r.quality.positions > 0);
  CHECK(r.quality.agreement > 0.95);  // a short run stays close to the original
  CHECK(std::fabs(r.quality.perplexity_adapted / r.quality.perplexity_original - 1) < 0.03);
  MESSAGE("agreement " << r.quality.agreement << ", KL " << r.quality.mean_kl << ", perplexity " << r.quality.perplexity_adapted << " vs "
                       << r.quality.perplexity_original);

  medusa::head_load_options lo;
  lo.hidden_size = 384;
  lo.vocab_size = 2048;
  auto loaded = medusa::load_heads(out, lo);
  medusa_llama::engine m(medusa_llama::model::load_llama2c(out / "model" / "model.bin"), {.threads = 2});
  medusa_llama::packed_heads runner(m, loaded.heads.view());
  medusa_llama::llama2c_tokenizer tok(out / "model" / "tokenizer.bin", 2048, false);
  medusa::decode_options dopt;
  dopt.max_new_tokens = capped("MEDUSA_E2E_NEW_TOKENS", 64);
  dopt.eos_token = tok.eos_id();
  for (const char* text : {"import os\nimport sys\n\n\ndef main():\n", "def parse_args(argv):\n    \"\"\"Parse the command line.\"\"\"\n"}) {
    const auto ids = tok.encode(text, true, false);
    const std::vector<std::int32_t> prompt(ids.begin(), ids.end());
    const auto plain = medusa::generate_vanilla(m, prompt, medusa::greedy_policy{}, dopt);
    medusa::decoder dec(m, runner, medusa::tree::from_paths({{0}, {1}, {0, 0}, {0, 0, 0}, {0, 0, 0, 0}}), medusa::greedy_policy{});
    const auto res = dec.generate(prompt, dopt);
    CHECK(res.tokens == plain.tokens);
  }
}
