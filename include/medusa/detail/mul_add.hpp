// SPDX-License-Identifier: Apache-2.0
//! @file detail/mul_add.hpp
//! `a·b + c` with a fixed rounding: once where the target has a fused multiply-add (x86 FMA3,
//! AArch64), twice where it has none. Without it, g++ (`-ffp-contract=fast`, its default) fuses a
//! written `a*b + c` or not by its own choice, which differs between -O2 and -O3 and between two
//! inlined copies of one function: a kernel's row could then get other bits in a call of another
//! size, which lossless decoding cannot allow. The vectoriser turns both forms into vector code.
#pragma once

#include <medusa/config.hpp>

#include <cmath>

MEDUSA_NAMESPACE_BEGIN

namespace detail {
// The body depends on the target's FMA: in the instruction-set namespace, which config.hpp splits
// by it.
MEDUSA_ISA_NAMESPACE_BEGIN
inline float mul_add(float a, float b, float c) noexcept {
#if MEDUSA_ISA_FMA
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}
MEDUSA_ISA_NAMESPACE_END
}  // namespace detail

MEDUSA_NAMESPACE_END
