// SPDX-License-Identifier: Apache-2.0
// libFuzzer target for Hugging Face tokenizer.json files (examples/llama: hf_tokenizer through
// load_tokenizer): model type, normalizer, vocab, added tokens, post-processor and merges, then
// encoding/decoding with what loads. Any crash, sanitizer report, broken invariant or exception
// other than medusa_llama::load_error is a bug.
#include <medusa_llama/tokenizer.hpp>

#include "fuzz_common.hpp"
#include "fuzz_tokenizer_touch.hpp"

#include <cstddef>
#include <cstdint>
#include <string_view>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto path = medusa_fuzz::input_file(data, size, "tokenizer.json");
  try {
    const auto tok = medusa_llama::load_tokenizer(path);
    medusa_fuzz::touch_tokenizer(*tok, std::string_view(reinterpret_cast<const char*>(data), size));
  } catch (const medusa_llama::load_error&) {
    // Typed rejection: the expected outcome for almost every input.
  }
  return 0;
}
