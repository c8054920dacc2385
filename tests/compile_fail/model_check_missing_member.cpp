// SPDX-License-Identifier: Apache-2.0
// Must not compile: a model without hidden_size() and with a read-only KV cache. The model check
// names both problems, one sentence each, before any decoder is instantiated.
#include <medusa/decoder/model_check.hpp>
#include <medusa/kv_cache.hpp>

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
#ifdef MEDUSA_COMPILE_FAIL_CONTROL
  [[nodiscard]] int hidden_size() const { return 4; }
#endif
  void forward(const medusa::forward_batch&) {}
  [[nodiscard]] medusa::kv_cache_view<element> kv_cache() {
    return medusa::make_kv_view<element>(std::span<element>(k), std::span<element>(v), {1, 1, 4}, 16);
  }
};

static_assert(medusa::check_decoder_model<model>());

int main() { return 0; }
