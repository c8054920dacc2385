// SPDX-License-Identifier: Apache-2.0
//! @file row_math.hpp
//! Vocabulary-row kernels of the CPU path: non-finite checks, max/argmax, softmax statistics,
//! entropy and per-row top-k.
//!
//! Every kernel walks the row in blocks of 16 lanes with one accumulator per lane. Without
//! -ffast-math a compiler may not reorder a floating-point reduction, so a plain `sum += x[i]`
//! loop stays scalar; per-lane accumulators make the vector form legal and the result
//! deterministic for a given row length. `exp2` (detail/exp2.hpp) and `log` are polynomial
//! versions that the compiler can vectorise (libm calls cannot be); both are accurate to a few
//! float ulp, at least float32 arithmetic as the acceptance rules require. Sums are accumulated in
//! double.
#pragma once

#include <medusa/config.hpp>
#include <medusa/detail/exp2.hpp>

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <limits>

MEDUSA_NAMESPACE_BEGIN

namespace detail {

inline constexpr int row_lanes = 16;
//! Elements per block: kernels map a block into a local buffer (a loop the compiler vectorises),
//! then fold it into per-lane accumulators (an element-wise update, vectorised too).
inline constexpr std::size_t row_block = 64;

//! Natural log of a positive normal float: exponent split plus the atanh series of the mantissa
//! reduced to [1/√2, √2] (series error < 1e-9).
inline float log_pos(float y) noexcept {
  const auto bits = std::bit_cast<std::uint32_t>(y);
  int e = static_cast<int>((bits >> 23) & 0xffu) - 127;
  float m = std::bit_cast<float>((bits & 0x007fffffu) | 0x3f800000u);
  const bool big = m > 1.41421356f;
  m = big ? m * 0.5f : m;
  e = big ? e + 1 : e;
  const float s = (m - 1.0f) / (m + 1.0f);
  const float s2 = s * s;
  float p = 1.0f / 11.0f;
  p = p * s2 + 1.0f / 9.0f;
  p = p * s2 + 1.0f / 7.0f;
  p = p * s2 + 1.0f / 5.0f;
  p = p * s2 + 1.0f / 3.0f;
  p = p * s2 + 1.0f;
  return static_cast<float>(e) * 0.693147180559945309f + 2.0f * s * p;
}

//! True for NaN and ±Inf (exponent field all ones), as an integer test that vectorises.
inline bool non_finite_bits(float v) noexcept {
  return (std::bit_cast<std::uint32_t>(v) & 0x7f800000u) == 0x7f800000u;
}

//! Monotone map of finite floats to int32 (integer max reductions vectorise, float ones do not
//! without -ffast-math). It is its own inverse.
inline std::int32_t ordered_key(float v) noexcept {
  const auto b = std::bit_cast<std::int32_t>(v);
  return b ^ ((b >> 31) & 0x7fffffff);
}
inline float from_ordered_key(std::int32_t k) noexcept {
  return std::bit_cast<float>(k ^ ((k >> 31) & 0x7fffffff));
}

//! True for the logits a row may not hold: NaN and +Inf. -Inf is legal: a masked (banned) token.
inline bool invalid_logit_bits(float v) noexcept {
  const auto u = std::bit_cast<std::uint32_t>(v);
  return (u & 0x7fffffffu) > 0x7f800000u || u == 0x7f800000u;
}

//! What `check_logit_row` needs from one pass over a row.
struct logit_row_scan {
  std::ptrdiff_t first_invalid;  //!< index of the first NaN or +Inf, or -1
  bool any_allowed;              //!< some logit is above -Inf (not every token is masked)
};

//! Finds the first NaN or +Inf of x[0, n) and whether any logit is above -Inf.
inline logit_row_scan scan_logit_row(const float* x, std::size_t n) noexcept {
  constexpr float masked = -std::numeric_limits<float>::infinity();
  const std::size_t nb = n - n % row_block;
  std::size_t i = 0;
  unsigned allowed = 0;
  for (; i < nb; i += row_block) {
    unsigned bad = 0;
    for (std::size_t j = 0; j < row_block; ++j) {
      bad |= invalid_logit_bits(x[i + j]) ? 1u : 0u;
      allowed |= x[i + j] != masked ? 1u : 0u;
    }
    if (bad) break;
  }
  for (; i < n; ++i) {
    if (invalid_logit_bits(x[i])) return {static_cast<std::ptrdiff_t>(i), allowed != 0};
    allowed |= x[i] != masked ? 1u : 0u;
  }
  return {-1, allowed != 0};
}

//! Largest value of x[0, n), n > 0, and whether the whole row is finite (NaN or ±Inf → false).
struct row_max_result {
  float max;
  bool finite;
};

inline row_max_result row_max(const float* x, std::size_t n) noexcept {
  std::int32_t m = std::numeric_limits<std::int32_t>::min();
  unsigned bad = 0;
  for (std::size_t i = 0; i < n; ++i) {
    m = std::max(m, ordered_key(x[i]));
    bad |= non_finite_bits(x[i]) ? 1u : 0u;
  }
  return {from_ordered_key(m), bad == 0};
}

//! Index of the first occurrence of the largest value (ties → lowest index). Rows without NaN or
//! +Inf and with at least one logit above -Inf (masked tokens never win).
inline std::int32_t argmax_finite(const float* x, std::size_t n) noexcept {
  const float m = row_max(x, n).max;
  const std::size_t nb = n - n % row_block;
  std::size_t i = 0;
  for (; i < nb; i += row_block) {
    unsigned hit = 0;
    for (std::size_t j = 0; j < row_block; ++j) hit |= x[i + j] == m ? 1u : 0u;
    if (hit) break;
  }
  while (i < n && x[i] != m) ++i;
  return static_cast<std::int32_t>(i);
}

//! Softmax statistics of x / T for finite x, T > 0: the row max and the sum of
//! exp((x - max) / T) (≥ 1, accumulated in double).
struct softmax_stats {
  float max;
  double sum;
};

namespace row_detail {
// exp((x - max)/T) of one block into e[0, len).
inline void exp_block(const float* x, std::size_t len, float max, float k, float* e) noexcept {
  for (std::size_t j = 0; j < len; ++j) e[j] = exp2_approx((x[j] - max) * k);
}
inline double fold(const double* acc) noexcept {
  double s = 0.0;
  for (int j = 0; j < row_lanes; ++j) s += acc[j];
  return s;
}
}  // namespace row_detail

inline softmax_stats softmax_sum(const float* x, std::size_t n, float max, float inv_t) noexcept {
  // exp(y) = 2^(y·log2 e): fold log2 e into the scale once.
  const float k = inv_t * log2e;
  double acc[row_lanes] = {};
  float e[row_block];
  for (std::size_t i = 0; i < n; i += row_block) {
    const std::size_t len = std::min(row_block, n - i);
    row_detail::exp_block(x + i, len, max, k, e);
    for (std::size_t j = len; j < row_block; ++j) e[j] = 0.0f;
    for (int j = 0; j < row_lanes; ++j)
      acc[j] += static_cast<double>(e[j] + e[j + 16]) + static_cast<double>(e[j + 32] + e[j + 48]);
  }
  return {max, row_detail::fold(acc)};
}

//! −Σ q·ln(q + eps) with q = exp((x - max)/T) / sum (typical acceptance: epsilon inside the log).
inline double softmax_entropy(const float* x, std::size_t n, softmax_stats st, float inv_t,
                              float eps) noexcept {
  const float k = inv_t * log2e;
  const auto inv_sum = static_cast<float>(1.0 / st.sum);
  double acc[row_lanes] = {};
  float e[row_block];
  for (std::size_t i = 0; i < n; i += row_block) {
    const std::size_t len = std::min(row_block, n - i);
    row_detail::exp_block(x + i, len, st.max, k, e);
    for (std::size_t j = 0; j < len; ++j) {
      const float q = e[j] * inv_sum;
      e[j] = q * log_pos(q + eps);
    }
    for (std::size_t j = len; j < row_block; ++j) e[j] = 0.0f;
    for (int j = 0; j < row_lanes; ++j)
      acc[j] += static_cast<double>(e[j] + e[j + 16]) + static_cast<double>(e[j + 32] + e[j + 48]);
  }
  return -row_detail::fold(acc);
}

//! exp((x - max)/T) written to out (double) for a finite row; returns their sum.
inline double softmax_fill(const float* x, std::size_t n, float max, float inv_t,
                           double* out) noexcept {
  const float k = inv_t * log2e;
  double acc[row_lanes] = {};
  float e[row_block];
  for (std::size_t i = 0; i < n; i += row_block) {
    const std::size_t len = std::min(row_block, n - i);
    row_detail::exp_block(x + i, len, max, k, e);
    for (std::size_t j = 0; j < len; ++j) out[i + j] = e[j];
    for (std::size_t j = len; j < row_block; ++j) e[j] = 0.0f;
    for (int j = 0; j < row_lanes; ++j)
      acc[j] += static_cast<double>(e[j] + e[j + 16]) + static_cast<double>(e[j + 32] + e[j + 48]);
  }
  return row_detail::fold(acc);
}

//! Candidate ranking: larger value first, equal values by ascending token id.
inline bool ranks_before(const float* x, std::int32_t a, std::int32_t b) noexcept {
  return x[a] > x[b] || (x[a] == x[b] && a < b);
}

//! Largest tracked k of the insertion top-k; larger k uses a heap over the output ids.
inline constexpr int top_k_insertion_limit = 64;

//! The k = `k` best ids of x[0, n) in ranking order (0 < k <= n), written to ids[0, k).
//! Non-finite rows are the caller's problem (NaN never enters; check first).
//! Small k: a sorted buffer with a per-block "anything above the current k-th?" test, so the
//! common case costs one vector compare per 16 logits. Large k: a binary heap, O(n log k).
inline void top_k_ids(const float* x, std::size_t n, int k, std::int32_t* ids) noexcept {
  if (k <= top_k_insertion_limit) {
    float vals[top_k_insertion_limit] = {};
    int size = 0;
    auto insert = [&](float v, std::int32_t id) {
      // Insert after every kept value >= v: those have lower ids when equal (ascending scan).
      int p = size < k ? size : k - 1;
      while (p > 0 && vals[p - 1] < v) {
        if (p < k) {
          vals[p] = vals[p - 1];
          ids[p] = ids[p - 1];
        }
        --p;
      }
      vals[p] = v;
      ids[p] = id;
      if (size < k) ++size;
    };
    std::size_t i = 0;
    for (; i < n && size < k; ++i) {
      // Fill phase: the k-th slot is empty, everything enters (shifting the tail right).
      const float v = x[i];
      int p = size;
      while (p > 0 && vals[p - 1] < v) {
        vals[p] = vals[p - 1];
        ids[p] = ids[p - 1];
        --p;
      }
      vals[p] = v;
      ids[p] = static_cast<std::int32_t>(i);
      ++size;
    }
    float thr = vals[k - 1];
    // Blocks of 64: one vectorised "anything above the current k-th?" test per block.
    for (; i + row_block <= n; i += row_block) {
      unsigned any = 0;
      for (std::size_t j = 0; j < row_block; ++j) any |= x[i + j] > thr ? 1u : 0u;
      if (!any) continue;
      for (std::size_t j = 0; j < row_block; ++j) {
        if (x[i + j] > thr) {
          insert(x[i + j], static_cast<std::int32_t>(i + j));
          thr = vals[k - 1];
        }
      }
    }
    for (; i < n; ++i) {
      if (x[i] > thr) {
        insert(x[i], static_cast<std::int32_t>(i));
        thr = vals[k - 1];
      }
    }
    return;
  }
  // Heap of the k best seen so far with the worst on top.
  auto better = [x](std::int32_t a, std::int32_t b) { return ranks_before(x, a, b); };
  for (int j = 0; j < k; ++j) ids[j] = j;
  std::make_heap(ids, ids + k, better);
  for (std::size_t i = static_cast<std::size_t>(k); i < n; ++i) {
    const auto id = static_cast<std::int32_t>(i);
    if (better(id, ids[0])) {
      std::pop_heap(ids, ids + k, better);
      ids[k - 1] = id;
      std::push_heap(ids, ids + k, better);
    }
  }
  std::sort_heap(ids, ids + k, better);
}

}  // namespace detail

MEDUSA_NAMESPACE_END
