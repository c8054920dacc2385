// SPDX-License-Identifier: Apache-2.0
// Parity of the example Llama engine with the reference outputs of the shared models: llama2.c's
// run.c on stories260K, the float64 reference on pycode-15m, the README story of
// tinystories-656K (Hugging Face format). Skips when ../shared is absent.
#include <medusa_llama/llama.hpp>

#include <medusa/decoder.hpp>

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using namespace medusa_llama;

namespace {

const fs::path models{fs::path(MEDUSA_SHARED_DIR) / "models"};

// Greedy decoding through the library's loop; stops (without emitting it) at `stop`.
std::vector<int> greedy(engine& e, std::span<const int> prompt, int max_new_tokens, int stop = -1) {
  medusa::decode_options opt;
  opt.max_new_tokens = max_new_tokens;
  opt.eos_token = stop;
  const auto r = medusa::generate_vanilla(e, prompt, medusa::greedy_policy{}, opt);
  return {r.tokens.begin(), r.tokens.end()};
}

bool have(const fs::path& p) {
  if (fs::exists(p)) return true;
  MESSAGE("skipped: " << p.string() << " is absent");
  return false;
}

}  // namespace

TEST_CASE("stories260K: greedy from BOS prints run.c's reference text") {
  const auto dir = models / "stories260K";
  if (!have(dir / "stories260K.bin") || !have(dir / "reference-greedy-200.txt")) return;
  engine e(model::load_llama2c(dir / "stories260K.bin"));
  const llama2c_tokenizer tok(dir / "tok512.bin", e.config().vocab_size);
  const int bos = 1;
  // run.c -t 0 -n 200: BOS at position 0, 200 steps, stop on BOS, a final newline.
  const auto g = greedy(e, {&bos, 1}, 200, /*stop=*/1);
  std::string printed;
  int prev = bos;
  for (int t : g) {
    printed += run_c_printable(tok.decode_piece(prev, t));
    prev = t;
  }
  printed += "\n";
  std::ifstream in(dir / "reference-greedy-200.txt", std::ios::binary);
  const std::string want(std::istreambuf_iterator<char>(in), {});
  CHECK(g.size() == 200);
  CHECK(printed == want);
}

TEST_CASE("pycode-15m: greedy continuations match the float64 reference") {
  const auto dir = models / "pycode-15m";
  if (!have(dir / "model.bin") || !have(dir / "reference-greedy.json")) return;
  engine e(model::load_llama2c(dir / "model.bin"), {.max_batch = 8});  // prompts run in chunks of 8
  const llama2c_tokenizer tok(dir / "tokenizer.bin", e.config().vocab_size, /*add_dummy_prefix=*/false);
  std::ifstream in(dir / "reference-greedy.json");
  const auto j = nlohmann::json::parse(in);
  const int n = j.at("new_tokens").get<int>();
  for (const auto& c : j.at("cases")) {
    const auto prompt = c.at("prompt").get<std::string>();
    CAPTURE(prompt);
    const auto ids = tok.encode(prompt, true, false);
    CHECK(ids == c.at("prompt_ids").get<std::vector<int>>());
    const auto g = greedy(e, ids, n);
    CHECK(g == c.at("greedy_ids").get<std::vector<int>>());
    CHECK(tok.decode(g) == c.at("greedy_text").get<std::string>());
  }
}

TEST_CASE("tinystories-656K (Hugging Face): greedy from BOS writes the README story") {
  const auto dir = models / "tinystories-656K";
  if (!have(dir / "model.safetensors") || !have(dir / "tokenizer.json")) return;
  const auto m = model::load_hf(dir);
  CHECK(m.config().rope == rope_style::split_halves);
  CHECK(m.config().n_kv_heads == 4);
  CHECK(m.config().rms_eps == doctest::Approx(1e-6));
  engine e(m);
  const hf_tokenizer tok(dir / "tokenizer.json");
  const int bos = tok.bos_id();
  const auto g = greedy(e, {&bos, 1}, 40, tok.eos_id());
  const std::string text = tok.decode(g);
  const std::string want = "Once upon a time, there was a little girl named Lily. She had a toy car that she loved very much.";
  CHECK(text.substr(0, want.size()) == want);
}
