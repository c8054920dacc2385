// SPDX-License-Identifier: Apache-2.0
#include <medusa_llama/errors.hpp>
#include <medusa_llama/load.hpp>

#include "gguf_reader.hpp"

#include <cmath>
#include <cstdint>
#include <random>
#include <fstream>
#include <iterator>
#include <string_view>
#include <system_error>
#include <vector>

namespace medusa_llama {
namespace {

// Minimal protobuf wire-format walker: enough to find one varint field in a nested message.
class proto_reader {
 public:
  proto_reader(std::string_view data, const std::string& origin) : p_(data), origin_(origin) {}
  [[nodiscard]] bool done() const noexcept { return p_.empty(); }

  std::uint64_t varint() {
    std::uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (p_.empty()) fail("truncated varint");
      const auto b = static_cast<unsigned char>(p_.front());
      p_.remove_prefix(1);
      v |= static_cast<std::uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0) return v;
    }
    fail("varint longer than 10 bytes");
  }

  std::string_view bytes(std::uint64_t n) {
    if (n > p_.size()) fail("field of " + std::to_string(n) + " bytes past the end");
    const std::string_view out = p_.substr(0, static_cast<std::size_t>(n));
    p_.remove_prefix(static_cast<std::size_t>(n));
    return out;
  }

  // Skips a field of the given wire type (after its key).
  void skip(std::uint64_t wire) {
    switch (wire) {
      case 0: (void)varint(); return;
      case 1: (void)bytes(8); return;
      case 2: (void)bytes(varint()); return;
      case 5: (void)bytes(4); return;
      default: fail("unsupported wire type " + std::to_string(wire));
    }
  }

  [[noreturn]] void fail(const std::string& what) const {
    throw load_error(load_errc::bad_tokenizer, "malformed SentencePiece model: " + what, origin_);
  }

 private:
  std::string_view p_;
  std::string origin_;
};

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw load_error(load_errc::open_failed, "cannot open", path.string());
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

}  // namespace

bool sentencepiece_adds_dummy_prefix(const std::filesystem::path& model_file) {
  const std::string data = read_file(model_file);
  proto_reader model(data, model_file.string());
  bool dummy_prefix = true;  // NormalizerSpec.add_dummy_prefix defaults to true
  while (!model.done()) {
    const std::uint64_t key = model.varint();
    if (key >> 3 == 3 && (key & 7) == 2) {  // ModelProto.normalizer_spec
      proto_reader spec(model.bytes(model.varint()), model_file.string());
      while (!spec.done()) {
        const std::uint64_t k = spec.varint();
        if (k >> 3 == 3 && (k & 7) == 0)
          dummy_prefix = spec.varint() != 0;
        else
          spec.skip(k & 7);
      }
    } else {
      model.skip(key & 7);
    }
  }
  return dummy_prefix;
}

bool default_dummy_prefix(const std::filesystem::path& tokenizer_path) {
  std::error_code ec;
  if (tokenizer_path.extension() != ".json" && is_gguf(tokenizer_path)) {
    const auto file = detail::gguf_file::open(tokenizer_path);
    return file.get_bool("tokenizer.ggml.add_space_prefix", load_errc::bad_tokenizer).value_or(true);
  }
  const auto sp_model = tokenizer_path.parent_path() / "tokenizer.model";
  if (tokenizer_path.extension() == ".json" || !std::filesystem::exists(sp_model, ec)) return true;
  return sentencepiece_adds_dummy_prefix(sp_model);
}

loaded_model load(const std::filesystem::path& model_path, const std::filesystem::path& tokenizer_path) {
  std::error_code ec;
  if (!std::filesystem::exists(model_path, ec))
    throw load_error(load_errc::open_failed, "no such file or directory", model_path.string());
  const bool hf = std::filesystem::is_directory(model_path, ec);
  if (!hf && is_gguf(model_path)) {
    // The weights and, unless another tokenizer is given, the tokenizer of the GGUF metadata.
    model weights = model::load_gguf(model_path);
    std::unique_ptr<tokenizer> tok;
    std::filesystem::path tok_path = tokenizer_path.empty() ? model_path : tokenizer_path;
    if (tokenizer_path.empty()) {
      tok = load_gguf_tokenizer(model_path);
    } else {
      if (!std::filesystem::exists(tok_path, ec)) throw load_error(load_errc::open_failed, "tokenizer not found", tok_path.string());
      tok = load_tokenizer(tok_path, default_dummy_prefix(tok_path));
    }
    if (tok->vocab_size() != weights.config().vocab_size)
      throw load_error(load_errc::bad_tokenizer, "tokenizer has " + std::to_string(tok->vocab_size()) + " tokens, the model " +
                           std::to_string(weights.config().vocab_size),
                       tok_path.string());
    return loaded_model{std::move(weights), std::move(tok), model_path, tok_path};
  }
  std::filesystem::path tok_path = tokenizer_path;
  if (tok_path.empty()) tok_path = hf ? model_path / "tokenizer.json" : model_path.parent_path() / "tokenizer.bin";
  if (!std::filesystem::exists(tok_path, ec))
    throw load_error(load_errc::open_failed, "tokenizer not found (pass --tokenizer: tokenizer.bin for llama2.c models)",
                     tok_path.string());
  model weights = hf ? model::load_hf(model_path) : model::load_llama2c(model_path);
  std::unique_ptr<tokenizer> tok = load_tokenizer(tok_path, default_dummy_prefix(tok_path));
  if (tok->vocab_size() != weights.config().vocab_size)
    throw load_error(load_errc::bad_tokenizer, "tokenizer has " + std::to_string(tok->vocab_size()) + " tokens, the model " +
                         std::to_string(weights.config().vocab_size),
                     tok_path.string());
  return loaded_model{std::move(weights), std::move(tok), model_path, tok_path};
}

medusa::head_weights random_heads(const model& m, int heads, std::uint64_t seed) {
  if (heads < 1) throw engine_error(engine_errc::bad_option, "random_heads: need at least one head, got " + std::to_string(heads));
  return medusa::head_weights::random(static_cast<std::size_t>(m.config().dim),
                                      static_cast<std::size_t>(m.config().vocab_size), static_cast<std::size_t>(heads), 1,
                                      medusa::weight_dtype::f32, medusa::weight_ptr::of(m.classifier()), seed);
}

}  // namespace medusa_llama
