// SPDX-License-Identifier: Apache-2.0
// Translation units built with different -m flags in one program: each keeps its own
// instruction-set-dependent inline bodies (the per-ISA inline namespace of config.hpp) instead of
// the linker keeping one of them for both, which is what an ODR violation would do.
#include <medusa/attention.hpp>
#include <medusa/config.hpp>
#include <medusa/detail/mul_add.hpp>

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
bool fma_unit_has_fma();
float fma_unit_mul_add(float a, float b, float c);
const void* fma_unit_mul_add_address();
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

TEST_CASE("a unit with a fused multiply-add and one without each keep their own rounding of a·b + c") {
#if defined(__x86_64__) || defined(__i386__)
  if (!__builtin_cpu_supports("fma")) {
    MESSAGE("skipped: this CPU has no FMA, the -mfma unit cannot run");
    return;
  }
#endif
  // (1 + 2^-12)² - 1 = 2^-11 + 2^-24: rounded once it stays; rounding the product first (a tie,
  // to even) drops the 2^-24.
  volatile float a = 1.0f + 0x1p-12f, c = -1.0f;
  const float fused = 0x1p-11f + 0x1p-24f, twice = 0x1p-11f;
  CHECK(isa_mix::fma_unit_has_fma());
  CHECK(isa_mix::fma_unit_mul_add(a, a, c) == fused);
  CHECK(medusa::detail::mul_add(a, a, c) == (MEDUSA_ISA_FMA ? fused : twice));
  if (!MEDUSA_ISA_FMA)  // the default x86-64 target: two definitions survive linking, one per unit
    CHECK(reinterpret_cast<const void*>(&medusa::detail::mul_add) != isa_mix::fma_unit_mul_add_address());
}
