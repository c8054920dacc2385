// SPDX-License-Identifier: Apache-2.0
// Internals shared by the trainer's sources: the clock, a portable splitmix64 generator (std
// distributions differ between standard libraries) and the wall-clock budget of a training loop.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>

namespace medusa_train::detail {

using clock_type = std::chrono::steady_clock;

inline double seconds_since(clock_type::time_point t) { return std::chrono::duration<double>(clock_type::now() - t).count(); }

//! splitmix64 of `z`: one step of the generator, a good 64-bit hash of a counter.
inline std::uint64_t mix(std::uint64_t z) noexcept {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

__extension__ typedef unsigned __int128 u128;  // 64x64 -> 128-bit product for unbiased ranges

//! Uniform in [0, n) from 64 random bits (bias < 2^-40 for the sizes used here).
inline std::uint64_t below(std::uint64_t r, std::uint64_t n) noexcept { return static_cast<std::uint64_t>((static_cast<u128>(r) * n) >> 64); }

//! Uniform in [0, 1) from 64 random bits (53 of them).
inline double unit(std::uint64_t r) noexcept { return static_cast<double>(r >> 11) * 0x1.0p-53; }

//! A training loop's wall-clock budget: once the step time is known (after `warm_steps` steps or
//! `warm_seconds`), the planned total is cut once so that the schedule ends (lr → 0) by the
//! deadline minus `reserve` seconds; past that point the loop ends after the current step.
struct deadline_plan {
  std::optional<clock_type::time_point> deadline;
  double reserve = 0;
  std::size_t warm_steps = 8;
  double warm_seconds = 3.0;
  bool replanned = false;

  //! After 0-based `step`, `elapsed` seconds into the loop: updates `total`; true when it cut it.
  bool update(std::size_t step, double elapsed, std::size_t& total) {
    if (!deadline) return false;
    bool cut = false;
    const double left = std::chrono::duration<double>(*deadline - clock_type::now()).count() - reserve;
    if (!replanned && (step + 1 >= warm_steps || elapsed > warm_seconds)) {
      replanned = true;
      const double per_step = elapsed / static_cast<double>(step + 1);
      const auto fit_steps = step + 1 + static_cast<std::size_t>(left > 0 ? left / per_step : 0.0);
      if (fit_steps < total) {
        total = fit_steps > step + 2 ? fit_steps : step + 2;
        cut = true;
      }
    }
    if (left <= 0 && step + 1 < total) {
      total = step + 1;
      cut = true;
    }
    return cut;
  }
};

}  // namespace medusa_train::detail
