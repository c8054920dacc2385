// SPDX-License-Identifier: Apache-2.0
// Must not compile: the decoder commits accepted paths in the model's KV cache, so a model whose
// kv_cache() is a read-only view (const elements) is not a decoder_model.
#include <medusa/decoder.hpp>
#include <medusa/kv_cache.hpp>
#include <medusa/tree.hpp>

#include <span>
#include <vector>

#ifdef MEDUSA_COMPILE_FAIL_CONTROL
using element = float;
#else
using element = const float;
#endif

struct model {
  std::vector<float> k = std::vector<float>(64), v = std::vector<float>(64);
  [[nodiscard]] int vocab_size() const { return 8; }
  [[nodiscard]] int hidden_size() const { return 4; }
  void forward(const medusa::forward_batch&) {}
  [[nodiscard]] medusa::kv_cache_view<element> kv_cache() {
    return medusa::make_kv_view<element>(std::span<element>(k), std::span<element>(v), {1, 1, 4}, 16);
  }
};

struct heads {
  [[nodiscard]] int num_heads() const { return 1; }
  void forward(std::span<const float>, std::span<float>) {}
};

int main() {
  model m;
  heads h;
  // Spelled out: with class template argument deduction clang names no reason for the mismatch.
  medusa::decoder<model, heads, medusa::tree, medusa::greedy_policy> dec(m, h, medusa::tree::from_text("[[0]]"));
  return dec.tree().num_nodes() == 2 ? 0 : 1;
}
