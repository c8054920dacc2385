// SPDX-License-Identifier: Apache-2.0
// Model loaders (llama2.c checkpoints memory-mapped, Hugging Face Llama directories, GGUF files) and writers.
#include <medusa_llama/model.hpp>

#include "gguf_reader.hpp"
#include "json_int.hpp"
#include "mapped_file.hpp"
#include "safetensors_reader.hpp"

#include <medusa/io/safetensors.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <bit>
#include <charconv>
#include <cmath>
#include <cstring>
#include <fstream>
#include <optional>
#include <random>
#include <sstream>
#include <string>

#include <unistd.h>

static_assert(std::endian::native == std::endian::little, "checkpoints are little-endian");

namespace medusa_llama {

std::string_view to_string(load_errc code) noexcept {
  switch (code) {
    case load_errc::open_failed: return "open_failed";
    case load_errc::truncated: return "truncated";
    case load_errc::size_mismatch: return "size_mismatch";
    case load_errc::bad_header: return "bad_header";
    case load_errc::bad_json: return "bad_json";
    case load_errc::missing_tensor: return "missing_tensor";
    case load_errc::unsupported: return "unsupported";
    case load_errc::bad_tokenizer: return "bad_tokenizer";
  }
  return "unknown";
}

std::string_view to_string(stored_type type) noexcept {
  switch (type) {
    case stored_type::f32: return "f32";
    case stored_type::f16: return "f16";
    case stored_type::bf16: return "bf16";
    case stored_type::q8_0: return "q8_0";
    case stored_type::q4_0: return "q4_0";
    case stored_type::mixed: return "mixed";
  }
  return "unknown";
}

bool is_gguf(const std::filesystem::path& path) {
  if (path.extension() == ".gguf") return true;
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return false;
  std::ifstream in(path, std::ios::binary);
  char magic[4] = {};
  return in.read(magic, 4) && std::memcmp(magic, "GGUF", 4) == 0;
}

namespace detail {

// Offsets (in floats) of every array of a llama2.c checkpoint, after the 28-byte header.
struct llama2c_layout {
  std::uint64_t emb, rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3, rms_final, rope, cls, total;
};

llama2c_layout layout_of(const model_config& c) {
  const std::uint64_t d = static_cast<std::uint64_t>(c.dim), h = static_cast<std::uint64_t>(c.hidden_dim),
                      L = static_cast<std::uint64_t>(c.n_layers), V = static_cast<std::uint64_t>(c.vocab_size),
                      kv = static_cast<std::uint64_t>(c.kv_dim()), hd = static_cast<std::uint64_t>(c.head_dim()),
                      S = static_cast<std::uint64_t>(c.seq_len);
  llama2c_layout l{};
  std::uint64_t o = 0;
  l.emb = o; o += V * d;
  l.rms_att = o; o += L * d;
  l.wq = o; o += L * d * d;
  l.wk = o; o += L * kv * d;
  l.wv = o; o += L * kv * d;
  l.wo = o; o += L * d * d;
  l.rms_ffn = o; o += L * d;
  l.w1 = o; o += L * h * d;
  l.w2 = o; o += L * d * h;
  l.w3 = o; o += L * h * d;
  l.rms_final = o; o += d;
  l.rope = o; o += S * hd;  // freq_cis_real and freq_cis_imag, [seq_len][head_dim/2] each
  l.cls = o; o += c.shared_classifier ? 0 : V * d;
  l.total = o;
  return l;
}

constexpr std::size_t llama2c_header_bytes = 7 * sizeof(std::int32_t);

}  // namespace detail

void model_config::validate(const std::string& origin) const {
  auto fail = [&](const std::string& msg) { throw load_error(load_errc::bad_header, msg, origin); };
  auto in_range = [&](const char* name, int v, int hi) {
    if (v <= 0 || v > hi) fail(std::string(name) + " = " + std::to_string(v) + " is outside [1, " + std::to_string(hi) + "]");
  };
  // The bounds keep every size product far below 2^63 and reject garbage headers early.
  in_range("dim", dim, 1 << 16);
  in_range("hidden_dim", hidden_dim, 1 << 18);
  in_range("n_layers", n_layers, 1 << 10);
  in_range("n_heads", n_heads, 1 << 10);
  in_range("n_kv_heads", n_kv_heads, 1 << 10);
  in_range("vocab_size", vocab_size, 1 << 22);
  in_range("seq_len", seq_len, 1 << 20);
  if (dim % n_heads != 0) fail("dim " + std::to_string(dim) + " is not a multiple of n_heads " + std::to_string(n_heads));
  if (n_heads % n_kv_heads != 0)
    fail("n_heads " + std::to_string(n_heads) + " is not a multiple of n_kv_heads " + std::to_string(n_kv_heads));
  if (head_dim() % 2 != 0) fail("head_dim " + std::to_string(head_dim()) + " is odd; RoPE needs pairs");
  if (!(rms_eps > 0.0f) || !std::isfinite(rms_eps)) fail("rms_eps " + std::to_string(rms_eps) + " must be positive");
  if (!(rope_theta > 1.0f) || !std::isfinite(rope_theta)) fail("rope_theta " + std::to_string(rope_theta) + " must be > 1");
}

std::uint64_t model_config::parameter_count() const noexcept {
  auto l = detail::layout_of(*this);
  return l.total - static_cast<std::uint64_t>(seq_len) * static_cast<std::uint64_t>(head_dim());
}

std::size_t model::weight_bytes() const noexcept {
  const auto& c = config_;
  const std::size_t d = static_cast<std::size_t>(c.dim), h = static_cast<std::size_t>(c.hidden_dim),
                    kv = static_cast<std::size_t>(c.kv_dim());
  const std::size_t per_layer = 2 * d + 2 * d * d + 2 * kv * d + 3 * h * d;
  return sizeof(float) * (static_cast<std::size_t>(c.n_layers) * per_layer + d +
                          static_cast<std::size_t>(c.vocab_size) * d);
}

void model::bind_llama2c(const float* base, bool rope_tables) {
  model_config lc = config_;
  if (!rope_tables) lc.seq_len = 0;
  const auto l = detail::layout_of(lc);
  const auto& c = config_;
  const std::size_t d = static_cast<std::size_t>(c.dim), h = static_cast<std::size_t>(c.hidden_dim),
                    kv = static_cast<std::size_t>(c.kv_dim());
  embedding_ = base + l.emb;
  layers_.assign(static_cast<std::size_t>(c.n_layers), {});
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    auto& w = layers_[i];
    w.rms_att = base + l.rms_att + i * d;
    w.wq = base + l.wq + i * d * d;
    w.wk = base + l.wk + i * kv * d;
    w.wv = base + l.wv + i * kv * d;
    w.wo = base + l.wo + i * d * d;
    w.rms_ffn = base + l.rms_ffn + i * d;
    w.w1 = base + l.w1 + i * h * d;
    w.w2 = base + l.w2 + i * d * h;
    w.w3 = base + l.w3 + i * h * d;
  }
  rms_final_ = base + l.rms_final;
  classifier_ = c.shared_classifier ? embedding_ : base + l.cls;
}

model model::load_llama2c(const std::filesystem::path& path) {
  const std::string p = path.string();
  auto file = std::make_shared<detail::mapped_file>(path);
  if (file->size() < detail::llama2c_header_bytes)
    throw load_error(load_errc::truncated, "file has " + std::to_string(file->size()) + " bytes, less than the 28-byte llama2.c header",
                     p);
  std::int32_t h[7];
  std::memcpy(h, file->data(), sizeof h);
  model m;
  auto& c = m.config_;
  c.dim = h[0];
  c.hidden_dim = h[1];
  c.n_layers = h[2];
  c.n_heads = h[3];
  c.n_kv_heads = h[4];
  c.shared_classifier = h[5] > 0;
  c.vocab_size = h[5] == INT32_MIN ? 0 : (h[5] < 0 ? -h[5] : h[5]);
  c.seq_len = h[6];
  c.rope = rope_style::adjacent_pairs;
  c.validate(p);
  const auto l = detail::layout_of(c);
  const std::uint64_t want = detail::llama2c_header_bytes + l.total * sizeof(float);
  if (file->size() < want)
    throw load_error(load_errc::truncated, "file has " + std::to_string(file->size()) + " bytes but its header (dim " + std::to_string(c.dim) +
                         ", hidden " + std::to_string(c.hidden_dim) + ", layers " + std::to_string(c.n_layers) +
                         ", vocab " + std::to_string(c.vocab_size) + ", seq_len " + std::to_string(c.seq_len) +
                         ") needs " + std::to_string(want),
                     p);
  if (file->size() != want)
    throw load_error(load_errc::size_mismatch, "file has " + std::to_string(file->size()) + " bytes but its header announces " +
                         std::to_string(want) + " (" + std::to_string(file->size() - want) + " trailing bytes)",
                     p);
  // The mapping is page-aligned and the header is 28 bytes, so the floats are 4-byte aligned.
  m.bind_llama2c(reinterpret_cast<const float*>(file->data() + detail::llama2c_header_bytes));
  m.mapping_ = file;
  m.storage_ = std::move(file);
  return m;
}

void model::release_pages(const float* first, std::size_t count) const noexcept {
  if (mapping_ != nullptr) mapping_->release(first, count * sizeof(float));
}

model model::first_layers(int layers) const {
  if (layers < 1 || layers > config_.n_layers)
    throw load_error(load_errc::bad_header,
                     "first_layers: " + std::to_string(layers) + " layers asked of a model of " +
                         std::to_string(config_.n_layers),
                     "(model)");
  model m = *this;
  m.config_.n_layers = layers;
  m.layers_.resize(static_cast<std::size_t>(layers));
  return m;
}

model model::with_classifier(std::vector<float> classifier) const {
  const std::size_t want = static_cast<std::size_t>(config_.vocab_size) * static_cast<std::size_t>(config_.dim);
  if (classifier.size() != want)
    throw load_error(load_errc::size_mismatch,
                     "with_classifier: " + std::to_string(classifier.size()) + " values, a classifier of " +
                         std::to_string(config_.vocab_size) + " x " + std::to_string(config_.dim) + " needs " + std::to_string(want),
                     "(model)");
  // The new model keeps the old storage alive beside its own classifier.
  struct both {
    std::shared_ptr<const void> weights;
    std::vector<float> classifier;
  };
  auto owned = std::make_shared<both>(both{storage_, std::move(classifier)});
  model m = *this;
  m.classifier_ = owned->classifier.data();
  m.storage_ = std::move(owned);
  m.config_.shared_classifier = false;
  m.classifier_stored_ = stored_type::f32;
  return m;
}

model model::random(const model_config& config, std::uint64_t seed, float scale) {
  config.validate("model::random");
  model m;
  m.config_ = config;
  const auto l = detail::layout_of(config);
  auto buf = std::make_shared<std::vector<float>>(l.total);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-scale, scale);
  for (auto& x : *buf) x = u(rng);
  auto norms = [&](std::uint64_t off, std::uint64_t n) {
    std::uniform_real_distribution<float> g(0.8f, 1.2f);
    for (std::uint64_t i = 0; i < n; ++i) (*buf)[off + i] = g(rng);
  };
  const auto d = static_cast<std::uint64_t>(config.dim), L = static_cast<std::uint64_t>(config.n_layers);
  norms(l.rms_att, L * d);
  norms(l.rms_ffn, L * d);
  norms(l.rms_final, d);
  std::fill(buf->begin() + static_cast<std::ptrdiff_t>(l.rope), buf->begin() + static_cast<std::ptrdiff_t>(l.cls), 0.0f);
  m.bind_llama2c(buf->data());
  m.storage_ = std::move(buf);
  return m;
}

model model::from_parts(const model_config& config, const float* embedding, std::span<const layer_weights> layers,
                        const float* rms_final, const float* classifier) {
  const std::string origin = "model::from_parts";
  config.validate(origin);
  if (layers.size() != static_cast<std::size_t>(config.n_layers))
    throw load_error(load_errc::size_mismatch, std::to_string(layers.size()) + " layers given for n_layers = " +
                                                   std::to_string(config.n_layers), origin);
  auto need = [&](const float* p, const std::string& name) {
    if (p == nullptr) throw load_error(load_errc::missing_tensor, name + " is null", origin);
  };
  need(embedding, "embedding");
  need(rms_final, "rms_final");
  if (!config.shared_classifier) need(classifier, "classifier (the config says it is not shared)");
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const auto& w = layers[i];
    const std::string pre = "layer " + std::to_string(i) + " ";
    const std::pair<const float*, const char*> parts[] = {{w.rms_att, "rms_att"}, {w.wq, "wq"},   {w.wk, "wk"},
                                                          {w.wv, "wv"},           {w.wo, "wo"},   {w.rms_ffn, "rms_ffn"},
                                                          {w.w1, "w1"},           {w.w2, "w2"},   {w.w3, "w3"}};
    for (const auto& [ptr, name] : parts) need(ptr, pre + name);
  }
  model m;
  m.config_ = config;
  model_config no_rope = config;  // the buffer holds no RoPE tables
  no_rope.seq_len = 0;
  const auto l = detail::layout_of(no_rope);
  auto buf = std::make_shared<std::vector<float>>(l.total);
  const std::size_t d = static_cast<std::size_t>(config.dim), h = static_cast<std::size_t>(config.hidden_dim),
                    kv = static_cast<std::size_t>(config.kv_dim()), V = static_cast<std::size_t>(config.vocab_size);
  auto put = [&](std::uint64_t offset, const float* src, std::size_t n) { std::copy_n(src, n, buf->data() + offset); };
  put(l.emb, embedding, V * d);
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const auto& w = layers[i];
    put(l.rms_att + i * d, w.rms_att, d);
    put(l.wq + i * d * d, w.wq, d * d);
    put(l.wk + i * kv * d, w.wk, kv * d);
    put(l.wv + i * kv * d, w.wv, kv * d);
    put(l.wo + i * d * d, w.wo, d * d);
    put(l.rms_ffn + i * d, w.rms_ffn, d);
    put(l.w1 + i * h * d, w.w1, h * d);
    put(l.w2 + i * d * h, w.w2, d * h);
    put(l.w3 + i * h * d, w.w3, h * d);
  }
  put(l.rms_final, rms_final, d);
  if (!config.shared_classifier) put(l.cls, classifier, V * d);
  m.bind_llama2c(buf->data(), /*rope_tables=*/false);
  m.storage_ = std::move(buf);
  return m;
}

void model::save_llama2c(const std::filesystem::path& path) const {
  // Written beside `path` and renamed over it when complete: a failed write never leaves half a
  // checkpoint, and a model still mapping the old file keeps reading the old file.
  auto tmp = path;
  tmp += ".tmp-" + std::to_string(::getpid());
  std::error_code ec;
  {
    const auto& c = config_;
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw load_error(load_errc::open_failed, "cannot create file", tmp.string());
    const std::int32_t h[7] = {c.dim, c.hidden_dim, c.n_layers, c.n_heads, c.n_kv_heads,
                               c.shared_classifier ? c.vocab_size : -c.vocab_size, c.seq_len};
    out.write(reinterpret_cast<const char*>(h), sizeof h);
    const std::size_t d = static_cast<std::size_t>(c.dim), hd = static_cast<std::size_t>(c.hidden_dim),
                      kv = static_cast<std::size_t>(c.kv_dim()), V = static_cast<std::size_t>(c.vocab_size);
    auto put = [&](const float* p, std::size_t n) {
      out.write(reinterpret_cast<const char*>(p), static_cast<std::streamsize>(n * sizeof(float)));
    };
    put(embedding_, V * d);
    for (const auto& w : layers_) put(w.rms_att, d);
    for (const auto& w : layers_) put(w.wq, d * d);
    for (const auto& w : layers_) put(w.wk, kv * d);
    for (const auto& w : layers_) put(w.wv, kv * d);
    for (const auto& w : layers_) put(w.wo, d * d);
    for (const auto& w : layers_) put(w.rms_ffn, d);
    for (const auto& w : layers_) put(w.w1, hd * d);
    for (const auto& w : layers_) put(w.w2, d * hd);
    for (const auto& w : layers_) put(w.w3, hd * d);
    put(rms_final_, d);
    const std::vector<float> rope(static_cast<std::size_t>(c.seq_len) * static_cast<std::size_t>(c.head_dim()), 0.0f);
    put(rope.data(), rope.size());
    if (!c.shared_classifier) put(classifier_, V * d);
    out.flush();  // a full disk shows here, not in a destructor that cannot report it
    if (!out) {
      out.close();
      std::filesystem::remove(tmp, ec);
      throw load_error(load_errc::open_failed, "write failed (disk full?)", path.string());
    }
  }
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::error_code ignored;
    std::filesystem::remove(tmp, ignored);
    throw load_error(load_errc::open_failed, "cannot rename " + tmp.string() + " into place: " + ec.message(), path.string());
  }
}

// --- Hugging Face ---------------------------------------------------------------------------------

namespace {

nlohmann::json read_json(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw load_error(load_errc::open_failed, "cannot open", path.string());
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw load_error(load_errc::bad_json, std::string("invalid JSON: ") + e.what(), path.string());
  }
}

template <class T>
T json_field(const nlohmann::json& j, const char* key, const std::string& origin) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) throw load_error(load_errc::bad_json, std::string("missing field \"") + key + "\"", origin);
  try {
    return it->get<T>();
  } catch (const nlohmann::json::exception& e) {
    throw load_error(load_errc::bad_json, std::string("field \"") + key + "\" has the wrong type: " + e.what(), origin);
  }
}

template <class T>
T json_field_or(const nlohmann::json& j, const char* key, T fallback, const std::string& origin) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  return json_field<T>(j, key, origin);
}

int json_int(const nlohmann::json& j, const char* key, const std::string& origin) {
  // A number that is no int64 (16.5, 1e300) would be truncated or overflow in get<>.
  if (const auto it = j.find(key); it != j.end() && it->is_number() && !detail::exact_int64(*it))
    throw load_error(load_errc::bad_header, std::string("\"") + key + "\" = " + it->dump() + " is not an integer in range", origin);
  const auto v = json_field<std::int64_t>(j, key, origin);
  if (v <= 0 || v > (1 << 30))
    throw load_error(load_errc::bad_header, std::string("\"") + key + "\" = " + std::to_string(v) + " is out of range", origin);
  return static_cast<int>(v);
}

// The fields of a Hugging Face config.json that the engine reads, checked (load_hf, parse_hf_config).
model_config hf_config_from_json(const nlohmann::json& j, const std::string& cp) {
  if (!j.is_object()) throw load_error(load_errc::bad_json, "top level is not an object", cp);
  const auto type = json_field_or<std::string>(j, "model_type", "llama", cp);
  if (type != "llama" && type != "mistral")
    throw load_error(load_errc::unsupported, "model_type \"" + type + "\" is not a Llama model", cp);
  model_config c;
  c.dim = json_int(j, "hidden_size", cp);
  c.hidden_dim = json_int(j, "intermediate_size", cp);
  c.n_layers = json_int(j, "num_hidden_layers", cp);
  c.n_heads = json_int(j, "num_attention_heads", cp);
  c.n_kv_heads = j.contains("num_key_value_heads") && !j["num_key_value_heads"].is_null()
                     ? json_int(j, "num_key_value_heads", cp)
                     : c.n_heads;
  c.vocab_size = json_int(j, "vocab_size", cp);
  c.seq_len = json_int(j, "max_position_embeddings", cp);
  c.rms_eps = static_cast<float>(json_field_or<double>(j, "rms_norm_eps", 1e-6, cp));
  c.rope_theta = static_cast<float>(json_field_or<double>(j, "rope_theta", 10000.0, cp));
  c.shared_classifier = json_field_or<bool>(j, "tie_word_embeddings", false, cp);
  c.rope = rope_style::split_halves;
  if (const auto act = json_field_or<std::string>(j, "hidden_act", "silu", cp); act != "silu")
    throw load_error(load_errc::unsupported, "hidden_act \"" + act + "\" (only silu)", cp);
  if (j.contains("rope_scaling") && !j["rope_scaling"].is_null())
    throw load_error(load_errc::unsupported, "rope_scaling is not supported", cp);
  if (json_field_or<bool>(j, "attention_bias", false, cp) || json_field_or<bool>(j, "mlp_bias", false, cp))
    throw load_error(load_errc::unsupported, "attention or MLP biases are not supported", cp);
  c.validate(cp);
  if (j.contains("head_dim") && !j["head_dim"].is_null() && json_int(j, "head_dim", cp) != c.head_dim())
    throw load_error(load_errc::unsupported, "head_dim " + std::to_string(json_int(j, "head_dim", cp)) +
                                                     " differs from hidden_size / num_attention_heads = " +
                                                     std::to_string(c.head_dim()), cp);
  return c;
}

}  // namespace

model_config parse_hf_config(std::string_view json_text, const std::string& origin) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json_text);
  } catch (const nlohmann::json::exception& e) {
    throw load_error(load_errc::bad_json, std::string("invalid JSON: ") + e.what(), origin);
  }
  return hf_config_from_json(j, origin);
}

model model::load_hf(const std::filesystem::path& dir) {
  const auto cfg_path = dir / "config.json";
  model m;
  m.config_ = hf_config_from_json(read_json(cfg_path), cfg_path.string());
  const auto& c = m.config_;

  const auto st_path = dir / "model.safetensors";
  const detail::safetensors_file st(st_path);
  const auto l = detail::layout_of(c);
  auto buf = std::make_shared<std::vector<float>>(l.total, 0.0f);
  const std::size_t d = static_cast<std::size_t>(c.dim), h = static_cast<std::size_t>(c.hidden_dim),
                    kv = static_cast<std::size_t>(c.kv_dim()), V = static_cast<std::size_t>(c.vocab_size);
  auto get = [&](const std::string& name, std::uint64_t off, std::size_t rows, std::size_t cols) {
    st.read_f32(name, rows, cols, buf->data() + off);
  };
  const bool has_embed = st.contains("model.embed_tokens.weight");
  const bool has_head = st.contains("lm_head.weight");
  // Tied checkpoints may store either name (HF de-duplicates shared tensors on save).
  if (has_embed) get("model.embed_tokens.weight", l.emb, V, d);
  else if (c.shared_classifier && has_head) get("lm_head.weight", l.emb, V, d);
  else get("model.embed_tokens.weight", l.emb, V, d);  // throws missing_tensor
  for (std::size_t i = 0; i < static_cast<std::size_t>(c.n_layers); ++i) {
    const std::string pre = "model.layers." + std::to_string(i) + ".";
    get(pre + "input_layernorm.weight", l.rms_att + i * d, 1, d);
    get(pre + "self_attn.q_proj.weight", l.wq + i * d * d, d, d);
    get(pre + "self_attn.k_proj.weight", l.wk + i * kv * d, kv, d);
    get(pre + "self_attn.v_proj.weight", l.wv + i * kv * d, kv, d);
    get(pre + "self_attn.o_proj.weight", l.wo + i * d * d, d, d);
    get(pre + "post_attention_layernorm.weight", l.rms_ffn + i * d, 1, d);
    get(pre + "mlp.gate_proj.weight", l.w1 + i * h * d, h, d);
    get(pre + "mlp.down_proj.weight", l.w2 + i * d * h, d, h);
    get(pre + "mlp.up_proj.weight", l.w3 + i * h * d, h, d);
  }
  get("model.norm.weight", l.rms_final, 1, d);
  if (!c.shared_classifier) get("lm_head.weight", l.cls, V, d);
  // What the file stored: the block matrices (all alike, else mixed) and the classifier.
  std::optional<stored_type> blocks;
  for (std::size_t i = 0; i < static_cast<std::size_t>(c.n_layers); ++i) {
    const std::string pre = "model.layers." + std::to_string(i) + ".";
    for (const char* w : {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                          "mlp.down_proj", "mlp.up_proj"}) {
      const auto t = st.stored(pre + w + ".weight");
      blocks = !blocks || *blocks == t ? t : stored_type::mixed;
    }
  }
  m.stored_ = blocks.value_or(stored_type::f32);
  m.classifier_stored_ = st.stored(!c.shared_classifier || !has_embed ? "lm_head.weight" : "model.embed_tokens.weight");
  m.bind_llama2c(buf->data());
  m.storage_ = std::move(buf);
  return m;
}

namespace {

// `f` as the double of its shortest decimal when that reads back as `f` (config.json then says
// 1e-05, not 9.999999747378752e-06), else exactly.
double float_for_json(float f) {
  char text[32];
  const auto [end, ec] = std::to_chars(text, text + sizeof text, f);
  double v = 0.0;
  if (ec != std::errc{} || std::from_chars(text, end, v).ec != std::errc{} || static_cast<float>(v) != f)
    return static_cast<double>(f);
  return v;
}

std::string without_prefix(const char* what) {
  const std::string_view s(what), p("medusa: ");
  return std::string(s.starts_with(p) ? s.substr(p.size()) : s);
}

}  // namespace

std::vector<float> adjacent_to_halves(const float* w, std::size_t heads, std::size_t head_dim, std::size_t cols) {
  std::vector<float> out(heads * head_dim * cols);
  const std::size_t half = head_dim / 2;
  for (std::size_t hd = 0; hd < heads; ++hd)
    for (std::size_t i = 0; i < half; ++i)
      for (std::size_t e = 0; e < 2; ++e)
        std::copy_n(w + (hd * head_dim + 2 * i + e) * cols, cols, out.data() + (hd * head_dim + e * half + i) * cols);
  return out;
}

void model::save_hf(const std::filesystem::path& dir) const {
  const auto& c = config_;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw load_error(load_errc::open_failed, "cannot create the directory: " + ec.message(), dir.string());
  const std::uint64_t d = static_cast<std::uint64_t>(c.dim), h = static_cast<std::uint64_t>(c.hidden_dim),
                      kv = static_cast<std::uint64_t>(c.kv_dim()), V = static_cast<std::uint64_t>(c.vocab_size);
  const std::size_t hd = static_cast<std::size_t>(c.head_dim());
  const bool permute = c.rope == rope_style::adjacent_pairs;

  medusa::safetensors_writer st;
  st.add_metadata("format", "pt");  // transformers refuses safetensors files without it
  std::vector<std::vector<float>> permuted;  // wq, wk in Hugging Face row order; the writer keeps spans
  permuted.reserve(permute ? 2 * layers_.size() : 0);
  auto add = [&](std::string name, const float* p, std::vector<std::uint64_t> shape) {
    std::uint64_t n = 1;
    for (auto s : shape) n *= s;
    st.add(std::move(name), medusa::safetensors_dtype::f32, std::move(shape),
           std::as_bytes(std::span<const float>(p, static_cast<std::size_t>(n))));
  };
  add("model.embed_tokens.weight", embedding_, {V, d});
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    const auto& w = layers_[i];
    const float* wq = w.wq;
    const float* wk = w.wk;
    if (permute) {
      wq = permuted.emplace_back(adjacent_to_halves(wq, static_cast<std::size_t>(c.n_heads), hd, d)).data();
      wk = permuted.emplace_back(adjacent_to_halves(wk, static_cast<std::size_t>(c.n_kv_heads), hd, d)).data();
    }
    const std::string pre = "model.layers." + std::to_string(i) + ".";
    add(pre + "input_layernorm.weight", w.rms_att, {d});
    add(pre + "self_attn.q_proj.weight", wq, {d, d});
    add(pre + "self_attn.k_proj.weight", wk, {kv, d});
    add(pre + "self_attn.v_proj.weight", w.wv, {kv, d});
    add(pre + "self_attn.o_proj.weight", w.wo, {d, d});
    add(pre + "post_attention_layernorm.weight", w.rms_ffn, {d});
    add(pre + "mlp.gate_proj.weight", w.w1, {h, d});
    add(pre + "mlp.down_proj.weight", w.w2, {d, h});
    add(pre + "mlp.up_proj.weight", w.w3, {h, d});
  }
  add("model.norm.weight", rms_final_, {d});
  if (!c.shared_classifier) add("lm_head.weight", classifier_, {V, d});
  const auto st_path = dir / "model.safetensors";
  try {
    st.write(st_path);
  } catch (const medusa::io_error& e) {
    throw load_error(load_errc::open_failed, without_prefix(e.what()), st_path.string());
  }

  nlohmann::ordered_json j;
  j["architectures"] = nlohmann::ordered_json::array({"LlamaForCausalLM"});
  j["model_type"] = "llama";
  j["hidden_size"] = c.dim;
  j["intermediate_size"] = c.hidden_dim;
  j["num_hidden_layers"] = c.n_layers;
  j["num_attention_heads"] = c.n_heads;
  j["num_key_value_heads"] = c.n_kv_heads;
  j["vocab_size"] = c.vocab_size;
  j["max_position_embeddings"] = c.seq_len;
  j["rms_norm_eps"] = float_for_json(c.rms_eps);
  j["rope_theta"] = float_for_json(c.rope_theta);
  j["hidden_act"] = "silu";
  j["tie_word_embeddings"] = c.shared_classifier;
  j["torch_dtype"] = "float32";
  // Written last and renamed into place: a directory with a config.json has its weights.
  const auto cfg_path = dir / "config.json";
  auto tmp = cfg_path;
  tmp += ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw load_error(load_errc::open_failed, "cannot create file", tmp.string());
    out << j.dump(2) << '\n';
    out.flush();
    if (!out) {
      out.close();
      std::filesystem::remove(tmp, ec);
      throw load_error(load_errc::open_failed, "write failed", tmp.string());
    }
  }
  std::filesystem::rename(tmp, cfg_path, ec);
  if (ec) {
    const std::string why = ec.message();
    std::filesystem::remove(tmp, ec);
    throw load_error(load_errc::open_failed, "cannot rename " + tmp.string() + " into place: " + why, cfg_path.string());
  }
}

// --- GGUF -----------------------------------------------------------------------------------------

model model::load_gguf(const std::filesystem::path& path) {
  const auto file = detail::gguf_file::open(path);
  model m;
  m.config_ = detail::gguf_llama_config(file);
  const auto& c = m.config_;
  model_config no_rope = c;  // the buffer holds no RoPE tables
  no_rope.seq_len = 0;
  const auto l = detail::layout_of(no_rope);
  const std::uint64_t d = static_cast<std::uint64_t>(c.dim), h = static_cast<std::uint64_t>(c.hidden_dim),
                      kv = static_cast<std::uint64_t>(c.kv_dim()), V = static_cast<std::uint64_t>(c.vocab_size);

  // Every tensor is found and checked before anything is allocated.
  struct part {
    const detail::gguf_tensor* t;
    std::uint64_t offset;  // in floats, into the buffer
  };
  std::vector<part> parts;
  auto add = [&](const std::string& name, std::uint64_t offset, std::uint64_t in, std::uint64_t out) {
    const detail::gguf_tensor* t = file.find_tensor(name);
    if (t == nullptr) throw load_error(load_errc::missing_tensor, "tensor \"" + name + "\" is missing", file.origin());
    // GGUF dims are innermost first: a [out][in] matrix has dims [in, out]; trailing 1s are allowed.
    bool ok = t->dims[0] == in && (out == 0 ? t->n_dims >= 1 : t->n_dims >= 2 && t->dims[1] == out);
    for (std::uint32_t k = out == 0 ? 1 : 2; k < t->n_dims; ++k) ok = ok && t->dims[k] == 1;
    if (!ok) {
      std::string want = "[" + std::to_string(in);
      if (out != 0) want += ", " + std::to_string(out);
      want += "]";
      throw load_error(load_errc::size_mismatch, "tensor \"" + name + "\" has dims " + t->shape() + ", expected " + want +
                                                     " (GGUF dims are innermost first)", file.origin());
    }
    file.check_decodable(*t);
    parts.push_back({t, offset});
  };
  add("token_embd.weight", l.emb, d, V);
  for (std::uint64_t i = 0; i < static_cast<std::uint64_t>(c.n_layers); ++i) {
    const std::string pre = "blk." + std::to_string(i) + ".";
    add(pre + "attn_norm.weight", l.rms_att + i * d, d, 0);
    add(pre + "attn_q.weight", l.wq + i * d * d, d, d);
    add(pre + "attn_k.weight", l.wk + i * kv * d, d, kv);
    add(pre + "attn_v.weight", l.wv + i * kv * d, d, kv);
    add(pre + "attn_output.weight", l.wo + i * d * d, d, d);
    add(pre + "ffn_norm.weight", l.rms_ffn + i * d, d, 0);
    add(pre + "ffn_gate.weight", l.w1 + i * h * d, d, h);
    add(pre + "ffn_down.weight", l.w2 + i * d * h, h, d);
    add(pre + "ffn_up.weight", l.w3 + i * h * d, d, h);
    for (const char* b : {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_down", "ffn_up"})
      if (file.find_tensor(pre + b + ".bias") != nullptr)
        throw load_error(load_errc::unsupported, "tensor \"" + pre + b + ".bias\": biases are not supported", file.origin());
  }
  add("output_norm.weight", l.rms_final, d, 0);
  if (!c.shared_classifier) add("output.weight", l.cls, d, V);

  auto buf = std::make_shared<std::vector<float>>(l.total);
  std::optional<stored_type> blocks;
  for (const auto& p : parts) {
    file.read_f32(*p.t, buf->data() + p.offset);
    const std::string_view name = p.t->name;
    const bool matrix = name.starts_with("blk.") && !name.ends_with("_norm.weight");
    const auto t = *detail::stored_type_of(p.t->type);
    if (matrix) blocks = !blocks || *blocks == t ? t : stored_type::mixed;
  }
  m.stored_ = blocks.value_or(stored_type::f32);
  m.classifier_stored_ = *detail::stored_type_of((c.shared_classifier ? parts.front() : parts.back()).t->type);
  m.bind_llama2c(buf->data(), /*rope_tables=*/false);
  m.storage_ = std::move(buf);
  return m;
}

}  // namespace medusa_llama
