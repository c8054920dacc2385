// SPDX-License-Identifier: Apache-2.0
// libFuzzer target for the safetensors reader (header length, strict JSON, entry validation) and
// the Medusa head-key inference on whatever the reader accepts. Any crash, sanitizer report or
// exception other than medusa's typed errors is a bug. Seeds: tests/fuzz/corpus/safetensors
// (scripts/make-fuzz-corpus).
#include <medusa/io/head_checkpoint.hpp>
#include <medusa/io/safetensors.hpp>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  try {
    const auto file = medusa::safetensors_file::from_span(bytes);
    // Touch every accepted range: the sanitizers flag any byte outside the input.
    unsigned sum = 0;
    for (const auto& t : file.tensors()) {
      const auto d = file.data(t);
      if (!d.empty()) sum += static_cast<unsigned>(d.front()) + static_cast<unsigned>(d.back());
      if (file.find(t.name) == nullptr) __builtin_trap();
    }
    for (const auto& [k, v] : file.metadata()) sum += static_cast<unsigned>(k.size() + v.size());
    (void)sum;
    const std::string name = "fuzz.safetensors";
    medusa::head_load_options opt;
    opt.vocab_size = size % 7;  // sometimes 0 (unchecked), sometimes a mismatch
    (void)medusa::head_loader::load(std::span(&file, 1), std::span(&name, 1), std::nullopt, opt);
  } catch (const medusa::error&) {
    // Typed rejection: the expected outcome for almost every input.
  }
  return 0;
}
