// SPDX-License-Identifier: Apache-2.0
// libFuzzer target for the example engine's GGUF reader (examples/llama/src/gguf_reader.cpp):
// header, metadata of every value type, tensor infos, tensor decoding (F32, F16, BF16, Q8_0,
// Q4_0), then, on whatever the reader accepts, the llama config and tokenizer extraction and, when
// those succeed, model::load_gguf on the same bytes. Any crash, sanitizer report or exception
// other than medusa_llama::load_error is a bug. Seeds: tests/fuzz/corpus/gguf
// (scripts/make-fuzz-corpus).
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

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
