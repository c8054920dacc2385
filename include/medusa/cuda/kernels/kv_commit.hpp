// SPDX-License-Identifier: Apache-2.0
//! @file cuda/kernels/kv_commit.hpp
//! The KV-cache commit of a whole batch in one launch: after a tree pass wrote the K/V rows of
//! request `b`'s `N_b` tree nodes at slots `[L_b, L_b + N_b)`, the rows of its accepted nodes
//! `path_b[0..A_b]` move to slots `[L_b, L_b + A_b]`, for every layer, KV head, K and V, exactly
//! as `medusa::kv_commit` does on the host (bit for bit: rows are moved, never converted).
//!
//! - Batch: paths are packed (or, with `path_stride`, read straight from the verify kernels' output).
//!   Request `b`'s path is `paths[path_offsets[b] .. path_offsets[b+1])`
//!   (an exclusive prefix over the path lengths `A_b + 1`), so a batch mixing short and long
//!   accepted paths wastes nothing and path lengths are unbounded.
//! - Caches: contiguous with element strides (each request owning the slots from
//!   `slot_bases[b]` on, so one tensor serves the batch) or paged (a pool of pages and one block
//!   table row per request, a page NHD or HND), the two layouts of `kv_cache.hpp`.
//! - Grid: `block_y` walks the requests, `block_x` and the threads walk the request's *items*: one
//!   item is one vector-wide column chunk of one (layer, K or V, head) row set, ordered (layer, K/V,
//!   head, chunk) so that neighbouring threads touch neighbouring bytes. Both walks are grid-stride
//!   loops, so any launch shape gives the same result; the plan's shape gives one item per thread.
//! - Vector moves: 16 bytes when the row size, both base pointers and every stride in use allow
//!   it, else 8, 4, or 2 (`kv_commit_vector_bytes`).
//! - In place: slot `L+j` is written from `L+path[j]` with `path[j] >= j`, and a later source
//!   `path[k] > path[j] >= j` is never a slot written before it, so moving rows in ascending `j`
//!   is safe. Each thread owns its columns (no barrier) and moves them in passes of
//!   `kv_commit_rows_per_pass` rows: all loads of a pass, then all stores, which keeps that many
//!   loads in flight and stays correct because a pass's sources all lie beyond its targets. The
//!   prefix where `path[j] == j` moves nothing and is skipped.
//! - Data checks: the kernel validates each request's path, committed length, slot range and
//!   pages before moving anything; a request that fails moves nothing and gets `new_lengths[b] =
//!   -1`, the others are unaffected (a kernel cannot throw). The host-side checks of `kv_commit`
//!   (nodes below `N`) need the tree size, which the kernel does not take.
//!
//! The plan (`plan_kv_commit`) is plain C++; `cuda/kv_commit.cuh` holds the `__global__` wrapper
//! and the launcher, and the host emulation runs the same body in CI.
//!
//! @code
//! auto params = medusa::cuda::kernels::make_kv_commit_params(
//!     device_view, {.size = B, .committed_lengths = d_len, .path_offsets = d_off, .paths = d_paths,
//!                   .new_lengths = d_new_len},
//!     d_slot_bases, capacity_per_request);
//! const auto plan = medusa::cuda::kernels::plan_kv_commit(params);  // throws launch_error
//! medusa::cuda::check(medusa::cuda::run(plan, params, stream), "kv commit");
//! @endcode
#pragma once

#include <medusa/config.hpp>
#include <medusa/cuda/kernel_context.hpp>
#include <medusa/cuda/kernels/batch_kv.hpp>
#include <medusa/cuda/launch.hpp>
#include <medusa/kv_cache.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

MEDUSA_NAMESPACE_BEGIN
namespace cuda {
namespace kernels {

//! Rows one thread loads before it stores them (registers: 16 bytes each at the widest).
inline constexpr int kv_commit_rows_per_pass = 8;

//! Threads per block of the planned launch (fewer for tiny caches).
inline constexpr int kv_commit_max_threads = 128;

//! Where the rows of a request live (the layouts of `batch_kv`).
using kv_commit_layout = batch_kv_layout;

//! The requests of one commit, all in device memory (host memory for the emulation). Every array
//! is read only, except `new_lengths`, which must not alias `committed_lengths` (other blocks
//! still read it).
struct kv_commit_batch {
  int size = 0;                                  //!< B, requests in the batch
  const std::int32_t* committed_lengths = nullptr;  //!< [B] `L_b`, the length before the tree pass
  const std::int32_t* path_offsets = nullptr;    //!< [B+1] request b's path is `paths[off[b] .. off[b+1])`
  const std::int32_t* paths = nullptr;           //!< packed accepted paths: `0 = p_0 < p_1 < ... < p_A`
  std::int32_t* new_lengths = nullptr;           //!< [B] out, optional: `L_b + A_b + 1`, or -1 if rejected
  //! > 0: the paths are the verify kernels' output instead (`verify_args::path_nodes`): request b's
  //! path is `paths[b·path_stride ..]` with `accept_lengths[b] + 1` entries, and `path_offsets` is
  //! unused. This lets a step chain verify and commit on the device without a host round trip.
  int path_stride = 0;
  const std::int32_t* accept_lengths = nullptr;  //!< [B] A_b, with `path_stride` (`verify_args::accept_length`)
};

//! Arguments of one commit: the cache geometry (`batch_kv`: pools, strides, slot ranges or block
//! tables) and the batch of paths.
struct kv_commit_params : batch_kv {
  kv_commit_batch batch;  //!< the requests and their paths
};

//! Launch shape of a commit (see `plan_kv_commit`).
struct kv_commit_plan {
  launch_shape shape;               //!< grid (item blocks per request, requests), no shared memory
  std::size_t workspace_bytes = 0;  //!< always 0: the commit needs no scratch memory
  int vector_bytes = 0;             //!< bytes per move for the planned pointers and strides
  int items_per_request = 0;        //!< layers × 2 × heads × row bytes / vector_bytes
};

namespace detail {

// The OR of everything a move's address is a multiple of or a sum of: row size, base addresses,
// and the byte strides in use (a stride along an axis of extent 1 never multiplies anything). Its
// lowest set bit is the alignment every move of the launch can count on.
MEDUSA_HOST_DEVICE inline std::uint64_t kv_commit_offset_bits(const kv_commit_params& p) noexcept {
  const auto eb = static_cast<std::uint64_t>(p.element_bytes);
  std::uint64_t bits = static_cast<std::uint64_t>(p.shape.head_dim) * eb;
  bits |= static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(p.k));
  bits |= static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(p.v));
  if (p.shape.num_layers > 1) bits |= p.layer_stride * eb;
  if (p.shape.num_kv_heads > 1) bits |= p.head_stride * eb;
  if (p.layout == kv_commit_layout::paged) {
    if (p.num_pages > 1) bits |= p.page_stride * eb;
    if (p.page_size > 1) bits |= p.token_stride * eb;
  } else {
    bits |= p.slot_stride * eb;
  }
  return bits;
}

}  // namespace detail

//! Bytes per move: the widest of 16, 8, 4, 2 that divides the row size, the addresses of `k` and
//! `v` and every stride in use (times the element size); at least `element_bytes`.
MEDUSA_HOST_DEVICE inline int kv_commit_vector_bytes(const kv_commit_params& p) noexcept {
  const std::uint64_t bits = detail::kv_commit_offset_bits(p);
  int bytes = 16;
  while (bytes > p.element_bytes && bytes > 2 && (bits & static_cast<std::uint64_t>(bytes - 1)) != 0) bytes /= 2;
  return bytes;
}

namespace detail {

[[noreturn]] inline void kv_commit_fail(launch_errc code, const std::string& what) {
  throw launch_error(code, "kv commit: " + what);
}

// Checks the geometry of `p` (not the pointers nor the data): sizes, strides, and that no byte
// offset of a row overflows size_t.
inline void kv_commit_check_geometry(const kv_commit_params& p) {
  if (p.batch.size < 1) kv_commit_fail(launch_errc::invalid_shape, "batch of " + std::to_string(p.batch.size) + " requests");
  check_batch_kv(p, "kv commit");
  const kv_extents& e = p.shape;
  const std::int64_t items = std::int64_t{e.num_layers} * 2 * e.num_kv_heads * e.head_dim;
  if (items > std::numeric_limits<int>::max() / 2)  // the item loops stay in int, one grid stride beyond the last item included
    kv_commit_fail(launch_errc::invalid_shape, "layers x 2 x kv_heads x head_dim = " + std::to_string(items) +
                                                   " columns exceed " + std::to_string(std::numeric_limits<int>::max() / 2));
}

}  // namespace detail

//! Validates the geometry of `p` and picks the launch shape: 32 to `kv_commit_max_threads`
//! threads, enough blocks along x for one item per thread, one block row per request (at most
//! 65535; the kernel strides over the rest). Pointers may still be null here (`run` checks them);
//! when set, `k` and `v` must be aligned to the element size. Path data are checked by the kernel.
//! @throws launch_error `invalid_shape` (batch < 1, non-positive extents or page geometry, a
//!         stride that makes rows overlap, offsets that overflow, misaligned `k`/`v`),
//!         `unsupported` (an element size other than 2 or 4 bytes).
[[nodiscard]] inline kv_commit_plan plan_kv_commit(const kv_commit_params& p) {
  detail::kv_commit_check_geometry(p);
  const auto misaligned = [&](const void* ptr) {
    return (reinterpret_cast<std::uintptr_t>(ptr) % static_cast<std::uintptr_t>(p.element_bytes)) != 0;
  };
  if (misaligned(p.k) || misaligned(p.v))
    detail::kv_commit_fail(launch_errc::invalid_shape,
                           "k and v must be aligned to the element size of " + std::to_string(p.element_bytes) + " bytes");
  kv_commit_plan plan;
  plan.vector_bytes = kv_commit_vector_bytes(p);
  const int chunks_per_row = p.shape.head_dim * p.element_bytes / plan.vector_bytes;
  plan.items_per_request = p.shape.num_layers * 2 * p.shape.num_kv_heads * chunks_per_row;
  const int threads = std::clamp((plan.items_per_request + warp_size - 1) / warp_size * warp_size, warp_size,
                                 kv_commit_max_threads);
  plan.shape = {.grid_x = (plan.items_per_request + threads - 1) / threads,
                .grid_y = std::min(p.batch.size, 65535),
                .threads = threads,
                .shared_bytes = 0};
  return plan;
}

namespace detail {

// VecBytes raw bytes moved as one access: aligned to their size.
template <int VecBytes>
struct alignas(VecBytes) kv_commit_chunk {
  using word = std::conditional_t<(VecBytes < 4), std::uint16_t, std::uint32_t>;
  word words[VecBytes / sizeof(word)];
};

// Whether request b's data allow the commit: a path `0 = p_0 < ... < p_A` whose slots
// `L + p_j` lie in the request's range (so `L + A + 1` fits), a non-negative slot base, and pages
// inside the pool for every slot a move reads or writes. Every thread computes the same answer.
MEDUSA_KERNEL_FN bool kv_commit_request_ok(const kv_commit_params& p, int b, int committed, int first,
                                           int length) noexcept {
  const int capacity = batch_kv_capacity(p);
  if (first < 0 || length < 1 || committed < 0 || committed >= capacity) return false;
  const std::int32_t* path = p.batch.paths + first;
  if (path[0] != 0) return false;
  if (p.layout == kv_commit_layout::strided && p.slot_bases != nullptr && p.slot_bases[b] < 0) return false;
  const auto page_ok = [&](int slot) {
    const std::int32_t page = batch_kv_page(p, b, slot);
    return page >= 0 && page < p.num_pages;
  };
  for (int j = 1; j < length; ++j) {
    const int node = path[j];
    if (node <= path[j - 1] || node >= capacity - committed) return false;
    if (p.layout == kv_commit_layout::paged && node != j && (!page_ok(committed + j) || !page_ok(committed + node)))
      return false;
  }
  return true;
}

}  // namespace detail

//! The commit body with moves of `VecBytes` bytes; `VecBytes` must divide
//! `kv_commit_vector_bytes(p)` and be at least `element_bytes`. Launchers that pick the width on
//! the host call this; `kv_commit` picks it per thread.
template <int VecBytes, class Ctx>
MEDUSA_KERNEL_FN void kv_commit_with_width(Ctx& ctx, const kv_commit_params& p) {
  static_assert(VecBytes == 2 || VecBytes == 4 || VecBytes == 8 || VecBytes == 16, "moves of 2, 4, 8 or 16 bytes");
  constexpr int rows_per_pass = kv_commit_rows_per_pass;
  const int chunks_per_row = p.shape.head_dim * p.element_bytes / VecBytes;
  const int row_sets = p.shape.num_layers * 2 * p.shape.num_kv_heads;
  const int items = row_sets * chunks_per_row;
  const int first_item = ctx.block_x() * ctx.threads() + ctx.thread();
  const int item_step = ctx.grid_x() * ctx.threads();
  auto* const k = static_cast<unsigned char*>(p.k);
  auto* const v = static_cast<unsigned char*>(p.v);
  const auto eb = static_cast<std::size_t>(p.element_bytes);
  for (int b = ctx.block_y(); b < p.batch.size; b += ctx.grid_y()) {
    const int committed = p.batch.committed_lengths[b];
    const bool strided_paths = p.batch.path_stride > 0;
    const int first = strided_paths ? b * p.batch.path_stride : p.batch.path_offsets[b];
    const int length = strided_paths ? p.batch.accept_lengths[b] + 1 : p.batch.path_offsets[b + 1] - first;
    const bool ok = (!strided_paths || length <= p.batch.path_stride) &&
                    detail::kv_commit_request_ok(p, b, committed, first, length);
    if (p.batch.new_lengths != nullptr && first_item == 0) p.batch.new_lengths[b] = ok ? committed + length : -1;
    if (!ok || first_item >= items) continue;
    const std::int32_t* path = p.batch.paths + first;
    int first_move = 1;  // path[j] == j moves nothing, and only a prefix can have it
    while (first_move < length && path[first_move] == first_move) ++first_move;
    for (int item = first_item; item < items; item += item_step) {
      const int chunk = item % chunks_per_row;
      int rest = item / chunks_per_row;
      const int head = rest % p.shape.num_kv_heads;
      rest /= p.shape.num_kv_heads;
      unsigned char* const column =
          ((rest & 1) != 0 ? v : k) +
          (static_cast<std::size_t>(rest >> 1) * p.layer_stride + static_cast<std::size_t>(head) * p.head_stride) * eb +
          static_cast<std::size_t>(chunk) * VecBytes;
      for (int pass = first_move; pass < length; pass += rows_per_pass) {
        detail::kv_commit_chunk<VecBytes> rows[rows_per_pass]{};
        MEDUSA_UNROLL
        for (int r = 0; r < rows_per_pass; ++r)
          if (pass + r < length)
            rows[r] = load_aligned<detail::kv_commit_chunk<VecBytes>>(column + batch_kv_slot_offset(p, b, committed + path[pass + r]) * eb);
        // Targets are computed before the first store: the reads they need (block table) cannot
        // then be held up behind stores the compiler must assume they alias.
        std::size_t target[rows_per_pass];
        MEDUSA_UNROLL
        for (int r = 0; r < rows_per_pass; ++r)
          target[r] = pass + r < length ? batch_kv_slot_offset(p, b, committed + pass + r) * eb : 0;
        MEDUSA_UNROLL
        for (int r = 0; r < rows_per_pass; ++r)
          if (pass + r < length) store_aligned(column + target[r], rows[r]);
      }
    }
  }
}

//! The commit body: for every request `b` of the batch whose data pass the checks, and every
//! layer, KV head, K and V: `slot[L_b + j] <- slot[L_b + path_b[j]]`, `j = 1..A_b`, in place.
//! Writes `new_lengths[b]` when given. Any launch shape is correct; `plan_kv_commit`'s is the
//! intended one. Moves are as wide as `kv_commit_vector_bytes(p)`.
template <class Ctx>
MEDUSA_KERNEL_FN void kv_commit(Ctx& ctx, const kv_commit_params& p) {
  switch (kv_commit_vector_bytes(p)) {
    case 16: kv_commit_with_width<16>(ctx, p); break;
    case 8: kv_commit_with_width<8>(ctx, p); break;
    case 4: kv_commit_with_width<4>(ctx, p); break;
    default: kv_commit_with_width<2>(ctx, p); break;
  }
}

//! Params for a contiguous cache described by a `kv_cache_view` whose handles are device
//! pointers (host pointers for the emulation). Request `b` owns slots
//! `[slot_bases[b], slot_bases[b] + slots_per_request)` of the view; `slot_bases` is a device
//! array, or nullptr for a single request at slot 0; `slots_per_request` 0 means the view's
//! capacity.
template <class T>
  requires(!std::is_const_v<T> && is_kv_element_v<T>)
[[nodiscard]] kv_commit_params make_kv_commit_params(const kv_cache_view<T, layout_kv_strided>& cache,
                                                     const kv_commit_batch& batch,
                                                     const std::int32_t* slot_bases = nullptr,
                                                     int slots_per_request = 0) {
  kv_commit_params p;
  static_cast<batch_kv&>(p) = make_batch_kv(cache, slot_bases, slots_per_request);
  p.batch = batch;
  return p;
}

//! Params for a paged cache: the view supplies the page pools (device pointers) and the page
//! geometry; `block_tables` is the batch's device table `[B][blocks_per_request]`. With
//! `block_tables` nullptr, the view's own block table is used (one request, `num_blocks` entries).
template <class T>
  requires(!std::is_const_v<T> && is_kv_element_v<T>)
[[nodiscard]] kv_commit_params make_kv_commit_params(const kv_cache_view<T, layout_kv_paged>& cache,
                                                     const kv_commit_batch& batch,
                                                     const std::int32_t* block_tables = nullptr,
                                                     int blocks_per_request = 0) {
  kv_commit_params p;
  static_cast<batch_kv&>(p) = make_batch_kv(cache, block_tables, blocks_per_request);
  p.batch = batch;
  return p;
}

}  // namespace kernels
}  // namespace cuda
MEDUSA_NAMESPACE_END
