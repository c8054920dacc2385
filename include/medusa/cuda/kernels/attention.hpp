// SPDX-License-Identifier: Apache-2.0
//! @file cuda/kernels/attention.hpp
//! Tree attention of a batch of requests on the GPU: the kernel bodies, their plan, and the
//! arguments. The same kernels serve plain decoding (one query per request), Medusa tree steps
//! (N queries under the tree mask) and chunked prefill (causal), over the caches of `batch_kv.hpp`
//! (contiguous or paged, f32/f16/bf16 K and V) with grouped-query heads. The CPU reference is
//! `medusa::tree_attention` (attention.hpp); `cuda/attention.cuh` launches these bodies.
//!
//! Request b owns query rows `[qo_indptr[b], qo_indptr[b+1])` (FlashInfer's ragged layout): its
//! `n_b` new tokens, whose K/V the engine has already written at slots `[L_b, L_b + n_b)` of its
//! cache (`L_b = cache_lengths[b]`). Query i of the request sees every committed slot `[0, L_b)`
//! and, among the new slots, what the mask says:
//! - `causal`: new tokens `0..i` (prefill, decoding);
//! - `tree`: the packed ancestor mask of `tree/mask.hpp` (`tree_mask_view` rows, one tree per
//!   request or one for all);
//! - `flashinfer`: FlashInfer's `MaskMode::kCustom` stream, the bit-packed `[n_b][L_b + n_b]`
//!   matrix of each request at byte `mask_indptr[b]` (`write_full_row_stream_batch` writes it);
//!   every bit is honoured, the prefix's included.
//!
//! Algorithm (one block per request × KV head × row tile × key split): the query rows of one KV
//! head (its nodes × the query heads of the group) share every K/V tile the block loads; each warp
//! owns up to 4 rows, each lane one key of a 32-key tile for the scores and 32-column slices of
//! head_dim for P·V; softmax is online, in base 2. A row's keys are taken in position order, as
//! they would sit in the cache had its ancestors been committed (the committed prefix, then the
//! tree keys the row sees, in node order), cut into tiles at multiples of 32 and into splits at
//! multiples of `kv_split`; splits are merged by a second kernel in split order. A row's result
//! therefore has the same bits whether it is computed alone (plain decoding), in a tree or in a
//! causal chunk: greedy Medusa decoding reproduces plain decoding exactly when the projections
//! are batch-invariant too. Keep `kv_split` fixed in an engine for that reason. Plans of one token
//! per request run `attention_single_query_with` instead, which spreads a row over the whole block
//! with the same keys, tiles, splits and operations, so the same bits. K and V rows are
//! read 16 bytes a thread where head_dim, the cache's strides and addresses allow it
//! (`attention_kv_vectorized`), element by element otherwise: the same values, the same bits.
//!
//! @code
//! namespace mk = medusa::cuda::kernels;
//! const mk::attention_plan plan = mk::plan_attention({.batch = B, .max_tokens = B * N,
//!     .max_tokens_per_request = N, .max_kv_length = capacity, .num_q_heads = 32, .num_kv_heads = 8,
//!     .head_dim = 128, .mask = mk::attention_mask_kind::tree});     // throws launch_error
//! mk::attention_params<medusa::bfloat16, medusa::bfloat16> a;
//! a.q = q;  a.q_row_stride = q_stride;  a.out = out;  a.out_row_stride = 32 * 128;
//! a.qo_indptr = indptr;  a.cache_lengths = lengths;  a.kv = kv;  a.layer = layer;
//! a.tree_mask = words;  a.words_per_row = 2;                           // one tree for all requests
//! medusa::cuda::check(medusa::cuda::run(plan, a, workspace, plan.workspace_bytes, stream), "attention");
//! @endcode
#pragma once

#include <medusa/config.hpp>
#include <medusa/cuda/kernel_context.hpp>
#include <medusa/cuda/kernels/batch_kv.hpp>
#include <medusa/cuda/launch.hpp>
#include <medusa/half.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

// Unrolls the next loop 4 times: the 32-key P·V and head_dim loops stay out of registers.
#if defined(__CUDACC__)
#define MEDUSA_ATTENTION_UNROLL4 _Pragma("unroll 4")
#elif defined(__clang__)
#define MEDUSA_ATTENTION_UNROLL4 _Pragma("clang loop unroll_count(4)")
#else
#define MEDUSA_ATTENTION_UNROLL4 _Pragma("GCC unroll 4")
#endif

MEDUSA_NAMESPACE_BEGIN
namespace cuda {
namespace kernels {

//! Keys per tile: one per lane of a warp.
inline constexpr int attention_key_tile = warp_size;
//! Most query rows one warp carries through a tile.
inline constexpr int attention_rows_per_warp_max = 4;
//! Warps of a main-kernel block; threads per block of both kernels.
inline constexpr int attention_warps = 4;
inline constexpr int attention_threads = attention_warps * warp_size;
//! Main-kernel blocks an SM should hold at once (the register budget `__launch_bounds__` sets:
//! 128 registers a thread), enough warps in flight to hide the K/V loads.
inline constexpr int attention_min_blocks = 4;
//! The largest head dimension the kernels take (each lane holds 4 columns at most).
inline constexpr int attention_head_dim_max = 128;
//! Dynamic shared memory a main-kernel block may use (the default limit of every device).
inline constexpr std::size_t attention_shared_max = 48 * 1024;
//! Most query heads per KV head the single-query kernel takes (each thread scores its key for all).
inline constexpr int attention_single_query_group_max = 8;
//! Keys the single-query kernel scores at once: one a thread.
inline constexpr int attention_single_query_keys = attention_threads;
//! Bytes of the single-query kernel's V stage in shared memory (128 keys of 128 16-bit columns);
//! its K stage holds as many keys, each row padded by 16 bytes against bank conflicts.
inline constexpr std::size_t attention_single_query_v_bytes = 32 * 1024;
inline constexpr std::size_t attention_single_query_k_bytes =
    attention_single_query_v_bytes + attention_single_query_keys * 16;
//! The most dynamic shared memory a single-query block uses (75 KiB: above the default 48 KiB, so
//! the launcher opts in; every sm_80+ device has room).
inline constexpr std::size_t attention_single_query_shared_max =
    attention_single_query_keys * sizeof(std::size_t) + attention_single_query_k_bytes +
    attention_single_query_v_bytes +
    attention_single_query_group_max * (attention_head_dim_max + attention_single_query_keys) * sizeof(float);

//! Which keys among the new tokens a query sees (see the file comment).
enum class attention_mask_kind : std::int32_t { causal, tree, flashinfer };

//! The name of an `attention_mask_kind`.
[[nodiscard]] constexpr const char* to_string(attention_mask_kind k) noexcept {
  return k == attention_mask_kind::causal ? "causal" : k == attention_mask_kind::tree ? "tree" : "flashinfer";
}

//! Sizes an attention plan is made for: the largest batch it will run (a run may hold fewer
//! requests and tokens; the grid covers these bounds and idle blocks return at once).
struct attention_problem {
  int batch = 0;                   //!< most requests per run (B)
  int max_tokens = 0;              //!< most query tokens per run (Σ n_b), which sizes the workspace
  int max_tokens_per_request = 0;  //!< most query tokens of one request (n_b: tree nodes, chunk length)
  int max_kv_length = 0;           //!< most keys of one request (L_b + n_b), e.g. the cache capacity
  int num_q_heads = 0;             //!< query heads (a multiple of `num_kv_heads`)
  int num_kv_heads = 0;            //!< KV heads
  int head_dim = 0;                //!< elements of one head (at most `attention_head_dim_max`)
  attention_mask_kind mask = attention_mask_kind::causal;  //!< how the new tokens see each other
  //! Keys per split (a multiple of 32); 0 = chosen from `max_kv_length`. A row's result depends
  //! on it, so an engine that wants plain and tree passes to agree bit for bit keeps it fixed.
  int kv_split = 0;
  //! Plans of one query token per request (plain decoding) with at most
  //! `attention_single_query_group_max` query heads per KV head run the single-query kernel,
  //! which spreads a row's work over the whole block; false keeps the general kernel. Both give
  //! the same bits.
  bool single_query_kernel = true;
};

//! Launch shapes and workspace of an attention run (made by `plan_attention`).
struct attention_plan {
  attention_problem problem;  //!< what it was planned for (`kv_split` resolved)
  int group = 0;              //!< query heads per KV head (G)
  int rows_per_warp = 0;      //!< query rows each warp carries (1..4)
  int rows_per_block = 0;     //!< rows of one row tile (warps × rows_per_warp)
  int row_tiles = 0;          //!< row tiles per request and KV head: ceil(max_tokens_per_request·G / rows_per_block)
  int splits = 0;             //!< key splits per request at most: ceil(max_kv_length / kv_split)
  int dim_chunks = 0;         //!< 32-column slices of head_dim each lane holds (1, 2 or 4)
  bool single_query = false;  //!< the main kernel is the single-query one (grid: splits × (B × KV heads))
  launch_shape main;          //!< grid (row_tiles × splits, B × KV heads)
  launch_shape merge;         //!< grid over max_tokens × query heads rows, one warp a row
  std::size_t workspace_bytes = 0;  //!< partial outputs of rows with more than one split
};

//! Arguments of one attention run. Pointers are device memory (host memory for the emulation).
//! @tparam KV the cache elements: float, medusa::half or medusa::bfloat16
//! @tparam O the output elements: float or the same 16-bit type as the cache
template <class KV, class O = float>
struct attention_params {
  const float* q = nullptr;         //!< token t's query heads at `q + t·q_row_stride`, `[num_q_heads][head_dim]`, RoPE applied
  std::int64_t q_row_stride = 0;    //!< elements between tokens of `q` (≥ num_q_heads·head_dim)
  O* out = nullptr;                 //!< token t's outputs at `out + t·out_row_stride`, `[num_q_heads][head_dim]`
  std::int64_t out_row_stride = 0;  //!< elements between tokens of `out`
  int batch = 0;                    //!< B (at most the plan's)
  const std::int32_t* qo_indptr = nullptr;      //!< [B + 1] request b's tokens are `[qo_indptr[b], qo_indptr[b+1])`
  const std::int32_t* cache_lengths = nullptr;  //!< [B] L_b: committed slots; its tokens are at `[L_b, L_b + n_b)`
  batch_kv kv;                      //!< the caches (element size sizeof(KV))
  int layer = 0;                    //!< layer of `kv` to read
  float scale = 0.0f;               //!< multiplies q·k; 0 = 1/sqrt(head_dim)
  // tree mask (`attention_mask_kind::tree`)
  const std::uint32_t* tree_mask = nullptr;          //!< packed rows (tree/mask.hpp), `words_per_row` words each
  int words_per_row = 0;                             //!< ≥ ceil(n_b / 32)
  const std::int32_t* tree_mask_offsets = nullptr;   //!< [B] word where request b's row 0 starts; nullptr: 0 for all
  // FlashInfer custom mask (`attention_mask_kind::flashinfer`)
  const std::uint8_t* custom_mask = nullptr;  //!< request b's `[n_b][L_b + n_b]` bits from byte `mask_indptr[b]`
  const std::int32_t* mask_indptr = nullptr;  //!< [B] byte offsets into `custom_mask`
  // workspace, bound by `bind_attention_workspace`
  float* partial_out = nullptr;  //!< [max_tokens][num_q_heads][splits][head_dim] unnormalised outputs
  float* partial_ml = nullptr;   //!< [max_tokens][num_q_heads][splits][2] running max (base 2) and sum
};

namespace detail {

[[noreturn]] inline void attention_fail(launch_errc code, const std::string& what) {
  throw launch_error(code, "attention: " + what);
}

inline std::size_t attention_shared_bytes(int rows_per_block, int head_dim) noexcept {
  const auto d = static_cast<std::size_t>(head_dim);
  return (static_cast<std::size_t>(rows_per_block) * d        // scaled queries
          + attention_key_tile * (d + 1)                       // K tile, padded against bank conflicts
          + attention_key_tile * d) * sizeof(float)            // V tile
         + attention_key_tile * sizeof(std::size_t);           // row offsets of the tile's keys
}

// Shared bytes of a single-query block: the stage's row offsets, its K and V rows, the G scaled
// queries and the G × 128 scores.
inline std::size_t attention_single_query_shared_bytes(int group, int head_dim) noexcept {
  const auto g = static_cast<std::size_t>(group);
  return attention_single_query_keys * sizeof(std::size_t) + attention_single_query_k_bytes +
         attention_single_query_v_bytes +
         g * (static_cast<std::size_t>(head_dim) + attention_single_query_keys) * sizeof(float);
}

}  // namespace detail

//! The default `kv_split` for caches of `max_kv_length` keys: 128 keys a split, so that a decode
//! row at batch 1 spreads over enough blocks to fill the GPU (on an H200, Llama-2-7B shape at
//! context 4096, 128-key splits decode 13 % faster than 512-key ones), and at most 256 splits
//! (longer caches: a multiple of 64 keys) to bound the merge's partial outputs.
[[nodiscard]] constexpr int default_attention_kv_split(int max_kv_length) noexcept {
  const int per = max_kv_length / 256 + (max_kv_length % 256 != 0 ? 1 : 0);  // no overflow near INT_MAX
  const int rounded = (per + 63) / 64 * 64;
  return rounded < 128 ? 128 : rounded;
}

//! Validates `p` and picks the launch shapes and workspace.
//! @throws launch_error `invalid_shape` (non-positive sizes, query heads not a multiple of the KV
//!         heads, a split that is not a positive multiple of 32, sizes whose products overflow),
//!         `unsupported` (head_dim above 128)
[[nodiscard]] inline attention_plan plan_attention(const attention_problem& p) {
  using detail::attention_fail;
  if (p.batch < 1 || p.max_tokens < 1 || p.max_tokens_per_request < 1 || p.max_kv_length < 1 || p.num_q_heads < 1 ||
      p.num_kv_heads < 1 || p.head_dim < 1)
    attention_fail(launch_errc::invalid_shape,
                   "every size must be positive, got batch=" + std::to_string(p.batch) + " max_tokens=" +
                       std::to_string(p.max_tokens) + " max_tokens_per_request=" + std::to_string(p.max_tokens_per_request) +
                       " max_kv_length=" + std::to_string(p.max_kv_length) + " q_heads=" + std::to_string(p.num_q_heads) +
                       " kv_heads=" + std::to_string(p.num_kv_heads) + " head_dim=" + std::to_string(p.head_dim));
  if (p.num_q_heads % p.num_kv_heads != 0)
    attention_fail(launch_errc::invalid_shape, std::to_string(p.num_q_heads) + " query heads are not a multiple of " +
                                                   std::to_string(p.num_kv_heads) + " KV heads");
  if (p.head_dim > attention_head_dim_max)
    attention_fail(launch_errc::unsupported, "head_dim " + std::to_string(p.head_dim) + " (at most " +
                                                 std::to_string(attention_head_dim_max) + ")");
  if (p.max_tokens_per_request > p.max_tokens)
    attention_fail(launch_errc::invalid_shape, "max_tokens_per_request " + std::to_string(p.max_tokens_per_request) +
                                                   " exceeds max_tokens " + std::to_string(p.max_tokens));
  if (p.max_tokens_per_request > p.max_kv_length)
    attention_fail(launch_errc::invalid_shape, "max_tokens_per_request " + std::to_string(p.max_tokens_per_request) +
                                                   " exceeds max_kv_length " + std::to_string(p.max_kv_length));
  if (p.mask != attention_mask_kind::causal && p.mask != attention_mask_kind::tree &&
      p.mask != attention_mask_kind::flashinfer)
    attention_fail(launch_errc::invalid_shape, "unknown mask kind " + std::to_string(static_cast<int>(p.mask)));
  attention_plan plan;
  plan.problem = p;
  if (plan.problem.kv_split == 0) plan.problem.kv_split = default_attention_kv_split(p.max_kv_length);
  const int split = plan.problem.kv_split;
  if (split < attention_key_tile || split % attention_key_tile != 0)
    attention_fail(launch_errc::invalid_shape,
                   "kv_split " + std::to_string(split) + " is not a positive multiple of " + std::to_string(attention_key_tile));
  plan.group = p.num_q_heads / p.num_kv_heads;
  plan.dim_chunks = p.head_dim <= 32 ? 1 : p.head_dim <= 64 ? 2 : 4;
  const std::int64_t rows = std::int64_t{p.max_tokens_per_request} * plan.group;
  plan.rows_per_warp = static_cast<int>(std::clamp<std::int64_t>((rows + attention_warps - 1) / attention_warps, 1,
                                                                  attention_rows_per_warp_max));
  while (plan.rows_per_warp > 1 &&
         detail::attention_shared_bytes(plan.rows_per_warp * attention_warps, p.head_dim) > attention_shared_max)
    --plan.rows_per_warp;
  plan.rows_per_block = plan.rows_per_warp * attention_warps;
  const std::int64_t tiles = (rows + plan.rows_per_block - 1) / plan.rows_per_block;
  plan.splits = (p.max_kv_length + split - 1) / split;
  const std::int64_t grid_x = tiles * plan.splits;
  const std::int64_t grid_y = std::int64_t{p.batch} * p.num_kv_heads;
  const std::int64_t merge_rows = std::int64_t{p.max_tokens} * p.num_q_heads;
  if (grid_x > std::numeric_limits<int>::max() || grid_y > 65535 || merge_rows > std::numeric_limits<int>::max() / 2)
    attention_fail(launch_errc::invalid_shape, "grid of " + std::to_string(grid_x) + " x " + std::to_string(grid_y) +
                                                   " blocks (" + std::to_string(merge_rows) + " query rows) is too large");
  plan.row_tiles = static_cast<int>(tiles);
  plan.main = {.grid_x = static_cast<int>(grid_x),
               .grid_y = static_cast<int>(grid_y),
               .threads = attention_threads,
               .shared_bytes = detail::attention_shared_bytes(plan.rows_per_block, p.head_dim)};
  if (p.single_query_kernel && p.max_tokens_per_request == 1 && plan.group <= attention_single_query_group_max) {
    plan.single_query = true;
    plan.row_tiles = 1;
    plan.main.grid_x = plan.splits;
    plan.main.shared_bytes = detail::attention_single_query_shared_bytes(plan.group, p.head_dim);
  }
  plan.merge = {.grid_x = static_cast<int>((merge_rows + attention_warps - 1) / attention_warps),
                .grid_y = 1,
                .threads = attention_threads,
                .shared_bytes = 0};
  if (plan.splits > 1) {
    const auto per_row = static_cast<std::size_t>(plan.splits);
    const auto n = static_cast<std::size_t>(merge_rows) * per_row;
    plan.workspace_bytes = workspace_carver::round_up(n * static_cast<std::size_t>(p.head_dim) * sizeof(float)) +
                           workspace_carver::round_up(n * 2 * sizeof(float));
  }
  return plan;
}

//! Points the workspace fields of `a` into `workspace` as `plan` sized it. False (nothing bound)
//! when the workspace is null or short while the plan needs one.
template <class KV, class O>
[[nodiscard]] bool bind_attention_workspace(const attention_plan& plan, attention_params<KV, O>& a, void* workspace,
                                            std::size_t workspace_bytes) noexcept {
  if (plan.workspace_bytes == 0) {
    a.partial_out = nullptr;
    a.partial_ml = nullptr;
    return true;
  }
  const auto n = static_cast<std::size_t>(plan.problem.max_tokens) * static_cast<std::size_t>(plan.problem.num_q_heads) *
                 static_cast<std::size_t>(plan.splits);
  workspace_carver carve(workspace, workspace_bytes);
  float* o = carve.take<float>(n * static_cast<std::size_t>(plan.problem.head_dim));
  float* ml = carve.take<float>(n * 2);
  if (!carve.ok()) return false;
  a.partial_out = o;
  a.partial_ml = ml;
  return true;
}

//! Checks the arguments of a run against its plan on the host (sizes, not the data): the cache
//! geometry and element size, head counts, the mask fields the plan's kind needs.
//! @throws launch_error `invalid_shape` naming the first mismatch
template <class KV, class O>
void check_attention_args(const attention_plan& plan, const attention_params<KV, O>& a) {
  using detail::attention_fail;
  check_batch_kv(a.kv, "attention");
  const attention_problem& p = plan.problem;
  if (a.kv.element_bytes != static_cast<int>(sizeof(KV)))
    attention_fail(launch_errc::invalid_shape, "cache elements of " + std::to_string(a.kv.element_bytes) +
                                                   " bytes, the kernel reads " + std::to_string(sizeof(KV)));
  if (a.kv.shape.num_kv_heads != p.num_kv_heads || a.kv.shape.head_dim != p.head_dim)
    attention_fail(launch_errc::invalid_shape, "cache of " + std::to_string(a.kv.shape.num_kv_heads) + " KV heads x " +
                                                   std::to_string(a.kv.shape.head_dim) + " for a plan of " +
                                                   std::to_string(p.num_kv_heads) + " x " + std::to_string(p.head_dim));
  if (a.layer < 0 || a.layer >= a.kv.shape.num_layers)
    attention_fail(launch_errc::invalid_shape, "layer " + std::to_string(a.layer) + " outside [0, " +
                                                   std::to_string(a.kv.shape.num_layers) + ")");
  if (a.batch < 1 || a.batch > p.batch)
    attention_fail(launch_errc::invalid_shape, "batch of " + std::to_string(a.batch) + " for a plan of " +
                                                   std::to_string(p.batch));
  const std::int64_t width = std::int64_t{p.num_q_heads} * p.head_dim;
  if (a.q_row_stride < width || a.out_row_stride < width)
    attention_fail(launch_errc::invalid_shape, "row strides " + std::to_string(a.q_row_stride) + " (q) and " +
                                                   std::to_string(a.out_row_stride) + " (out) are below heads x head_dim = " +
                                                   std::to_string(width));
  if (!(std::isfinite(a.scale)) || a.scale < 0.0f)
    attention_fail(launch_errc::invalid_shape, "scale " + std::to_string(a.scale) + " is not a finite value >= 0");
  if (p.mask == attention_mask_kind::tree &&
      (a.words_per_row < (p.max_tokens_per_request + 31) / 32 || a.words_per_row < 1))
    attention_fail(launch_errc::invalid_shape, "tree mask of " + std::to_string(a.words_per_row) +
                                                   " words per row for up to " + std::to_string(p.max_tokens_per_request) +
                                                   " nodes");
}

namespace detail {

// Bit helpers with the device's instructions.
MEDUSA_KERNEL_FN int attention_popcount(std::uint32_t x) noexcept {
#if defined(__CUDA_ARCH__)
  return __popc(x);
#else
  return std::popcount(x);
#endif
}
MEDUSA_KERNEL_FN int attention_lowest_bit(std::uint32_t x) noexcept {
#if defined(__CUDA_ARCH__)
  return __ffs(static_cast<int>(x)) - 1;
#else
  return std::countr_zero(x);
#endif
}

// a·b + c rounded once, the same on both sides.
MEDUSA_KERNEL_FN float attention_fma(float a, float b, float c) noexcept {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

MEDUSA_KERNEL_FN float attention_max(float a, float b) noexcept { return a > b ? a : b; }
// std::min / std::max are host functions to nvcc.
MEDUSA_KERNEL_FN int attention_imin(int a, int b) noexcept { return a < b ? a : b; }
MEDUSA_KERNEL_FN int attention_imax(int a, int b) noexcept { return a > b ? a : b; }

inline constexpr float attention_neg_inf = -std::numeric_limits<float>::infinity();
inline constexpr float attention_log2e = 1.44269504088896341f;  // scores are kept in base-2 units
inline constexpr float attention_nan = std::numeric_limits<float>::quiet_NaN();  // a value device code may read

// What a block knows of its request.
struct attention_request {
  int b = 0;       // request
  int g = 0;       // KV head
  int first = 0;   // its first token (row of q / out)
  int tokens = 0;  // n_b
  int length = 0;  // L_b
};

// The request and KV head of this block's row of the grid (y = request × KV heads + KV head):
// false for a row beyond the batch.
template <class Ctx, class KV, class O>
MEDUSA_KERNEL_FN bool attention_block_request(Ctx& ctx, const attention_params<KV, O>& a, int kv_heads,
                                              attention_request& r) {
  r.b = ctx.block_y() / kv_heads;
  r.g = ctx.block_y() % kv_heads;
  if (r.b >= a.batch) return false;
  r.first = a.qo_indptr[r.b];
  r.tokens = a.qo_indptr[r.b + 1] - r.first;
  r.length = a.cache_lengths[r.b];
  return true;
}

// Whether request r fits the plan's bounds. The kernels leave a request beyond them alone: its
// splits or rows would not fit the grid and the workspace (the host launchers check what they
// can see).
MEDUSA_KERNEL_FN bool attention_in_plan(const attention_plan& plan, const attention_request& r) noexcept {
  return r.length >= 0 && r.tokens <= plan.problem.max_tokens_per_request &&
         r.first + r.tokens <= plan.problem.max_tokens && r.length + r.tokens <= plan.problem.max_kv_length;
}

// The packed mask row of node i of request r (tree masks).
template <class KV, class O>
MEDUSA_KERNEL_FN const std::uint32_t* attention_tree_row(const attention_params<KV, O>& a, const attention_request& r,
                                                         int i) noexcept {
  const std::size_t base = a.tree_mask_offsets == nullptr ? 0 : static_cast<std::size_t>(a.tree_mask_offsets[r.b]);
  return a.tree_mask + base + static_cast<std::size_t>(i) * static_cast<std::size_t>(a.words_per_row);
}

// Visible tree keys of node i (its mask bits among the request's nodes).
template <class KV, class O>
MEDUSA_KERNEL_FN int attention_tree_count(const attention_params<KV, O>& a, const attention_request& r, int i) noexcept {
  const std::uint32_t* row = attention_tree_row(a, r, i);
  int count = 0;
  for (int w = 0; w * 32 < r.tokens; ++w) {
    std::uint32_t bits = row[w];
    if (r.tokens - w * 32 < 32) bits &= (1u << (r.tokens - w * 32)) - 1u;
    count += attention_popcount(bits);
  }
  return count;
}

// The node of node i's `rank`-th visible tree key (rank < attention_tree_count).
template <class KV, class O>
MEDUSA_KERNEL_FN int attention_tree_select(const attention_params<KV, O>& a, const attention_request& r, int i,
                                           int rank) noexcept {
  const std::uint32_t* row = attention_tree_row(a, r, i);
  for (int w = 0; w * 32 < r.tokens; ++w) {
    std::uint32_t bits = row[w];
    if (r.tokens - w * 32 < 32) bits &= (1u << (r.tokens - w * 32)) - 1u;
    const int c = attention_popcount(bits);
    if (rank < c) {
      for (; rank > 0; --rank) bits &= bits - 1u;
      return w * 32 + attention_lowest_bit(bits);
    }
    rank -= c;
  }
  return -1;
}

// Keys of query i in position order: what a row sees, and so how many splits it spans.
template <class Mask, class KV, class O>
MEDUSA_KERNEL_FN int attention_key_count(const attention_params<KV, O>& a, const attention_request& r, int i) noexcept {
  if constexpr (Mask::value == attention_mask_kind::causal) return r.length + i + 1;
  else if constexpr (Mask::value == attention_mask_kind::tree) return r.length + attention_tree_count(a, r, i);
  else return r.length + r.tokens;  // custom masks: every slot, each tested against its bit
}

// Whether query i sees slot `key` under a FlashInfer custom mask.
template <class KV, class O>
MEDUSA_KERNEL_FN bool attention_custom_bit(const attention_params<KV, O>& a, const attention_request& r, int i,
                                           int key) noexcept {
  const std::uint64_t bit = static_cast<std::uint64_t>(i) * static_cast<std::uint64_t>(r.length + r.tokens) +
                            static_cast<std::uint64_t>(key);
  const std::uint8_t byte = a.custom_mask[static_cast<std::size_t>(a.mask_indptr[r.b]) + static_cast<std::size_t>(bit >> 3)];
  return ((byte >> (bit & 7u)) & 1u) != 0;
}

// The request of token t: the last b with qo_indptr[b] <= t (binary search).
template <class KV, class O>
MEDUSA_KERNEL_FN int attention_request_of(const attention_params<KV, O>& a, int t) noexcept {
  int lo = 0, hi = a.batch - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (a.qo_indptr[mid] <= t) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// One query row's running state: max and sum (base 2), this lane's output columns.
template <int DC>
struct attention_row_state {
  float m = attention_neg_inf;
  float l = 0.0f;
  float o[DC] = {};
};

// Writes the state of row (token t, query head h) for key split c: the output when the row's keys
// fit one split (`nsplits` == 1), else the split's partial for the merge. The state's column slice
// i is head_dim slice `chunk0 + i`; the holder of slice 0 writes the maximum and the sum.
template <int DC, class Ctx, class KV, class O>
MEDUSA_KERNEL_FN void attention_store_row(Ctx& ctx, const attention_plan& plan, const attention_params<KV, O>& a,
                                          int t, int h, int c, int nsplits, const attention_row_state<DC>& s,
                                          int chunk0 = 0) {
  const int D = plan.problem.head_dim;
  if (nsplits == 1) {
    O* const dst = a.out + static_cast<std::size_t>(t) * static_cast<std::size_t>(a.out_row_stride) +
                   static_cast<std::size_t>(h) * static_cast<std::size_t>(D);
    MEDUSA_UNROLL
    for (int i = 0; i < DC; ++i) {
      const int d = ctx.lane() + (chunk0 + i) * warp_size;
      if (d < D) dst[d] = store_float<O>(s.l > 0.0f || s.l != s.l ? s.o[i] / s.l : 0.0f);
    }
    return;
  }
  const std::size_t cell = (static_cast<std::size_t>(t) * static_cast<std::size_t>(plan.problem.num_q_heads) +
                            static_cast<std::size_t>(h)) * static_cast<std::size_t>(plan.splits) +
                           static_cast<std::size_t>(c);
  float* const po = a.partial_out + cell * static_cast<std::size_t>(D);
  MEDUSA_UNROLL
  for (int i = 0; i < DC; ++i) {
    const int d = ctx.lane() + (chunk0 + i) * warp_size;
    if (d < D) po[d] = s.o[i];
  }
  if (chunk0 == 0 && ctx.lane() == 0) {
    a.partial_ml[2 * cell] = s.m;
    a.partial_ml[2 * cell + 1] = s.l;
  }
}

// Sum of a value over the warp; every lane gets the same bits (each level adds the same pair).
template <class Ctx>
MEDUSA_KERNEL_FN float attention_warp_sum(Ctx& ctx, float v) {
  MEDUSA_UNROLL
  for (int m = warp_size / 2; m > 0; m /= 2) v += ctx.shfl_xor(v, m);
  return v;
}
template <class Ctx>
MEDUSA_KERNEL_FN float attention_warp_max(Ctx& ctx, float v) {
  MEDUSA_UNROLL
  for (int m = warp_size / 2; m > 0; m /= 2) v = attention_max(v, ctx.shfl_xor(v, m));
  return v;
}

// One 32-key tile of one row: lane j holds the score of key j (base-2 units; `valid` false for a
// key the row does not see), `row_of(j)` gives key j's V row (called by every lane for every j, so
// it may use warp operations). The state's column slice c is head_dim slice `chunk0 + c` (the
// single-query kernel gives each warp one slice of a row). The only place the softmax and P·V are
// computed, so a key contributes the same bits from every path.
template <int DC, class Ctx, class RowOf>
MEDUSA_KERNEL_FN void attention_tile(Ctx& ctx, attention_row_state<DC>& s, float score, bool valid, int head_dim,
                                     RowOf&& row_of, int chunk0 = 0) {
  const std::uint32_t seen = ctx.ballot(valid);
  if (seen == 0) return;
  const bool nan = valid && score != score;
  if (ctx.ballot(nan) != 0) s.l = attention_nan;  // a NaN score poisons the row, as on the CPU
  // NaN kept out of the max, so that every lane agrees on it (and on the return below).
  const float tile_max = attention_warp_max(ctx, valid && !nan ? score : attention_neg_inf);
  if (!(tile_max > attention_neg_inf)) return;  // every visible score is -inf (or NaN, flagged above)
  const float m_new = attention_max(s.m, tile_max);
  const float alpha = s.m == attention_neg_inf ? 0.0f : exp2f(s.m - m_new);
  const float p = valid ? exp2f(score - m_new) : 0.0f;
  const float sum = attention_warp_sum(ctx, p);
  s.l = attention_fma(s.l, alpha, sum);  // one rounding, whatever a compiler would contract
  s.m = m_new;
  MEDUSA_UNROLL
  for (int c = 0; c < DC; ++c) s.o[c] *= alpha;
  MEDUSA_ATTENTION_UNROLL4
  for (int j = 0; j < attention_key_tile; ++j) {
    const float pj = ctx.shfl(p, j);
    const auto row = row_of(j);
    if (((seen >> j) & 1u) == 0) continue;  // the same for every lane
    MEDUSA_UNROLL
    for (int c = 0; c < DC; ++c) {
      const int d = ctx.lane() + (chunk0 + c) * warp_size;
      if (d < head_dim) s.o[c] = attention_fma(pj, load_float(row[d]), s.o[c]);
    }
  }
}

// q · k over head_dim in order of d, one rounding per step.
template <class K>
MEDUSA_KERNEL_FN float attention_dot(const float* q, K&& k, int head_dim) noexcept {
  float s = 0.0f;
  MEDUSA_ATTENTION_UNROLL4
  for (int d = 0; d < head_dim; ++d) s = attention_fma(q[d], k(d), s);
  return s;
}

// The same dot product over a cache row read 16 bytes at a time (`attention_kv_vectorized`).
template <class KV>
MEDUSA_KERNEL_FN float attention_dot_vectorized(const float* q, const KV* k, int head_dim) noexcept {
  constexpr int per = vector16<KV>::size;
  float s = 0.0f;
  for (int d0 = 0; d0 < head_dim; d0 += per) {
    const vector16<KV> kv = load_vector16(k + d0);
    MEDUSA_UNROLL
    for (int i = 0; i < per; ++i) s = attention_fma(q[d0 + i], load_float(kv.e[i]), s);
  }
  return s;
}

// Whether every K/V row of the cache can be read 16 bytes at a time: head_dim, every stride and
// both base addresses multiples of 16 bytes. The same for the whole launch (no divergence); the
// element-wise reads it replaces load the same values, so a row's bits do not depend on it.
template <class KV>
MEDUSA_KERNEL_FN bool attention_kv_vectorized(const batch_kv& kv, int head_dim) noexcept {
  constexpr std::size_t per = static_cast<std::size_t>(vector16<KV>::size);
  const bool rows = kv.layout == batch_kv_layout::paged ? kv.page_stride % per == 0 && kv.token_stride % per == 0
                                                        : kv.slot_stride % per == 0;
  return static_cast<std::size_t>(head_dim) % per == 0 && rows && kv.layer_stride % per == 0 &&
         kv.head_stride % per == 0 && (reinterpret_cast<std::uintptr_t>(kv.k) & 15u) == 0 &&
         (reinterpret_cast<std::uintptr_t>(kv.v) & 15u) == 0;
}

template <attention_mask_kind M>
struct attention_mask_tag {
  static constexpr attention_mask_kind value = M;
};

}  // namespace detail

//! The main kernel body (launch shape `plan.main`): block (x, y) takes request y / KV heads, KV
//! head y mod KV heads, row tile x / splits and key split x mod splits. A row whose keys fit one
//! split writes its output; the others write their split's partial output for `attention_merge`.
//! @tparam DC 32-column slices of head_dim per lane (`plan.dim_chunks`)
template <int DC, class Mask, class Ctx, class KV, class O>
MEDUSA_KERNEL_FN void attention_main_with(Ctx& ctx, const attention_plan& plan, const attention_params<KV, O>& a) {
  using namespace detail;
  constexpr int RW = attention_rows_per_warp_max;
  constexpr int KT = attention_key_tile;
  const int hkv = plan.problem.num_kv_heads;
  const int D = plan.problem.head_dim;
  const int G = plan.group;
  const int split = plan.problem.kv_split;
  attention_request r;
  if (!attention_block_request(ctx, a, hkv, r)) return;
  const int tile = ctx.block_x() / plan.splits;
  const int c = ctx.block_x() % plan.splits;
  const int R = plan.rows_per_block;
  const int row0 = tile * R;
  const int rows = r.tokens * G;
  if (r.tokens <= 0 || row0 >= rows || !attention_in_plan(plan, r)) return;  // the same for every thread
  const int key_end = r.length + r.tokens;  // slots the request has written
  const int split_begin = c * split;
  if (split_begin >= key_end) return;
  const int split_end = split_begin + split;

  // Shared: scaled queries [R][D], the K tile [KT][D+1], the V tile [KT][D], the tile's row offsets.
  auto* const q_s = static_cast<float*>(ctx.shared());
  float* const k_s = q_s + static_cast<std::size_t>(R) * static_cast<std::size_t>(D);
  float* const v_s = k_s + static_cast<std::size_t>(KT) * static_cast<std::size_t>(D + 1);
  auto* const off_s = reinterpret_cast<std::size_t*>(v_s + static_cast<std::size_t>(KT) * static_cast<std::size_t>(D));
  const float scale = (a.scale > 0.0f ? a.scale : 1.0f / sqrtf(static_cast<float>(D))) * attention_log2e;
  for (int e = ctx.thread(); e < R * D; e += ctx.threads()) {
    const int lr = e / D, d = e % D;
    const int row = row0 + lr;
    float x = 0.0f;
    if (row < rows) {
      const int i = row / G, h = r.g * G + row % G;
      x = a.q[static_cast<std::size_t>(r.first + i) * static_cast<std::size_t>(a.q_row_stride) +
              static_cast<std::size_t>(h) * static_cast<std::size_t>(D) + static_cast<std::size_t>(d)] *
          scale;
    }
    q_s[e] = x;
  }
  ctx.sync();

  // This warp's rows.
  const KV* const kg = static_cast<const KV*>(a.kv.k);
  const KV* const vg = static_cast<const KV*>(a.kv.v);
  const bool vectorized = attention_kv_vectorized<KV>(a.kv, D);
  attention_row_state<DC> st[RW];
  int node[RW], keys[RW];
  bool live[RW];
  int keys_max = 0;  // over the block's rows
  MEDUSA_UNROLL
  for (int j = 0; j < RW; ++j) {
    const int lr = ctx.warp() * plan.rows_per_warp + j;
    live[j] = j < plan.rows_per_warp && row0 + lr < rows;
    node[j] = live[j] ? (row0 + lr) / G : 0;
    keys[j] = live[j] ? attention_key_count<Mask>(a, r, node[j]) : 0;
  }
  {
    // The most keys of any row of the block: the shared-tile range of causal and custom masks.
    const int last_row = attention_imin(rows, row0 + R) - 1;
    keys_max = Mask::value == attention_mask_kind::causal ? r.length + last_row / G + 1 : key_end;
  }
  // Tiles every row reads in slot order, from shared memory: the committed prefix's whole tiles
  // (tree), or every slot (causal, custom). Tree rows then read their own tail (below).
  const int shared_end = Mask::value == attention_mask_kind::tree ? r.length / KT * KT : keys_max;
  const int phase1_end = attention_imin(split_end, shared_end);
  for (int t0 = split_begin; t0 < phase1_end; t0 += KT) {
    ctx.sync();  // the previous tile is no longer read
    if (ctx.thread() < KT) {
      const int slot = t0 + ctx.thread();
      off_s[ctx.thread()] = slot < key_end && batch_kv_slot_ok(a.kv, r.b, slot)
                                ? batch_kv_row_offset(a.kv, r.b, a.layer, slot, r.g)
                                : ~std::size_t{0};
    }
    ctx.sync();
    if (vectorized) {
      // 16 bytes of K and of V a thread at a time: 8 loads a thread per 32 × 128 bf16 tile, not 64.
      constexpr int per = vector16<KV>::size;
      const int row_vectors = D / per;
      for (int e = ctx.thread(); e < KT * row_vectors; e += ctx.threads()) {
        const int j = e / row_vectors, d0 = e % row_vectors * per;
        const std::size_t off = off_s[j];
        float* const kd = k_s + j * (D + 1) + d0;
        float* const vd = v_s + j * D + d0;
        if (off != ~std::size_t{0}) {
          const vector16<KV> kw = load_vector16(kg + off + static_cast<std::size_t>(d0));
          const vector16<KV> vw = load_vector16(vg + off + static_cast<std::size_t>(d0));
          MEDUSA_UNROLL
          for (int i = 0; i < per; ++i) {
            kd[i] = load_float(kw.e[i]);
            vd[i] = load_float(vw.e[i]);
          }
        } else {
          MEDUSA_UNROLL
          for (int i = 0; i < per; ++i) kd[i] = vd[i] = 0.0f;
        }
      }
    } else {
      for (int e = ctx.thread(); e < KT * D; e += ctx.threads()) {
        const int j = e / D, d = e % D;
        const std::size_t off = off_s[j];
        const bool ok = off != ~std::size_t{0};
        k_s[j * (D + 1) + d] = ok ? load_float(kg[off + static_cast<std::size_t>(d)]) : 0.0f;
        v_s[j * D + d] = ok ? load_float(vg[off + static_cast<std::size_t>(d)]) : 0.0f;
      }
    }
    ctx.sync();
    const int key = t0 + ctx.lane();
    const bool in_tile = off_s[ctx.lane()] != ~std::size_t{0};
    // Scores of the warp's rows, K read once for all of them.
    float score[RW];
    MEDUSA_UNROLL
    for (int j = 0; j < RW; ++j) score[j] = 0.0f;
    if (plan.rows_per_warp == 1) {
      // One row a warp (decoding, and trees of full-width heads): the same products, in the same
      // order, without the three idle rows' loads and products.
      const float* const q = q_s + ctx.warp() * D;
      const float* const k = k_s + ctx.lane() * (D + 1);
      MEDUSA_ATTENTION_UNROLL4
      for (int d = 0; d < D; ++d) score[0] = attention_fma(q[d], k[d], score[0]);
    } else {
      MEDUSA_ATTENTION_UNROLL4
      for (int d = 0; d < D; ++d) {
        const float kd = k_s[ctx.lane() * (D + 1) + d];
        MEDUSA_UNROLL
        for (int j = 0; j < RW; ++j)
          score[j] = attention_fma(q_s[(ctx.warp() * plan.rows_per_warp + j) * D + d], kd, score[j]);
      }
    }
    MEDUSA_UNROLL
    for (int j = 0; j < RW; ++j) {
      if (!live[j]) continue;  // the same for the whole warp
      bool valid = in_tile && key < keys[j];
      if constexpr (Mask::value == attention_mask_kind::flashinfer)
        valid = in_tile && key < key_end && attention_custom_bit(a, r, node[j], key);
      attention_tile<DC>(ctx, st[j], score[j], valid, D, [&](int kj) -> const float* { return v_s + kj * D; });
    }
  }
  // Tree rows past the shared tiles: the row's own keys in position order (the rest of the
  // prefix, then its visible tree keys), read from the cache.
  if constexpr (Mask::value == attention_mask_kind::tree) {
    MEDUSA_UNROLL
    for (int j = 0; j < RW; ++j) {
      if (!live[j]) continue;
      const float* const q = q_s + (ctx.warp() * plan.rows_per_warp + j) * D;
      const int end = attention_imin(split_end, keys[j]);
      for (int t0 = attention_imax(split_begin, shared_end); t0 < end; t0 += KT) {
        const int key = t0 + ctx.lane();
        int slot = -1;
        if (key < end) slot = key < r.length ? key : r.length + attention_tree_select(a, r, node[j], key - r.length);
        const bool valid = slot >= 0 && slot < key_end && batch_kv_slot_ok(a.kv, r.b, slot);
        const std::size_t off = valid ? batch_kv_row_offset(a.kv, r.b, a.layer, slot, r.g) : 0;
        float score = 0.0f;
        if (valid)
          score = vectorized ? attention_dot_vectorized(q, kg + off, D)
                             : attention_dot(q, [&](int d) { return load_float(kg[off + static_cast<std::size_t>(d)]); }, D);
        attention_tile<DC>(ctx, st[j], score, valid, D, [&](int kj) -> const KV* { return vg + ctx.shfl(off, kj); });
      }
    }
  }
  // Results: the output when the row's keys fit one split, else this split's partial.
  MEDUSA_UNROLL
  for (int j = 0; j < RW; ++j) {
    if (!live[j]) continue;
    const int nsplits = (keys[j] + split - 1) / split;
    if (c >= nsplits) continue;
    attention_store_row(ctx, plan, a, r.first + node[j], r.g * G + (row0 + ctx.warp() * plan.rows_per_warp + j) % G, c,
                        nsplits, st[j]);
  }
}

//! The single-query body (launch shape `plan.main` of a plan with `single_query`): block (x, y)
//! takes split x of request y / KV heads' one query token, KV head y mod KV heads, and all G query
//! heads of that KV head. Its keys pass in stages of up to 128, their K and V rows copied into
//! shared memory asynchronously, all at once; each thread then scores one key for the G rows, and
//! each warp carries 32-column slices of the rows through the stage's 32-key tiles. A row sees the
//! same keys, cut into the same tiles and splits, and every score and column goes through the same
//! operations as in `attention_main_with`, so the two kernels give the same bits; this one keeps
//! all four warps busy when a KV head has one query row (plain decoding without grouped heads) and
//! has a stage's loads in flight together.
//! @tparam DC 32-column slices of head_dim (`plan.dim_chunks`)
template <int DC, class Mask, class Ctx, class KV, class O>
MEDUSA_KERNEL_FN void attention_single_query_with(Ctx& ctx, const attention_plan& plan,
                                                  const attention_params<KV, O>& a) {
  using namespace detail;
  constexpr int GM = attention_single_query_group_max;
  constexpr int SK = attention_single_query_keys;
  constexpr int KT = attention_key_tile;
  constexpr int UM = GM * DC / attention_warps;  // (row, column slice) units a warp carries at most
  const int hkv = plan.problem.num_kv_heads;
  const int D = plan.problem.head_dim;
  const int G = plan.group;
  const int split = plan.problem.kv_split;
  attention_request r;
  if (!attention_block_request(ctx, a, hkv, r)) return;
  if (r.tokens <= 0 || !attention_in_plan(plan, r)) return;  // the same for every thread
  const int key_end = r.length + r.tokens;
  // One query: key k of the row is slot k under every mask (a tree of one node sees the prefix and
  // itself), and the row's keys end at `keys`.
  const int keys = attention_key_count<Mask>(a, r, 0);
  const int split_begin = ctx.block_x() * split;
  if (split_begin >= keys) return;
  const int split_end = attention_imin(split_begin + split, keys);

  // Shared: the stage's row offsets [SK], its K rows [SK][D + pad], its V rows [SK][D], the scaled
  // queries [G][D], the scores [G][SK].
  auto* const off_s = static_cast<std::size_t*>(ctx.shared());
  KV* const k_s = reinterpret_cast<KV*>(off_s + SK);
  KV* const v_s = reinterpret_cast<KV*>(reinterpret_cast<unsigned char*>(k_s) + attention_single_query_k_bytes);
  float* const q_s =
      reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(v_s) + attention_single_query_v_bytes);
  float* const s_s = q_s + static_cast<std::size_t>(G) * static_cast<std::size_t>(D);
  const float scale = (a.scale > 0.0f ? a.scale : 1.0f / sqrtf(static_cast<float>(D))) * attention_log2e;
  for (int e = ctx.thread(); e < G * D; e += ctx.threads()) {
    const int j = e / D, d = e % D;
    q_s[e] = a.q[static_cast<std::size_t>(r.first) * static_cast<std::size_t>(a.q_row_stride) +
                 static_cast<std::size_t>(r.g * G + j) * static_cast<std::size_t>(D) + static_cast<std::size_t>(d)] *
             scale;
  }

  const KV* const kg = static_cast<const KV*>(a.kv.k);
  const KV* const vg = static_cast<const KV*>(a.kv.v);
  const bool vectorized = attention_kv_vectorized<KV>(a.kv, D);
  constexpr int per = vector16<KV>::size;
  // Keys a stage holds: as many whole tiles as the V stage fits, at most one a thread.
  const int fit = static_cast<int>(attention_single_query_v_bytes / (static_cast<std::size_t>(D) * sizeof(KV))) / KT * KT;
  const int stage_keys = attention_imin(fit, SK);
  // K rows padded by 16 bytes: the 8 lanes of a 16-byte shared read then hit distinct banks.
  const int k_pitch = D + 16 / static_cast<int>(sizeof(KV));
  const int slices = (D + warp_size - 1) / warp_size;
  const int units = G * slices;  // unit u: row u / slices, columns slice u mod slices
  attention_row_state<1> st[UM];
  for (int s0 = split_begin; s0 < split_end; s0 += stage_keys) {
    const int n = attention_imin(stage_keys, split_end - s0);
    ctx.sync();  // the previous stage's offsets, K and V rows and scores are no longer read
    if (ctx.thread() < n) {
      const int slot = s0 + ctx.thread();
      bool seen = slot < key_end && batch_kv_slot_ok(a.kv, r.b, slot);
      if constexpr (Mask::value == attention_mask_kind::flashinfer) seen = seen && attention_custom_bit(a, r, 0, slot);
      off_s[ctx.thread()] = seen ? batch_kv_row_offset(a.kv, r.b, a.layer, slot, r.g) : ~std::size_t{0};
    }
    ctx.sync();
    // The stage's K and V rows.
    if (vectorized) {
      const int row_vectors = D / per;
      for (int e = ctx.thread(); e < n * row_vectors; e += ctx.threads()) {
        const int j = e / row_vectors, d0 = e % row_vectors * per;
        const std::size_t off = off_s[j];
        if (off == ~std::size_t{0}) continue;
        ctx.copy_async16(k_s + j * k_pitch + d0, kg + off + static_cast<std::size_t>(d0), true);
        ctx.copy_async16(v_s + j * D + d0, vg + off + static_cast<std::size_t>(d0), true);
      }
      ctx.async_commit();
      ctx.template async_wait<0>();
    } else {
      for (int e = ctx.thread(); e < n * D; e += ctx.threads()) {
        const int j = e / D, d = e % D;
        const std::size_t off = off_s[j];
        if (off == ~std::size_t{0}) continue;
        k_s[j * k_pitch + d] = kg[off + static_cast<std::size_t>(d)];
        v_s[e] = vg[off + static_cast<std::size_t>(d)];
      }
    }
    ctx.sync();
    // This thread's key: its G scores, each summed over head_dim in order of d.
    if (ctx.thread() < n) {
      float score[GM];
      MEDUSA_UNROLL
      for (int j = 0; j < GM; ++j) score[j] = 0.0f;
      if (off_s[ctx.thread()] != ~std::size_t{0}) {
        const KV* const k = k_s + ctx.thread() * k_pitch;
        if (vectorized) {
          for (int d0 = 0; d0 < D; d0 += per) {
            const vector16<KV> kv = load_vector16(k + d0);
            MEDUSA_UNROLL
            for (int e = 0; e < per; ++e) {
              const float kd = load_float(kv.e[e]);
              MEDUSA_UNROLL
              for (int j = 0; j < GM; ++j)
                if (j < G) score[j] = attention_fma(q_s[j * D + d0 + e], kd, score[j]);
            }
          }
        } else {
          for (int d = 0; d < D; ++d) {
            const float kd = load_float(k[d]);
            MEDUSA_UNROLL
            for (int j = 0; j < GM; ++j)
              if (j < G) score[j] = attention_fma(q_s[j * D + d], kd, score[j]);
          }
        }
      }
      MEDUSA_UNROLL
      for (int j = 0; j < GM; ++j)
        if (j < G) s_s[j * SK + ctx.thread()] = score[j];
    }
    ctx.sync();  // the scores visible to every warp
    // Each warp's units through the stage's tiles, in key order.
    MEDUSA_UNROLL
    for (int k = 0; k < UM; ++k) {
      const int u = ctx.warp() + k * attention_warps;
      if (u >= units) break;  // the same for the whole warp
      const int j = u / slices, slice = u % slices;
      for (int t0 = 0; t0 < n; t0 += KT) {
        const int kj = t0 + ctx.lane();
        const bool valid = kj < n && off_s[kj] != ~std::size_t{0};
        attention_tile<1>(ctx, st[k], valid ? s_s[j * SK + kj] : 0.0f, valid, D,
                          [&](int i) -> const KV* { return v_s + (t0 + i) * D; },
                          slice);
      }
    }
  }
  // Results: the output when the row's keys fit one split, else this split's partial.
  const int nsplits = (keys + split - 1) / split;
  MEDUSA_UNROLL
  for (int k = 0; k < UM; ++k) {
    const int u = ctx.warp() + k * attention_warps;
    if (u >= units) break;
    attention_store_row(ctx, plan, a, r.first, r.g * G + u / slices, ctx.block_x(), nsplits, st[k], u % slices);
  }
}

//! The merge body (launch shape `plan.merge`): one warp per (token, query head) row whose keys
//! span several splits combines the splits' partial outputs in split order.
template <int DC, class Mask, class Ctx, class KV, class O>
MEDUSA_KERNEL_FN void attention_merge_with(Ctx& ctx, const attention_plan& plan, const attention_params<KV, O>& a) {
  using namespace detail;
  const int hq = plan.problem.num_q_heads;
  const int D = plan.problem.head_dim;
  const int row = ctx.block_x() * attention_warps + ctx.warp();
  const int total = a.qo_indptr[a.batch];
  if (row >= total * hq) return;  // whole warps leave together
  const int t = row / hq, h = row % hq;
  attention_request r;
  r.b = attention_request_of(a, t);
  r.first = a.qo_indptr[r.b];
  r.tokens = a.qo_indptr[r.b + 1] - r.first;
  r.length = a.cache_lengths[r.b];
  if (!attention_in_plan(plan, r)) return;  // skipped by the main kernel as well
  const int split = plan.problem.kv_split;
  const int nsplits = (attention_key_count<Mask>(a, r, t - r.first) + split - 1) / split;
  if (nsplits <= 1) return;
  const std::size_t cell0 = (static_cast<std::size_t>(t) * static_cast<std::size_t>(hq) + static_cast<std::size_t>(h)) *
                            static_cast<std::size_t>(plan.splits);
  // The largest split maximum, the lanes reading 32 splits at a time (a split's maximum is never
  // NaN, so the order of the comparisons does not matter).
  float m = attention_neg_inf;
  for (int c0 = 0; c0 < nsplits; c0 += warp_size) {
    const int c = c0 + ctx.lane();
    const float mc = c < nsplits ? a.partial_ml[2 * (cell0 + static_cast<std::size_t>(c))] : attention_neg_inf;
    m = attention_max(m, attention_warp_max(ctx, mc));
  }
  float l = 0.0f;
  float o[DC] = {};
  bool nan = false;
  // The splits in order, their partials loaded a batch at a time so that the loads overlap.
  constexpr int batch = 4;
  for (int c0 = 0; c0 < nsplits; c0 += batch) {
    float mc[batch], lc[batch], po[batch][DC];
    MEDUSA_UNROLL
    for (int i = 0; i < batch; ++i) {
      const std::size_t cell = cell0 + static_cast<std::size_t>(c0 + i);
      const bool in = c0 + i < nsplits;
      mc[i] = in ? a.partial_ml[2 * cell] : attention_neg_inf;
      lc[i] = in ? a.partial_ml[2 * cell + 1] : 0.0f;
      MEDUSA_UNROLL
      for (int cc = 0; cc < DC; ++cc) {
        const int d = ctx.lane() + cc * warp_size;
        po[i][cc] = in && d < D ? a.partial_out[cell * static_cast<std::size_t>(D) + static_cast<std::size_t>(d)] : 0.0f;
      }
    }
    MEDUSA_UNROLL
    for (int i = 0; i < batch; ++i) {
      if (c0 + i >= nsplits) break;
      if (lc[i] != lc[i]) nan = true;
      if (!(mc[i] > attention_neg_inf)) continue;  // a split that saw nothing
      const float w = exp2f(mc[i] - m);
      l = attention_fma(lc[i], w, l);
      MEDUSA_UNROLL
      for (int cc = 0; cc < DC; ++cc) o[cc] = attention_fma(po[i][cc], w, o[cc]);
    }
  }
  if (nan) l = attention_nan;
  O* dst = a.out + static_cast<std::size_t>(t) * static_cast<std::size_t>(a.out_row_stride) +
           static_cast<std::size_t>(h) * static_cast<std::size_t>(D);
  MEDUSA_UNROLL
  for (int cc = 0; cc < DC; ++cc) {
    const int d = ctx.lane() + cc * warp_size;
    if (d < D) dst[d] = store_float<O>(l > 0.0f || l != l ? o[cc] / l : 0.0f);
  }
}

//! Calls `f(std::integral_constant<int, DC>{}, detail::attention_mask_tag<kind>{})` for the plan's
//! head-dim slices and mask kind: the one place the run-time choices become template arguments.
template <class F>
decltype(auto) with_attention_variant(const attention_plan& plan, F&& f) {
  auto by_mask = [&](auto dc) -> decltype(auto) {
    switch (plan.problem.mask) {
      case attention_mask_kind::tree: return f(dc, detail::attention_mask_tag<attention_mask_kind::tree>{});
      case attention_mask_kind::flashinfer: return f(dc, detail::attention_mask_tag<attention_mask_kind::flashinfer>{});
      default: return f(dc, detail::attention_mask_tag<attention_mask_kind::causal>{});
    }
  };
  switch (plan.dim_chunks) {
    case 1: return by_mask(std::integral_constant<int, 1>{});
    case 2: return by_mask(std::integral_constant<int, 2>{});
    default: return by_mask(std::integral_constant<int, 4>{});
  }
}

//! The main body for any plan, dispatched on the host (for the emulation; device launchers
//! instantiate `attention_main_with` per variant).
template <class Ctx, class KV, class O>
void attention_main(Ctx& ctx, const attention_plan& plan, const attention_params<KV, O>& a) {
  with_attention_variant(plan, [&](auto dc, auto mask) {
    if (plan.single_query) attention_single_query_with<decltype(dc)::value, decltype(mask)>(ctx, plan, a);
    else attention_main_with<decltype(dc)::value, decltype(mask)>(ctx, plan, a);
  });
}

//! The merge body for any plan, dispatched on the host (for the emulation).
template <class Ctx, class KV, class O>
void attention_merge(Ctx& ctx, const attention_plan& plan, const attention_params<KV, O>& a) {
  with_attention_variant(plan, [&](auto dc, auto mask) {
    attention_merge_with<decltype(dc)::value, decltype(mask)>(ctx, plan, a);
  });
}

}  // namespace kernels
}  // namespace cuda
MEDUSA_NAMESPACE_END
