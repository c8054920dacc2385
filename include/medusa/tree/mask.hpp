// SPDX-License-Identifier: Apache-2.0
//! @file tree/mask.hpp
//! `tree_mask_view`, the one view of a packed tree mask that the decoder, attention and engines
//! pass around, and writers of the other mask formats (dense, FlashInfer's custom-mask stream).
//!
//! Packed format: row-major `[rows][words_per_row]` 32-bit words; bit `j % 32` of word `j / 32` of
//! row `i` set = node `i` may attend to node `j` (its ancestors, the root and itself), least
//! significant bit first. Committed cache slots before the tree are always visible and are not
//! part of the mask.
//!
//! @code
//! #include <medusa/tree.hpp>
//! auto t = medusa::tree::from_text("[[0],[1],[0,0]]");
//! medusa::tree_mask_view m = t.mask_view();   // rows 0b0001, 0b0011, 0b0101, 0b1011
//! bool sees = m.visible(3, 1);                 // true: node 1 is node 3's parent
//! @endcode
#pragma once

#include <medusa/config.hpp>
#include <medusa/error.hpp>
#include <medusa/tree/concepts.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

MEDUSA_NAMESPACE_BEGIN

//! A non-owning view of a packed tree mask (see the file comment). An empty view (no words)
//! stands for "no tree": the causal mask of a plain chunk, wherever the API says so.
struct tree_mask_view {
  std::span<const std::uint32_t> words;  //!< `rows * words_per_row` words (or more)
  int words_per_row = 0;                 //!< at least `ceil(rows / 32)`

  //! True when the view holds no words.
  [[nodiscard]] constexpr bool empty() const noexcept { return words.empty(); }
  //! Number of whole rows in `words`.
  [[nodiscard]] constexpr int rows() const noexcept {
    return words_per_row > 0 ? static_cast<int>(words.size() / static_cast<std::size_t>(words_per_row)) : 0;
  }
  //! True when the view can describe `n` nodes: `n` rows of at least `ceil(n / 32)` words.
  [[nodiscard]] constexpr bool covers(int n) const noexcept {
    return n >= 0 && words_per_row >= (n + 31) / 32 && rows() >= n;
  }
  //! Whether node `i` may attend to node `j` (unchecked).
  [[nodiscard]] constexpr bool visible(int i, int j) const noexcept {
    return ((row(i)[j / 32] >> (j % 32)) & 1u) != 0;
  }
  //! The 64 visibility bits of row `i` for nodes `[j0, j0 + 64)`, `j0` a multiple of 32; words past
  //! the row read as 0.
  [[nodiscard]] constexpr std::uint64_t bits64(int i, int j0) const noexcept {
    const std::uint32_t* r = row(i);
    const int w0 = j0 / 32;
    const std::uint64_t lo = w0 < words_per_row ? r[w0] : 0u;
    const std::uint64_t hi = w0 + 1 < words_per_row ? r[w0 + 1] : 0u;
    return lo | (hi << 32);
  }

 private:
  [[nodiscard]] constexpr const std::uint32_t* row(int i) const noexcept {
    return words.data() + static_cast<std::size_t>(i) * static_cast<std::size_t>(words_per_row);
  }
};

//! Copies the packed mask of any `masked_tree` into `out`, row-major `[num_nodes][words_per_row]`
//! (for trees that do not hold one to hand out as a `tree_mask_view`). Throws `invalid_input` if
//! `out` is too small.
template <masked_tree T>
void copy_packed_mask(const T& t, std::span<std::uint32_t> out) {
  const auto n = static_cast<std::size_t>(t.num_nodes());
  const auto w = static_cast<std::size_t>(t.words_per_row());
  if (out.size() < n * w)
    throw invalid_input("copy_packed_mask: buffer holds " + std::to_string(out.size()) + " words, needs " +
                        std::to_string(n * w));
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t j = 0; j < w; ++j) out[i * w + j] = t.packed_mask_word(static_cast<int>(i), static_cast<int>(j));
}

//! Writes the dense mask `[num_nodes][num_nodes]` (row = query, 1 = may attend) as values of V
//! (e.g. `float` for the reference's `[1,1,N,N]` tensor). Throws `invalid_input` if `out` is too small.
template <masked_tree T, class V>
void write_dense_mask(const T& t, std::span<V> out) {
  const auto n = static_cast<std::size_t>(t.num_nodes());
  if (out.size() < n * n)
    throw invalid_input("write_dense_mask: buffer holds " + std::to_string(out.size()) + " values, needs " +
                        std::to_string(n * n));
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t j = 0; j < n; ++j)
      out[i * n + j] = static_cast<V>(t.mask(static_cast<int>(i), static_cast<int>(j)) ? 1 : 0);
}

//! Bytes of one request's FlashInfer full-row stream: ceil(N * (L + N) / 8).
constexpr std::size_t full_row_stream_bytes(int num_nodes, int prefix_len) noexcept {
  const auto n = static_cast<std::size_t>(num_nodes < 0 ? 0 : num_nodes);
  const auto l = static_cast<std::size_t>(prefix_len < 0 ? 0 : prefix_len);
  return (n * (l + n) + 7) / 8;
}

//! Writes the FlashInfer `MaskMode::kCustom` stream of one request: the row-major `N x (L + N)`
//! boolean matrix (prefix columns 1, then the tree mask), packed 8 bits per byte, bit b of byte
//! k = element 8k + b (`numpy.packbits(bitorder="little")`). Writes exactly
//! `full_row_stream_bytes(N, L)` bytes (unused high bits of the last byte are 0). Throws
//! `invalid_input` for L < 0 or a short buffer.
//! @return the number of bytes written
template <masked_tree T>
std::size_t write_full_row_stream(const T& t, int prefix_len, std::span<std::uint8_t> out) {
  if (prefix_len < 0) throw invalid_input("full-row stream: prefix length " + std::to_string(prefix_len) + " < 0");
  const std::size_t bytes = full_row_stream_bytes(t.num_nodes(), prefix_len);
  if (out.size() < bytes)
    throw invalid_input("full-row stream: buffer holds " + std::to_string(out.size()) + " bytes, needs " +
                        std::to_string(bytes));
  std::fill(out.begin(), out.begin() + static_cast<std::ptrdiff_t>(bytes), std::uint8_t{0});
  const auto n = static_cast<std::size_t>(t.num_nodes());
  const auto l = static_cast<std::size_t>(prefix_len);
  auto set = [&out](std::size_t e) { out[e >> 3] |= static_cast<std::uint8_t>(1u << (e & 7)); };
  std::size_t e = 0;  // element index
  for (std::size_t i = 0; i < n; ++i) {
    // prefix columns: all ones; whole bytes at once
    std::size_t c = 0;
    for (; c < l && ((e + c) & 7) != 0; ++c) set(e + c);
    if (const std::size_t full = (l - c) / 8; full > 0) {
      std::fill_n(out.begin() + static_cast<std::ptrdiff_t>((e + c) >> 3), full, std::uint8_t{0xFF});
      c += full * 8;
    }
    for (; c < l; ++c) set(e + c);
    e += l;
    // only ancestors (j <= i) can be set
    for (std::size_t j = 0; j <= i; ++j)
      if (t.mask(static_cast<int>(i), static_cast<int>(j))) set(e + j);
    e += n;
  }
  return bytes;
}

//! Batched full-row stream: request b (prefix length `prefix_lens[b]`) starts on a fresh byte at
//! `indptr[b]`; `indptr[B]` = total bytes. `indptr` needs B + 1 entries. Every request is checked
//! before anything is written: on `invalid_input` (L < 0, a short buffer) `out` and `indptr` are
//! unchanged.
//! @return the total number of bytes written
template <masked_tree T>
std::size_t write_full_row_stream_batch(const T& t, std::span<const int> prefix_lens, std::span<std::uint8_t> out,
                                        std::span<std::int64_t> indptr) {
  if (indptr.size() < prefix_lens.size() + 1)
    throw invalid_input("full-row stream: indptr holds " + std::to_string(indptr.size()) + " entries, needs " +
                        std::to_string(prefix_lens.size() + 1));
  std::size_t total = 0;
  for (std::size_t b = 0; b < prefix_lens.size(); ++b) {
    if (prefix_lens[b] < 0)
      throw invalid_input("full-row stream: request " + std::to_string(b) + ": prefix length " +
                          std::to_string(prefix_lens[b]) + " < 0");
    total += full_row_stream_bytes(t.num_nodes(), prefix_lens[b]);
  }
  if (out.size() < total)
    throw invalid_input("full-row stream: buffer holds " + std::to_string(out.size()) + " bytes, the batch needs " +
                        std::to_string(total));
  std::size_t off = 0;
  for (std::size_t b = 0; b < prefix_lens.size(); ++b) {
    indptr[b] = static_cast<std::int64_t>(off);
    off += write_full_row_stream(t, prefix_lens[b], out.subspan(off));
  }
  indptr[prefix_lens.size()] = static_cast<std::int64_t>(off);
  return off;
}

MEDUSA_NAMESPACE_END
