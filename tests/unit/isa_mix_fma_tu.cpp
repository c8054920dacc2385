// SPDX-License-Identifier: Apache-2.0
// The third translation unit of test_isa_mix: built with -mfma on x86 (test_isa_mix.cmake), so on
// the default target it keeps the portable kernels but has a fused multiply-add, which changes how
// the library rounds a·b + c (detail/mul_add.hpp) and so the instruction-set namespace.
#include <medusa/config.hpp>
#include <medusa/detail/mul_add.hpp>

namespace isa_mix {

bool fma_unit_has_fma() { return MEDUSA_ISA_FMA != 0; }

float fma_unit_mul_add(float a, float b, float c) { return medusa::detail::mul_add(a, b, c); }

const void* fma_unit_mul_add_address() { return reinterpret_cast<const void*>(&medusa::detail::mul_add); }

}  // namespace isa_mix
