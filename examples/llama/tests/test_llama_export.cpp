// SPDX-License-Identifier: Apache-2.0
// Building a model from weight pointers (`model::from_parts`) and writing it as a Hugging Face
// directory (`model::save_hf`): weights survive bit for bit, and a model with RoPE on adjacent
// pairs comes back as an equivalent split-halves model (same logits).
#include <medusa_llama/llama.hpp>

#include <medusa/io/safetensors.hpp>

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using namespace medusa_llama;

namespace {

fs::path scratch(const std::string& name) {
  const fs::path p = fs::path(MEDUSA_TEST_TMPDIR) / ("llama_export_" + name);
  std::error_code ec;
  fs::remove_all(p, ec);
  return p;
}

model_config small_config(bool shared, rope_style rope) {
  model_config c;
  c.dim = 64;
  c.hidden_dim = 96;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;  // GQA: wk has fewer heads than wq
  c.vocab_size = 97;
  c.seq_len = 48;
  c.rms_eps = 1e-6f;
  c.rope_theta = 500000.0f;
  c.rope = rope;
  c.shared_classifier = shared;
  return c;
}

bool same(const float* a, const float* b, std::size_t n) { return std::memcmp(a, b, n * sizeof(float)) == 0; }

// Every weight of `a` and `b` bit for bit; `with_qk` false skips wq and wk.
void check_same_weights(const model& a, const model& b, bool with_qk = true) {
  const auto& c = a.config();
  const std::size_t d = static_cast<std::size_t>(c.dim), h = static_cast<std::size_t>(c.hidden_dim),
                    kv = static_cast<std::size_t>(c.kv_dim()), V = static_cast<std::size_t>(c.vocab_size);
  CHECK(same(a.token_embedding(), b.token_embedding(), V * d));
  CHECK(same(a.classifier(), b.classifier(), V * d));
  CHECK(same(a.rms_final(), b.rms_final(), d));
  for (int l = 0; l < c.n_layers; ++l) {
    CAPTURE(l);
    const auto &x = a.layer(l), &y = b.layer(l);
    CHECK(same(x.rms_att, y.rms_att, d));
    if (with_qk) {
      CHECK(same(x.wq, y.wq, d * d));
      CHECK(same(x.wk, y.wk, kv * d));
    }
    CHECK(same(x.wv, y.wv, kv * d));
    CHECK(same(x.wo, y.wo, d * d));
    CHECK(same(x.rms_ffn, y.rms_ffn, d));
    CHECK(same(x.w1, y.w1, h * d));
    CHECK(same(x.w2, y.w2, d * h));
    CHECK(same(x.w3, y.w3, h * d));
  }
}

// Logits of `tokens` decoded one at a time from position 0, concatenated.
std::vector<float> decode_all(const model& m, const std::vector<int>& tokens) {
  engine e(m, {.threads = 1});
  const auto V = static_cast<std::size_t>(m.config().vocab_size);
  std::vector<float> all, one(V);
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    e.decode(tokens[i], static_cast<int>(i), one);
    all.insert(all.end(), one.begin(), one.end());
  }
  return all;
}

std::vector<layer_weights> layers_of(const model& m) {
  std::vector<layer_weights> v;
  for (int l = 0; l < m.config().n_layers; ++l) v.push_back(m.layer(l));
  return v;
}

const std::vector<int> tokens = {1, 42, 7, 96, 0, 13, 55, 8};

}  // namespace

TEST_CASE("from_parts copies the weights: same values, same logits") {
  for (bool shared : {true, false}) {
    CAPTURE(shared);
    const auto cfg = small_config(shared, rope_style::adjacent_pairs);
    const auto m = model::random(cfg, 11, 0.2f);
    const auto layers = layers_of(m);
    const auto p = model::from_parts(cfg, m.token_embedding(), layers, m.rms_final(), shared ? nullptr : m.classifier());
    CHECK(p.token_embedding() != m.token_embedding());  // an owned copy
    CHECK(p.layer(1).w2 != m.layer(1).w2);
    CHECK((p.classifier() == p.token_embedding()) == shared);
    CHECK(p.config().dim == cfg.dim);
    CHECK(p.config().seq_len == cfg.seq_len);
    CHECK(p.stored() == stored_type::f32);
    check_same_weights(m, p);
    CHECK(decode_all(m, tokens) == decode_all(p, tokens));
  }
}

TEST_CASE("from_parts rejects a bad config, a wrong layer count and null pointers") {
  const auto cfg = small_config(false, rope_style::adjacent_pairs);
  const auto m = model::random(cfg, 12);
  auto layers = layers_of(m);
  auto expect = [&](auto&& call, load_errc code) {
    try {
      (void)call();
      FAIL("no exception");
    } catch (const load_error& e) {
      CHECK(e.code() == code);
    }
  };
  expect([&] { return model::from_parts(cfg, m.token_embedding(), std::span(layers).first(1), m.rms_final(), m.classifier()); },
         load_errc::size_mismatch);
  expect([&] { return model::from_parts(cfg, nullptr, layers, m.rms_final(), m.classifier()); }, load_errc::missing_tensor);
  expect([&] { return model::from_parts(cfg, m.token_embedding(), layers, m.rms_final(), nullptr); }, load_errc::missing_tensor);
  auto bad = cfg;
  bad.n_heads = 5;
  expect([&] { return model::from_parts(bad, m.token_embedding(), layers, m.rms_final(), m.classifier()); }, load_errc::bad_header);
  layers[1].w3 = nullptr;
  expect([&] { return model::from_parts(cfg, m.token_embedding(), layers, m.rms_final(), m.classifier()); }, load_errc::missing_tensor);
}

TEST_CASE("save_hf then load_hf: split-halves models come back bit for bit") {
  for (bool shared : {true, false}) {
    CAPTURE(shared);
    const auto m = model::random(small_config(shared, rope_style::split_halves), 21, 0.2f);
    const auto dir = scratch(shared ? "halves_tied" : "halves");
    m.save_hf(dir);
    CHECK_FALSE(fs::exists(dir / "model.safetensors.tmp"));
    CHECK_FALSE(fs::exists(dir / "config.json.tmp"));
    const auto r = model::load_hf(dir);
    const auto &a = m.config(), &b = r.config();
    CHECK(b.dim == a.dim);
    CHECK(b.hidden_dim == a.hidden_dim);
    CHECK(b.n_layers == a.n_layers);
    CHECK(b.n_heads == a.n_heads);
    CHECK(b.n_kv_heads == a.n_kv_heads);
    CHECK(b.vocab_size == a.vocab_size);
    CHECK(b.seq_len == a.seq_len);
    CHECK(b.rms_eps == a.rms_eps);
    CHECK(b.rope_theta == a.rope_theta);
    CHECK(b.rope == rope_style::split_halves);
    CHECK(b.shared_classifier == shared);
    CHECK(r.stored() == stored_type::f32);
    check_same_weights(m, r);

    std::ifstream in(dir / "config.json");
    const auto j = nlohmann::json::parse(in);
    CHECK(j["architectures"] == nlohmann::json::array({"LlamaForCausalLM"}));
    CHECK(j["model_type"] == "llama");
    CHECK(j["torch_dtype"] == "float32");
    CHECK(j["tie_word_embeddings"] == shared);
    CHECK(j["rms_norm_eps"].get<double>() == 1e-6);  // the short decimal, not 9.99999997e-07
    const auto st = medusa::safetensors_file::open(dir / "model.safetensors");
    CHECK((st.find("lm_head.weight") != nullptr) == !shared);
    CHECK(st.find("model.layers.1.mlp.down_proj.weight")->shape == std::vector<std::uint64_t>{64, 96});
    CHECK(st.find("model.norm.weight")->shape == std::vector<std::uint64_t>{64});
  }
}

TEST_CASE("save_hf permutes q/k of adjacent-pair models: the reloaded split-halves model has the same logits") {
  for (bool shared : {true, false}) {
    CAPTURE(shared);
    const auto m = model::random(small_config(shared, rope_style::adjacent_pairs), 31, 0.3f);
    const auto dir = scratch(shared ? "pairs_tied" : "pairs");
    m.save_hf(dir);
    const auto r = model::load_hf(dir);
    CHECK(r.config().rope == rope_style::split_halves);
    CHECK(r.config().shared_classifier == shared);
    check_same_weights(m, r, /*with_qk=*/false);
    // Row 2i+e of a Meta head is row e*hd/2+i of the Hugging Face head.
    const std::size_t d = 64, hd = 16;
    for (std::size_t head = 0; head < 2; ++head)
      for (std::size_t i = 0; i < hd / 2; ++i)
        for (std::size_t e = 0; e < 2; ++e) {
          CHECK(same(m.layer(1).wk + (head * hd + 2 * i + e) * d, r.layer(1).wk + (head * hd + e * hd / 2 + i) * d, d));
          CHECK(same(m.layer(0).wq + (head * hd + 2 * i + e) * d, r.layer(0).wq + (head * hd + e * hd / 2 + i) * d, d));
        }
    const auto want = decode_all(m, tokens), got = decode_all(r, tokens);
    REQUIRE(want.size() == got.size());
    float top = 0, diff = 0;
    for (std::size_t i = 0; i < want.size(); ++i) {
      top = std::max(top, std::abs(want[i]));
      diff = std::max(diff, std::abs(want[i] - got[i]));
    }
    CHECK(top > 0);
    CHECK(diff <= 1e-5f * top);
    // Without the permutation the positions after the first would differ: the check has teeth.
    auto unpermuted = small_config(shared, rope_style::split_halves);
    const auto layers = layers_of(m);
    const auto wrong = model::from_parts(unpermuted, m.token_embedding(), layers, m.rms_final(), m.classifier());
    const auto bad = decode_all(wrong, tokens);
    float bad_diff = 0;
    for (std::size_t i = 0; i < want.size(); ++i) bad_diff = std::max(bad_diff, std::abs(want[i] - bad[i]));
    CHECK(bad_diff > 1e-3f * top);
  }
}

TEST_CASE("save_hf reports a directory it cannot create") {
  const auto file = scratch("not_a_dir");
  fs::create_directories(file.parent_path());
  std::ofstream(file) << "x";
  const auto m = model::random(small_config(true, rope_style::split_halves), 41);
  try {
    m.save_hf(file / "sub");
    FAIL("no exception");
  } catch (const load_error& e) {
    CHECK(e.code() == load_errc::open_failed);
  }
}

TEST_CASE("parse_hf_config reads the config.json that save_hf writes, with load_hf's checks") {
  const auto dir = scratch("config");
  const auto m = model::random(small_config(false, rope_style::split_halves), 43);
  m.save_hf(dir);
  std::ifstream in(dir / "config.json");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const model_config c = parse_hf_config(text, "config.json");
  const model_config& want = m.config();
  CHECK(c.dim == want.dim);
  CHECK(c.hidden_dim == want.hidden_dim);
  CHECK(c.n_layers == want.n_layers);
  CHECK(c.n_heads == want.n_heads);
  CHECK(c.n_kv_heads == want.n_kv_heads);
  CHECK(c.vocab_size == want.vocab_size);
  CHECK(c.seq_len == want.seq_len);
  CHECK(c.rms_eps == want.rms_eps);
  CHECK(c.rope_theta == want.rope_theta);
  CHECK(c.shared_classifier == want.shared_classifier);
  CHECK(c.rope == rope_style::split_halves);
  CHECK(model::load_hf(dir).config().dim == c.dim);

  auto code_of = [](const std::string& json) {
    try {
      (void)parse_hf_config(json, "x/config.json");
    } catch (const load_error& e) {
      CHECK(std::string(e.what()).find("x/config.json") != std::string::npos);
      return e.code();
    }
    FAIL("no exception: " << json);
    return load_errc::open_failed;
  };
  auto patched = [&](const std::string& key, nlohmann::json value) {
    auto j = nlohmann::json::parse(text);
    if (value.is_discarded()) j.erase(key);
    else j[key] = value;
    return j.dump();
  };
  CHECK(code_of("{\"hidden_size\": ") == load_errc::bad_json);
  CHECK(code_of("[1, 2]") == load_errc::bad_json);
  CHECK(code_of(patched("hidden_size", nlohmann::json(nlohmann::json::value_t::discarded))) == load_errc::bad_json);
  CHECK(code_of(patched("hidden_size", "64")) == load_errc::bad_json);
  CHECK(code_of(patched("hidden_size", 0)) == load_errc::bad_header);
  CHECK(code_of(patched("num_attention_heads", 3)) == load_errc::bad_header);
  CHECK(code_of(patched("model_type", "gpt2")) == load_errc::unsupported);
  CHECK(code_of(patched("hidden_act", "gelu")) == load_errc::unsupported);
  CHECK(code_of(patched("rope_scaling", {{"type", "linear"}})) == load_errc::unsupported);
  // Sizes must be integers that fit: 1e300 once reached an unchecked double-to-int conversion
  // (tests/fuzz/regressions/hf_config), 64.5 was silently truncated, 2^64 - 1 wrapped to -1.
  CHECK(code_of(patched("hidden_size", 1e300)) == load_errc::bad_header);
  CHECK(code_of(patched("vocab_size", -1e300)) == load_errc::bad_header);
  CHECK(code_of(patched("hidden_size", 64.5)) == load_errc::bad_header);
  CHECK(code_of(patched("max_position_embeddings", 18446744073709551615ull)) == load_errc::bad_header);
  CHECK(parse_hf_config(patched("hidden_size", 64.0), "config.json").dim == 64);  // an integral float is fine
}
