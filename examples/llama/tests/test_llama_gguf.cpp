// SPDX-License-Identifier: Apache-2.0
// GGUF loading. A small GGUF writer (bytes built here) makes models of every supported tensor type
// from random weights; corrupt files fail with the right load_errc and a message naming the
// problem; the GGUF files of ../shared match their llama2.c / Hugging Face originals; and
// scripts/convert_to_gguf.py writes what independent reference quantizers predict.
#include <medusa_llama/llama.hpp>
#include <medusa_llama/load.hpp>

#include "../src/gguf_reader.hpp"  // private reader: every prefix of a file, fed from memory

#include <medusa/decoder.hpp>
#include <medusa/half.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using namespace medusa_llama;

namespace {

const fs::path tmp_dir{MEDUSA_TEST_TMPDIR};
const fs::path models{fs::path(MEDUSA_SHARED_DIR) / "models"};

bool have(const fs::path& p) {
  if (fs::exists(p)) return true;
  MESSAGE("skipped: " << p.string() << " is absent");
  return false;
}

// ggml tensor type ids used here.
constexpr std::uint32_t F32 = 0, F16 = 1, Q4_0 = 2, Q8_0 = 8, Q6_K = 14, BF16 = 30;
// gguf metadata value types used here.
constexpr std::uint32_t U32 = 4, I32 = 5, F32V = 6, BOOL = 7, STR = 8, ARR = 9;

// --- reference encodings (ggml's reference quantizers, written from their definition) ------------

using bytes = std::vector<unsigned char>;

template <class T>
void put(bytes& b, T v) {
  unsigned char tmp[sizeof(T)];
  std::memcpy(tmp, &v, sizeof v);
  b.insert(b.end(), tmp, tmp + sizeof v);
}

// quantize_row_q8_0_ref: d = amax / 127, q = roundf(x · (1/d)), d stored as binary16.
bytes quantize_q8_0(const float* x, std::size_t n) {
  bytes out;
  for (std::size_t b = 0; b < n; b += 32) {
    float amax = 0.0f;
    for (std::size_t j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[b + j]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    put<std::uint16_t>(out, medusa::detail::float_to_half_bits(d));
    for (std::size_t j = 0; j < 32; ++j) {
      volatile float v = x[b + j] * id;  // volatile: no contraction into anything else
      out.push_back(static_cast<unsigned char>(static_cast<std::int8_t>(std::round(v))));
    }
  }
  return out;
}

// quantize_row_q4_0_ref: max = the value of largest magnitude (first on ties), d = max / -8,
// q = min(15, (int8)(x · (1/d) + 8.5)); element j in the low nibble of byte j, j + 16 in the high.
bytes quantize_q4_0(const float* x, std::size_t n) {
  bytes out;
  for (std::size_t b = 0; b < n; b += 32) {
    float amax = 0.0f, max = 0.0f;
    for (std::size_t j = 0; j < 32; ++j)
      if (amax < std::fabs(x[b + j])) {
        amax = std::fabs(x[b + j]);
        max = x[b + j];
      }
    const float d = max / -8.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    put<std::uint16_t>(out, medusa::detail::float_to_half_bits(d));
    auto q = [&](std::size_t j) {
      volatile float v = x[b + j] * id;  // rounded to float before the + 8.5f, as in ggml's C
      const float shifted = v + 8.5f;
      return std::min(15, static_cast<int>(static_cast<std::int8_t>(shifted)));
    };
    for (std::size_t j = 0; j < 16; ++j) out.push_back(static_cast<unsigned char>(q(j) | (q(j + 16) << 4)));
  }
  return out;
}

bytes encode(const float* x, std::size_t n, std::uint32_t type) {
  bytes out;
  switch (type) {
    case F32: out.resize(4 * n); std::memcpy(out.data(), x, 4 * n); break;
    case F16: for (std::size_t i = 0; i < n; ++i) put<std::uint16_t>(out, medusa::detail::float_to_half_bits(x[i])); break;
    case BF16: for (std::size_t i = 0; i < n; ++i) put<std::uint16_t>(out, medusa::detail::float_to_bfloat16_bits(x[i])); break;
    case Q8_0: out = quantize_q8_0(x, n); break;
    case Q4_0: out = quantize_q4_0(x, n); break;
    default: FAIL("no encoder for type " << type);
  }
  return out;
}

// Decodes bytes written by `encode` (independently of the library's reader).
std::vector<float> decode(const bytes& b, std::size_t n, std::uint32_t type) {
  std::vector<float> out(n);
  auto u16 = [&](std::size_t off) {
    std::uint16_t v;
    std::memcpy(&v, b.data() + off, 2);
    return v;
  };
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t blk = i / 32, j = i % 32;
    switch (type) {
      case F32: std::memcpy(&out[i], b.data() + 4 * i, 4); break;
      case F16: out[i] = medusa::detail::half_bits_to_float(u16(2 * i)); break;
      case BF16: out[i] = medusa::detail::bfloat16_bits_to_float(u16(2 * i)); break;
      case Q8_0: out[i] = static_cast<float>(static_cast<std::int8_t>(b[34 * blk + 2 + j])) * medusa::detail::half_bits_to_float(u16(34 * blk)); break;
      case Q4_0: {
        const unsigned char q = b[18 * blk + 2 + j % 16];
        const int v = (j < 16 ? (q & 15) : (q >> 4)) - 8;
        out[i] = static_cast<float>(v) * medusa::detail::half_bits_to_float(u16(18 * blk));
        break;
      }
      default: FAIL("no decoder for type " << type);
    }
  }
  return out;
}

// --- a small GGUF writer ---------------------------------------------------------------------------

struct gguf_writer {
  struct tensor {
    std::string name;
    std::vector<std::uint64_t> dims;  // innermost first
    std::uint32_t type = F32;
    bytes data;
    std::optional<std::uint64_t> offset;  // written instead of the real one
  };
  std::uint32_t version = 3;
  std::vector<std::pair<std::string, bytes>> kvs;  // key -> value type + value
  std::vector<tensor> tensors;
  std::optional<std::uint64_t> tensor_count;  // written instead of the real one

  void set(const std::string& key, std::uint32_t type, const bytes& value) {
    bytes v;
    put(v, type);
    v.insert(v.end(), value.begin(), value.end());
    for (auto& kv : kvs)
      if (kv.first == key) {
        kv.second = v;
        return;
      }
    kvs.emplace_back(key, v);
  }
  void erase(const std::string& key) {
    std::erase_if(kvs, [&](const auto& kv) { return kv.first == key; });
  }
  static bytes str(std::string_view s) {
    bytes b;
    put<std::uint64_t>(b, s.size());
    b.insert(b.end(), s.begin(), s.end());
    return b;
  }
  void u32(const std::string& k, std::uint32_t v) { bytes b; put(b, v); set(k, U32, b); }
  void f32(const std::string& k, float v) { bytes b; put(b, v); set(k, F32V, b); }
  void boolean(const std::string& k, bool v) { set(k, BOOL, bytes{static_cast<unsigned char>(v)}); }
  void string(const std::string& k, std::string_view v) { set(k, STR, str(v)); }
  void strings(const std::string& k, const std::vector<std::string>& v) {
    bytes b;
    put(b, STR);
    put<std::uint64_t>(b, v.size());
    for (const auto& s : v) {
      const auto e = str(s);
      b.insert(b.end(), e.begin(), e.end());
    }
    set(k, ARR, b);
  }
  template <class T>
  void array(const std::string& k, std::uint32_t elem, const std::vector<T>& v) {
    bytes b;
    put(b, elem);
    put<std::uint64_t>(b, v.size());
    for (const T& x : v) put(b, x);
    set(k, ARR, b);
  }
  tensor* find(const std::string& name) {
    for (auto& t : tensors)
      if (t.name == name) return &t;
    return nullptr;
  }

  // Header, metadata, tensor infos, padding to 32, data (each tensor at a multiple of 32).
  [[nodiscard]] bytes serialize() const {
    bytes o = {'G', 'G', 'U', 'F'};
    put(o, version);
    put<std::uint64_t>(o, tensor_count.value_or(tensors.size()));
    put<std::uint64_t>(o, kvs.size());
    for (const auto& [k, v] : kvs) {
      const auto ks = str(k);
      o.insert(o.end(), ks.begin(), ks.end());
      o.insert(o.end(), v.begin(), v.end());
    }
    std::uint64_t off = 0;
    std::vector<std::uint64_t> at;
    for (const auto& t : tensors) {
      const auto ns = str(t.name);
      o.insert(o.end(), ns.begin(), ns.end());
      put<std::uint32_t>(o, static_cast<std::uint32_t>(t.dims.size()));
      for (auto d : t.dims) put(o, d);
      put(o, t.type);
      put(o, t.offset.value_or(off));
      at.push_back(off);
      off = (off + t.data.size() + 31) / 32 * 32;
    }
    const std::size_t data_start = (o.size() + 31) / 32 * 32;
    o.resize(data_start);
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      o.resize(data_start + at[i]);
      o.insert(o.end(), tensors[i].data.begin(), tensors[i].data.end());
    }
    return o;
  }
  fs::path write(const std::string& file) const {
    fs::create_directories(tmp_dir);
    const auto path = tmp_dir / file;
    const auto b = serialize();
    std::ofstream(path, std::ios::binary | std::ios::trunc).write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
    return path;
  }
};

model_config small_config(bool shared = true) {
  model_config c;
  c.dim = 64;
  c.hidden_dim = 96;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.vocab_size = 64;
  c.seq_len = 32;
  c.shared_classifier = shared;
  return c;
}

// A SentencePiece-style vocabulary: <unk>, <s>, </s>, "▁", letters, "▁"-prefixed letters.
std::vector<std::string> vocab_pieces(int n) {
  std::vector<std::string> v = {"<unk>", "<s>", "</s>", "\xE2\x96\x81"};
  for (int i = 4; i < n; ++i) {
    const char c = static_cast<char>('a' + (i - 4) % 26);
    v.push_back((i - 4) / 26 % 2 == 0 ? std::string(1, c) : "\xE2\x96\x81" + std::string(1, c));
    if (i - 4 >= 52) v.back() += std::to_string(i);
  }
  return v;
}

// Every tensor of a model as llama.cpp names it: name, pointer, [out, in] (out = 0 for vectors).
struct named_tensor {
  std::string name;
  const float* data;
  std::size_t out, in;
  bool matrix() const { return out != 0; }
  std::size_t size() const { return (out == 0 ? 1 : out) * in; }
};

std::vector<named_tensor> tensors_of(const model& m, bool write_output) {
  const auto& c = m.config();
  const auto d = static_cast<std::size_t>(c.dim), h = static_cast<std::size_t>(c.hidden_dim),
             kv = static_cast<std::size_t>(c.kv_dim()), V = static_cast<std::size_t>(c.vocab_size);
  std::vector<named_tensor> t = {{"token_embd.weight", m.token_embedding(), V, d}};
  for (int l = 0; l < c.n_layers; ++l) {
    const auto& w = m.layer(l);
    const std::string p = "blk." + std::to_string(l) + ".";
    t.push_back({p + "attn_norm.weight", w.rms_att, 0, d});
    t.push_back({p + "attn_q.weight", w.wq, d, d});
    t.push_back({p + "attn_k.weight", w.wk, kv, d});
    t.push_back({p + "attn_v.weight", w.wv, kv, d});
    t.push_back({p + "attn_output.weight", w.wo, d, d});
    t.push_back({p + "ffn_norm.weight", w.rms_ffn, 0, d});
    t.push_back({p + "ffn_gate.weight", w.w1, h, d});
    t.push_back({p + "ffn_down.weight", w.w2, d, h});
    t.push_back({p + "ffn_up.weight", w.w3, h, d});
  }
  t.push_back({"output_norm.weight", m.rms_final(), 0, d});
  if (write_output) t.push_back({"output.weight", m.classifier(), V, d});
  return t;
}

// A GGUF of `m`: matrices in the type `type_of(name)` says, norms F32, a vocabulary of the
// model's size. `expected` receives each tensor's values as the file holds them.
gguf_writer gguf_of(const model& m, const std::function<std::uint32_t(const std::string&)>& type_of,
                    std::map<std::string, std::vector<float>>* expected = nullptr) {
  const auto& c = m.config();
  gguf_writer w;
  w.string("general.architecture", "llama");
  w.string("general.name", "test");
  w.u32("llama.context_length", static_cast<std::uint32_t>(c.seq_len));
  w.u32("llama.embedding_length", static_cast<std::uint32_t>(c.dim));
  w.u32("llama.feed_forward_length", static_cast<std::uint32_t>(c.hidden_dim));
  w.u32("llama.block_count", static_cast<std::uint32_t>(c.n_layers));
  w.u32("llama.attention.head_count", static_cast<std::uint32_t>(c.n_heads));
  w.u32("llama.attention.head_count_kv", static_cast<std::uint32_t>(c.n_kv_heads));
  w.u32("llama.rope.dimension_count", static_cast<std::uint32_t>(c.head_dim()));
  w.f32("llama.attention.layer_norm_rms_epsilon", c.rms_eps);
  w.f32("llama.rope.freq_base", c.rope_theta);
  w.u32("llama.vocab_size", static_cast<std::uint32_t>(c.vocab_size));
  w.string("tokenizer.ggml.model", "llama");
  w.strings("tokenizer.ggml.tokens", vocab_pieces(c.vocab_size));
  std::vector<float> scores(static_cast<std::size_t>(c.vocab_size));
  std::vector<std::int32_t> types(scores.size(), 1);
  for (std::size_t i = 0; i < scores.size(); ++i) scores[i] = -static_cast<float>(i);
  types[0] = 2;
  types[1] = types[2] = 3;
  w.array("tokenizer.ggml.scores", F32V, scores);
  w.array("tokenizer.ggml.token_type", I32, types);
  w.u32("tokenizer.ggml.bos_token_id", 1);
  w.u32("tokenizer.ggml.eos_token_id", 2);
  w.u32("tokenizer.ggml.unknown_token_id", 0);
  w.boolean("tokenizer.ggml.add_space_prefix", true);
  for (const auto& t : tensors_of(m, !c.shared_classifier)) {
    const std::uint32_t type = t.matrix() ? type_of(t.name) : F32;
    gguf_writer::tensor g;
    g.name = t.name;
    g.dims = t.matrix() ? std::vector<std::uint64_t>{t.in, t.out} : std::vector<std::uint64_t>{t.in};
    g.type = type;
    g.data = encode(t.data, t.size(), type);
    if (expected != nullptr) (*expected)[t.name] = decode(g.data, t.size(), type);
    w.tensors.push_back(std::move(g));
  }
  return w;
}

std::function<std::uint32_t(const std::string&)> all(std::uint32_t type) {
  return [type](const std::string&) { return type; };
}

// Compares every tensor of `m` with `expected` (bitwise, so NaN-free inputs only).
void check_weights(const model& m, const std::map<std::string, std::vector<float>>& expected) {
  for (const auto& t : tensors_of(m, !m.config().shared_classifier)) {
    CAPTURE(t.name);
    const auto it = expected.find(t.name);
    REQUIRE(it != expected.end());
    REQUIRE(it->second.size() == t.size());
    CHECK(std::memcmp(it->second.data(), t.data, 4 * t.size()) == 0);
  }
}

void check_same_weights(const model& a, const model& b) {
  const auto ta = tensors_of(a, true), tb = tensors_of(b, true);
  REQUIRE(ta.size() == tb.size());
  for (std::size_t i = 0; i < ta.size(); ++i) {
    CAPTURE(ta[i].name);
    CHECK(std::memcmp(ta[i].data, tb[i].data, 4 * ta[i].size()) == 0);
  }
}

// The logits of `tokens` decoded one at a time.
std::vector<float> logits_of(engine& e, const std::vector<int>& tokens) {
  const auto V = static_cast<std::size_t>(e.config().vocab_size);
  std::vector<float> all(tokens.size() * V), one(V);
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    e.decode(tokens[i], static_cast<int>(i), one);
    std::copy(one.begin(), one.end(), all.begin() + static_cast<std::ptrdiff_t>(i * V));
  }
  return all;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double d = 0;
  for (std::size_t i = 0; i < a.size(); ++i) d = std::max(d, static_cast<double>(std::abs(a[i] - b[i])));
  return d;
}

std::vector<int> greedy(engine& e, std::span<const int> prompt, int n) {
  medusa::decode_options opt;
  opt.max_new_tokens = n;
  const auto r = medusa::generate_vanilla(e, prompt, medusa::greedy_policy{}, opt);
  return {r.tokens.begin(), r.tokens.end()};
}

template <class F>
std::optional<load_error> error_of(F&& f) {
  try {
    f();
  } catch (const load_error& e) {
    return e;
  }
  return std::nullopt;
}

// `f` throws load_error with `code` and a message containing `fragment`.
void expect_error(const std::function<void()>& f, load_errc code, std::string_view fragment) {
  const auto e = error_of(f);
  REQUIRE_MESSAGE(e.has_value(), "no load_error thrown");
  INFO("what(): " << std::string(e->what()));
  CHECK(std::string(to_string(e->code())) == std::string(to_string(code)));
  CHECK(std::string_view(e->what()).find(fragment) != std::string_view::npos);
}

model small_model(bool shared = true, std::uint64_t seed = 11) { return model::random(small_config(shared), seed, 0.3f); }

}  // namespace

TEST_CASE("GGUF: F32 weights load exactly and give the llama2.c checkpoint's logits") {
  for (bool shared : {true, false}) {
    CAPTURE(shared);
    const auto m = small_model(shared);
    std::map<std::string, std::vector<float>> expected;
    const auto path = gguf_of(m, all(F32), &expected).write(shared ? "f32.gguf" : "f32_cls.gguf");
    CHECK(is_gguf(path));
    const auto g = model::load_gguf(path);
    CHECK(g.config().dim == 64);
    CHECK(g.config().n_kv_heads == 2);
    CHECK(g.config().vocab_size == 64);
    CHECK(g.config().seq_len == 32);
    CHECK(g.config().rope == rope_style::adjacent_pairs);
    CHECK(g.config().shared_classifier == shared);
    CHECK(g.config().rms_eps == m.config().rms_eps);
    CHECK(g.stored() == stored_type::f32);
    CHECK(g.classifier_stored() == stored_type::f32);
    check_weights(g, expected);
    if (shared) CHECK(g.classifier() == g.token_embedding());

    const auto bin = tmp_dir / (shared ? "f32.bin" : "f32_cls.bin");
    m.save_llama2c(bin);
    engine a(model::load_llama2c(bin), {.threads = 1}), b(g, {.threads = 1});
    const std::vector<int> tokens = {1, 5, 9, 33, 2, 63, 17, 4};
    CHECK(max_abs_diff(logits_of(a, tokens), logits_of(b, tokens)) == 0.0);
  }
}

TEST_CASE("GGUF: F16, BF16, Q8_0 and Q4_0 tensors decode to the values of their bytes") {
  const auto m = small_model(false, 12);
  const std::pair<std::uint32_t, stored_type> cases[] = {
      {F16, stored_type::f16}, {BF16, stored_type::bf16}, {Q8_0, stored_type::q8_0}, {Q4_0, stored_type::q4_0}};
  for (const auto& [type, stored] : cases) {
    CAPTURE(to_string(stored));
    std::map<std::string, std::vector<float>> expected;
    const auto g = model::load_gguf(gguf_of(m, all(type), &expected).write("typed.gguf"));
    check_weights(g, expected);
    CHECK(g.stored() == stored);
    CHECK(g.classifier_stored() == stored);
    // The quantized values differ from the originals, but not by much.
    double err = 0;
    for (std::size_t i = 0; i < 64 * 64; ++i) err = std::max(err, static_cast<double>(std::abs(g.layer(1).wq[i] - m.layer(1).wq[i])));
    CHECK(err > 0.0);
    CHECK(err < (type == Q4_0 ? 0.04 : 0.002));  // Q4_0 clips the side opposite its largest weight
  }
  // Hand-made blocks: Q8_0 with d = 0.5 and q = -128..; Q4_0 with d = 2 and nibbles 0..15.
  std::map<std::string, std::vector<float>> expected;
  auto w = gguf_of(m, all(F32), &expected);
  auto* q8 = w.find("blk.0.attn_q.weight");
  q8->type = Q8_0;
  q8->data.clear();
  for (std::size_t b = 0; b < 64 * 64 / 32; ++b) {
    put<std::uint16_t>(q8->data, 0x3800);  // 0.5
    for (int j = 0; j < 32; ++j) q8->data.push_back(static_cast<unsigned char>(static_cast<std::int8_t>(j * 8 - 128)));
  }
  auto* q4 = w.find("blk.0.attn_k.weight");
  q4->type = Q4_0;
  q4->data.clear();
  for (std::size_t b = 0; b < 32 * 64 / 32; ++b) {
    put<std::uint16_t>(q4->data, 0x4000);  // 2.0
    for (int j = 0; j < 16; ++j) q4->data.push_back(static_cast<unsigned char>(j | ((15 - j) << 4)));
  }
  const auto g = model::load_gguf(w.write("handmade.gguf"));
  for (std::size_t i = 0; i < 64 * 64; ++i) REQUIRE(g.layer(0).wq[i] == 0.5f * static_cast<float>(static_cast<int>(i % 32) * 8 - 128));
  for (std::size_t i = 0; i < 32 * 64; ++i) {
    const int j = static_cast<int>(i % 32);
    REQUIRE(g.layer(0).wk[i] == 2.0f * static_cast<float>((j < 16 ? j : 15 - (j - 16)) - 8));
  }
  CHECK(g.stored() == stored_type::mixed);
  CHECK(g.classifier_stored() == stored_type::f32);
  CHECK(to_string(stored_type::mixed) == "mixed");
  CHECK(to_string(stored_type::q4_0) == "q4_0");
}

TEST_CASE("GGUF: the tokenizer comes from the metadata; load() uses it") {
  const auto m = small_model();
  auto w = gguf_of(m, all(F32));
  const auto path = w.write("tok.gguf");
  const auto lm = load(path);
  CHECK(lm.tokenizer_path == path);
  REQUIRE(lm.tok->vocab_size() == 64);
  CHECK(lm.tok->bos_id() == 1);
  CHECK(lm.tok->eos_id() == 2);
  // "▁" is a space; with the dummy prefix " a" is one token.
  const auto ids = lm.tok->encode("a b", true, true);
  CHECK(ids.front() == 1);
  CHECK(ids.back() == 2);
  CHECK(lm.tok->decode(ids) == "a b");
  CHECK(lm.tok->decode_piece(-1, 0).empty());  // <unk> is not text
  CHECK(default_dummy_prefix(path));
  // Without the dummy prefix, and with BOS/EOS elsewhere.
  w.boolean("tokenizer.ggml.add_space_prefix", false);
  w.u32("tokenizer.ggml.bos_token_id", 2);
  w.u32("tokenizer.ggml.eos_token_id", 1);
  const auto p2 = w.write("tok2.gguf");
  CHECK_FALSE(default_dummy_prefix(p2));
  const auto t2 = load_tokenizer(p2, default_dummy_prefix(p2));
  CHECK(t2->bos_id() == 2);
  CHECK(t2->encode("a", true, false) == std::vector<int>{2, 4});
  CHECK(t2->decode(t2->encode(" a b", false, false)) == " a b");
  // A tokenizer file given explicitly wins over the metadata.
  const auto tokbin = tmp_dir / "tok_for_gguf.bin";
  {
    std::ofstream out(tokbin, std::ios::binary);
    const std::int32_t max_len = 8;
    out.write(reinterpret_cast<const char*>(&max_len), 4);
    for (int i = 0; i < 64; ++i) {
      const float score = 0;
      const std::string s = i < 3 ? std::string("x") : std::string(1, static_cast<char>(' ' + i));
      const auto len = static_cast<std::int32_t>(s.size());
      out.write(reinterpret_cast<const char*>(&score), 4);
      out.write(reinterpret_cast<const char*>(&len), 4);
      out.write(s.data(), len);
    }
  }
  const auto lm2 = load(path, tokbin);
  CHECK(lm2.tokenizer_path == tokbin);
  CHECK(dynamic_cast<const llama2c_tokenizer&>(*lm2.tok).piece(40) == std::string(1, static_cast<char>(' ' + 40)));
}

TEST_CASE("GGUF: every prefix of a valid file is refused as truncated, never read past") {
  const auto m = model::random([] {
    auto c = small_config();
    c.dim = 32;
    c.hidden_dim = 32;
    c.n_layers = 1;
    c.n_heads = 2;
    c.n_kv_heads = 1;
    c.vocab_size = 8;
    return c;
  }(), 3, 0.3f);
  const auto full = gguf_of(m, all(Q8_0)).serialize();
  (void)detail::gguf_file::from_bytes(full, "full");
  for (std::size_t n = 0; n < full.size(); ++n) {
    // A copy of exactly n bytes, so the sanitizers see any read beyond it.
    const std::vector<unsigned char> prefix(full.begin(), full.begin() + static_cast<std::ptrdiff_t>(n));
    const auto e = error_of([&] { (void)detail::gguf_file::from_bytes(prefix, "prefix"); });
    REQUIRE_MESSAGE(e.has_value(), "a prefix of " << n << " bytes parsed");
    REQUIRE_MESSAGE(e->code() == load_errc::truncated, e->what());
  }
}

TEST_CASE("GGUF: truncated files name where they end") {
  const auto m = small_model();
  const auto w = gguf_of(m, all(F32));
  const auto full = w.serialize();
  auto cut = [&](std::size_t n) {
    const auto path = tmp_dir / "cut.gguf";
    std::ofstream(path, std::ios::binary | std::ios::trunc).write(reinterpret_cast<const char*>(full.data()), static_cast<std::streamsize>(n));
    return path;
  };
  // Inside the header, the metadata (a key, then the token array), the tensor infos and the data.
  expect_error([&] { (void)model::load_gguf(cut(0)); }, load_errc::truncated, "empty file");
  expect_error([&] { (void)model::load_gguf(cut(3)); }, load_errc::truncated, "the magic");
  expect_error([&] { (void)model::load_gguf(cut(6)); }, load_errc::truncated, "the version");
  expect_error([&] { (void)model::load_gguf(cut(20)); }, load_errc::truncated, "metadata count");
  // Counts are checked against the bytes left before anything is read.
  expect_error([&] { (void)model::load_gguf(cut(30)); }, load_errc::truncated, "the metadata count is 20, but only 6 bytes are left");
  auto at = [&](const std::string& s) {
    return static_cast<std::size_t>(std::search(full.begin(), full.end(), s.begin(), s.end()) - full.begin());
  };
  const std::size_t model_key = at("tokenizer.ggml.model"), tokens_at = at("tokenizer.ggml.tokens"), infos_at = at("token_embd.weight"),
                    last_info = at("output_norm.weight");
  REQUIRE(model_key < tokens_at);
  REQUIRE(tokens_at < infos_at);
  REQUIRE(infos_at < last_info);
  expect_error([&] { (void)model::load_gguf(cut(model_key + 5)); }, load_errc::truncated, "file ends inside the key of metadata entry 12");
  expect_error([&] { (void)model::load_gguf(cut(tokens_at + 60)); }, load_errc::truncated, "\"tokenizer.ggml.tokens\"");
  expect_error([&] { (void)model::load_gguf(cut(infos_at + 20)); }, load_errc::truncated, "the tensor count is 20");
  expect_error([&] { (void)model::load_gguf(cut(last_info + 20)); }, load_errc::truncated, "file ends inside the dimension count of tensor \"output_norm.weight\"");
  expect_error([&] { (void)model::load_gguf(cut(full.size() - 10)); }, load_errc::truncated, "\"output_norm.weight\"");
  expect_error([&] { (void)model::load_gguf(cut(full.size() - 10)); }, load_errc::truncated, "extends past the end of the file");
}

TEST_CASE("GGUF: malformed headers, metadata and tensor infos") {
  const auto m = small_model();
  auto load_w = [](const gguf_writer& w) { return [p = w.write("bad.gguf")] { (void)model::load_gguf(p); }; };
  const auto good = gguf_of(m, all(F32));

  {  // bad magic
    auto b = good.serialize();
    b[0] = 'X';
    const auto p = tmp_dir / "magic.bin";
    std::ofstream(p, std::ios::binary | std::ios::trunc).write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
    expect_error([&] { (void)model::load_gguf(p); }, load_errc::bad_header, "bad magic 0x58475546");
    CHECK_FALSE(is_gguf(p));
    CHECK(is_gguf(good.write("magic_ok.bin")));  // no .gguf extension: the magic decides
  }
  for (std::uint32_t v : {1u, 4u, 0x03000000u}) {
    auto w = good;
    w.version = v;
    expect_error(load_w(w), load_errc::unsupported, "GGUF version " + std::to_string(v));
  }
  {
    auto w = good;
    w.version = 2;  // the same layout as version 3
    CHECK_NOTHROW((void)model::load_gguf(w.write("v2.gguf")));
  }
  {  // a tensor beyond the end
    auto w = good;
    w.find("blk.1.ffn_up.weight")->offset = std::uint64_t{1} << 40;
    expect_error(load_w(w), load_errc::truncated, "\"blk.1.ffn_up.weight\"");
  }
  {  // offset + size wraps around
    auto w = good;
    w.find("blk.1.ffn_up.weight")->offset = ~std::uint64_t{31};
    expect_error(load_w(w), load_errc::truncated, "extends past the end");
  }
  {  // two tensors on the same bytes (a file could otherwise decode to far more than its size)
    auto w = good;
    w.find("blk.0.attn_q.weight")->offset = 0;
    expect_error(load_w(w), load_errc::bad_header, "tensors \"token_embd.weight\" and \"blk.0.attn_q.weight\" overlap");
  }
  {
    auto w = good;
    w.find("blk.0.attn_q.weight")->offset = 16;
    expect_error(load_w(w), load_errc::bad_header, "not a multiple of the alignment 32");
  }
  {
    auto w = good;
    w.u32("general.alignment", 24);
    expect_error(load_w(w), load_errc::bad_header, "power of two");
    w.u32("general.alignment", 0);
    expect_error(load_w(w), load_errc::bad_header, "general.alignment");
    w.string("general.alignment", "32");
    expect_error(load_w(w), load_errc::bad_header, "expected an integer");
  }
  {
    auto w = good;
    w.find("blk.0.attn_q.weight")->type = 31;
    expect_error(load_w(w), load_errc::unsupported, "unknown ggml type id 31");
  }
  {
    auto w = good;
    w.find("blk.0.attn_q.weight")->type = Q8_0;  // data of the wrong size: now past the end or overlapping
    w.find("output_norm.weight")->dims = {63};
    w.find("output_norm.weight")->type = Q8_0;
    expect_error(load_w(w), load_errc::bad_header, "not a multiple of its block size 32");
  }
  {
    auto w = good;
    w.find("blk.0.ffn_gate.weight")->dims = {std::uint64_t{1} << 32, std::uint64_t{1} << 32, std::uint64_t{1} << 32};
    expect_error(load_w(w), load_errc::bad_header, "overflows");
    w.find("blk.0.ffn_gate.weight")->dims = {std::uint64_t{1} << 62, 4};
    expect_error(load_w(w), load_errc::bad_header, "overflows");
    w.find("blk.0.ffn_gate.weight")->dims = {1, 2, 3, 4, 5};
    expect_error(load_w(w), load_errc::bad_header, "5 dimensions");
  }
  {  // a count that cannot fit in the file
    auto w = good;
    bytes lie;
    put(lie, STR);
    put<std::uint64_t>(lie, std::uint64_t{1} << 40);
    w.set("tokenizer.ggml.tokens", ARR, lie);
    expect_error(load_w(w), load_errc::truncated, "1099511627776");
    bytes lie2;
    put(lie2, F32V);
    put<std::uint64_t>(lie2, std::uint64_t{1} << 62);  // × 4 bytes overflows
    w.set("tokenizer.ggml.scores", ARR, lie2);
    w.erase("tokenizer.ggml.tokens");
    expect_error(load_w(w), load_errc::truncated, "tokenizer.ggml.scores");
    w = good;
    w.tensor_count = std::uint64_t{1} << 50;
    expect_error(load_w(w), load_errc::truncated, "tensor count");
  }
  {
    auto w = good;
    w.tensors.push_back(w.tensors[2]);
    expect_error(load_w(w), load_errc::bad_header, "duplicate tensor \"blk.0.attn_q.weight\"");
  }
  {
    auto w = good;
    w.kvs.push_back(w.kvs[0]);
    expect_error(load_w(w), load_errc::bad_header, "duplicate metadata key \"general.architecture\"");
  }
  {  // unknown value types, bad bools, arrays nested too deep, over-long names
    auto w = good;
    w.set("x.unknown", 13, bytes{0, 0, 0, 0});
    expect_error(load_w(w), load_errc::bad_header, "unknown value type 13");
    w = good;
    w.set("x.bool", BOOL, bytes{2});
    expect_error(load_w(w), load_errc::bad_header, "bool of value 2");
    w = good;
    bytes nest;
    for (int k = 0; k < 12; ++k) {
      put(nest, ARR);
      put<std::uint64_t>(nest, 1);
    }
    put(nest, U32);
    put<std::uint64_t>(nest, 0);
    w.set("x.nested", ARR, nest);
    expect_error(load_w(w), load_errc::bad_header, "nests arrays deeper");
    w = good;
    w.tensors[0].name = std::string(65, 'n');
    expect_error(load_w(w), load_errc::bad_header, "more than the 64 allowed");
  }
  {  // nested arrays within the limit are fine (and skipped)
    auto w = good;
    bytes nest;
    put(nest, ARR);
    put<std::uint64_t>(nest, 2);
    for (int k = 0; k < 2; ++k) {
      put(nest, STR);
      put<std::uint64_t>(nest, 1);
      const auto s = gguf_writer::str("hi");
      nest.insert(nest.end(), s.begin(), s.end());
    }
    w.set("x.nested", ARR, nest);
    CHECK_NOTHROW((void)model::load_gguf(w.write("nested.gguf")));
  }
}

TEST_CASE("GGUF: llama models the engine cannot run, and broken ones") {
  const auto m = small_model();
  auto load_w = [](const gguf_writer& w) { return [p = w.write("bad.gguf")] { (void)model::load_gguf(p); }; };
  const auto good = gguf_of(m, all(F32));
  {
    auto w = good;
    w.string("general.architecture", "gpt2");
    expect_error(load_w(w), load_errc::unsupported, "general.architecture is \"gpt2\"");
    w.erase("general.architecture");
    expect_error(load_w(w), load_errc::bad_header, "general.architecture");
  }
  {
    auto w = good;
    w.erase("blk.1.ffn_up.weight");
    std::erase_if(w.tensors, [](const auto& t) { return t.name == "blk.1.ffn_up.weight"; });
    expect_error(load_w(w), load_errc::missing_tensor, "\"blk.1.ffn_up.weight\" is missing");
    w = good;
    std::erase_if(w.tensors, [](const auto& t) { return t.name == "token_embd.weight"; });
    expect_error(load_w(w), load_errc::missing_tensor, "token_embd.weight");
  }
  {
    auto w = good;
    auto* k = w.find("blk.0.attn_k.weight");
    k->dims = {64, 64};
    k->data.resize(64 * 64 * 4);
    expect_error(load_w(w), load_errc::size_mismatch, "\"blk.0.attn_k.weight\" has dims [64, 64], expected [64, 32]");
    w = good;
    w.find("blk.1.ffn_down.weight")->dims = {64, 96};  // transposed
    expect_error(load_w(w), load_errc::size_mismatch, "\"blk.1.ffn_down.weight\" has dims [64, 96], expected [96, 64]");
    w = good;
    w.find("token_embd.weight")->dims = {32, 128};
    expect_error(load_w(w), load_errc::size_mismatch, "token_embd.weight");
  }
  {
    auto w = good;
    w.u32("llama.vocab_size", 65);
    expect_error(load_w(w), load_errc::bad_header, "llama.vocab_size = 65");
    w = good;
    w.erase("llama.block_count");
    expect_error(load_w(w), load_errc::bad_header, "missing key \"llama.block_count\"");
    w = good;
    w.u32("llama.attention.head_count", 5);
    expect_error(load_w(w), load_errc::bad_header, "not a multiple of n_heads");
    w = good;
    w.string("llama.embedding_length", "64");
    expect_error(load_w(w), load_errc::bad_header, "\"llama.embedding_length\" is string, expected an integer");
  }
  {
    auto w = good;
    w.u32("llama.rope.dimension_count", 8);
    expect_error(load_w(w), load_errc::unsupported, "partial RoPE");
    w = good;
    w.string("llama.rope.scaling.type", "linear");
    expect_error(load_w(w), load_errc::unsupported, "RoPE scaling \"linear\"");
    w = good;
    w.string("llama.rope.scaling.type", "none");
    CHECK_NOTHROW((void)model::load_gguf(w.write("none.gguf")));
    w.erase("llama.rope.scaling.type");
    w.f32("llama.rope.scale_linear", 2.0f);
    expect_error(load_w(w), load_errc::unsupported, "llama.rope.scale_linear");
  }
  {  // defaults: head_count_kv = head_count, freq_base = 10000; rope_freqs and biases refused
    auto w = good;
    w.erase("llama.attention.head_count_kv");
    auto* k = w.find("blk.0.attn_k.weight");
    k->dims = {64, 64};
    k->data.resize(64 * 64 * 4);
    for (int l = 0; l < 2; ++l)
      for (const char* n : {"attn_k", "attn_v"}) {
        auto* t = w.find("blk." + std::to_string(l) + "." + n + ".weight");
        t->dims = {64, 64};
        t->data.resize(64 * 64 * 4);
      }
    w.erase("llama.rope.freq_base");
    const auto g = model::load_gguf(w.write("mha.gguf"));
    CHECK(g.config().n_kv_heads == 4);
    CHECK(g.config().rope_theta == 10000.0f);
    w = good;
    w.tensors.push_back({"rope_freqs.weight", {8}, F32, bytes(32), {}});
    expect_error(load_w(w), load_errc::unsupported, "rope_freqs.weight");
    w = good;
    w.tensors.push_back({"blk.0.attn_q.bias", {64}, F32, bytes(256), {}});
    expect_error(load_w(w), load_errc::unsupported, "blk.0.attn_q.bias");
  }
  {  // a known ggml type the engine does not decode
    auto c = small_config(false);
    c.dim = 256;
    c.hidden_dim = 256;
    c.n_layers = 1;
    c.n_heads = 4;
    c.n_kv_heads = 4;
    c.vocab_size = 16;
    auto w = gguf_of(model::random(c, 5, 0.1f), all(F32));
    auto* out = w.find("output.weight");
    out->type = Q6_K;
    out->data.assign(16 * 210, 0);
    expect_error(load_w(w), load_errc::unsupported, "tensor \"output.weight\" has type Q6_K; supported: F32, F16, BF16, Q8_0, Q4_0");
  }
}

TEST_CASE("GGUF: tokenizer metadata is checked") {
  const auto m = small_model();
  const auto good = gguf_of(m, all(F32));
  auto load_w = [](const gguf_writer& w) { return [p = w.write("badtok.gguf")] { (void)load(p); }; };
  {  // vocabulary of the tokenizer and the model differ
    auto w = good;
    w.strings("tokenizer.ggml.tokens", vocab_pieces(65));
    std::vector<float> s(65, 0.0f);
    std::vector<std::int32_t> t(65, 1);
    w.array("tokenizer.ggml.scores", F32V, s);
    w.array("tokenizer.ggml.token_type", I32, t);
    expect_error(load_w(w), load_errc::bad_tokenizer, "tokenizer has 65 tokens, the model 64");
  }
  {
    auto w = good;
    w.array("tokenizer.ggml.scores", F32V, std::vector<float>(63, 0.0f));
    expect_error(load_w(w), load_errc::bad_tokenizer, "tokenizer.ggml.scores has 63 entries, tokenizer.ggml.tokens 64");
    w = good;
    w.array("tokenizer.ggml.token_type", I32, std::vector<std::int32_t>(65, 1));
    expect_error(load_w(w), load_errc::bad_tokenizer, "tokenizer.ggml.token_type has 65 entries");
    w = good;
    w.array("tokenizer.ggml.scores", I32, std::vector<std::int32_t>(64, 0));
    expect_error(load_w(w), load_errc::bad_tokenizer, "expected an array of floats");
  }
  {
    auto w = good;
    w.erase("tokenizer.ggml.tokens");
    expect_error(load_w(w), load_errc::bad_tokenizer, "missing key \"tokenizer.ggml.tokens\"");
    w = good;
    w.erase("tokenizer.ggml.model");
    expect_error(load_w(w), load_errc::bad_tokenizer, "tokenizer.ggml.model");
    w = good;
    w.string("tokenizer.ggml.model", "gpt2");
    expect_error(load_w(w), load_errc::unsupported, "tokenizer.ggml.model \"gpt2\"");
    w = good;
    w.u32("tokenizer.ggml.bos_token_id", 64);
    expect_error(load_w(w), load_errc::bad_tokenizer, "tokenizer.ggml.bos_token_id = 64");
  }
  {  // the weights still load on their own
    auto w = good;
    w.erase("tokenizer.ggml.tokens");
    CHECK_NOTHROW((void)model::load_gguf(w.write("notok.gguf")));
  }
}

TEST_CASE("GGUF (shared): stories260K.gguf holds stories260K.bin's weights and tok512.bin's vocabulary") {
  const auto dir = models / "stories260K";
  if (!have(dir / "stories260K.gguf") || !have(dir / "stories260K.bin") || !have(dir / "tok512.bin")) return;
  const auto g = model::load_gguf(dir / "stories260K.gguf");
  const auto b = model::load_llama2c(dir / "stories260K.bin");
  const auto& gc = g.config();
  const auto& bc = b.config();
  CHECK(gc.dim == bc.dim);
  CHECK(gc.hidden_dim == bc.hidden_dim);
  CHECK(gc.n_layers == bc.n_layers);
  CHECK(gc.n_heads == bc.n_heads);
  CHECK(gc.n_kv_heads == bc.n_kv_heads);
  CHECK(gc.vocab_size == bc.vocab_size);
  CHECK(gc.seq_len == 128);  // the converter hard-codes it (see the README)
  CHECK(gc.rms_eps == bc.rms_eps);
  CHECK_FALSE(gc.shared_classifier);  // output.weight is a copy of the embedding
  CHECK(g.stored() == stored_type::f32);
  check_same_weights(g, b);

  const auto lm = load(dir / "stories260K.gguf");
  const auto& gt = *lm.tok;
  const llama2c_tokenizer bt(dir / "tok512.bin", 512);
  REQUIRE(gt.vocab_size() == 512);
  CHECK(gt.bos_id() == 1);
  CHECK(gt.eos_id() == 2);
  for (const std::string text : {"Once upon a time, there was a little girl named Lily.", " leading and trailing ", "line\nbreak\n\n",
                                 "caf\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac", "\x01\x7f\xff odd bytes", "", "Tom and Sue's dog ran!"}) {
    CAPTURE(text);
    const auto ids = gt.encode(text, true, false);
    CHECK(ids == bt.encode(text, true, false));
    CHECK(gt.decode(ids) == bt.decode(ids));
  }
  for (int id = 3; id < 512; ++id) CHECK(gt.decode_piece(1, id) == bt.decode_piece(1, id));
}

TEST_CASE("GGUF (shared): tinystories-656K-f32.gguf decodes like the Hugging Face checkpoint") {
  const auto dir = models / "tinystories-656K";
  if (!have(dir / "tinystories-656K-f32.gguf") || !have(dir / "model.safetensors")) return;
  const auto g = model::load_gguf(dir / "tinystories-656K-f32.gguf");
  CHECK(g.config().rope == rope_style::adjacent_pairs);
  CHECK(g.config().shared_classifier);
  CHECK(g.config().n_kv_heads == 4);
  CHECK(g.config().rms_eps == doctest::Approx(1e-6));
  engine eg(g, {.threads = 2}), eh(model::load_hf(dir), {.threads = 2});
  const int bos = 1;
  const auto tg = greedy(eg, {&bos, 1}, 64), th = greedy(eh, {&bos, 1}, 64);
  REQUIRE(tg.size() == 64);
  CHECK(tg == th);
  std::vector<int> seq = {bos};
  seq.insert(seq.end(), tg.begin(), tg.end());
  CHECK(max_abs_diff(logits_of(eg, seq), logits_of(eh, seq)) < 1e-4);
  // The GGUF's own tokenizer decodes the story.
  const auto lm = load(dir / "tinystories-656K-f32.gguf");
  const std::string text = lm.tok->decode(tg);
  CHECK(text.substr(0, 30) == "Once upon a time, there was a ");
}

TEST_CASE("scripts/convert_to_gguf.py: every --type matches the reference encodings") {
  const std::string python = MEDUSA_PYTHON;
  const fs::path script = fs::path(MEDUSA_SOURCE_DIR) / "scripts" / "convert_to_gguf.py";
  if (python.empty()) {
    MESSAGE("skipped: no python3 found at configure time");
    return;
  }
  REQUIRE(fs::exists(script));
  fs::create_directories(tmp_dir);
  // A llama2.c model and tokenizer.bin (pieces with spaces, BOS/EOS as llama2.c writes them).
  const auto tok = tmp_dir / "conv_tokenizer.bin";
  std::vector<std::string> pieces = {"<unk>", "\n<s>\n", "\n</s>\n", " ", "a", " a", "b", " b", "ab", "<0xZZ>"};
  while (pieces.size() < 64) pieces.push_back("w" + std::to_string(pieces.size()));
  {
    std::ofstream out(tok, std::ios::binary);
    const std::int32_t max_len = 8;
    out.write(reinterpret_cast<const char*>(&max_len), 4);
    for (std::size_t i = 0; i < pieces.size(); ++i) {
      const float score = -static_cast<float>(i);
      const auto len = static_cast<std::int32_t>(pieces[i].size());
      out.write(reinterpret_cast<const char*>(&score), 4);
      out.write(reinterpret_cast<const char*>(&len), 4);
      out.write(pieces[i].data(), len);
    }
  }
  auto run = [&](const fs::path& bin, const fs::path& out, const std::string& type) {
    const std::string cmd = "'" + python + "' '" + script.string() + "' '" + bin.string() + "' '" + out.string() + "' --tokenizer '" +
                            tok.string() + "' --add-space-prefix false --type " + type + " > '" + out.string() + ".log' 2>&1";
    const int rc = std::system(cmd.c_str());
    std::ifstream log(out.string() + ".log");
    INFO("log: " << std::string(std::istreambuf_iterator<char>(log), {}));
    REQUIRE(rc == 0);
  };
  for (bool shared : {true, false}) {
    auto c = small_config(shared);
    const auto m = model::random(c, shared ? 21 : 22, 0.5f);
    const auto bin = tmp_dir / (shared ? "conv.bin" : "conv_cls.bin");
    m.save_llama2c(bin);
    const std::pair<std::string, std::uint32_t> types[] = {{"f32", F32}, {"f16", F16}, {"bf16", BF16}, {"q8_0", Q8_0}, {"q4_0", Q4_0}};
    for (const auto& [name, type] : types) {
      CAPTURE(name);
      CAPTURE(shared);
      const auto out = tmp_dir / ("conv_" + name + (shared ? "" : "_cls") + ".gguf");
      run(bin, out, name);
      const auto g = model::load_gguf(out);
      CHECK(g.config().shared_classifier == shared);
      CHECK(g.config().seq_len == c.seq_len);
      CHECK(g.config().rms_eps == 1e-5f);
      CHECK(to_string(g.stored()) == name);
      CHECK(to_string(g.classifier_stored()) == name);
      const auto tm = tensors_of(m, !shared), tg = tensors_of(g, !shared);
      REQUIRE(tm.size() == tg.size());
      for (std::size_t i = 0; i < tm.size(); ++i) {
        CAPTURE(tm[i].name);
        const auto want = decode(encode(tm[i].data, tm[i].size(), tm[i].matrix() ? type : F32), tm[i].size(), tm[i].matrix() ? type : F32);
        CHECK(std::memcmp(want.data(), tg[i].data, 4 * want.size()) == 0);
      }
      if (name == "f32") {
        check_same_weights(g, model::load_llama2c(bin));
        const auto t = load_gguf_tokenizer(out);
        const llama2c_tokenizer ref(tok, 64, false);
        CHECK(t->bos_id() == 1);
        CHECK(t->eos_id() == 2);
        for (int id = 3; id < 64; ++id) CHECK(t->piece(id) == ref.piece(id));
        for (const std::string s : {"a b ab", " aab ", "xyz"}) CHECK(t->encode(s, true, true) == ref.encode(s, true, true));
        CHECK_FALSE(default_dummy_prefix(out));
      }
    }
  }
  // Rows that are not a multiple of 32 cannot be quantized: a clear error, exit status 1.
  auto c = small_config();
  c.hidden_dim = 72;
  const auto bin = tmp_dir / "conv_72.bin";
  model::random(c, 3, 0.5f).save_llama2c(bin);
  const std::string cmd = "'" + python + "' '" + script.string() + "' '" + bin.string() + "' '" + (tmp_dir / "conv_72.gguf").string() +
                          "' --tokenizer '" + tok.string() + "' --type q8_0 > '" + (tmp_dir / "conv_72.log").string() + "' 2>&1";
  CHECK(std::system(cmd.c_str()) != 0);
  std::ifstream log(tmp_dir / "conv_72.log");
  const std::string text(std::istreambuf_iterator<char>(log), {});
  CHECK(text.find("blk.0.ffn_down.weight has rows of 72 values") != std::string::npos);
}
