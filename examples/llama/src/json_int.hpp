// SPDX-License-Identifier: Apache-2.0
// Private: a JSON number read as a 64-bit integer without undefined behaviour. nlohmann's
// get<std::int64_t>() converts a double such as 1e300 with an unchecked cast and wraps unsigned
// values above INT64_MAX; the loaders check with this first.
#pragma once

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>

namespace medusa_llama::detail {

// The value of `v` when it is a number with an integral value in the range of int64 (8 and 8.0,
// not 8.5, 1e300 or 2^64 - 1); nullopt otherwise, also for non-numbers.
inline std::optional<std::int64_t> exact_int64(const nlohmann::json& v) noexcept {
  if (v.is_number_unsigned()) {
    const auto u = v.get<std::uint64_t>();
    if (u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) return std::nullopt;
    return static_cast<std::int64_t>(u);
  }
  if (v.is_number_integer()) return v.get<std::int64_t>();
  if (v.is_number_float()) {
    const double d = v.get<double>();
    // 2^63 is exact as a double; every integral double in [-2^63, 2^63) converts exactly.
    if (std::isfinite(d) && d == std::trunc(d) && d >= -9223372036854775808.0 && d < 9223372036854775808.0)
      return static_cast<std::int64_t>(d);
  }
  return std::nullopt;
}

}  // namespace medusa_llama::detail
