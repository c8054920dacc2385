// SPDX-License-Identifier: Apache-2.0
// libFuzzer target for the example engine's GGUF reader (examples/llama/src/gguf_reader.cpp):
// header, metadata of every value type, tensor infos, tensor decoding (F32, F16, BF16, Q8_0,
// Q4_0), then, on whatever the reader accepts, the llama config and tokenizer extraction and, when
// those succeed, model::load_gguf on the same bytes. Any crash, sanitizer report or exception
// other than medusa_llama::load_error is a bug.
//
// Built with -DMEDUSA_FUZZ_WRITE_SEEDS it is instead a small program that writes a seed corpus of
// valid files into the directory given as argv[1].
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#ifndef MEDUSA_FUZZ_WRITE_SEEDS

#include "gguf_reader.hpp"  // examples/llama/src (private)

#include <medusa_llama/model.hpp>
#include <medusa_llama/tokenizer.hpp>

#include <sys/mman.h>
#include <unistd.h>

namespace {

using namespace medusa_llama;

// The input as a file, for model::load_gguf (which maps a path): one memfd, rewritten each time.
std::string as_file(const std::uint8_t* data, std::size_t size) {
  static const int fd = ::memfd_create("fuzz.gguf", 0);
  if (fd < 0 || ::ftruncate(fd, 0) != 0) __builtin_trap();
  std::size_t done = 0;
  while (done < size) {
    const auto n = ::pwrite(fd, data + done, size - done, static_cast<off_t>(done));
    if (n <= 0) __builtin_trap();
    done += static_cast<std::size_t>(n);
  }
  return "/proc/self/fd/" + std::to_string(fd);
}

void touch_tokenizer(const tokenizer& tok) {
  for (const char* text : {"", "Once upon a time", " a\nb\xc3\xa9\xff"}) {
    const auto ids = tok.encode(text, true, true);
    for (int id : ids)
      if (id < 0 || id >= tok.vocab_size()) __builtin_trap();
    (void)tok.decode(ids);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using medusa_llama::detail::gguf_file;
  using medusa_llama::detail::gguf_value_type;
  try {
    const auto f = gguf_file::from_bytes(std::span<const unsigned char>(data, size), "fuzz.gguf");
    // Every accepted array decodes (or is refused with a load_error).
    for (const auto& kv : f.metadata()) {
      try {
        if (kv.type == gguf_value_type::array) {
          if (kv.elem == gguf_value_type::string) (void)f.get_string_array(kv.key);
          else if (kv.elem == gguf_value_type::f32 || kv.elem == gguf_value_type::f64) (void)f.get_float_array(kv.key);
          else (void)f.get_int_array(kv.key);
        } else if (kv.type == gguf_value_type::string) {
          (void)f.get_string(kv.key);
        }
      } catch (const medusa_llama::load_error&) {
      }
    }
    // Every tensor's bytes lie inside the input; decode the ones the reader supports.
    for (const auto& t : f.tensors()) {
      const auto d = f.data(t);
      if (d.size() != t.bytes || t.offset + t.bytes > size) __builtin_trap();
      if (!medusa_llama::detail::stored_type_of(t.type) || t.elements > (std::uint64_t{1} << 22)) continue;
      std::vector<float> out(static_cast<std::size_t>(t.elements));
      f.read_f32(t, out.data());
    }
    bool config_ok = false;
    try {
      const auto c = medusa_llama::detail::gguf_llama_config(f);
      config_ok = c.vocab_size > 0;
    } catch (const medusa_llama::load_error&) {
    }
    try {
      const auto tok = medusa_llama::detail::gguf_llama_tokenizer(f, 0);
      touch_tokenizer(*tok);
    } catch (const medusa_llama::load_error&) {
    }
    if (config_ok) {
      const auto m = medusa_llama::model::load_gguf(as_file(data, size));
      if (m.config().vocab_size <= 0 || m.token_embedding() == nullptr) __builtin_trap();
      (void)medusa_llama::to_string(m.stored());
    }
  } catch (const medusa_llama::load_error&) {
    // Typed rejection: the expected outcome for almost every input.
  }
  return 0;
}

#else

#include <filesystem>
#include <fstream>
#include <utility>

namespace {

using bytes = std::vector<unsigned char>;

template <class T>
void put(bytes& b, T v) {
  unsigned char tmp[sizeof(T)];
  std::memcpy(tmp, &v, sizeof v);
  b.insert(b.end(), tmp, tmp + sizeof v);
}
void put_str(bytes& b, const std::string& s) {
  put<std::uint64_t>(b, s.size());
  b.insert(b.end(), s.begin(), s.end());
}

// A minimal GGUF v3 writer (alignment 32).
struct writer {
  struct tensor {
    std::string name;
    std::vector<std::uint64_t> dims;
    std::uint32_t type;
    bytes data;
  };
  bytes kv;
  std::uint64_t n_kv = 0;
  std::vector<tensor> tensors;

  void key(const std::string& k, std::uint32_t type) {
    put_str(kv, k);
    put(kv, type);
    ++n_kv;
  }
  void u32(const std::string& k, std::uint32_t v) { key(k, 4), put(kv, v); }
  void f32(const std::string& k, float v) { key(k, 6), put(kv, v); }
  void str(const std::string& k, const std::string& v) { key(k, 8), put_str(kv, v); }
  void tokenizer(int n) {
    key("tokenizer.ggml.model", 8), put_str(kv, "llama");
    key("tokenizer.ggml.tokens", 9), put<std::uint32_t>(kv, 8), put<std::uint64_t>(kv, static_cast<std::uint64_t>(n));
    const char* pieces[] = {"<unk>", "<s>", "</s>", "\xE2\x96\x81", "a", "\xE2\x96\x81" "a", "<0x0A>", "b"};
    for (int i = 0; i < n; ++i) put_str(kv, pieces[i % 8]);
    key("tokenizer.ggml.scores", 9), put<std::uint32_t>(kv, 6), put<std::uint64_t>(kv, static_cast<std::uint64_t>(n));
    for (int i = 0; i < n; ++i) put<float>(kv, -static_cast<float>(i));
    key("tokenizer.ggml.token_type", 9), put<std::uint32_t>(kv, 5), put<std::uint64_t>(kv, static_cast<std::uint64_t>(n));
    for (int i = 0; i < n; ++i) put<std::int32_t>(kv, i == 0 ? 2 : i < 3 ? 3 : i % 8 == 6 ? 6 : 1);
    u32("tokenizer.ggml.bos_token_id", 1);
    u32("tokenizer.ggml.eos_token_id", 2);
    key("tokenizer.ggml.add_space_prefix", 7), kv.push_back(1);
  }
  // A llama model: dim d, hidden h, one layer, 2 heads, 1 KV head, vocab v, matrices of `type`.
  void llama(std::uint64_t d, std::uint64_t h, std::uint64_t v, std::uint32_t type) {
    str("general.architecture", "llama");
    u32("llama.context_length", 16);
    u32("llama.embedding_length", static_cast<std::uint32_t>(d));
    u32("llama.feed_forward_length", static_cast<std::uint32_t>(h));
    u32("llama.block_count", 1);
    u32("llama.attention.head_count", 2);
    u32("llama.attention.head_count_kv", 1);
    u32("llama.rope.dimension_count", static_cast<std::uint32_t>(d / 2));
    f32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
    const std::uint64_t kv_dim = d / 2;
    auto add = [&](const std::string& name, std::uint64_t in, std::uint64_t out, std::uint32_t t) {
      const std::uint64_t n = in * (out ? out : 1);
      bytes b;
      switch (t) {
        case 0: for (std::uint64_t i = 0; i < n; ++i) put<float>(b, 0.01f * static_cast<float>(i % 13) - 0.05f); break;
        case 1: case 30: for (std::uint64_t i = 0; i < n; ++i) put<std::uint16_t>(b, static_cast<std::uint16_t>(0x3c00 + i % 7)); break;
        case 8: for (std::uint64_t k = 0; k < n / 32; ++k) { put<std::uint16_t>(b, 0x2000); for (int j = 0; j < 32; ++j) b.push_back(static_cast<unsigned char>(j * 7)); } break;
        case 2: for (std::uint64_t k = 0; k < n / 32; ++k) { put<std::uint16_t>(b, 0x2000); for (int j = 0; j < 16; ++j) b.push_back(static_cast<unsigned char>(j * 17)); } break;
      }
      tensors.push_back({name, out ? std::vector<std::uint64_t>{in, out} : std::vector<std::uint64_t>{in}, t, b});
    };
    add("token_embd.weight", d, v, type);
    add("blk.0.attn_norm.weight", d, 0, 0);
    add("blk.0.attn_q.weight", d, d, type);
    add("blk.0.attn_k.weight", d, kv_dim, type);
    add("blk.0.attn_v.weight", d, kv_dim, type);
    add("blk.0.attn_output.weight", d, d, type);
    add("blk.0.ffn_norm.weight", d, 0, 0);
    add("blk.0.ffn_gate.weight", d, h, type);
    add("blk.0.ffn_down.weight", h, d, type);
    add("blk.0.ffn_up.weight", d, h, type);
    add("output_norm.weight", d, 0, 0);
  }
  bytes serialize() const {
    bytes o = {'G', 'G', 'U', 'F'};
    put<std::uint32_t>(o, 3);
    put<std::uint64_t>(o, tensors.size());
    put<std::uint64_t>(o, n_kv);
    o.insert(o.end(), kv.begin(), kv.end());
    std::uint64_t off = 0;
    std::vector<std::uint64_t> at;
    for (const auto& t : tensors) {
      put_str(o, t.name);
      put<std::uint32_t>(o, static_cast<std::uint32_t>(t.dims.size()));
      for (auto d : t.dims) put(o, d);
      put(o, t.type);
      put(o, off);
      at.push_back(off);
      off = (off + t.data.size() + 31) / 32 * 32;
    }
    const std::size_t start = (o.size() + 31) / 32 * 32;
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      o.resize(start + at[i]);
      o.insert(o.end(), tensors[i].data.begin(), tensors[i].data.end());
    }
    if (tensors.empty()) o.resize(start);
    return o;
  }
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  const std::filesystem::path dir = argv[1];
  std::filesystem::create_directories(dir);
  auto save = [&](const std::string& name, const writer& w) {
    const auto b = w.serialize();
    std::ofstream(dir / name, std::ios::binary).write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
  };
  for (std::uint32_t type : {0u, 1u, 30u}) {  // a 4-wide model with a tokenizer
    writer w;
    w.llama(4, 8, 8, type);
    w.tokenizer(8);
    save("llama_d4_t" + std::to_string(type) + ".gguf", w);
  }
  for (std::uint32_t type : {8u, 2u}) {  // quantized rows need 32 values
    writer w;
    w.llama(32, 32, 3, type);
    w.tokenizer(3);
    save("llama_d32_t" + std::to_string(type) + ".gguf", w);
  }
  {  // every metadata value type, nested arrays, an unsupported tensor type
    writer w;
    w.key("u8", 0), w.kv.push_back(7);
    w.key("i8", 1), w.kv.push_back(0xF9);
    w.key("u16", 2), put<std::uint16_t>(w.kv, 7);
    w.key("i16", 3), put<std::int16_t>(w.kv, -7);
    w.u32("general.alignment", 32);
    w.key("i32", 5), put<std::int32_t>(w.kv, -7);
    w.f32("f32", 0.5f);
    w.key("bool", 7), w.kv.push_back(1);
    w.str("general.architecture", "llama");
    w.key("u64", 10), put<std::uint64_t>(w.kv, 7);
    w.key("i64", 11), put<std::int64_t>(w.kv, -7);
    w.key("f64", 12), put<double>(w.kv, 0.25);
    w.key("nested", 9), put<std::uint32_t>(w.kv, 9), put<std::uint64_t>(w.kv, 2);
    for (int k = 0; k < 2; ++k) put<std::uint32_t>(w.kv, 4), put<std::uint64_t>(w.kv, 2), put<std::uint32_t>(w.kv, 1), put<std::uint32_t>(w.kv, 2);
    w.key("bools", 9), put<std::uint32_t>(w.kv, 7), put<std::uint64_t>(w.kv, 3), w.kv.push_back(0), w.kv.push_back(1), w.kv.push_back(0);
    w.key("strs", 9), put<std::uint32_t>(w.kv, 8), put<std::uint64_t>(w.kv, 2), put_str(w.kv, "x"), put_str(w.kv, "");
    w.tensors.push_back({"q6k", {256}, 14, bytes(210, 1)});
    w.tensors.push_back({"f32", {2, 2}, 0, bytes(16, 0)});
    save("metadata.gguf", w);
  }
  save("empty.gguf", writer{});
  return 0;
}

#endif
