// SPDX-License-Identifier: Apache-2.0
// libFuzzer target for the safetensors reader (header length, strict JSON, entry validation) and
// the Medusa head-key inference on whatever the reader accepts. Any crash, sanitizer report or
// exception other than medusa's typed errors is a bug.
//
// Built with -DMEDUSA_FUZZ_WRITE_SEEDS it is instead a small program that writes a seed corpus of
// valid files (made by safetensors_writer) into the directory given as argv[1].
#include <medusa/io/head_checkpoint.hpp>
#include <medusa/io/safetensors.hpp>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#ifndef MEDUSA_FUZZ_WRITE_SEEDS

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

#else

#include <filesystem>
#include <fstream>

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  const std::filesystem::path dir = argv[1];
  std::filesystem::create_directories(dir);
  auto save = [&](const std::string& name, const medusa::safetensors_writer& w) {
    const auto b = w.to_bytes();
    std::ofstream(dir / name, std::ios::binary).write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
  };
  std::vector<float> f(4 * 4, 0.5f), u(6 * 4, 0.25f);
  std::vector<std::uint16_t> h(4, 0x3c00);
  {  // legacy heads, 2 heads x 1 layer, d = 4, V = 6
    medusa::safetensors_writer w;
    for (int k = 0; k < 2; ++k) {
      const std::string p = std::to_string(k);
      w.add(p + ".0.linear.weight", medusa::safetensors_dtype::f32, {4, 4}, std::as_bytes(std::span(f)));
      w.add(p + ".0.linear.bias", medusa::safetensors_dtype::bf16, {4}, std::as_bytes(std::span(h)));
      w.add(p + ".1.weight", medusa::safetensors_dtype::f32, {6, 4}, std::as_bytes(std::span(u)));
    }
    save("legacy.safetensors", w);
  }
  {  // HF-style version-2 heads plus a base tensor and metadata
    medusa::safetensors_writer w;
    w.add("medusa_head.0.0.linear.weight", medusa::safetensors_dtype::f32, {4, 4}, std::as_bytes(std::span(f)));
    w.add("medusa_head.0.0.linear.bias", medusa::safetensors_dtype::f16, {4}, std::as_bytes(std::span(h)));
    w.add("lm_head.weight", medusa::safetensors_dtype::f32, {6, 4}, std::as_bytes(std::span(u)));
    w.add_metadata("format", "pt");
    save("hf_v2.safetensors", w);
  }
  {  // every dtype and an empty tensor
    medusa::safetensors_writer w;
    std::vector<std::byte> raw(64, std::byte{1});
    const char* names[] = {"f64", "f32", "f16", "bf16", "i64", "i32", "i16", "i8", "u64", "u32", "u16", "u8", "bool"};
    const medusa::safetensors_dtype types[] = {
        medusa::safetensors_dtype::f64, medusa::safetensors_dtype::f32, medusa::safetensors_dtype::f16, medusa::safetensors_dtype::bf16,
        medusa::safetensors_dtype::i64, medusa::safetensors_dtype::i32, medusa::safetensors_dtype::i16, medusa::safetensors_dtype::i8,
        medusa::safetensors_dtype::u64, medusa::safetensors_dtype::u32, medusa::safetensors_dtype::u16, medusa::safetensors_dtype::u8,
        medusa::safetensors_dtype::boolean};
    for (int i = 0; i < 13; ++i)
      w.add(names[i], types[i], {2}, std::span(raw).first(2 * medusa::dtype_size(types[i])));
    w.add("empty", medusa::safetensors_dtype::f32, {0, 3}, {});
    w.add_metadata("k\"ey", "v\\al\n");
    save("dtypes.safetensors", w);
  }
  save("empty.safetensors", medusa::safetensors_writer{});
  return 0;
}

#endif
