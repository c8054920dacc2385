// SPDX-License-Identifier: Apache-2.0
// libFuzzer target for llama2.c tokenizer.bin files (examples/llama: load_tokenizer, which also
// takes a GGUF file by its magic), the same file read as the SentencePiece tokenizer.model that
// load() consults beside a tokenizer.bin, and encoding/decoding with what loads. Any crash,
// sanitizer report, broken invariant or exception other than medusa_llama::load_error is a bug.
#include <medusa_llama/load.hpp>
#include <medusa_llama/tokenizer.hpp>

#include "fuzz_common.hpp"
#include "fuzz_tokenizer_touch.hpp"

#include <cstddef>
#include <cstdint>
#include <string_view>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  const auto path = medusa_fuzz::input_file(data, size, "tokenizer.bin");
  int vocab = 0;
  try {
    const auto tok = medusa_llama::load_tokenizer(path, (size & 1) != 0);
    vocab = tok->vocab_size();
    medusa_fuzz::touch_tokenizer(*tok, bytes);
  } catch (const medusa_llama::load_error&) {
  }
  // A model's vocabulary size (the file must hold exactly that many tokens).
  try {
    const medusa_llama::llama2c_tokenizer tok(path, vocab > 1 ? vocab - 1 : 3);
    medusa_fuzz::touch_tokenizer(tok, bytes);
  } catch (const medusa_llama::load_error&) {
  }
  try {
    (void)medusa_llama::sentencepiece_adds_dummy_prefix(path);
  } catch (const medusa_llama::load_error&) {
  }
  return 0;
}
