// SPDX-License-Identifier: Apache-2.0
// libFuzzer target for llama2.c checkpoints (examples/llama: model::load_llama2c): the 28-byte
// header (dims, negative vocab for a separate classifier), the size checks and the mapping. On
// whatever loads, every weight pointer must lie inside the file. Any crash, sanitizer report,
// broken invariant or exception other than medusa_llama::load_error is a bug.
#include <medusa_llama/model.hpp>

#include "fuzz_common.hpp"

#include <cstddef>
#include <cstdint>

namespace {

float touch(const float* p, std::size_t n) { return n ? p[0] + p[n - 1] : 0.0f; }

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto path = medusa_fuzz::input_file(data, size, "model.bin");
  try {
    const auto m = medusa_llama::model::load_llama2c(path);
    const auto& c = m.config();
    MEDUSA_FUZZ_CHECK(c.dim > 0 && c.n_layers > 0 && c.vocab_size > 0 && c.dim % c.n_heads == 0);
    MEDUSA_FUZZ_CHECK(m.weight_bytes() <= size);
    const auto d = static_cast<std::size_t>(c.dim), h = static_cast<std::size_t>(c.hidden_dim),
               kv = static_cast<std::size_t>(c.kv_dim()), V = static_cast<std::size_t>(c.vocab_size);
    float s = touch(m.token_embedding(), V * d) + touch(m.classifier(), V * d) + touch(m.rms_final(), d);
    for (int l = 0; l < c.n_layers; ++l) {
      const auto& w = m.layer(l);
      s += touch(w.rms_att, d) + touch(w.wq, d * d) + touch(w.wk, kv * d) + touch(w.wv, kv * d) + touch(w.wo, d * d) +
           touch(w.rms_ffn, d) + touch(w.w1, h * d) + touch(w.w2, d * h) + touch(w.w3, h * d);
    }
    (void)s;
  } catch (const medusa_llama::load_error&) {
    // Typed rejection: the expected outcome for almost every input.
  }
  return 0;
}
