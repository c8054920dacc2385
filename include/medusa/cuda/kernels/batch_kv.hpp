// SPDX-License-Identifier: Apache-2.0
//! @file cuda/kernels/batch_kv.hpp
//! The KV cache of a batch of requests as device kernels address it: one K and one V tensor (or
//! page pool) shared by the batch, each request owning a slot range of a contiguous cache or a
//! block-table row of a paged one. The KV commit (`kv_commit.hpp`) and tree attention
//! (`attention.hpp`) take this geometry; `make_batch_kv` builds it from a `kv_cache_view` whose
//! handles are device pointers (host pointers for the emulation).
//!
//! Strides are in elements and pointers address the element at offset 0 (slot 0 of request 0, or
//! page 0 of the pool). Row (layer, slot, head) of request b starts at
//! - contiguous: `layer·layer_stride + (slot_bases[b] + slot)·slot_stride + head·head_stride`;
//! - paged: `layer·layer_stride + page·page_stride + (slot mod page_size)·token_stride + head·head_stride`
//!   with `page = block_tables[b·blocks_per_request + slot / page_size]`.
//!
//! @code
//! namespace mk = medusa::cuda::kernels;
//! // a paged pool of device memory, one block-table row of `blocks` entries per request
//! const mk::batch_kv kv = mk::make_batch_kv(device_paged_view, d_block_tables, blocks);
//! mk::check_batch_kv(kv, "attention");   // throws launch_error on a bad geometry
//! @endcode
#pragma once

#include <medusa/config.hpp>
#include <medusa/cuda/kernel_context.hpp>
#include <medusa/cuda/launch.hpp>
#include <medusa/kv_cache.hpp>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

MEDUSA_NAMESPACE_BEGIN
namespace cuda {
namespace kernels {

//! Where the rows of a request live.
enum class batch_kv_layout : std::int32_t {
  strided,  //!< contiguous: `layer·layer_stride + (slot_bases[b] + slot)·slot_stride + head·head_stride`
  paged,    //!< paged: `layer·layer_stride + page·page_stride + (slot mod page_size)·token_stride + head·head_stride`
};

//! The KV cache of a batch (see the file comment). Trivially copyable: kernels take it by value.
struct batch_kv {
  void* k = nullptr;             //!< K cache or K page pool
  void* v = nullptr;             //!< V cache or V page pool (same geometry as K)
  int element_bytes = 0;         //!< 2 (f16, bf16) or 4 (f32)
  kv_extents shape{};            //!< layers, KV heads, head_dim (elements of one contiguous row)
  std::size_t layer_stride = 0;  //!< elements between layer l and l+1
  std::size_t head_stride = 0;   //!< elements between KV head h and h+1
  batch_kv_layout layout = batch_kv_layout::strided;  //!< which of the fields below apply

  // contiguous (`batch_kv_layout::strided`)
  std::size_t slot_stride = 0;               //!< elements between slot s and s+1
  int slots_per_request = 0;                 //!< capacity of each request's slot range
  const std::int32_t* slot_bases = nullptr;  //!< [B] first slot of each request's range; nullptr: all 0

  // paged (`batch_kv_layout::paged`)
  std::size_t page_stride = 0;                 //!< elements between page p and p+1 of the pool
  std::size_t token_stride = 0;                //!< elements between in-page slots
  int page_size = 0;                           //!< slots per page
  int num_pages = 0;                           //!< pages in the pool (per layer); table entries are below
  int blocks_per_request = 0;                  //!< block-table entries per request (row length)
  const std::int32_t* block_tables = nullptr;  //!< [B][blocks_per_request] logical block -> page
};

//! Slots each request can address: its slot range, or its block-table row.
MEDUSA_HOST_DEVICE constexpr int batch_kv_capacity(const batch_kv& p) noexcept {
  return p.layout == batch_kv_layout::paged ? p.blocks_per_request * p.page_size : p.slots_per_request;
}

//! The page holding `slot` of request b (unchecked).
MEDUSA_KERNEL_FN std::int32_t batch_kv_page(const batch_kv& p, int b, int slot) noexcept {
  return p.block_tables[static_cast<std::size_t>(b) * static_cast<std::size_t>(p.blocks_per_request) +
                        static_cast<std::size_t>(slot / p.page_size)];
}

//! Whether `slot` of request b is backed by a page of the pool (always true for contiguous caches
//! whose slot base is not negative). Kernels test it before they read or write a row.
MEDUSA_KERNEL_FN bool batch_kv_slot_ok(const batch_kv& p, int b, int slot) noexcept {
  if (slot < 0 || slot >= batch_kv_capacity(p)) return false;
  if (p.layout == batch_kv_layout::paged) {
    const std::int32_t page = batch_kv_page(p, b, slot);
    return page >= 0 && page < p.num_pages;
  }
  return p.slot_bases == nullptr || p.slot_bases[b] >= 0;
}

//! Element offset of slot `slot` of request b, head 0 of layer 0 (the slot's share of a row offset).
MEDUSA_KERNEL_FN std::size_t batch_kv_slot_offset(const batch_kv& p, int b, int slot) noexcept {
  if (p.layout == batch_kv_layout::paged) {
    const auto page = static_cast<std::size_t>(batch_kv_page(p, b, slot));
    return page * p.page_stride + static_cast<std::size_t>(slot % p.page_size) * p.token_stride;
  }
  const std::size_t base = p.slot_bases == nullptr ? 0 : static_cast<std::size_t>(p.slot_bases[b]);
  return (base + static_cast<std::size_t>(slot)) * p.slot_stride;
}

//! Element offset of row (layer, slot, head) of request b (unchecked).
MEDUSA_KERNEL_FN std::size_t batch_kv_row_offset(const batch_kv& p, int b, int layer, int slot, int head) noexcept {
  return static_cast<std::size_t>(layer) * p.layer_stride + batch_kv_slot_offset(p, b, slot) +
         static_cast<std::size_t>(head) * p.head_stride;
}

namespace detail {

[[noreturn]] inline void batch_kv_fail(const char* who, launch_errc code, const std::string& what) {
  throw launch_error(code, std::string(who) + ": " + what);
}

// a*b + c in size_t, false on overflow.
inline bool batch_kv_mul_add(std::size_t a, std::size_t b, std::size_t c, std::size_t& out) noexcept {
  if (a != 0 && b > (std::numeric_limits<std::size_t>::max() - c) / a) return false;
  out = a * b + c;
  return true;
}

// An axis of `extent` indices with `stride`: rows along it must not overlap, and the last one
// must be addressable.
inline void batch_kv_check_axis(const char* who, const char* name, std::size_t stride, int extent, int head_dim,
                                std::size_t& span) {
  if (extent > 1 && stride < static_cast<std::size_t>(head_dim))
    batch_kv_fail(who, launch_errc::invalid_shape,
                  std::string(name) + " stride " + std::to_string(stride) + " is below head_dim " +
                      std::to_string(head_dim) + ": rows would overlap");
  if (!batch_kv_mul_add(stride, static_cast<std::size_t>(extent - 1), span, span))
    batch_kv_fail(who, launch_errc::invalid_shape, "cache offsets overflow size_t");
}

}  // namespace detail

//! Checks the geometry of `p` (not the pointers nor the data): element size, extents, strides,
//! and that no byte offset of a row overflows size_t. `who` prefixes the message ("kv commit").
//! @throws launch_error `invalid_shape`, or `unsupported` for an element size other than 2 or 4.
inline void check_batch_kv(const batch_kv& p, const char* who) {
  using detail::batch_kv_fail;
  if (p.element_bytes != 2 && p.element_bytes != 4) {
    batch_kv_fail(who, p.element_bytes > 0 ? launch_errc::unsupported : launch_errc::invalid_shape,
                  "element size of " + std::to_string(p.element_bytes) + " bytes (2 or 4 are supported)");
  }
  const kv_extents& e = p.shape;
  if (e.num_layers <= 0 || e.num_kv_heads <= 0 || e.head_dim <= 0)
    batch_kv_fail(who, launch_errc::invalid_shape,
                  "extents must be positive, got layers=" + std::to_string(e.num_layers) +
                      " kv_heads=" + std::to_string(e.num_kv_heads) + " head_dim=" + std::to_string(e.head_dim));
  std::size_t span = static_cast<std::size_t>(e.head_dim);
  detail::batch_kv_check_axis(who, "layer", p.layer_stride, e.num_layers, e.head_dim, span);
  detail::batch_kv_check_axis(who, "head", p.head_stride, e.num_kv_heads, e.head_dim, span);
  const int int_max = std::numeric_limits<int>::max();
  if (p.layout == batch_kv_layout::paged) {
    if (p.page_size <= 0 || p.num_pages <= 0 || p.blocks_per_request <= 0)
      batch_kv_fail(who, launch_errc::invalid_shape,
                    "page_size, num_pages and blocks_per_request must be positive, got " + std::to_string(p.page_size) +
                        ", " + std::to_string(p.num_pages) + ", " + std::to_string(p.blocks_per_request));
    if (p.blocks_per_request > int_max / p.page_size)
      batch_kv_fail(who, launch_errc::invalid_shape,
                    std::to_string(p.blocks_per_request) + " blocks of " + std::to_string(p.page_size) +
                        " slots overflow int");
    detail::batch_kv_check_axis(who, "page", p.page_stride, p.num_pages, e.head_dim, span);
    detail::batch_kv_check_axis(who, "token", p.token_stride, p.page_size, e.head_dim, span);
  } else if (p.layout == batch_kv_layout::strided) {
    if (p.slots_per_request <= 0)
      batch_kv_fail(who, launch_errc::invalid_shape,
                    "slots_per_request must be positive, got " + std::to_string(p.slots_per_request));
    detail::batch_kv_check_axis(who, "slot", p.slot_stride, p.slots_per_request, e.head_dim, span);
  } else {
    batch_kv_fail(who, launch_errc::invalid_shape, "unknown layout " + std::to_string(static_cast<int>(p.layout)));
  }
  if (!detail::batch_kv_mul_add(span, static_cast<std::size_t>(p.element_bytes), 0, span))
    batch_kv_fail(who, launch_errc::invalid_shape, "cache offsets overflow size_t");
}

namespace detail {
// The fields every layout shares: pools, element size, extents, layer and head strides.
template <class View>
batch_kv batch_kv_of(const View& cache) {
  const auto& m = cache.mapping();
  batch_kv p;
  p.k = const_cast<void*>(static_cast<const void*>(cache.k_data()));
  p.v = const_cast<void*>(static_cast<const void*>(cache.v_data()));
  p.element_bytes = static_cast<int>(sizeof(typename View::element_type));
  p.shape = m.shape;
  p.layer_stride = m.layer_stride;
  p.head_stride = m.head_stride;
  return p;
}
}  // namespace detail

//! The geometry of a contiguous cache described by a `kv_cache_view` whose handles are device
//! pointers (host pointers for the emulation). Request `b` owns slots
//! `[slot_bases[b], slot_bases[b] + slots_per_request)` of the view; `slot_bases` is a device
//! array, or nullptr for a single request at slot 0; `slots_per_request` 0 means the view's
//! capacity.
template <class T>
  requires is_kv_element_v<std::remove_const_t<T>>
[[nodiscard]] batch_kv make_batch_kv(const kv_cache_view<T, layout_kv_strided>& cache,
                                     const std::int32_t* slot_bases = nullptr, int slots_per_request = 0) {
  const auto& m = cache.mapping();
  batch_kv p = detail::batch_kv_of(cache);
  p.layout = batch_kv_layout::strided;
  p.slot_stride = m.slot_stride;
  p.slots_per_request = slots_per_request > 0 ? slots_per_request : m.capacity;
  p.slot_bases = slot_bases;
  return p;
}

//! The geometry of a paged cache: the view supplies the page pools (device pointers) and the page
//! geometry; `block_tables` is the batch's device table `[B][blocks_per_request]`. With
//! `block_tables` nullptr, the view's own block table is used (one request, `num_blocks` entries).
template <class T>
  requires is_kv_element_v<std::remove_const_t<T>>
[[nodiscard]] batch_kv make_batch_kv(const kv_cache_view<T, layout_kv_paged>& cache,
                                     const std::int32_t* block_tables = nullptr, int blocks_per_request = 0) {
  const auto& m = cache.mapping();
  batch_kv p = detail::batch_kv_of(cache);
  p.layout = batch_kv_layout::paged;
  p.page_stride = m.page_stride;
  p.token_stride = m.token_stride;
  p.page_size = m.page_size;
  p.num_pages = m.num_pages;
  p.block_tables = block_tables != nullptr ? block_tables : m.block_table;
  p.blocks_per_request = block_tables != nullptr ? blocks_per_request : m.num_blocks;
  return p;
}

}  // namespace kernels
}  // namespace cuda
MEDUSA_NAMESPACE_END
