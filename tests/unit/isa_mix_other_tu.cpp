// SPDX-License-Identifier: Apache-2.0
// The second translation unit of test_isa_mix: built with -mno-avx512f (test_isa_mix.cmake), so
// it sees a different instruction set than the test's own translation unit.
#include <medusa/attention.hpp>
#include <medusa/config.hpp>

#include <span>
#include <string>

namespace isa_mix {

std::string other_isa() { return medusa::kernel_isa(); }

// The address of an inline function as this unit sees it: equal in both units iff the linker
// merged their definitions into one.
const void* other_kernel_isa_address() { return reinterpret_cast<const void*>(&medusa::kernel_isa); }

bool other_is_avx512() { return MEDUSA_ISA_AVX512 != 0; }

void other_attention(const medusa::kv_cache_view<float>& kv, int L, std::span<const float> q, int n, int hq,
                     medusa::tree_mask_view mask, std::span<float> out) {
  medusa::tree_attention(kv, 0, L, q, n, hq, mask, out);
}

}  // namespace isa_mix
