// SPDX-License-Identifier: Apache-2.0
//! @file philox.hpp
//! Philox4x32-10, the counter-based generator of rejection sampling (docs/acceptance.md).
//!
//! A counter-based generator has no state to carry between calls: draw `i` of step `s` of a
//! request is a pure function of `(seed, s, i)`. That is what lets a CUDA kernel and the CPU path
//! produce the same stream without sharing anything, so the CPU result is the GPU test oracle.
//! Layout (fixed, tested): key = {seed low 32 bits, seed high 32 bits}, counter = {draw low,
//! draw high, step low, step high}.
#pragma once

#include <medusa/config.hpp>

#include <array>
#include <cstdint>

MEDUSA_NAMESPACE_BEGIN

namespace detail {

//! The four 32-bit output words of one Philox4x32-10 block.
struct philox_block {
  std::uint32_t v[4];
};

//! Philox4x32 with 10 rounds (Salmon et al., SC'11; constants of Random123 and cuRAND).
MEDUSA_HOST_DEVICE constexpr philox_block philox4x32_10(philox_block ctr, std::uint32_t k0,
                                                        std::uint32_t k1) noexcept {
  constexpr std::uint32_t m0 = 0xD2511F53u;
  constexpr std::uint32_t m1 = 0xCD9E8D57u;
  constexpr std::uint32_t w0 = 0x9E3779B9u;
  constexpr std::uint32_t w1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += w0;
      k1 += w1;
    }
    const std::uint64_t p0 = static_cast<std::uint64_t>(m0) * ctr.v[0];
    const std::uint64_t p1 = static_cast<std::uint64_t>(m1) * ctr.v[2];
    const auto hi0 = static_cast<std::uint32_t>(p0 >> 32);
    const auto lo0 = static_cast<std::uint32_t>(p0);
    const auto hi1 = static_cast<std::uint32_t>(p1 >> 32);
    const auto lo1 = static_cast<std::uint32_t>(p1);
    ctr = philox_block{{hi1 ^ ctr.v[1] ^ k0, lo1, hi0 ^ ctr.v[3] ^ k1, lo0}};
  }
  return ctr;
}

//! Uniform double in [0, 1) with 53 random bits, for draw `draw` of step `step` under `seed`.
MEDUSA_HOST_DEVICE constexpr double philox_uniform(std::uint64_t seed, std::uint64_t step,
                                                   std::uint64_t draw) noexcept {
  const philox_block out = philox4x32_10(
      philox_block{{static_cast<std::uint32_t>(draw), static_cast<std::uint32_t>(draw >> 32),
                    static_cast<std::uint32_t>(step), static_cast<std::uint32_t>(step >> 32)}},
      static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32));
  const std::uint64_t bits =
      (static_cast<std::uint64_t>(out.v[0]) << 21) | static_cast<std::uint64_t>(out.v[1] >> 11);
  return static_cast<double>(bits) * 0x1.0p-53;
}

//! The uniform stream of one request in one step: draw indices count up from 0.
struct philox_stream {
  std::uint64_t seed = 0;
  std::uint64_t step = 0;
  std::uint64_t next_draw = 0;

  //! The next uniform in [0, 1).
  MEDUSA_HOST_DEVICE constexpr double operator()() noexcept {
    return philox_uniform(seed, step, next_draw++);
  }
};

}  // namespace detail

MEDUSA_NAMESPACE_END
