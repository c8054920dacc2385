// SPDX-License-Identifier: Apache-2.0
//! @file half.hpp
//! 16-bit floating-point storage types for KV caches on the CPU: `medusa::half` (IEEE 754
//! binary16) and `medusa::bfloat16` (the upper half of a binary32).
//!
//! They are storage types, not arithmetic types: they convert to `float` implicitly and from
//! `float` explicitly, exactly as the IEEE definitions say (round to nearest, ties to even;
//! overflow to infinity; subnormals kept; NaN stays NaN with its payload truncated, and a NaN
//! never turns into an infinity). Every conversion is `constexpr`, `noexcept` and
//! `MEDUSA_HOST_DEVICE`, so kernels and the CPU reference share them. The layout is one
//! `std::uint16_t`, bit-compatible with CUDA's `__half` / `__nv_bfloat16` and with PyTorch's
//! `torch.float16` / `torch.bfloat16` storage, so engine buffers can be viewed in place.
//!
//! @code
//! #include <medusa/half.hpp>
//! constexpr medusa::half h(0.1f);                  // rounds to the nearest binary16
//! static_assert(h.bits() == 0x2E66);
//! static_assert(static_cast<float>(medusa::bfloat16(1.0f)) == 1.0f);
//! @endcode
#pragma once

#include <medusa/config.hpp>

#include <cstdint>
#include <type_traits>

MEDUSA_NAMESPACE_BEGIN

namespace detail {

// __builtin_bit_cast is what std::bit_cast is built on in g++, clang and nvcc; calling it
// directly keeps these functions usable in device code without --expt-relaxed-constexpr.
MEDUSA_HOST_DEVICE constexpr std::uint32_t float_to_bits(float f) noexcept {
  return __builtin_bit_cast(std::uint32_t, f);
}
MEDUSA_HOST_DEVICE constexpr float bits_to_float(std::uint32_t u) noexcept {
  return __builtin_bit_cast(float, u);
}

//! binary32 -> binary16 bits, round to nearest even.
MEDUSA_HOST_DEVICE constexpr std::uint16_t float_to_half_bits(float f) noexcept {
  const std::uint32_t x = float_to_bits(f);
  const auto sign = static_cast<std::uint16_t>((x >> 16) & 0x8000u);
  const std::uint32_t ax = x & 0x7FFFFFFFu;
  if (ax >= 0x7F800000u) {  // Inf or NaN
    if (ax == 0x7F800000u) return static_cast<std::uint16_t>(sign | 0x7C00u);
    auto m = static_cast<std::uint16_t>((ax >> 13) & 0x3FFu);
    if (m == 0) m = 0x200u;  // payload only in dropped bits: keep it a (quiet) NaN
    return static_cast<std::uint16_t>(sign | 0x7C00u | m);
  }
  if (ax >= 0x477FF000u) return static_cast<std::uint16_t>(sign | 0x7C00u);  // >= 65520: Inf
  if (ax < 0x38800000u) {  // below the smallest normal binary16 (2^-14): subnormal or zero
    if (ax <= 0x33000000u) return sign;  // <= 2^-25 rounds to zero (2^-25 is a tie -> even 0)
    const std::uint32_t e = ax >> 23;
    const std::uint32_t mant = (ax & 0x7FFFFFu) | 0x800000u;
    const std::uint32_t shift = 126u - e;  // value = mant * 2^(e-150), unit 2^-24
    std::uint32_t r = mant >> shift;
    const std::uint32_t rem = mant & ((1u << shift) - 1u);
    const std::uint32_t halfway = 1u << (shift - 1u);
    if (rem > halfway || (rem == halfway && (r & 1u))) ++r;  // may carry into the normal range
    return static_cast<std::uint16_t>(sign | r);
  }
  std::uint32_t h = ((((ax >> 23) - 112u) << 10) | ((ax >> 13) & 0x3FFu));
  const std::uint32_t rem = ax & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // carry propagates into the exponent
  return static_cast<std::uint16_t>(sign | h);
}

//! binary16 bits -> binary32 (always exact).
MEDUSA_HOST_DEVICE constexpr float half_bits_to_float(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t e = (h >> 10) & 0x1Fu;
  std::uint32_t m = h & 0x3FFu;
  if (e == 0x1Fu) return bits_to_float(sign | 0x7F800000u | (m << 13));
  if (e == 0) {
    if (m == 0) return bits_to_float(sign);
    std::uint32_t e32 = 113;  // biased binary32 exponent of 2^-14
    while ((m & 0x400u) == 0) {
      m <<= 1;
      --e32;
    }
    return bits_to_float(sign | (e32 << 23) | ((m & 0x3FFu) << 13));
  }
  return bits_to_float(sign | ((e + 112u) << 23) | (m << 13));
}

//! binary32 -> bfloat16 bits, round to nearest even.
MEDUSA_HOST_DEVICE constexpr std::uint16_t float_to_bfloat16_bits(float f) noexcept {
  const std::uint32_t x = float_to_bits(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) {  // NaN: truncate, but never into an infinity
    auto r = static_cast<std::uint16_t>(x >> 16);
    if ((r & 0x7Fu) == 0) r = static_cast<std::uint16_t>(r | 0x40u);
    return r;
  }
  return static_cast<std::uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

//! bfloat16 bits -> binary32 (always exact).
MEDUSA_HOST_DEVICE constexpr float bfloat16_bits_to_float(std::uint16_t b) noexcept {
  return bits_to_float(static_cast<std::uint32_t>(b) << 16);
}

}  // namespace detail

//! IEEE 754 binary16 storage type (1 sign, 5 exponent, 10 mantissa bits).
//!
//! Trivially copyable, 2 bytes, no arithmetic: convert to `float` to compute.
class half {
 public:
  //! Uninitialised, like `float`.
  half() = default;
  //! Rounds `f` to the nearest binary16 (ties to even).
  MEDUSA_HOST_DEVICE constexpr explicit half(float f) noexcept : bits_(detail::float_to_half_bits(f)) {}
  //! The exact binary32 value.
  MEDUSA_HOST_DEVICE constexpr operator float() const noexcept { return detail::half_bits_to_float(bits_); }
  //! The value with bit pattern `b`.
  MEDUSA_HOST_DEVICE static constexpr half from_bits(std::uint16_t b) noexcept {
    half h;
    h.bits_ = b;
    return h;
  }
  //! The raw bit pattern.
  [[nodiscard]] MEDUSA_HOST_DEVICE constexpr std::uint16_t bits() const noexcept { return bits_; }

 private:
  std::uint16_t bits_;
};

//! bfloat16 storage type (1 sign, 8 exponent, 7 mantissa bits; the top half of a binary32).
//!
//! Trivially copyable, 2 bytes, no arithmetic: convert to `float` to compute.
class bfloat16 {
 public:
  //! Uninitialised, like `float`.
  bfloat16() = default;
  //! Rounds `f` to the nearest bfloat16 (ties to even).
  MEDUSA_HOST_DEVICE constexpr explicit bfloat16(float f) noexcept
      : bits_(detail::float_to_bfloat16_bits(f)) {}
  //! The exact binary32 value.
  MEDUSA_HOST_DEVICE constexpr operator float() const noexcept { return detail::bfloat16_bits_to_float(bits_); }
  //! The value with bit pattern `b`.
  MEDUSA_HOST_DEVICE static constexpr bfloat16 from_bits(std::uint16_t b) noexcept {
    bfloat16 h;
    h.bits_ = b;
    return h;
  }
  //! The raw bit pattern.
  [[nodiscard]] MEDUSA_HOST_DEVICE constexpr std::uint16_t bits() const noexcept { return bits_; }

 private:
  std::uint16_t bits_;
};

static_assert(sizeof(half) == 2 && std::is_trivially_copyable_v<half>);
static_assert(sizeof(bfloat16) == 2 && std::is_trivially_copyable_v<bfloat16>);

//! True for the element types medusa's KV algorithms accept: `float`, `half`, `bfloat16`
//! (cv-qualifiers ignored).
template <class T>
inline constexpr bool is_kv_element_v =
    std::is_same_v<std::remove_cv_t<T>, float> || std::is_same_v<std::remove_cv_t<T>, half> ||
    std::is_same_v<std::remove_cv_t<T>, bfloat16>;

//! Converts any KV element type to `float` (exact).
template <class T>
MEDUSA_HOST_DEVICE constexpr float to_float(T x) noexcept {
  return static_cast<float>(x);
}

//! Converts a `float` to a KV element type (round to nearest even for the 16-bit types).
template <class T>
MEDUSA_HOST_DEVICE constexpr T from_float(float f) noexcept {
  return T(f);
}

MEDUSA_NAMESPACE_END
