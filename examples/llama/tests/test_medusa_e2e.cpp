// SPDX-License-Identifier: Apache-2.0
// End to end on the real models in ../shared/models: greedy Medusa decoding through the example
// engine equals plain greedy decoding token for token (random heads, several prompts and trees,
// 256 new tokens), with run-time trees and, for presets on each model's first prompt, their
// compile-time trees through medusa::dispatch_tree. Skips with a message when the shared models are absent.
// MEDUSA_E2E_NEW_TOKENS=N caps the new tokens per prompt and MEDUSA_E2E_PROMPTS=N the prompts per
// model: the sanitizer and emulator runs use them to cover every model, tree and weight format in
// a few minutes.
#include <medusa/dispatch.hpp>
#include <medusa/medusa.hpp>

#include <medusa_llama/engine.hpp>
#include <medusa_llama/load.hpp>
#include <medusa_llama/packed_heads.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

namespace {

const std::filesystem::path models = std::filesystem::path(MEDUSA_SHARED_DIR) / "models";

// `wanted`, or the positive integer in environment variable `name` when that is smaller.
int env_cap(const char* name, int wanted) {
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0') return wanted;
  const int cap = std::atoi(env);
  REQUIRE_MESSAGE(cap > 0, (std::string(name) + " must be a positive integer, not " + env));
  return std::min(wanted, cap);
}

bool have(const std::filesystem::path& p) {
  if (std::filesystem::exists(p)) return true;
  MESSAGE("skipped: " << p.string() << " not found");
  return false;
}

void check_lossless(const std::filesystem::path& model_path, const std::filesystem::path& tokenizer_path,
                    const std::vector<std::string>& prompts, const std::vector<std::string>& trees, int new_tokens,
                    medusa_llama::weight_format weights = medusa_llama::weight_format::f32, int threads = 2) {
  auto lm = medusa_llama::load(model_path, tokenizer_path);
  const int eos = lm.tok->eos_id();
  std::vector<std::vector<std::int32_t>> encoded;
  const std::size_t n_prompts = static_cast<std::size_t>(env_cap("MEDUSA_E2E_PROMPTS", static_cast<int>(prompts.size())));
  for (const auto& p : std::span(prompts).first(n_prompts)) {
    std::vector<std::int32_t> ids;
    for (int id : lm.tok->encode(p, true, false)) ids.push_back(id);
    encoded.push_back(ids);
  }
  auto heads_w = medusa_llama::random_heads(lm.weights, 5, 17);
  medusa_llama::engine_options eo;
  eo.max_batch = 64;
  eo.threads = threads;
  eo.weights = weights;
  medusa_llama::engine model(std::move(lm.weights), eo);
  medusa_llama::packed_heads heads(model, heads_w.view(), medusa_llama::weight_format::f32);
  medusa::decode_options opt;
  opt.max_new_tokens = env_cap("MEDUSA_E2E_NEW_TOKENS", new_tokens);
  opt.eos_token = eos;
  for (std::size_t p = 0; p < encoded.size(); ++p) {
    const auto vanilla = medusa::generate_vanilla(model, encoded[p], medusa::greedy_policy{}, opt);
    CHECK(!vanilla.tokens.empty());
    for (const auto& t : trees) {
      CAPTURE(model_path.string());
      CAPTURE(prompts[p]);
      CAPTURE(t);
      const std::string weights_name = medusa_llama::to_string(weights);
      CAPTURE(weights_name);
      const auto tree = medusa::tree::from_text(t);
      medusa::decoder dec(model, heads, tree, medusa::greedy_policy{});
      const auto out = dec.generate(encoded[p], opt);
      CHECK(out.tokens == vanilla.tokens);
      CHECK(out.reason == vanilla.reason);
      CHECK(out.stats.tree_steps > 0);
      // A preset again on its compile-time tree, on the first prompt (another tree's dispatch is
      // the run-time tree above again).
      bool is_static = false;
      medusa::dispatch_tree(tree, [&](const auto& tr) {
        is_static = !std::is_same_v<std::remove_cvref_t<decltype(tr)>, medusa::tree>;
        if (is_static && p == 0) {
          medusa::decoder d(model, heads, tr, medusa::greedy_policy{});
          const auto dispatched = d.generate(encoded[p], opt);
          CHECK(dispatched.tokens == vanilla.tokens);
          CHECK(dispatched.reason == vanilla.reason);
        }
        return 0;
      });
      CHECK(is_static == (medusa::preset_index(t) < medusa::preset_table.size()));
    }
  }
}

const std::string small_tree = "[[0],[1],[2],[0,0],[0,1],[1,0],[0,0,0],[0,0,1],[0,1,0],[0,0,0,0],[0,0,0,0,0]]";

}  // namespace

TEST_CASE("stories260K: greedy Medusa equals greedy, every preset") {
  const auto path = models / "stories260K" / "stories260K.bin";
  if (!have(path)) return;
  std::vector<std::string> trees(medusa::preset_names().begin(), medusa::preset_names().end());
  trees.push_back(small_tree);
  // Its tokenizer has another name than tokenizer.bin: without --tokenizer loading fails clearly.
  CHECK_THROWS_AS(medusa_llama::load(path), medusa::io_error);
  // One thread: a second one only waits on a model this small (pycode-15m below runs two).
  check_lossless(path, models / "stories260K" / "tok512.bin", {"", "Once upon a time", "The cat"}, trees, 256,
                 medusa_llama::weight_format::f32, 1);
}

TEST_CASE("pycode-15m: greedy Medusa equals greedy") {
  const auto path = models / "pycode-15m" / "model.bin";
  if (!have(path)) return;
  check_lossless(path, {}, {"import os\nimport sys\n\n\ndef main():\n", "class Stack:\n    def __init__(self):\n", ""},
                 {"mc_sim_7b_63", small_tree}, 256);
}

TEST_CASE("tinystories-656K (Hugging Face layout): greedy Medusa equals greedy") {
  const auto path = models / "tinystories-656K";
  if (!have(path / "model.safetensors")) return;
  check_lossless(path, {}, {"", "Once upon a time, there was a"}, {"vicuna_7b_stage2", "zephyr_stage2", small_tree}, 256,
                 medusa_llama::weight_format::f32, 1);
}

TEST_CASE("pycode-15m: greedy Medusa equals greedy decoding of the same bf16, q8_0 and q4_0 weights") {
  const auto path = models / "pycode-15m" / "model.bin";
  if (!have(path)) return;
  using medusa_llama::weight_format;
  for (auto w : {weight_format::bf16, weight_format::q8_0, weight_format::q4_0})
    check_lossless(path, {}, {"import os\nimport sys\n\n\ndef main():\n", "class Stack:\n    def __init__(self):\n"},
                   {small_tree}, 256, w);
}
