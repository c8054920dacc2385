// SPDX-License-Identifier: Apache-2.0
// medusa::half and medusa::bfloat16 against the IEEE definitions: exhaustive over all 65536 bit
// patterns, and float -> 16 bit against an independent round-to-nearest-even reference.
#include <medusa/half.hpp>

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <ios>
#include <limits>
#include <random>
#include <type_traits>

namespace {

std::uint32_t bits_of(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float float_of(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Independent decoders: value of a positive finite pattern, straight from the definitions.
double half_value(std::uint16_t h) {  // h without sign, exponent < 31
  const int e = (h >> 10) & 0x1F;
  const int m = h & 0x3FF;
  return e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
}
double bf16_value(std::uint16_t b) {  // b without sign, exponent < 255
  const int e = (b >> 7) & 0xFF;
  const int m = b & 0x7F;
  return e == 0 ? std::ldexp(m, -133) : std::ldexp(128 + m, e - 134);
}

// Round |x| (finite, positive) to the nearest pattern in [0, max_finite], ties to the even
// pattern; `inf_bits` counts as the value `inf_value` (the next power of two), as IEEE's
// "unbounded exponent" rounding prescribes.
template <class Value>
std::uint16_t reference_round(double x, std::uint16_t max_finite, std::uint16_t inf_bits, double inf_value,
                              Value value) {
  if (x >= inf_value) return inf_bits;
  // largest pattern whose value is <= x (values increase with the pattern)
  std::uint32_t lo = 0, hi = max_finite;
  while (lo < hi) {
    const std::uint32_t mid = (lo + hi + 1) / 2;
    if (value(static_cast<std::uint16_t>(mid)) <= x)
      lo = mid;
    else
      hi = mid - 1;
  }
  const double a = value(static_cast<std::uint16_t>(lo));
  if (a == x) return static_cast<std::uint16_t>(lo);
  const std::uint32_t up = lo + 1;
  const double b = up == inf_bits ? inf_value : value(static_cast<std::uint16_t>(up));
  const double da = x - a, db = b - x;
  if (da < db) return static_cast<std::uint16_t>(lo);
  if (db < da) return static_cast<std::uint16_t>(up);
  return static_cast<std::uint16_t>((lo & 1u) == 0 ? lo : up);
}

std::uint16_t reference_half(float f) {
  const std::uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  if (std::isinf(f)) return sign | 0x7C00;
  return sign | reference_round(std::fabs(static_cast<double>(f)), 0x7BFF, 0x7C00, 65536.0, half_value);
}
std::uint16_t reference_bf16(float f) {
  const std::uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  if (std::isinf(f)) return sign | 0x7F80;
  return sign | reference_round(std::fabs(static_cast<double>(f)), 0x7F7F, 0x7F80, std::ldexp(1.0, 128), bf16_value);
}

}  // namespace

// Compile-time checks (this unit does not compile when one fails): 16-bit types are trivially
// copyable 2-byte storage, and their constexpr conversions give the known bits.
static_assert(sizeof(medusa::half) == 2 && std::is_trivially_copyable_v<medusa::half>);
static_assert(sizeof(medusa::bfloat16) == 2 && std::is_trivially_copyable_v<medusa::bfloat16>);
static_assert(std::is_standard_layout_v<medusa::half> && std::is_standard_layout_v<medusa::bfloat16>);
static_assert(!std::is_convertible_v<float, medusa::half>);  // rounding is explicit
static_assert(std::is_convertible_v<medusa::half, float>);   // widening is exact, implicit
static_assert(medusa::is_kv_element_v<const medusa::bfloat16> && !medusa::is_kv_element_v<double>);
static_assert(medusa::half(1.0f).bits() == 0x3C00);
static_assert(medusa::half(-2.0f).bits() == 0xC000);
static_assert(medusa::half(65504.0f).bits() == 0x7BFF);
static_assert(medusa::half(65520.0f).bits() == 0x7C00);  // tie above the max rounds to Inf
static_assert(medusa::half(65519.99f).bits() == 0x7BFF);
static_assert(medusa::half(0.1f).bits() == 0x2E66);
static_assert(medusa::half(5.9604645e-08f).bits() == 0x0001);  // 2^-24, smallest subnormal
static_assert(medusa::half(2.9802322e-08f).bits() == 0x0000);  // 2^-25: tie, to even (0)
static_assert(medusa::half(-0.0f).bits() == 0x8000);
static_assert(static_cast<float>(medusa::half::from_bits(0x3555)) == 0.33325195f);
static_assert(static_cast<float>(medusa::half::from_bits(0x0001)) == 5.9604645e-08f);
static_assert(medusa::bfloat16(1.0f).bits() == 0x3F80);
static_assert(medusa::bfloat16(3.14159265f).bits() == 0x4049);
static_assert(medusa::bfloat16(1.00390625f).bits() == 0x3F80);  // 1 + 2^-8: tie, to even
static_assert(medusa::bfloat16(1.01171875f).bits() == 0x3F82);  // 1 + 3*2^-8: tie, to even
static_assert(static_cast<float>(medusa::bfloat16::from_bits(0xC2F7)) == -123.5f);
static_assert(medusa::from_float<medusa::half>(medusa::to_float(medusa::half(0.5f))).bits() == 0x3800);

TEST_CASE("half: all 65536 patterns convert exactly and round-trip bit for bit") {
  for (std::uint32_t u = 0; u < 65536; ++u) {
    const auto h = medusa::half::from_bits(static_cast<std::uint16_t>(u));
    const float f = h;
    const bool neg = (u & 0x8000u) != 0;
    const std::uint16_t mag = static_cast<std::uint16_t>(u & 0x7FFFu);
    if ((mag >> 10) == 0x1F) {
      if ((mag & 0x3FF) == 0) {
        REQUIRE(std::isinf(f));
      } else {
        REQUIRE(std::isnan(f));
      }
    } else {
      REQUIRE(static_cast<double>(f) == (neg ? -half_value(mag) : half_value(mag)));
    }
    REQUIRE(std::signbit(f) == neg);
    REQUIRE(medusa::half(f).bits() == u);
  }
}

TEST_CASE("bfloat16: all 65536 patterns convert exactly and round-trip bit for bit") {
  for (std::uint32_t u = 0; u < 65536; ++u) {
    const auto b = medusa::bfloat16::from_bits(static_cast<std::uint16_t>(u));
    const float f = b;
    REQUIRE(bits_of(f) == (u << 16));
    const std::uint16_t mag = static_cast<std::uint16_t>(u & 0x7FFFu);
    if ((mag >> 7) != 0xFF) REQUIRE(std::fabs(static_cast<double>(f)) == bf16_value(mag));
    REQUIRE(medusa::bfloat16(f).bits() == u);
  }
}

namespace {
template <class H>
void check_against_reference(float f) {
  const std::uint16_t got = H(f).bits();
  if (std::isnan(f)) {
    const bool is_nan = std::is_same_v<H, medusa::half> ? ((got & 0x7C00) == 0x7C00 && (got & 0x3FF) != 0)
                                                        : ((got & 0x7F80) == 0x7F80 && (got & 0x7F) != 0);
    REQUIRE(is_nan);
    REQUIRE(((got & 0x8000) != 0) == std::signbit(f));
    return;
  }
  const std::uint16_t want = std::is_same_v<H, medusa::half> ? reference_half(f) : reference_bf16(f);
  if (got != want) FAIL("float bits 0x" << std::hex << bits_of(f) << ": got 0x" << got << ", want 0x" << want);
}
}  // namespace

TEST_CASE_TEMPLATE("float -> 16 bit matches round-to-nearest-even on random floats", H, medusa::half,
                   medusa::bfloat16) {
  std::mt19937_64 rng(12345);
  // (1) uniform over all 2^32 float patterns (NaN, Inf, subnormals included)
  for (int i = 0; i < 200000; ++i) check_against_reference<H>(float_of(static_cast<std::uint32_t>(rng())));
  // (2) floats whose exponent lies in and around the 16-bit type's range
  const int lo = std::is_same_v<H, medusa::half> ? 127 - 27 : 1;
  const int hi = std::is_same_v<H, medusa::half> ? 127 + 17 : 254;
  std::uniform_int_distribution<int> exp(lo, hi);
  for (int i = 0; i < 200000; ++i) {
    const auto u = static_cast<std::uint32_t>(rng());
    check_against_reference<H>(float_of((u & 0x807FFFFFu) | (static_cast<std::uint32_t>(exp(rng)) << 23)));
  }
  // (3) exact ties and their neighbours: midpoints between consecutive finite 16-bit values
  const std::uint32_t max_finite = std::is_same_v<H, medusa::half> ? 0x7BFF : 0x7F7F;
  for (std::uint32_t u = 0; u < max_finite; ++u) {
    const double mid = (static_cast<double>(static_cast<float>(H::from_bits(static_cast<std::uint16_t>(u)))) +
                        static_cast<double>(static_cast<float>(H::from_bits(static_cast<std::uint16_t>(u + 1))))) /
                       2;
    const auto m = static_cast<float>(mid);
    if (static_cast<double>(m) != mid) continue;  // not representable (only for bf16 subnormals)
    check_against_reference<H>(m);
    check_against_reference<H>(-m);
    check_against_reference<H>(std::nextafter(m, 0.0f));
    check_against_reference<H>(std::nextafter(m, std::numeric_limits<float>::infinity()));
  }
  // (4) specials
  for (float f : {0.0f, -0.0f, std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::max(), std::numeric_limits<float>::denorm_min(),
                  std::numeric_limits<float>::min(), std::numeric_limits<float>::quiet_NaN(),
                  float_of(0x7F800001u), float_of(0xFF800001u), float_of(0x7FC00000u)})
    check_against_reference<H>(f);
}

TEST_CASE("NaN payloads only in dropped bits still give NaN, never Inf") {
  CHECK(medusa::half(float_of(0x7F800001u)).bits() == 0x7E00);
  CHECK(medusa::half(float_of(0xFF800FFFu)).bits() == 0xFE00);
  CHECK(medusa::bfloat16(float_of(0x7F800001u)).bits() == 0x7FC0);
  CHECK(medusa::bfloat16(float_of(0x7FC00000u)).bits() == 0x7FC0);
}
