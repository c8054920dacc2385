// SPDX-License-Identifier: Apache-2.0
//! @file cuda/kernels/top_k.hpp
//! Per-row top-k over the vocabulary (k ≤ 16), for the heads' candidates (B × H rows) and, with
//! k = 1, the argmax of every tree node's row in greedy verification.
//!
//! Ranking as on the CPU (`medusa::top_k`): larger logit first, equal logits by ascending id.
//! Two stages, as TensorRT-LLM's and FlashInfer's samplers: stage 1 splits each row over
//! `splits` blocks (enough blocks to fill the GPU when there are few rows); each thread keeps its
//! K best in registers while it streams its slice, then the block merges the per-thread lists
//! with warp butterflies (bitonic merges of two sorted lists, all indices static so the lists stay
//! in registers). Stage 2 merges the `splits` lists of a row. With one split, stage 1 writes the
//! result and stage 2 is skipped. -Inf is a masked token and ranks last; a NaN or +Inf in a row, or
//! a row with every token masked, sets the request's `request_status`.
#pragma once

#include <medusa/config.hpp>
#include <medusa/cuda/kernel_context.hpp>
#include <medusa/cuda/launch.hpp>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

MEDUSA_NAMESPACE_BEGIN
namespace cuda {
namespace kernels {

//! Most threads of a top-k block (the launchers' `__launch_bounds__`).
inline constexpr int top_k_threads_max = 256;

//! Candidate ranking: larger value first, equal values by ascending id.
MEDUSA_KERNEL_FN bool ranks_before(float a, int ia, float b, int ib) noexcept {
  return a > b || (a == b && ia < ib);
}

//! The K best (value, id) pairs seen so far, best first; empty slots are (-inf, INT_MAX).
template <int K>
struct top_list {
  float v[K];
  int id[K];

  MEDUSA_KERNEL_FN void clear() noexcept {
    MEDUSA_UNROLL
    for (int j = 0; j < K; ++j) {
      v[j] = -__builtin_inff();
      id[j] = INT_MAX;
    }
  }

  //! Inserts (x, i) if it ranks before the K-th: replace the last slot, then bubble up.
  MEDUSA_KERNEL_FN void insert(float x, int i) noexcept {
    if (!ranks_before(x, i, v[K - 1], id[K - 1])) return;
    v[K - 1] = x;
    id[K - 1] = i;
    MEDUSA_UNROLL
    for (int j = K - 1; j > 0; --j) {
      if (ranks_before(v[j], id[j], v[j - 1], id[j - 1])) {
        const float tv = v[j];
        v[j] = v[j - 1];
        v[j - 1] = tv;
        const int ti = id[j];
        id[j] = id[j - 1];
        id[j - 1] = ti;
      }
    }
  }

  //! Keeps the K best of this list and `o` (both sorted best first). The element-wise best of
  //! this list and `o` reversed is bitonic and holds the K best; a bitonic merge sorts it.
  MEDUSA_KERNEL_FN void merge(const top_list& o) noexcept {
    MEDUSA_UNROLL
    for (int j = 0; j < K; ++j) {
      if (ranks_before(o.v[K - 1 - j], o.id[K - 1 - j], v[j], id[j])) {
        v[j] = o.v[K - 1 - j];
        id[j] = o.id[K - 1 - j];
      }
    }
    MEDUSA_UNROLL
    for (int stride = K / 2; stride > 0; stride /= 2) {
      MEDUSA_UNROLL
      for (int j = 0; j < K; ++j) {
        if ((j & stride) == 0 && ranks_before(v[j + stride], id[j + stride], v[j], id[j])) {
          const float tv = v[j];
          v[j] = v[j + stride];
          v[j + stride] = tv;
          const int ti = id[j];
          id[j] = id[j + stride];
          id[j + stride] = ti;
        }
      }
    }
  }
};

//! Butterfly merge over the warp: every lane ends with the warp's K best.
template <int K, class Ctx>
MEDUSA_KERNEL_FN void warp_merge(Ctx& ctx, top_list<K>& l) {
  for (int m = warp_size / 2; m > 0; m /= 2) {
    top_list<K> o;
    MEDUSA_UNROLL
    for (int j = 0; j < K; ++j) {
      o.v[j] = ctx.shfl_xor(l.v[j], m);
      o.id[j] = ctx.shfl_xor(l.id[j], m);
    }
    l.merge(o);
  }
}

//! Shared bytes `block_merge<K>` needs.
constexpr std::size_t block_merge_shared_bytes(int k_bucket) noexcept {
  return static_cast<std::size_t>(warp_size) * static_cast<std::size_t>(k_bucket) * 8;
}

//! Merges the lists of the whole block; the lanes of warp 0 end with the block's K best.
//! Every thread must call it; shared memory is free again on return.
template <int K, class Ctx>
MEDUSA_KERNEL_FN void block_merge(Ctx& ctx, top_list<K>& l) {
  warp_merge(ctx, l);
  const int warps = ctx.threads() / warp_size;
  if (warps == 1) return;
  float* sv = static_cast<float*>(ctx.shared());
  int* si = reinterpret_cast<int*>(sv + warp_size * K);
  if (ctx.lane() == 0) {
    MEDUSA_UNROLL
    for (int j = 0; j < K; ++j) {
      sv[ctx.warp() * K + j] = l.v[j];
      si[ctx.warp() * K + j] = l.id[j];
    }
  }
  ctx.sync();
  if (ctx.warp() == 0) {
    if (ctx.lane() < warps) {
      MEDUSA_UNROLL
      for (int j = 0; j < K; ++j) {
        l.v[j] = sv[ctx.lane() * K + j];
        l.id[j] = si[ctx.lane() * K + j];
      }
    } else {
      l.clear();
    }
    warp_merge(ctx, l);
  }
  ctx.sync();
}

//! Writes the first `k` entries of `l` (ids, and values when `values` is not null).
template <int K>
MEDUSA_KERNEL_FN void write_list(const top_list<K>& l, int k, std::int32_t* ids, float* values) {
  MEDUSA_UNROLL
  for (int j = 0; j < K; ++j) {
    if (j < k) {
      ids[j] = l.id[j];
      if (values != nullptr) values[j] = l.v[j];
    }
  }
}

//! Arguments of the top-k kernels; `T` is float, `medusa::half` or `medusa::bfloat16`.
template <class T>
struct top_k_args {
  const T* logits = nullptr;       //!< row r starts at `logits + r * row_stride`
  std::int64_t row_stride = 0;     //!< elements between rows (≥ vocab)
  int rows = 0;                    //!< rows to rank
  int vocab = 0;                   //!< row length
  int k = 0;                       //!< ids to keep per row, ≤ the bucket K
  int splits = 1;                  //!< blocks per row in stage 1
  int chunk = 0;                   //!< elements per split
  float* part_values = nullptr;    //!< [rows][splits][k] (splits > 1)
  std::int32_t* part_ids = nullptr;  //!< [rows][splits][k] (splits > 1)
  std::int32_t* out_ids = nullptr;   //!< [rows][k], best first
  float* out_values = nullptr;       //!< [rows][k] or nullptr
  std::int32_t* status = nullptr;    //!< [rows / rows_per_status] or nullptr
  int rows_per_status = 1;           //!< rows of one request (its heads)
};

//! Stage 1: block (x = split, y = row) ranks its slice of the row.
template <int K, class Ctx, class T>
MEDUSA_KERNEL_FN void top_k_scan(Ctx& ctx, const top_k_args<T>& a) {
  const int row = ctx.block_y();
  const int split = ctx.block_x();
  const T* x = a.logits + static_cast<std::int64_t>(row) * a.row_stride;
  const int begin = split * a.chunk;
  const int end = a.vocab - begin < a.chunk ? a.vocab : begin + a.chunk;
  top_list<K> l;
  l.clear();
  bool finite = true;
  for_each_element(ctx, x, begin, end, [&](float xi, int i) {
    finite = finite && is_valid_logit(xi);
    l.insert(xi, i);
  });
  if (!finite && a.status != nullptr)
    a.status[row / a.rows_per_status] = static_cast<std::int32_t>(request_status::non_finite_logit);
  block_merge(ctx, l);
  if (ctx.thread() == 0) {
    // Static indices keep the list in registers.
    if (a.splits == 1) {
      if (l.v[0] == -__builtin_inff() && a.status != nullptr)  // every token of the row masked
        a.status[row / a.rows_per_status] = static_cast<std::int32_t>(request_status::non_finite_logit);
      write_list(l, a.k, a.out_ids + static_cast<std::int64_t>(row) * a.k,
                 a.out_values != nullptr ? a.out_values + static_cast<std::int64_t>(row) * a.k : nullptr);
    } else {
      const std::int64_t base = (static_cast<std::int64_t>(row) * a.splits + split) * a.k;
      write_list(l, a.k, a.part_ids + base, a.part_values + base);
    }
  }
}

//! Stage 2 (splits > 1): block x merges the split lists of row x.
template <int K, class Ctx, class T>
MEDUSA_KERNEL_FN void top_k_merge_splits(Ctx& ctx, const top_k_args<T>& a) {
  const int row = ctx.block_x();
  top_list<K> l;
  l.clear();
  for (int s = ctx.thread(); s < a.splits; s += ctx.threads()) {
    const std::int64_t base = (static_cast<std::int64_t>(row) * a.splits + s) * a.k;
    top_list<K> o;
    o.clear();
    MEDUSA_UNROLL
    for (int j = 0; j < K; ++j) {
      if (j < a.k) {
        o.v[j] = a.part_values[base + j];
        o.id[j] = a.part_ids[base + j];
      }
    }
    l.merge(o);
  }
  block_merge(ctx, l);
  if (ctx.thread() == 0) {
    if (l.v[0] == -__builtin_inff() && a.status != nullptr)  // every token of the row masked
      a.status[row / a.rows_per_status] = static_cast<std::int32_t>(request_status::non_finite_logit);
    write_list(l, a.k, a.out_ids + static_cast<std::int64_t>(row) * a.k,
               a.out_values != nullptr ? a.out_values + static_cast<std::int64_t>(row) * a.k : nullptr);
  }
}

//! Launch shapes and workspace of a top-k over `rows` rows.
struct top_k_plan {
  int rows = 0;
  int vocab = 0;
  int k = 0;
  int bucket = 1;     //!< K of the kernel instance: the power of two ≥ k
  int splits = 1;     //!< blocks per row in stage 1
  int chunk = 0;      //!< elements per split
  launch_shape scan;   //!< stage 1: grid (splits, rows)
  launch_shape merge;  //!< stage 2: grid rows (unused when splits == 1)
  std::size_t workspace_bytes = 0;
};

//! Plans a top-k of `k` ids per row. `target_blocks` is the number of stage-1 blocks that fills
//! the GPU (about 4 per SM); rows are split until there are that many, slices no shorter than
//! 2048 elements.
//! @throws launch_error `invalid_shape` (rows < 1, vocab < k, k < 1), `unsupported` (k > 16).
inline top_k_plan plan_top_k(int rows, int vocab, int k, int target_blocks = 528) {
  if (rows < 1 || k < 1 || vocab < k)
    throw launch_error(launch_errc::invalid_shape,
                       "top-k: need rows >= 1 and 1 <= k <= vocab, got rows " + std::to_string(rows) +
                           ", k " + std::to_string(k) + ", vocab " + std::to_string(vocab));
  if (k > 16)
    throw launch_error(launch_errc::unsupported,
                       "top-k: k = " + std::to_string(k) + " exceeds the 16 the kernels keep per row");
  top_k_plan p;
  p.rows = rows;
  p.vocab = vocab;
  p.k = k;
  while (p.bucket < k) p.bucket *= 2;
  constexpr int min_slice = 2048;
  const int max_splits = std::min(256, (vocab + min_slice - 1) / min_slice);
  p.splits = std::clamp((std::max(target_blocks, 1) + rows - 1) / rows, 1, std::max(max_splits, 1));
  p.chunk = (vocab + p.splits - 1) / p.splits;
  p.chunk = (p.chunk + 7) / 8 * 8;  // slices start 16-byte aligned for 2- and 4-byte logits
  p.splits = (vocab + p.chunk - 1) / p.chunk;
  const int threads = std::clamp((p.chunk / 8 + warp_size - 1) / warp_size * warp_size, warp_size, top_k_threads_max);
  const std::size_t shared = block_merge_shared_bytes(p.bucket);
  p.scan = {.grid_x = p.splits, .grid_y = rows, .threads = threads, .shared_bytes = shared};
  const int merge_threads =
      std::clamp((p.splits + warp_size - 1) / warp_size * warp_size, warp_size, top_k_threads_max);
  p.merge = {.grid_x = rows, .grid_y = 1, .threads = merge_threads, .shared_bytes = shared};
  if (p.splits > 1) {
    const auto cells = static_cast<std::size_t>(rows) * static_cast<std::size_t>(p.splits) * static_cast<std::size_t>(k);
    p.workspace_bytes = workspace_carver::round_up(cells * sizeof(float)) +
                        workspace_carver::round_up(cells * sizeof(std::int32_t));
  }
  return p;
}

//! Points the split lists of `a` into `workspace`; false if it is too short.
template <class T>
bool bind_top_k_workspace(const top_k_plan& p, top_k_args<T>& a, void* workspace, std::size_t bytes) {
  a.rows = p.rows;
  a.vocab = p.vocab;
  a.k = p.k;
  a.splits = p.splits;
  a.chunk = p.chunk;
  if (p.splits == 1) return true;
  workspace_carver carve(workspace, bytes);
  const auto cells = static_cast<std::size_t>(p.rows) * static_cast<std::size_t>(p.splits) * static_cast<std::size_t>(p.k);
  a.part_values = carve.take<float>(cells);
  a.part_ids = carve.take<std::int32_t>(cells);
  return carve.ok();
}

//! Calls `f(std::integral_constant<int, K>{})` for the plan's bucket K.
template <class F>
decltype(auto) with_top_k_bucket(int bucket, F&& f) {
  switch (bucket) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 8: return f(std::integral_constant<int, 8>{});
    default: return f(std::integral_constant<int, 16>{});
  }
}

}  // namespace kernels
}  // namespace cuda
MEDUSA_NAMESPACE_END
