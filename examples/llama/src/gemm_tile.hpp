// SPDX-License-Identifier: Apache-2.0
// Private: the epilogue of the packed kernels' AVX-512 micro-tiles (gemm.cpp, gemm_blocks.cpp):
// MR tokens × NB panels of float32 results written, added or (SwiGLU pair) gated into Y.
#pragma once

#include "gemm.hpp"

#include <medusa/detail/exp2.hpp>

#include <cstddef>

#if defined(__AVX512F__)
#include <immintrin.h>

namespace medusa_llama::detail {

inline __mmask16 col_mask(int n) { return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1u); }

// Writes the MR × NB accumulators of one micro-tile. `cols[b]` = valid columns of panel b.
template <int MR, int NB>
inline void write_tile(__m512 (&acc)[MR][NB], float* Y, std::size_t ldy, const int (&cols)[NB], epilogue op) {
  if constexpr (NB == 2) {
    if (op == epilogue::swiglu) {
      const __mmask16 m = col_mask(cols[0]);
      const __m512 one = _mm512_set1_ps(1.0f);
#pragma GCC unroll 8
      for (int t = 0; t < MR; ++t) {
        const __m512 g = acc[t][0];
        // silu(g) = g / (1 + e^-g), e^-g = 2^(-g·log2 e)
        const __m512 e = medusa::detail::exp2_approx(_mm512_mul_ps(g, _mm512_set1_ps(-medusa::detail::log2e)));
        const __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, e));
        _mm512_mask_storeu_ps(Y + static_cast<std::size_t>(t) * ldy, m, _mm512_mul_ps(s, acc[t][1]));
      }
      return;
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < MR; ++t)
#pragma GCC unroll 3
    for (int b = 0; b < NB; ++b) {
      float* y = Y + static_cast<std::size_t>(t) * ldy + static_cast<std::size_t>(b) * 16;
      const __mmask16 m = col_mask(cols[b]);
      __m512 v = acc[t][b];
      if (op == epilogue::add) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, y));
      _mm512_mask_storeu_ps(y, m, v);
    }
}

}  // namespace medusa_llama::detail
#endif
