// SPDX-License-Identifier: Apache-2.0
// Translation units built with different -m flags in one program: each keeps its own
// instruction-set-dependent inline bodies (the per-ISA inline namespace of config.hpp) instead of
// the linker keeping one of them for both, which is what an ODR violation would do.
#include <medusa/attention.hpp>
#include <medusa/config.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <vector>

namespace isa_mix {
std::string other_isa();
const void* other_kernel_isa_address();
bool other_is_avx512();
void other_attention(const medusa::kv_cache_view<float>& kv, int L, std::span<const float> q, int n, int hq,
                     medusa::tree_mask_view mask, std::span<float> out);
}  // namespace isa_mix

TEST_CASE("each translation unit runs the kernels of its own instruction set") {
  const std::string mine = medusa::kernel_isa();
  const std::string other = isa_mix::other_isa();
  MESSAGE("this unit: " << mine << ", the -mno-avx512f unit: " << other);
  CHECK_FALSE(isa_mix::other_is_avx512());
  CHECK(other != "avx512");
#if MEDUSA_ISA_AVX512
  CHECK(mine == "avx512");
  // One definition per instruction set survives linking: the two units' functions are distinct.
  CHECK(reinterpret_cast<const void*>(&medusa::kernel_isa) != isa_mix::other_kernel_isa_address());
#endif
}

TEST_CASE("both instruction sets compute the same tree attention") {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int L = 37, n = 5, hkv = 2, hq = 4, D = 32, cap = L + n;
  std::vector<float> k(static_cast<std::size_t>(cap * hkv * D)), v(k.size()), q(static_cast<std::size_t>(n * hq * D));
  for (auto* vec : {&k, &v, &q})
    for (float& x : *vec) x = nd(rng);
  const auto kv = medusa::make_kv_view<float>(k, v, {1, hkv, D}, cap);
  const std::uint32_t mask[] = {0x1, 0x3, 0x5, 0xB, 0x13};  // root, 1 and 2 under it, 3 under 1, 4 under 1
  std::vector<float> a(q.size()), b(q.size());
  medusa::tree_attention(kv, 0, L, q, n, hq, medusa::tree_mask_view{mask, 1}, a);
  isa_mix::other_attention(kv, L, q, n, hq, medusa::tree_mask_view{mask, 1}, b);
  for (std::size_t i = 0; i < a.size(); ++i) REQUIRE(std::abs(a[i] - b[i]) < 1e-5f);
}
