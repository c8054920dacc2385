// SPDX-License-Identifier: Apache-2.0
//! @file kv_cache.hpp
//! Non-owning views over an engine's KV cache and the accepted-path commit.
//!
//! Engines keep their own K/V memory. `kv_cache_view` describes it in the style of `std::mdspan`
//! (extents + layout mapping + accessor): per layer, per slot (token position), per KV head, one
//! contiguous row of `head_dim` elements. Layouts are open: any type whose `mapping` satisfies
//! `kv_layout_mapping` plugs in. Two are provided:
//!
//! * `layout_kv_strided`: contiguous caches with explicit element strides for layer, slot and
//!   head; `nhd` (`[layer][slot][head][dim]`) and `hnd` (`[layer][head][slot][dim]`) are presets.
//! * `layout_kv_paged`: a pool of fixed-size pages addressed through a block table, as in vLLM
//!   and FlashInfer; a page is `[page_size][head][dim]` (NHD) or `[head][page_size][dim]` (HND).
//!
//! After a tree pass wrote the K/V of the `N` tree nodes at slots `[L, L+N)`, `kv_commit` moves
//! the rows of the accepted nodes `nodes[0..A]` to `[L, L+A]` and returns the new length
//! `L+A+1`. Every argument is validated before any byte is written; bad input throws
//! `kv_cache_error` and leaves the cache untouched.
//!
//! @code
//! #include <medusa/kv_cache.hpp>
//! #include <vector>
//! int main() {
//!   const medusa::kv_extents ext{/*layers*/ 2, /*kv_heads*/ 2, /*head_dim*/ 4};
//!   std::vector<float> k(2 * 16 * 2 * 4), v(k.size());
//!   auto kv = medusa::make_kv_view<float>(k, v, ext, /*capacity*/ 16, medusa::kv_layout::nhd);
//!   // a tree pass of N = 9 nodes wrote slots [5, 14); the accepted path is root -> 2 -> 8
//!   const int path[] = {0, 2, 8};
//!   int length = medusa::kv_commit(kv, /*L*/ 5, /*N*/ 9, path);  // slots 5,6,7 <- 5,7,13
//!   return length == 8 ? 0 : 1;
//! }
//! @endcode
#pragma once

#include <medusa/config.hpp>
#include <medusa/error.hpp>
#include <medusa/half.hpp>
#include <medusa/tree/concepts.hpp>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <ranges>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

MEDUSA_NAMESPACE_BEGIN

//! What was wrong with a KV-cache argument.
enum class kv_errc {
  invalid_shape,          //!< non-positive extents, bad strides, buffer smaller than the mapping
  capacity_exceeded,      //!< `L + N` (or a length) beyond the view's capacity
  invalid_length,         //!< negative length, a truncation that grows the cache, or a model's own
                          //!< commit reporting a length other than `L + A + 1`
  invalid_path,           //!< accepted path empty, not starting at 0, not strictly increasing, node >= N
  path_not_in_tree,       //!< accepted path is not a root path of the given tree
  block_table_too_short,  //!< paged cache: the block table does not map the slots needed
  invalid_block,          //!< paged cache: a block-table entry outside the page pool
  size_mismatch,          //!< spans of a batch or of queries/outputs have inconsistent sizes
  pool_exhausted,         //!< the engine's page pool cannot map even one more slot of a request
};

//! The name of a `kv_errc` value, e.g. `"invalid_path"`.
[[nodiscard]] constexpr std::string_view to_string(kv_errc c) noexcept {
  switch (c) {
    case kv_errc::invalid_shape: return "invalid_shape";
    case kv_errc::capacity_exceeded: return "capacity_exceeded";
    case kv_errc::invalid_length: return "invalid_length";
    case kv_errc::invalid_path: return "invalid_path";
    case kv_errc::path_not_in_tree: return "path_not_in_tree";
    case kv_errc::block_table_too_short: return "block_table_too_short";
    case kv_errc::invalid_block: return "invalid_block";
    case kv_errc::size_mismatch: return "size_mismatch";
    case kv_errc::pool_exhausted: return "pool_exhausted";
  }
  return "unknown";
}

//! Bad KV-cache input (shape, capacity, path, block table). The cache is left unchanged.
class kv_cache_error : public coded_error<kv_errc> {
 public:
  //! @param code the error category; @param what the message; @param request index of the
  //! offending request in a batch call, -1 otherwise (the message then names it).
  kv_cache_error(kv_errc code, const std::string& what, int request = -1)
      : coded_error(code, request >= 0 ? "kv request #" + std::to_string(request) + ": " + what : what, request) {}
  //! Index of the offending request in a batch call, -1 if not a batch call.
  [[nodiscard]] int request() const noexcept { return index(); }
};

//! Order of the three row coordinates inside a contiguous cache or inside one page.
enum class kv_layout {
  nhd,  //!< `[slot][head][dim]` (vLLM flash layout, FlashInfer NHD, llama.cpp)
  hnd,  //!< `[head][slot][dim]` (HF `past_key_values`, FlashInfer HND)
};

//! Sizes shared by every layout: layers, KV heads, head dimension (elements of one row).
struct kv_extents {
  int num_layers = 0;    //!< layers held by the view
  int num_kv_heads = 0;  //!< KV heads per layer
  int head_dim = 0;      //!< elements per row; a row is contiguous (unit stride)
};

namespace detail {

[[noreturn]] inline void kv_fail(kv_errc c, const std::string& what, int request = -1) {
  throw kv_cache_error(c, what, request);
}

inline void kv_check_extents(const kv_extents& e) {
  if (e.num_layers <= 0 || e.num_kv_heads <= 0 || e.head_dim <= 0)
    kv_fail(kv_errc::invalid_shape, "kv extents must be positive, got layers=" + std::to_string(e.num_layers) +
                                        " kv_heads=" + std::to_string(e.num_kv_heads) +
                                        " head_dim=" + std::to_string(e.head_dim));
}

// Products of sizes, checked so that a huge shape is an error rather than a wrapped offset.
inline std::size_t kv_mul(std::size_t a, std::size_t b) {
  if (a != 0 && b > std::numeric_limits<std::size_t>::max() / a)
    kv_fail(kv_errc::invalid_shape, "kv cache size overflows size_t");
  return a * b;
}
inline std::size_t kv_add(std::size_t a, std::size_t b) {
  if (b > std::numeric_limits<std::size_t>::max() - a) kv_fail(kv_errc::invalid_shape, "kv cache size overflows size_t");
  return a + b;
}

}  // namespace detail

//! Layout policy of contiguous caches: element offset of row (layer, slot, head) is
//! `layer*layer_stride + slot*slot_stride + head*head_stride`.
struct layout_kv_strided {
  //! The mapping: extents, capacity (slots) and strides in elements.
  struct mapping {
    kv_extents shape{};            //!< layers, KV heads, head_dim
    int capacity = 0;              //!< slots per layer
    std::size_t layer_stride = 0;  //!< elements between layer l and l+1
    std::size_t slot_stride = 0;   //!< elements between slot s and s+1
    std::size_t head_stride = 0;   //!< elements between head h and h+1

    //! Dense `[layers][capacity][heads][dim]` (NHD) or `[layers][heads][capacity][dim]` (HND).
    static mapping dense(const kv_extents& e, int capacity, kv_layout layout) {
      detail::kv_check_extents(e);
      if (capacity < 0) detail::kv_fail(kv_errc::invalid_shape, "negative kv capacity " + std::to_string(capacity));
      const std::size_t d = static_cast<std::size_t>(e.head_dim);
      const std::size_t h = static_cast<std::size_t>(e.num_kv_heads);
      const std::size_t c = static_cast<std::size_t>(capacity);
      const std::size_t layer = detail::kv_mul(detail::kv_mul(c, h), d);
      if (layout == kv_layout::nhd) return {e, capacity, layer, h * d, d};
      return {e, capacity, layer, d, c * d};
    }
    //! Any strides (elements). Rows must not overlap each other; this is not checked.
    static mapping strided(const kv_extents& e, int capacity, std::size_t layer_stride, std::size_t slot_stride,
                           std::size_t head_stride) {
      detail::kv_check_extents(e);
      if (capacity < 0) detail::kv_fail(kv_errc::invalid_shape, "negative kv capacity " + std::to_string(capacity));
      mapping m{e, capacity, layer_stride, slot_stride, head_stride};
      (void)m.required_span_size();  // throws on overflow
      return m;
    }

    //! Elements a buffer must hold (offset of the last element + 1), 0 if the capacity is 0.
    [[nodiscard]] std::size_t required_span_size() const {
      if (capacity == 0) return 0;
      using detail::kv_add;
      using detail::kv_mul;
      std::size_t last = kv_mul(static_cast<std::size_t>(shape.num_layers - 1), layer_stride);
      last = kv_add(last, kv_mul(static_cast<std::size_t>(capacity - 1), slot_stride));
      last = kv_add(last, kv_mul(static_cast<std::size_t>(shape.num_kv_heads - 1), head_stride));
      return kv_add(last, static_cast<std::size_t>(shape.head_dim));
    }
    //! Layers, KV heads, head_dim.
    [[nodiscard]] MEDUSA_HOST_DEVICE constexpr const kv_extents& extents() const noexcept { return shape; }
    //! Slots addressable through the view.
    [[nodiscard]] MEDUSA_HOST_DEVICE constexpr int slots() const noexcept { return capacity; }
    //! Offset (elements) of the first element of row (layer, slot, head). No bounds checks.
    [[nodiscard]] MEDUSA_HOST_DEVICE constexpr std::size_t offset(int layer, int slot, int head) const noexcept {
      return static_cast<std::size_t>(layer) * layer_stride + static_cast<std::size_t>(slot) * slot_stride +
             static_cast<std::size_t>(head) * head_stride;
    }
    //! True when the heads of one slot form one contiguous run (NHD), so a slot moves in one copy.
    [[nodiscard]] MEDUSA_HOST_DEVICE constexpr bool heads_contiguous() const noexcept {
      return shape.num_kv_heads == 1 || head_stride == static_cast<std::size_t>(shape.head_dim);
    }
  };
};

//! Layout policy of paged caches: slot `s` lives in page `block_table[s / page_size]` at offset
//! `s % page_size`; element offset of row (layer, slot, head) is
//! `layer*layer_stride + page*page_stride + (s % page_size)*token_stride + head*head_stride`.
//! The block table is not owned; it must outlive the view.
struct layout_kv_paged {
  //! The mapping: extents, block table, page geometry and strides in elements.
  struct mapping {
    kv_extents shape{};                     //!< layers, KV heads, head_dim
    const std::int32_t* block_table = nullptr;  //!< logical block -> physical page
    int num_blocks = 0;                     //!< entries in `block_table` (mapped blocks)
    int page_size = 0;                      //!< slots per page
    int num_pages = 0;                      //!< pages in the pool (per layer); table entries must be below
    std::size_t layer_stride = 0;           //!< elements between layer l and l+1 of the pool
    std::size_t page_stride = 0;            //!< elements between page p and p+1
    std::size_t token_stride = 0;           //!< elements between in-page slots
    std::size_t head_stride = 0;            //!< elements between heads

    //! A pool of `num_pages` dense pages per layer, `[layers][num_pages][page...]`, each page
    //! `[page_size][heads][dim]` (NHD) or `[heads][page_size][dim]` (HND).
    static mapping dense(const kv_extents& e, int page_size, int num_pages, kv_layout page_layout,
                         std::span<const std::int32_t> block_table) {
      detail::kv_check_extents(e);
      if (page_size <= 0 || num_pages < 0)
        detail::kv_fail(kv_errc::invalid_shape, "page_size must be positive and num_pages non-negative, got page_size=" +
                                                    std::to_string(page_size) + " num_pages=" + std::to_string(num_pages));
      if (block_table.size() > static_cast<std::size_t>(std::numeric_limits<int>::max() / page_size))
        detail::kv_fail(kv_errc::invalid_shape, "block table of " + std::to_string(block_table.size()) +
                                                    " entries: capacity overflows int");
      const std::size_t d = static_cast<std::size_t>(e.head_dim);
      const std::size_t h = static_cast<std::size_t>(e.num_kv_heads);
      const std::size_t p = static_cast<std::size_t>(page_size);
      const std::size_t page = detail::kv_mul(detail::kv_mul(p, h), d);
      const std::size_t layer = detail::kv_mul(page, static_cast<std::size_t>(num_pages));
      mapping m{e, block_table.data(), static_cast<int>(block_table.size()), page_size, num_pages, layer, page, 0, 0};
      if (page_layout == kv_layout::nhd) {
        m.token_stride = h * d;
        m.head_stride = d;
      } else {
        m.token_stride = d;
        m.head_stride = p * d;
      }
      return m;
    }

    //! Elements a pool buffer must hold, 0 if there are no pages.
    [[nodiscard]] std::size_t required_span_size() const {
      if (num_pages == 0) return 0;
      using detail::kv_add;
      using detail::kv_mul;
      std::size_t last = kv_mul(static_cast<std::size_t>(shape.num_layers - 1), layer_stride);
      last = kv_add(last, kv_mul(static_cast<std::size_t>(num_pages - 1), page_stride));
      last = kv_add(last, kv_mul(static_cast<std::size_t>(page_size - 1), token_stride));
      last = kv_add(last, kv_mul(static_cast<std::size_t>(shape.num_kv_heads - 1), head_stride));
      return kv_add(last, static_cast<std::size_t>(shape.head_dim));
    }
    //! Layers, KV heads, head_dim.
    [[nodiscard]] MEDUSA_HOST_DEVICE constexpr const kv_extents& extents() const noexcept { return shape; }
    //! Slots addressable through the block table (`num_blocks * page_size`).
    [[nodiscard]] MEDUSA_HOST_DEVICE constexpr int slots() const noexcept { return num_blocks * page_size; }
    //! Offset (elements) of the first element of row (layer, slot, head). No bounds checks.
    [[nodiscard]] MEDUSA_HOST_DEVICE constexpr std::size_t offset(int layer, int slot, int head) const noexcept {
      const auto page = static_cast<std::size_t>(block_table[slot / page_size]);
      return static_cast<std::size_t>(layer) * layer_stride + page * page_stride +
             static_cast<std::size_t>(slot % page_size) * token_stride + static_cast<std::size_t>(head) * head_stride;
    }
    //! True when the heads of one slot form one contiguous run (NHD pages).
    [[nodiscard]] MEDUSA_HOST_DEVICE constexpr bool heads_contiguous() const noexcept {
      return shape.num_kv_heads == 1 || head_stride == static_cast<std::size_t>(shape.head_dim);
    }
    //! Throws `kv_cache_error` unless the block table maps slots `[begin, end)` to pages of the
    //! pool (`block_table_too_short`, `invalid_block`); `request` names the request of a batch.
    void validate_slots(int begin, int end, int request = -1) const {
      const int blocks = end / page_size + (end % page_size != 0 ? 1 : 0);
      if (blocks > num_blocks)
        detail::kv_fail(kv_errc::block_table_too_short,
                        "slots up to " + std::to_string(end) + " need " + std::to_string(blocks) + " blocks of " +
                            std::to_string(page_size) + ", the block table maps " + std::to_string(num_blocks),
                        request);
      for (int b = begin / page_size; b < blocks; ++b) {
        const std::int32_t page = block_table[b];
        if (page < 0 || page >= num_pages)
          detail::kv_fail(kv_errc::invalid_block,
                          "block table entry " + std::to_string(b) + " is page " + std::to_string(page) +
                              ", the pool has " + std::to_string(num_pages) + " pages",
                          request);
      }
    }
  };
};

//! The default accessor: plain pointers, like `std::default_accessor`.
template <class T>
struct kv_default_accessor {
  using element_type = T;                 //!< element type (may be const)
  using reference = T&;                   //!< what `access` returns
  using data_handle_type = T*;            //!< what the view stores
  using offset_policy = kv_default_accessor;  //!< accessor of an offset handle
  //! Element `i` of `p`.
  MEDUSA_HOST_DEVICE constexpr reference access(data_handle_type p, std::size_t i) const noexcept { return p[i]; }
  //! Handle to element `i` of `p`.
  MEDUSA_HOST_DEVICE constexpr data_handle_type offset(data_handle_type p, std::size_t i) const noexcept { return p + i; }
};

//! A non-owning, trivially copyable view of the K and V caches of an engine.
//!
//! @tparam T        element type: `float`, `half`, `bfloat16` (or `const` of these for read-only views)
//! @tparam Layout   a layout policy whose nested `mapping` satisfies `kv_layout_mapping`:
//!                  `layout_kv_strided` (contiguous, NHD/HND/any strides), `layout_kv_paged`, or yours
//! @tparam Accessor mdspan-style accessor; the algorithms of this header need `kv_default_accessor`
//!
//! K and V share one mapping (same shape and strides) but have their own base handles. Element
//! access is `MEDUSA_HOST_DEVICE` and unchecked, as in `std::mdspan`; the algorithms validate.
template <class T, class Layout = layout_kv_strided, class Accessor = kv_default_accessor<T>>
class kv_cache_view {
 public:
  using element_type = T;                                          //!< possibly const element type
  using value_type = std::remove_cv_t<T>;                          //!< element type without cv
  using layout_type = Layout;                                      //!< layout policy
  using mapping_type = typename Layout::mapping;                   //!< the layout's mapping
  using accessor_type = Accessor;                                  //!< accessor policy
  using data_handle_type = typename Accessor::data_handle_type;    //!< base handle type
  using reference = typename Accessor::reference;                  //!< element reference type

  //! An empty view.
  kv_cache_view() = default;
  //! A view of K at `k` and V at `v`, both laid out by `m`. No checks (device handles allowed).
  MEDUSA_HOST_DEVICE constexpr kv_cache_view(data_handle_type k, data_handle_type v, const mapping_type& m,
                                             const accessor_type& a = {}) noexcept
      : k_(k), v_(v), map_(m), acc_(a) {}

  //! Layers in the view.
  [[nodiscard]] MEDUSA_HOST_DEVICE constexpr int num_layers() const noexcept { return map_.extents().num_layers; }
  //! KV heads per layer.
  [[nodiscard]] MEDUSA_HOST_DEVICE constexpr int num_kv_heads() const noexcept { return map_.extents().num_kv_heads; }
  //! Elements per row.
  [[nodiscard]] MEDUSA_HOST_DEVICE constexpr int head_dim() const noexcept { return map_.extents().head_dim; }
  //! Addressable slots (contiguous: the capacity; paged: mapped blocks × page size).
  [[nodiscard]] MEDUSA_HOST_DEVICE constexpr int capacity() const noexcept { return map_.slots(); }
  //! The extents.
  [[nodiscard]] MEDUSA_HOST_DEVICE constexpr const kv_extents& extents() const noexcept { return map_.extents(); }
  //! The layout mapping.
  [[nodiscard]] MEDUSA_HOST_DEVICE constexpr const mapping_type& mapping() const noexcept { return map_; }
  //! The accessor.
  [[nodiscard]] MEDUSA_HOST_DEVICE constexpr const accessor_type& accessor() const noexcept { return acc_; }
  //! Base handle of the K cache.
  [[nodiscard]] MEDUSA_HOST_DEVICE constexpr data_handle_type k_data() const noexcept { return k_; }
  //! Base handle of the V cache.
  [[nodiscard]] MEDUSA_HOST_DEVICE constexpr data_handle_type v_data() const noexcept { return v_; }

  //! Element `d` of the K row (layer, slot, head).
  [[nodiscard]] MEDUSA_HOST_DEVICE constexpr reference k(int layer, int slot, int head, int d) const noexcept {
    return acc_.access(k_, map_.offset(layer, slot, head) + static_cast<std::size_t>(d));
  }
  //! Element `d` of the V row (layer, slot, head).
  [[nodiscard]] MEDUSA_HOST_DEVICE constexpr reference v(int layer, int slot, int head, int d) const noexcept {
    return acc_.access(v_, map_.offset(layer, slot, head) + static_cast<std::size_t>(d));
  }
  //! Handle to the first element of the K row (layer, slot, head); `head_dim()` contiguous elements.
  [[nodiscard]] MEDUSA_HOST_DEVICE constexpr data_handle_type k_row(int layer, int slot, int head) const noexcept {
    return acc_.offset(k_, map_.offset(layer, slot, head));
  }
  //! Handle to the first element of the V row (layer, slot, head).
  [[nodiscard]] MEDUSA_HOST_DEVICE constexpr data_handle_type v_row(int layer, int slot, int head) const noexcept {
    return acc_.offset(v_, map_.offset(layer, slot, head));
  }

 private:
  data_handle_type k_{};
  data_handle_type v_{};
  mapping_type map_{};
  [[no_unique_address]] accessor_type acc_{};
};

//! Paged view alias.
template <class T, class Accessor = kv_default_accessor<T>>
using paged_kv_cache_view = kv_cache_view<T, layout_kv_paged, Accessor>;

static_assert(std::is_trivially_copyable_v<kv_cache_view<float>>);
static_assert(std::is_trivially_copyable_v<kv_cache_view<const half>>);
static_assert(std::is_trivially_copyable_v<paged_kv_cache_view<bfloat16>>);

//! A layout mapping of a KV cache: where row (layer, slot, kv_head) starts. Required:
//! - `extents()`: the `kv_extents` (layers, KV heads, head_dim);
//! - `slots()`: the slots addressable now (the capacity, or what a block table maps);
//! - `offset(layer, slot, head)`: element offset of the row's first element; a row is `head_dim`
//!   contiguous elements.
//! Optional, detected with `requires`:
//! - `heads_contiguous()`: true when the heads of one slot are one contiguous run (the commit then
//!   moves a slot in one copy);
//! - `validate_slots(begin, end, request)`: throws `kv_cache_error` unless slots `[begin, end)`
//!   can be addressed (e.g. a block table entry outside the pool); without it the check is
//!   `end <= slots()`.
//! `layout_kv_strided::mapping` and `layout_kv_paged::mapping` are two models; an engine's own
//! layout (say `[layer][page][kv_head][slot][dim]` with its block tables) is a third.
template <class M>
concept kv_layout_mapping = std::copyable<M> && requires(const M& m, int i) {
  { m.extents() } -> std::convertible_to<kv_extents>;
  { m.slots() } -> std::convertible_to<int>;
  { m.offset(i, i, i) } -> std::convertible_to<std::size_t>;
};

//! A `kv_cache_view` the library's algorithms accept: element type `float`, `half` or `bfloat16`
//! (const for read-only views), any `kv_layout_mapping`, and the default (pointer) accessor.
template <class V>
concept kv_view = requires {
  typename V::element_type;
  typename V::mapping_type;
  typename V::accessor_type;
} && is_kv_element_v<typename V::element_type> && kv_layout_mapping<typename V::mapping_type> &&
                  std::same_as<typename V::accessor_type, kv_default_accessor<typename V::element_type>> &&
                  std::same_as<V, kv_cache_view<typename V::element_type, typename V::layout_type,
                                                typename V::accessor_type>>;

//! A `kv_view` whose elements may be written: what the commit and the decoder need (a view of
//! `const` elements is read-only: attention only).
template <class V>
concept writable_kv_view = kv_view<V> && !std::is_const_v<typename V::element_type>;

//! One writable view per layer, as engines that allocate each layer separately keep them
//! (llama.cpp, vLLM): a sized range whose elements are `writable_kv_view`s, typically one layer
//! each. The commit and the append checks accept it wherever they accept one view; the layers
//! commit together (every view is validated before any row moves).
template <class R>
concept kv_layer_views = std::ranges::sized_range<const R> && std::ranges::forward_range<const R> &&
                         writable_kv_view<std::ranges::range_value_t<const R>>;

//! What a model may hand the decoder as its cache: one view over all layers, or one per layer.
template <class C>
concept writable_kv_cache = writable_kv_view<C> || kv_layer_views<C>;

//! A contiguous view over caller buffers holding `[layers][capacity][heads][dim]` (NHD) or
//! `[layers][heads][capacity][dim]` (HND). Throws `kv_cache_error` if a buffer is too small.
template <class T>
[[nodiscard]] kv_cache_view<T> make_kv_view(std::span<T> k, std::span<T> v, const kv_extents& ext, int capacity,
                                            kv_layout layout = kv_layout::nhd) {
  const auto m = layout_kv_strided::mapping::dense(ext, capacity, layout);
  const std::size_t need = m.required_span_size();
  if (k.size() < need || v.size() < need)
    detail::kv_fail(kv_errc::invalid_shape, "kv buffers hold " + std::to_string(k.size()) + " (K) and " +
                                                std::to_string(v.size()) + " (V) elements, the layout needs " +
                                                std::to_string(need));
  return kv_cache_view<T>(k.data(), v.data(), m);
}

//! A contiguous view with an explicit mapping over caller buffers (sizes checked).
template <class T>
[[nodiscard]] kv_cache_view<T> make_kv_view(std::span<T> k, std::span<T> v, const layout_kv_strided::mapping& m) {
  const std::size_t need = m.required_span_size();
  if (k.size() < need || v.size() < need)
    detail::kv_fail(kv_errc::invalid_shape, "kv buffers hold " + std::to_string(k.size()) + " (K) and " +
                                                std::to_string(v.size()) + " (V) elements, the mapping needs " +
                                                std::to_string(need));
  return kv_cache_view<T>(k.data(), v.data(), m);
}

//! A paged view over page pools `k_pool`/`v_pool` laid out `[layers][num_pages][page...]`; the
//! number of pages is `pool size / (layers × page elements)`. `block_table` maps the request's
//! logical blocks to pool pages and must outlive the view; its entries are checked by the
//! algorithms, not here (the engine may fill the table later).
template <class T>
[[nodiscard]] paged_kv_cache_view<T> make_paged_kv_view(std::span<T> k_pool, std::span<T> v_pool, const kv_extents& ext,
                                                        int page_size, kv_layout page_layout,
                                                        std::span<const std::int32_t> block_table) {
  detail::kv_check_extents(ext);
  if (page_size <= 0) detail::kv_fail(kv_errc::invalid_shape, "page_size must be positive, got " + std::to_string(page_size));
  if (k_pool.size() != v_pool.size())
    detail::kv_fail(kv_errc::invalid_shape, "K pool holds " + std::to_string(k_pool.size()) + " elements, V pool " +
                                                std::to_string(v_pool.size()));
  const std::size_t per_page_all_layers =
      detail::kv_mul(detail::kv_mul(detail::kv_mul(static_cast<std::size_t>(page_size),
                                                   static_cast<std::size_t>(ext.num_kv_heads)),
                                    static_cast<std::size_t>(ext.head_dim)),
                     static_cast<std::size_t>(ext.num_layers));
  const std::size_t pages = k_pool.size() / per_page_all_layers;
  if (pages * per_page_all_layers != k_pool.size() || pages > static_cast<std::size_t>(std::numeric_limits<int>::max()))
    detail::kv_fail(kv_errc::invalid_shape, "pool of " + std::to_string(k_pool.size()) +
                                                " elements is not a whole number of pages of " +
                                                std::to_string(per_page_all_layers) + " elements (all layers)");
  const auto m = layout_kv_paged::mapping::dense(ext, page_size, static_cast<int>(pages), page_layout, block_table);
  return paged_kv_cache_view<T>(k_pool.data(), v_pool.data(), m);
}

// ---------------------------------------------------------------------------------------------
// Page accounting (paged caches)

//! Pages needed to hold `length` slots: `ceil(length / page_size)`.
[[nodiscard]] constexpr int kv_pages_for(int length, int page_size) {
  if (length < 0 || page_size <= 0)
    detail::kv_fail(kv_errc::invalid_length, "kv_pages_for: length " + std::to_string(length) + ", page_size " +
                                                 std::to_string(page_size));
  return length / page_size + (length % page_size != 0 ? 1 : 0);
}

//! Pages the host must map (append to the block table) before a tree pass of `num_tree_nodes`
//! at committed length `committed_length`, given `mapped_pages` already in the table.
[[nodiscard]] constexpr int kv_pages_to_map(int mapped_pages, int committed_length, int num_tree_nodes, int page_size) {
  if (mapped_pages < 0 || committed_length < 0 || num_tree_nodes < 0 ||
      committed_length > std::numeric_limits<int>::max() - num_tree_nodes)
    detail::kv_fail(kv_errc::invalid_length, "kv_pages_to_map: mapped_pages " + std::to_string(mapped_pages) +
                                                 ", L " + std::to_string(committed_length) + ", N " +
                                                 std::to_string(num_tree_nodes));
  const int need = kv_pages_for(committed_length + num_tree_nodes, page_size);
  return need > mapped_pages ? need - mapped_pages : 0;
}

//! Pages wholly beyond `new_length` that the host may release (from the end of the block table)
//! after a commit or truncation, given `mapped_pages` in the table.
[[nodiscard]] constexpr int kv_pages_releasable(int mapped_pages, int new_length, int page_size) {
  if (mapped_pages < 0) detail::kv_fail(kv_errc::invalid_length, "negative mapped_pages " + std::to_string(mapped_pages));
  const int keep = kv_pages_for(new_length, page_size);
  return mapped_pages > keep ? mapped_pages - keep : 0;
}

//! @overload for a paged view: its block-table length is the mapped page count.
template <class T, class A>
[[nodiscard]] int kv_pages_releasable(const kv_cache_view<T, layout_kv_paged, A>& kv, int new_length) {
  return kv_pages_releasable(kv.mapping().num_blocks, new_length, kv.mapping().page_size);
}

// ---------------------------------------------------------------------------------------------
// Validation

namespace detail {

// The capacity rule of appends and commits: slots up to `end` fit `capacity` slots.
inline void kv_check_capacity(int end, int capacity, int request) {
  if (end > capacity)
    kv_fail(kv_errc::capacity_exceeded,
            "slots up to " + std::to_string(end) + " needed, capacity is " + std::to_string(capacity), request);
}

// Checks that slots [begin, end) are addressable: the mapping's own check when it has one,
// else the capacity.
template <class View>
void kv_check_range(const View& kv, int begin, int end, int request) {
  const auto& m = kv.mapping();
  if constexpr (requires { m.validate_slots(begin, end, request); }) {
    m.validate_slots(begin, end, request);
  } else {
    kv_check_capacity(end, kv.capacity(), request);
  }
}

// The argument rule of an append of N rows at length L: both non-negative, L + N an int.
inline void kv_check_append_args(int L, int N) {
  if (L < 0 || N < 0)
    kv_fail(kv_errc::invalid_length, "append of " + std::to_string(N) + " rows at length " + std::to_string(L));
  if (L > std::numeric_limits<int>::max() - N) kv_fail(kv_errc::capacity_exceeded, "L + N overflows int");
}

// `kv_check_append` for a cache the caller cannot address (a model that keeps it to itself):
// the same rules against a context of `capacity` slots.
inline void kv_check_append_within(int capacity, int L, int N) {
  kv_check_append_args(L, N);
  kv_check_capacity(L + N, capacity, -1);
}

inline std::string kv_path_string(std::span<const int> path) {
  std::string s = "[";
  for (std::size_t i = 0; i < path.size() && i < 20; ++i) {
    if (i) s += ',';
    s += std::to_string(path[i]);
  }
  if (path.size() > 20) s += ",...";
  return s + "]";
}

inline void kv_check_path(int L, int N, std::span<const int> path, int request) {
  if (L < 0) kv_fail(kv_errc::invalid_length, "negative committed length " + std::to_string(L), request);
  if (N <= 0) kv_fail(kv_errc::invalid_path, "tree of " + std::to_string(N) + " nodes", request);
  if (L > std::numeric_limits<int>::max() - N)
    kv_fail(kv_errc::capacity_exceeded, "L + N overflows int", request);
  if (path.empty()) kv_fail(kv_errc::invalid_path, "empty accepted path (it must hold at least the root 0)", request);
  if (path.size() > static_cast<std::size_t>(N))
    kv_fail(kv_errc::invalid_path,
            "accepted path " + kv_path_string(path) + " is longer than the tree (" + std::to_string(N) + " nodes)",
            request);
  if (path[0] != 0)
    kv_fail(kv_errc::invalid_path, "accepted path " + kv_path_string(path) + " does not start at the root 0", request);
  for (std::size_t j = 1; j < path.size(); ++j) {
    if (path[j] >= N || path[j] < 0)
      kv_fail(kv_errc::invalid_path,
              "accepted path " + kv_path_string(path) + ": node " + std::to_string(path[j]) + " at position " +
                  std::to_string(j) + " is outside [0, " + std::to_string(N) + ")",
              request);
    if (path[j] <= path[j - 1])
      kv_fail(kv_errc::invalid_path,
              "accepted path " + kv_path_string(path) + " is not strictly increasing at position " + std::to_string(j),
              request);
  }
}

}  // namespace detail

//! Checks before a tree pass that `num_tree_nodes` rows can be appended at `committed_length`:
//! `L + N <= capacity` and, for paged views, the block table maps those slots to valid pages.
//! Throws `kv_cache_error` (`capacity_exceeded`, `block_table_too_short`, `invalid_block`).
template <kv_view View>
void kv_check_append(const View& kv, int committed_length, int num_tree_nodes) {
  detail::kv_check_append_args(committed_length, num_tree_nodes);
  detail::kv_check_range(kv, committed_length, committed_length + num_tree_nodes, -1);
}

// ---------------------------------------------------------------------------------------------
// Commit

namespace detail {

// Sequential ascending moves: safe in place because path[j] >= j and the path is strictly
// increasing, so a slot is never written before it has been read.
template <class View>
void kv_commit_unchecked(const View& kv, int L, std::span<const int> path) {
  using T = typename View::value_type;
  const int layers = kv.num_layers();
  const int heads = kv.num_kv_heads();
  const std::size_t row_bytes = static_cast<std::size_t>(kv.head_dim()) * sizeof(T);
  bool whole_slot = heads == 1;
  if constexpr (requires { kv.mapping().heads_contiguous(); }) whole_slot = kv.mapping().heads_contiguous();
  for (int layer = 0; layer < layers; ++layer) {
    for (std::size_t j = 1; j < path.size(); ++j) {
      const int src = L + path[j];
      const int dst = L + static_cast<int>(j);
      if (src == dst) continue;
      if (whole_slot) {
        std::memmove(kv.k_row(layer, dst, 0), kv.k_row(layer, src, 0), row_bytes * static_cast<std::size_t>(heads));
        std::memmove(kv.v_row(layer, dst, 0), kv.v_row(layer, src, 0), row_bytes * static_cast<std::size_t>(heads));
      } else {
        for (int h = 0; h < heads; ++h) {
          std::memmove(kv.k_row(layer, dst, h), kv.k_row(layer, src, h), row_bytes);
          std::memmove(kv.v_row(layer, dst, h), kv.v_row(layer, src, h), row_bytes);
        }
      }
    }
  }
}

template <class View>
void kv_validate_commit(const View& kv, int L, int N, std::span<const int> path, int request) {
  kv_check_path(L, N, path, request);
  kv_check_range(kv, L, L + N, request);
}

template <class Tree>
void kv_validate_tree_path(const Tree& tree, std::span<const int> path, int request) {
  for (std::size_t j = 1; j < path.size(); ++j) {
    const int p = static_cast<int>(tree.parent(path[j]));
    if (p != path[j - 1])
      kv_fail(kv_errc::path_not_in_tree,
              "accepted path " + kv_path_string(path) + " is not a root path of the tree: the parent of node " +
                  std::to_string(path[j]) + " is " + std::to_string(p) + ", not " + std::to_string(path[j - 1]),
              request);
  }
}

// `kv_commit(kv, L, tree, path)`'s checks for a cache the caller cannot address (a model that
// commits it itself): the path rule, the tree pass `[L, L + N)` within `capacity` slots (so
// `L + A + 1` too), and the path a root path of `tree`.
template <class Tree>
void kv_validate_commit_within(int capacity, int L, const Tree& tree, std::span<const int> path, int request) {
  const int n = static_cast<int>(tree.num_nodes());
  kv_check_path(L, n, path, request);
  kv_check_capacity(L + n, capacity, request);
  kv_validate_tree_path(tree, path, request);
}

}  // namespace detail

//! Commits the accepted path of one request and returns the new length `L + A + 1`.
//!
//! For every layer, KV head, K and V: `slot[L + j] <- slot[L + path[j]]` for `j = 0..A`
//! (`A = path.size() - 1`), in place.
//! @param kv               the cache (contiguous or paged)
//! @param committed_length `L`, the length before the tree pass
//! @param num_tree_nodes   `N`; the tree pass wrote slots `[L, L+N)`
//! @param path             `nodes[0..A]`: starts at 0, strictly increasing, every node `< N`
//! @throws kv_cache_error on any invalid argument, before touching memory.
template <writable_kv_view View>
int kv_commit(const View& kv, int committed_length, int num_tree_nodes, std::span<const int> path) {
  detail::kv_validate_commit(kv, committed_length, num_tree_nodes, path, -1);
  detail::kv_commit_unchecked(kv, committed_length, path);
  return committed_length + static_cast<int>(path.size());
}

//! @overload Also checks that `path` is a root path of `tree` (`N = tree.num_nodes()`).
template <writable_kv_view View, tree_topology Tree>
int kv_commit(const View& kv, int committed_length, const Tree& tree, std::span<const int> path) {
  const int n = static_cast<int>(tree.num_nodes());
  detail::kv_validate_commit(kv, committed_length, n, path, -1);
  detail::kv_validate_tree_path(tree, path, -1);
  detail::kv_commit_unchecked(kv, committed_length, path);
  return committed_length + static_cast<int>(path.size());
}

//! @overload Per-layer views: every view is validated, then each commits; returns `L + A + 1`.
//! @throws kv_cache_error `size_mismatch` on an empty range, or the first view's error.
template <kv_layer_views Layers>
int kv_commit(const Layers& layers, int committed_length, int num_tree_nodes, std::span<const int> path) {
  if (std::ranges::empty(layers)) detail::kv_fail(kv_errc::size_mismatch, "per-layer commit: no views");
  for (const auto& kv : layers) detail::kv_validate_commit(kv, committed_length, num_tree_nodes, path, -1);
  for (const auto& kv : layers) detail::kv_commit_unchecked(kv, committed_length, path);
  return committed_length + static_cast<int>(path.size());
}

//! @overload Per-layer views, and `path` must be a root path of `tree`.
template <kv_layer_views Layers, tree_topology Tree>
int kv_commit(const Layers& layers, int committed_length, const Tree& tree, std::span<const int> path) {
  detail::kv_validate_tree_path(tree, path, -1);
  return kv_commit(layers, committed_length, static_cast<int>(tree.num_nodes()), path);
}

//! @overload Per-layer views: every view must take the append.
template <kv_layer_views Layers>
void kv_check_append(const Layers& layers, int committed_length, int num_tree_nodes) {
  if (std::ranges::empty(layers)) detail::kv_fail(kv_errc::size_mismatch, "per-layer append: no views");
  for (const auto& kv : layers) kv_check_append(kv, committed_length, num_tree_nodes);
}

//! Slots a cache source can address: a view's `capacity()`, or the smallest of per-layer views'.
template <writable_kv_cache Cache>
[[nodiscard]] int kv_capacity(const Cache& cache) {
  if constexpr (writable_kv_view<Cache>) {
    return cache.capacity();
  } else {
    if (std::ranges::empty(cache)) detail::kv_fail(kv_errc::size_mismatch, "per-layer cache: no views");
    int capacity = std::numeric_limits<int>::max();
    for (const auto& kv : cache) capacity = std::min(capacity, kv.capacity());
    return capacity;
  }
}

//! One request of a batched commit.
struct kv_commit_request {
  int committed_length = 0;     //!< `L` of this request
  int num_tree_nodes = 0;       //!< `N` of this request's tree pass
  std::span<const int> path{};  //!< accepted `nodes[0..A]`
};

//! Commits a batch: request `b` uses `views[b]` (each its own contiguous slice or block table over
//! a shared pool). All requests are validated first; on any error nothing is written and the
//! `kv_cache_error` names the request (`request()`). Writes `L_b + A_b + 1` to `new_lengths[b]`.
template <writable_kv_view View>
void kv_commit_batch(std::span<const View> views, std::span<const kv_commit_request> requests,
                     std::span<int> new_lengths) {
  if (views.size() != requests.size() || new_lengths.size() != requests.size())
    detail::kv_fail(kv_errc::size_mismatch, "batch commit: " + std::to_string(views.size()) + " views, " +
                                                std::to_string(requests.size()) + " requests, " +
                                                std::to_string(new_lengths.size()) + " output lengths");
  for (std::size_t b = 0; b < requests.size(); ++b)
    detail::kv_validate_commit(views[b], requests[b].committed_length, requests[b].num_tree_nodes, requests[b].path,
                               static_cast<int>(b));
  for (std::size_t b = 0; b < requests.size(); ++b) {
    detail::kv_commit_unchecked(views[b], requests[b].committed_length, requests[b].path);
    new_lengths[b] = requests[b].committed_length + static_cast<int>(requests[b].path.size());
  }
}

//! @overload for a vector of views.
template <writable_kv_view View>
void kv_commit_batch(const std::vector<View>& views, std::span<const kv_commit_request> requests,
                     std::span<int> new_lengths) {
  kv_commit_batch(std::span<const View>(views), requests, new_lengths);
}

//! Rolls a cache back to `new_length` (e.g. dropping a rejected suffix) and returns it. Nothing
//! is moved: slots at and beyond `new_length` simply become free for the next pass. Checks
//! `0 <= new_length <= length <= capacity`; for a paged view, `kv_pages_releasable(kv, new_length)`
//! tells how many trailing pages the host may free.
template <kv_view View>
int kv_truncate(const View& kv, int length, int new_length) {
  if (length < 0 || length > kv.capacity())
    detail::kv_fail(kv_errc::invalid_length,
                    "length " + std::to_string(length) + " outside [0, " + std::to_string(kv.capacity()) + "]");
  if (new_length < 0 || new_length > length)
    detail::kv_fail(kv_errc::invalid_length, "truncation to " + std::to_string(new_length) + " from length " +
                                                 std::to_string(length) + " (must be in [0, length])");
  return new_length;
}

MEDUSA_NAMESPACE_END
