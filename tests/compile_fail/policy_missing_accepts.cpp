// SPDX-License-Identifier: Apache-2.0
// Must not compile: a user policy with a parent_state and prepare() but no accepts() is not an
// acceptance_policy, and verify() says so.
#include <medusa/acceptance.hpp>
#include <medusa/tree.hpp>

#include <cstdint>
#include <span>
#include <vector>

struct always_first {
  struct parent_state {
    int unused;
  };
  [[nodiscard]] parent_state prepare(std::span<const float>) const noexcept { return {0}; }
#ifdef MEDUSA_COMPILE_FAIL_CONTROL
  [[nodiscard]] bool accepts(const parent_state&, std::span<const float>, std::int32_t) const noexcept { return true; }
#endif
};

int main() {
  const auto t = medusa::tree::from_text("[[0]]");
  std::vector<std::int32_t> tokens{0, 1};
  std::vector<float> logits(4, 0.0f);
  medusa::verify_request req;
  req.node_tokens = tokens;
  req.logits = logits;
  req.vocab = 2;
  return medusa::verify(t, req, always_first{}).accept_length;
}
