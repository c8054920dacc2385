// SPDX-License-Identifier: Apache-2.0
// The example engine's part of the error catalogue (docs/errors.md): one case per load_errc and
// engine_errc reachable without a GPU. Each checks the type, code and message, and that the
// caller's data is unchanged: model files byte for byte (and no file left behind), the engine's KV
// cache, its page accounting and the output buffers. MEDUSA_PRINT_ERRORS=1 prints the messages.
#include <medusa_llama/cuda_engine.hpp>
#include <medusa_llama/llama.hpp>

#include <medusa/io/safetensors.hpp>

#include <doctest/doctest.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace fs = std::filesystem;
using namespace medusa_llama;

namespace {

// Runs `f`, which must throw `E`; checks the "medusa: " prefix and the needles; returns the error.
template <class E, class F>
E thrown(F&& f, std::initializer_list<std::string_view> needles) {
  try {
    f();
  } catch (const E& e) {
    const std::string what = e.what();
    if (std::getenv("MEDUSA_PRINT_ERRORS") != nullptr) std::printf("%s\n", what.c_str());
    CHECK_MESSAGE(what.rfind("medusa: ", 0) == 0, what);
    for (std::string_view n : needles) CHECK_MESSAGE(what.find(n) != std::string::npos, "'" << n << "' not in: " << what);
    return e;
  } catch (const std::exception& e) {
    FAIL("expected another exception type, got: " << e.what());
  }
  FAIL("no exception");
  throw std::logic_error("unreachable");
}

fs::path fresh_dir(const std::string& name) {
  const fs::path p = fs::path(MEDUSA_TEST_TMPDIR) / ("llama_errors_" + name);
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const fs::path& p, std::string_view s) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(s.data(), static_cast<std::streamsize>(s.size()));
}

// Every entry under `dir` (relative path -> bytes; directories map to "<dir>").
std::map<std::string, std::string> snapshot(const fs::path& dir) {
  std::map<std::string, std::string> s;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    s[fs::relative(e.path(), dir).string()] = e.is_directory() ? "<dir>" : read_bytes(e.path());
  return s;
}

// 2 layers, GQA (4 query heads, 2 KV heads of 16), vocabulary 97, context 96.
model_config tiny_config() {
  model_config c;
  c.dim = 64;
  c.hidden_dim = 96;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.vocab_size = 97;
  c.seq_len = 96;
  return c;
}

model tiny_model() { return model::random(tiny_config(), 7, 0.2f); }

// Loads `path` with `load`, which must fail with `code`; the directory is unchanged afterwards.
template <class Load>
load_error load_error_of(const fs::path& dir, Load&& load, load_errc code, std::initializer_list<std::string_view> needles) {
  const auto before = snapshot(dir);
  auto e = thrown<load_error>(load, needles);
  CHECK_MESSAGE(e.code() == code, to_string(e.code()));
  CHECK(dynamic_cast<const medusa::io_error*>(&e) != nullptr);
  CHECK(snapshot(dir) == before);
  return e;
}

// The whole KV cache of a contiguous view: [layer][slot][head][dim].
std::vector<float> kv_bytes(const medusa::kv_cache_view<float>& kv) {
  std::vector<float> out;
  for (int l = 0; l < kv.num_layers(); ++l)
    for (int s = 0; s < kv.capacity(); ++s)
      for (int h = 0; h < kv.num_kv_heads(); ++h) {
        out.insert(out.end(), kv.k_row(l, s, h), kv.k_row(l, s, h) + kv.head_dim());
        out.insert(out.end(), kv.v_row(l, s, h), kv.v_row(l, s, h) + kv.head_dim());
      }
  return out;
}

// `tokens` as one batch at positions `positions`, slots from `start`.
medusa::forward_batch batch_of(const std::vector<int>& tokens, const std::vector<int>& positions, int start,
                               std::span<float> logits, std::span<float> hidden = {}, medusa::tree_mask_view mask = {}) {
  medusa::forward_batch b;
  b.tokens = tokens;
  b.positions = positions;
  b.cache_length = start;
  b.tree_mask = mask;
  b.logits = logits;
  b.hidden = hidden;
  return b;
}

// An engine with 4 tokens prefilled; each case makes one argument of a forward bad and checks
// the code, and that neither the cache nor the output buffers changed.
struct engine_fixture {
  engine e{tiny_model(), {.capacity = 40, .max_batch = 8, .threads = 1}};
  std::vector<float> logits = std::vector<float>(2 * 97, 5.0f);
  std::vector<float> hidden = std::vector<float>(2 * 64, 6.0f);
  engine_fixture() {
    std::vector<float> last(97);
    e.prefill(std::vector<int>{1, 2, 3, 4}, 0, last, {});
  }
  engine_error fails(const medusa::forward_batch& b, engine_errc code, std::initializer_list<std::string_view> needles) {
    const auto kv = kv_bytes(e.kv_cache());
    const auto lg = logits, hd = hidden;
    auto x = thrown<engine_error>([&] { e.forward(b); }, needles);
    CHECK_MESSAGE(x.code() == code, to_string(x.code()));
    CHECK(kv_bytes(e.kv_cache()) == kv);
    CHECK(logits == lg);
    CHECK(hidden == hd);
    return x;
  }
};

}  // namespace

// ================================================================================================
// load_error: every load_errc; the files unchanged
// ================================================================================================

TEST_CASE("load_error: open_failed") {
  const auto dir = fresh_dir("open");
  load_error_of(dir, [&] { (void)model::load_llama2c(dir / "none.bin"); }, load_errc::open_failed, {"none.bin"});
  load_error_of(dir, [&] { (void)model::load_llama2c(dir); }, load_errc::open_failed, {});
}

TEST_CASE("load_error: truncated and size_mismatch") {
  const auto dir = fresh_dir("llama2c");
  tiny_model().save_llama2c(dir / "good.bin");
  const std::string bytes = read_bytes(dir / "good.bin");
  write_bytes(dir / "cut.bin", bytes.substr(0, bytes.size() - 4));
  write_bytes(dir / "long.bin", bytes + "1234");
  auto e = load_error_of(dir, [&] { (void)model::load_llama2c(dir / "cut.bin"); }, load_errc::truncated, {"cut.bin"});
  CHECK(e.path() == (dir / "cut.bin").string());
  load_error_of(dir, [&] { (void)model::load_llama2c(dir / "long.bin"); }, load_errc::size_mismatch, {"long.bin"});
}

TEST_CASE("load_error: bad_header") {
  const auto dir = fresh_dir("header");
  tiny_model().save_llama2c(dir / "good.bin");
  std::string bytes = read_bytes(dir / "good.bin");
  const std::int32_t heads = 5;  // 64 is not a multiple of 5 heads
  std::memcpy(bytes.data() + 12, &heads, 4);
  write_bytes(dir / "heads.bin", bytes);
  load_error_of(dir, [&] { (void)model::load_llama2c(dir / "heads.bin"); }, load_errc::bad_header, {"heads.bin", "5"});
}

TEST_CASE("load_error: bad_json, unsupported, missing_tensor (Hugging Face directories)") {
  const auto dir = fresh_dir("hf");
  tiny_model().save_hf(dir / "good");
  const std::string config = read_bytes(dir / "good" / "config.json");
  fs::create_directories(dir / "bad_json");
  fs::copy_file(dir / "good" / "model.safetensors", dir / "bad_json" / "model.safetensors");
  write_bytes(dir / "bad_json" / "config.json", "{\"hidden_size\": 64,");
  load_error_of(dir, [&] { (void)model::load_hf(dir / "bad_json"); }, load_errc::bad_json, {"config.json"});

  fs::create_directories(dir / "gelu");
  fs::copy_file(dir / "good" / "model.safetensors", dir / "gelu" / "model.safetensors");
  std::string gelu = config;
  const auto at = gelu.find("\"silu\"");
  REQUIRE(at != std::string::npos);
  gelu.replace(at, 6, "\"gelu\"");
  write_bytes(dir / "gelu" / "config.json", gelu);
  load_error_of(dir, [&] { (void)model::load_hf(dir / "gelu"); }, load_errc::unsupported, {"gelu"});

  // The same weights without model.norm.weight.
  fs::create_directories(dir / "no_norm");
  write_bytes(dir / "no_norm" / "config.json", config);
  const auto file = medusa::safetensors_file::open(dir / "good" / "model.safetensors");
  medusa::safetensors_writer w;
  for (const auto& t : file.tensors())
    if (t.name != "model.norm.weight") w.add(t.name, t.dtype, t.shape, file.data(t));
  w.write(dir / "no_norm" / "model.safetensors");
  load_error_of(dir, [&] { (void)model::load_hf(dir / "no_norm"); }, load_errc::missing_tensor, {"model.norm.weight"});
}

TEST_CASE("load_error: bad_tokenizer") {
  const auto dir = fresh_dir("tokenizer");
  // A llama2.c tokenizer whose header says tokens are at most 0 bytes long.
  std::string bytes(4, '\0');
  write_bytes(dir / "tok.bin", bytes);
  load_error_of(dir, [&] { (void)load_tokenizer(dir / "tok.bin"); }, load_errc::bad_tokenizer, {"max_token_length 0"});
}

TEST_CASE("model::save_llama2c that fails leaves no file behind") {
  const auto dir = fresh_dir("save");
  fs::create_directories(dir / "taken.bin" / "inside");  // a directory in the file's place
  const auto before = snapshot(dir);
  load_error_of(dir, [&] { tiny_model().save_llama2c(dir / "taken.bin"); }, load_errc::open_failed, {"taken.bin"});
  CHECK(snapshot(dir) == before);
}

// ================================================================================================
// engine_error: every engine_errc reachable without a GPU; the engine unchanged
// ================================================================================================

TEST_CASE("engine_error: bad_batch") {
  engine_fixture f;
  const std::vector<int> none, one{1}, two_positions{4, 5};
  f.fails(batch_of(none, none, 4, {}), engine_errc::bad_batch, {"empty"});
  f.fails(batch_of(one, two_positions, 4, f.logits), engine_errc::bad_batch, {"1 tokens", "2 positions"});
}

TEST_CASE("engine_error: bad_token") {
  engine_fixture f;
  const std::vector<int> t{97}, p{4};
  f.fails(batch_of(t, p, 4, std::span(f.logits).first(97)), engine_errc::bad_token, {"97"});
}

TEST_CASE("engine_error: bad_position") {
  engine_fixture f;
  const std::vector<int> t{5}, p{96};
  f.fails(batch_of(t, p, 4, std::span(f.logits).first(97)), engine_errc::bad_position, {"96"});
}

TEST_CASE("engine_error: bad_slot") {
  engine_fixture f;
  const std::vector<int> t{5}, p{4};
  f.fails(batch_of(t, p, 40, std::span(f.logits).first(97)), engine_errc::bad_slot, {"40"});
}

TEST_CASE("engine_error: bad_mask") {
  engine_fixture f;
  const std::vector<int> t{5, 6}, p{4, 5};
  const std::uint32_t later[2] = {0x3, 0x3};  // row 0 sees row 1, which comes after it
  f.fails(batch_of(t, p, 4, f.logits, {}, medusa::tree_mask_view{later, 1}), engine_errc::bad_mask, {"row 0"});
}

TEST_CASE("engine_error: bad_output") {
  engine_fixture f;
  const std::vector<int> t{5, 6}, p{4, 5};
  f.fails(batch_of(t, p, 4, std::span(f.logits).first(2 * 97 - 1)), engine_errc::bad_output, {"logits"});
}

TEST_CASE("engine_error: bad_option") {
  auto e = thrown<engine_error>([] { engine bad(tiny_model(), {.max_batch = 0}); }, {"max_batch"});
  CHECK(e.code() == engine_errc::bad_option);
  auto e2 = thrown<engine_error>([] { batch_engine bad(tiny_model(), {.page_size = 0}); }, {"page_size"});
  CHECK(e2.code() == engine_errc::bad_option);
}

TEST_CASE("engine_error: bad_request and out_of_pages leave the page pool as it was") {
  batch_engine be(tiny_model(), {.page_size = 4, .num_pages = 6, .max_requests = 2, .max_context = 40, .threads = 1});
  be.reserve(0, 12);  // 3 pages
  auto state = [&] { return std::vector<int>{be.pages_mapped(0), be.pages_mapped(1), be.pages_in_use(), be.free_pages(), be.peak_pages_in_use()}; };
  const auto before = state();
  auto e = thrown<engine_error>([&] { be.reserve(2, 4); }, {"request 2", "max_requests 2"});
  CHECK(e.code() == engine_errc::bad_request);
  CHECK(e.request() == 2);
  CHECK(state() == before);
  auto e2 = thrown<engine_error>([&] { be.reserve(1, 20); }, {"request 1", "5 more pages", "3 free of 6"});
  CHECK(e2.code() == engine_errc::out_of_pages);
  CHECK(e2.request() == 1);
  CHECK(state() == before);
}

TEST_CASE("engine_error: no_device (the GPU engine without a device or a CUDA build)") {
  if (cuda_device_count() > 0) {
    MESSAGE("a CUDA device is present: the no_device case is not reachable here");
    return;
  }
  const model m = tiny_model();
  auto e = thrown<engine_error>([&] { cuda_engine bad(m, {}); }, {"no CUDA device"});
  CHECK(e.code() == engine_errc::no_device);
}
