// SPDX-License-Identifier: Apache-2.0
//! @file detail/exp2.hpp
//! The library's one `2^t`: range reduction to `t = n + f`, `|f| <= 1/2`, then a degree-7 Taylor
//! polynomial of `2^f` (truncation error 5e-9, below float rounding) scaled by `2^n` through the
//! exponent bits. `t` is clamped to [-127, 127]: results below 2^-126.5 are exactly 0 (softmax
//! weights far below the maximum), NaN gives 0. The scalar form is branch-free, so loops over it
//! vectorise without -ffast-math (a libm call cannot); the AVX2 and AVX-512 forms compute the same
//! polynomial eight and sixteen lanes at a time, with the same roundings: the scalar form fuses its
//! multiply-adds where the target has FMA (detail/mul_add.hpp), and gives their bits there.
//! `exp(x) = exp2(x · log2 e)`.
#pragma once

#include <medusa/config.hpp>
#include <medusa/detail/mul_add.hpp>

#include <cstdint>

#if MEDUSA_ISA_AVX2
#include <immintrin.h>
#endif

MEDUSA_NAMESPACE_BEGIN

namespace detail {

inline constexpr float exp2_c7 = 1.525273380405984e-05f;
inline constexpr float exp2_c6 = 1.540353039338161e-04f;
inline constexpr float exp2_c5 = 1.333355814642844e-03f;
inline constexpr float exp2_c4 = 9.618129107628477e-03f;
inline constexpr float exp2_c3 = 5.550410866482158e-02f;
inline constexpr float exp2_c2 = 2.402265069591007e-01f;
inline constexpr float exp2_c1 = 6.931471805599453e-01f;
//! log2(e), to turn exp(x) into exp2(x · log2e).
inline constexpr float log2e = 1.44269504088896341f;

//! `c ? a : b` on the bits: a conditional with a constant arm lets g++ thread a branch through the
//! rest of `exp2_approx` (the clamped values fold to constants), and a loop with a branch does not
//! vectorise.
inline float exp2_select(bool c, float a, float b) noexcept {
  const std::uint32_t m = 0u - static_cast<std::uint32_t>(c);
  return __builtin_bit_cast(float, (__builtin_bit_cast(std::uint32_t, a) & m) | (__builtin_bit_cast(std::uint32_t, b) & ~m));
}

MEDUSA_ISA_NAMESPACE_BEGIN
//! 2^t (see the file comment).
inline float exp2_approx(float t) noexcept {
  const float lo = exp2_select(t > -127.0f, t, -127.0f);  // NaN -> -127
  const float tc = exp2_select(lo < 127.0f, lo, 127.0f);
  // Round to nearest with the 1.5·2^23 trick: exact for |tc| < 2^22, and vectorises everywhere.
  const float n = (tc + 12582912.0f) - 12582912.0f;
  const float f = tc - n;
  float p = exp2_c7;
  p = mul_add(p, f, exp2_c6);
  p = mul_add(p, f, exp2_c5);
  p = mul_add(p, f, exp2_c4);
  p = mul_add(p, f, exp2_c3);
  p = mul_add(p, f, exp2_c2);
  p = mul_add(p, f, exp2_c1);
  p = mul_add(p, f, 1.0f);
  const auto e = static_cast<std::uint32_t>(static_cast<std::int32_t>(n) + 127);  // [0, 254]; 0 gives 0
  return p * __builtin_bit_cast(float, e << 23);
}

#if MEDUSA_ISA_AVX2
//! 2^t on eight lanes, the same polynomial as the scalar form.
inline __m256 exp2_approx(__m256 t) noexcept {
  // max(t, lo) gives lo for NaN (the second operand when unordered), as the scalar form.
  const __m256 tc = _mm256_min_ps(_mm256_max_ps(t, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
  const __m256 n = _mm256_round_ps(tc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(tc, n);
  __m256 p = _mm256_set1_ps(exp2_c7);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(exp2_c6));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(exp2_c5));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(exp2_c4));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(exp2_c3));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(exp2_c2));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(exp2_c1));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
}
#endif

#if MEDUSA_ISA_AVX512
//! 2^t on sixteen lanes, the same polynomial as the scalar form.
inline __m512 exp2_approx(__m512 t) noexcept {
  // Masked forms with an explicit source: the plain intrinsics pass _mm512_undefined_ps() and
  // trip g++ 12's -Wmaybe-uninitialized under -Werror.
  constexpr auto all = static_cast<__mmask16>(0xFFFF);
  const __m512 lo = _mm512_set1_ps(-127.0f);
  const __m512 tc = _mm512_mask_min_ps(lo, all, _mm512_mask_max_ps(lo, all, t, lo), _mm512_set1_ps(127.0f));
  const __m512 n = _mm512_mask_roundscale_ps(tc, all, tc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(tc, n);
  __m512 p = _mm512_set1_ps(exp2_c7);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(exp2_c6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(exp2_c5));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(exp2_c4));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(exp2_c3));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(exp2_c2));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(exp2_c1));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  const __m512i zero = _mm512_setzero_si512();
  const __m512i e = _mm512_add_epi32(_mm512_mask_cvtps_epi32(zero, all, n), _mm512_set1_epi32(127));
  return _mm512_mul_ps(p, _mm512_castsi512_ps(_mm512_mask_slli_epi32(zero, all, e, 23)));
}
#endif
MEDUSA_ISA_NAMESPACE_END

}  // namespace detail

MEDUSA_NAMESPACE_END
