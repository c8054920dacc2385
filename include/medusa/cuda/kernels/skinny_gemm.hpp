// SPDX-License-Identifier: Apache-2.0
//! @file cuda/kernels/skinny_gemm.hpp
//! The batch-invariant GEMM of a decode or tree step, `Y = X·Wᵀ` (optionally `Y += X·Wᵀ`, the
//! residual add): W is `[n][k]` in bf16 or f16 (an engine's linear layer, row-major as stored), X
//! the pass's `[rows][k]` activations of the same type, Y `[rows][n]` in float. Tensor cores
//! (`mma_m16n8k16`), float accumulation.
//!
//! **Every output element is reduced over k in one order whatever `rows` is**, so a row's bits do
//! not depend on the pass it is in (a tree node equals its row decoded alone; docs/cuda.md):
//! - k is cut into 32-element chunks; the block's 8 warps each own a fixed range of chunks (a
//!   function of k alone) and sum theirs in order, two mma k-steps a chunk;
//! - the warps' partial sums are added in warp order, then the residual, if any.
//! The pass size only chooses how many 8-row column tiles a block carries (1, 4 or 8) and how many
//! 16-feature tiles (1 or 2): neither changes an element's arithmetic. There is no split of k
//! across blocks and no switch of algorithm by size.
//!
//! X and Y may have row strides, and one launch may run a batch of GEMMs of the same sizes over
//! strided W, X and Y (`skinny_gemm_problem::batch`: the Medusa heads, one per head); neither
//! changes an element's arithmetic.
//!
//! **The SwiGLU epilogue** (`skinny_gemm_problem::swiglu`) fuses an FFN's gate and up projections
//! with `h = SiLU(gate) ⊙ up`: W holds gate and up rows interleaved by eight
//! (`skinny_gemm_swiglu_source` gives the layout), so each lane's accumulators hold a gate and its
//! up, and the block writes `h` rounded to T, `[rows][gated_columns]`, instead of Y. The sums are
//! those of the plain GEMM over the same W: the fused result has the bits of the plain GEMM
//! followed by `store_float<T>(silu(gate) * up)`.
//!
//! **Streaming.** Each warp copies its k range of the block's W rows and X rows into a ring of
//! shared-memory stages with asynchronous 16-byte copies (`copy_async16`), a warp instruction
//! covering whole 64- to 128-byte runs of rows, several stages in flight; it then reads each
//! lane's fragments from the ring. W is streamed once per row group (`8 · row_tiles` rows); the
//! pass's activations are re-read from L2 by every block. The tensor cores see W as A (16 features
//! × 16 k) and X as B (16 k × 8 rows), so a single row wastes only B's other columns. Inside a
//! chunk each lane takes 8 consecutive elements of a row and feeds them to the two k-steps as k
//! positions {2t, 2t+1, 2t+8, 2t+9}: A and B use the same permutation, so the product is the same
//! sum, with 16-byte instead of 4-byte reads. Where W or X do not allow 16-byte copies
//! (`skinny_gemm_aligned`), the stages are filled element by element: the same values, the same
//! bits.
//!
//! @code
//! namespace mk = medusa::cuda::kernels;
//! const mk::skinny_gemm_plan plan = mk::plan_skinny_gemm({.n = 4096, .k = 4096, .rows = rows});
//! medusa::cuda::check(medusa::cuda::run(plan, mk::skinny_gemm_params<medusa::bfloat16>{w, x, y, false}, stream),
//!                     "skinny gemm");
//! @endcode
#pragma once

#include <medusa/config.hpp>
#include <medusa/cuda/kernel_context.hpp>
#include <medusa/cuda/launch.hpp>
#include <medusa/half.hpp>
#include <medusa/heads.hpp>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

MEDUSA_NAMESPACE_BEGIN
namespace cuda::kernels {

inline constexpr int skinny_gemm_warps = 8;                           //!< warps of a block, each a k range
inline constexpr int skinny_gemm_threads = skinny_gemm_warps * warp_size;  //!< threads of a block
inline constexpr int skinny_gemm_chunk = 32;                           //!< k elements of one mma pair
inline constexpr int skinny_gemm_max_row_tiles = 8;                    //!< 8-row tiles a block carries at most

//! The sizes of one GEMM.
struct skinny_gemm_problem {
  int n = 0;     //!< output features: W's rows, Y's columns
  int k = 0;     //!< the reduction: W's and X's columns
  int rows = 0;  //!< the pass's rows: X's and Y's rows
  //! Independent GEMMs of these sizes in one launch, the arrays of GEMM i advanced by the params'
  //! batch strides (the Medusa heads: one ResBlock or projection per head).
  int batch = 1;
  //! The SwiGLU epilogue: W's features are gate/up rows interleaved by eight
  //! (`skinny_gemm_swiglu_source`), n a multiple of 16, and the run writes `h` instead of Y.
  bool swiglu = false;
};

//! A validated GEMM and its launch (`plan_skinny_gemm`).
struct skinny_gemm_plan {
  skinny_gemm_problem problem;
  int row_tiles = 0;      //!< 8-row column tiles of B per block: 1 (up to 8 rows), 4 (up to 32) or 8
  int feature_tiles = 0;  //!< 16-feature tiles of A per block: 1 or 2
  launch_shape launch;    //!< grid (n / 16·feature_tiles, rows / 8·row_tiles · batch), 256 threads
};

//! The arrays of one run: W `[n][k]` (rows contiguous), X `[rows][k]` and Y `[rows][n]` with row
//! strides `ldx`, `ldy` (0: contiguous); GEMM i of a batch reads `w + i·stride_w`,
//! `x + i·stride_x` and writes `y + i·stride_y` (a stride may be 0: a W or X shared by the batch).
template <class T>
struct skinny_gemm_params {
  const T* w = nullptr;
  const T* x = nullptr;
  float* y = nullptr;
  bool accumulate = false;  //!< Y += X·Wᵀ (the residual add) instead of Y = X·Wᵀ
  //! SwiGLU plans: `h = SiLU(gate) ⊙ up` rounded to T, `[rows][gated_columns]` (Y is not used).
  T* gated = nullptr;
  int gated_columns = 0;  //!< h's columns: at most n/2, more than n/2 - 8 (W's pad rows are zeros)
  std::int64_t ldx = 0;       //!< elements between rows of X (0: k)
  std::int64_t ldy = 0;       //!< elements between rows of Y (0: n)
  std::int64_t stride_w = 0;  //!< elements between the W of consecutive GEMMs of a batch
  std::int64_t stride_x = 0;  //!< ... of X
  std::int64_t stride_y = 0;  //!< ... of Y
};

//! W's feature `feature` of a SwiGLU GEMM with `columns` outputs: in each group of 16 features,
//! the first eight are gate rows `8·group + 0..7` and the last eight the matching up rows. Returns
//! the row of the stacked `[gate; up]` matrix (`[2·columns][k]`: gate rows, then up rows) to place
//! there, or -1 for a pad row (zeros) past the last column.
[[nodiscard]] constexpr int skinny_gemm_swiglu_source(int feature, int columns) noexcept {
  const int column = feature / 16 * 8 + feature % 8;
  if (column >= columns) return -1;
  return feature % 16 < 8 ? column : columns + column;
}

//! W's features for a SwiGLU GEMM with `columns` outputs (`columns` rounded up to 8, times 2).
[[nodiscard]] constexpr int skinny_gemm_swiglu_features(int columns) noexcept { return 16 * ((columns + 7) / 8); }

namespace detail {

// The body's loops unroll on the device (registers, not local memory); on the host, where the
// emulation runs them, unrolling only makes the compile minutes long.
#if defined(__CUDACC__)
#define MEDUSA_SKINNY_UNROLL _Pragma("unroll")
#else
#define MEDUSA_SKINNY_UNROLL
#endif

// The three instances, by their row tiles (1, 4, 8): 16-feature tiles (two halve the re-reads of
// X at 8 row tiles), ring stages per warp, and 32-element chunks per stage: the fastest of the
// schedules measured on an H200, each at most 96 KiB of shared memory, so that two or three blocks
// share an SM (and a consumer GPU's 99 KiB a block suffices). The plan's grid and the launched
// instance both read them here. (The body takes any schedule as template arguments: bench_gemm
// times others against these.)
MEDUSA_HOST_DEVICE constexpr int skinny_gemm_feature_tiles(int row_tiles) noexcept { return row_tiles == 8 ? 2 : 1; }
MEDUSA_HOST_DEVICE constexpr int skinny_gemm_stages(int row_tiles) noexcept { return row_tiles == 4 ? 3 : 2; }
MEDUSA_HOST_DEVICE constexpr int skinny_gemm_stage_chunks(int row_tiles) noexcept { return row_tiles == 1 ? 2 : 1; }
// 16-byte pieces from one row of a stage to the next: the row's pieces, plus 64 bytes where a row
// is 128 bytes or more, so that the eight lanes of a quarter-warp read eight distinct bank groups.
MEDUSA_HOST_DEVICE constexpr int skinny_gemm_row_stride(int chunks) noexcept { return 4 * chunks + (chunks == 1 ? 0 : 4); }
// Rows (of W and X) in one stage.
MEDUSA_HOST_DEVICE constexpr int skinny_gemm_stage_rows(int row_tiles, int feature_tiles) noexcept {
  return 16 * feature_tiles + 8 * row_tiles;
}

[[noreturn]] inline void skinny_gemm_fail(launch_errc c, const std::string& what) {
  throw launch_error(c, "skinny gemm: " + what);
}

// Shared bytes of a schedule: every warp's ring; after the k loop, one warp's partial sums at a
// time (the cross-warp sum goes in warp order) in the same bytes.
constexpr std::size_t skinny_gemm_shared_bytes(int row_tiles, int feature_tiles, int stages, int stage_chunks) noexcept {
  const std::size_t ring = std::size_t{skinny_gemm_warps} * static_cast<std::size_t>(stages) *
                           static_cast<std::size_t>(skinny_gemm_stage_rows(row_tiles, feature_tiles)) *
                           static_cast<std::size_t>(skinny_gemm_row_stride(stage_chunks)) * 16;
  const std::size_t partial =
      static_cast<std::size_t>(row_tiles) * static_cast<std::size_t>(feature_tiles) * warp_size * 4 * sizeof(float);
  return ring > partial ? ring : partial;
}
// ... of the library's instance with `row_tiles`.
constexpr std::size_t skinny_gemm_shared_bytes(int row_tiles) noexcept {
  return skinny_gemm_shared_bytes(row_tiles, skinny_gemm_feature_tiles(row_tiles), skinny_gemm_stages(row_tiles),
                                  skinny_gemm_stage_chunks(row_tiles));
}

// Sixteen bytes of the ring: eight elements, two to a register.
struct alignas(16) skinny_words {
  std::uint32_t w[4];
};

// Fills `Rows` rows of a stage (`Stride` pieces apart) with chunks [c0, c0 + Pieces / 4) of the
// rows `first_row + r` of `m` (`ld` elements apart, `count` of them, the rest zeros), zeros for
// chunks at or past `last`. Piece p is row p / Pieces, so a warp instruction covers whole runs of
// consecutive rows. `aligned`: 16-byte asynchronous copies (the same for the whole launch); else
// element by element, zeros past k: the same values.
template <int Rows, int Pieces, int Stride, class T, class Ctx>
MEDUSA_KERNEL_FN void fill_rows(Ctx& ctx, skinny_words* stage, const T* m, std::size_t ld, int first_row, int count,
                                int c0, int last, int k, bool aligned) noexcept {
  const int lane = ctx.lane();
  if (aligned) {
    MEDUSA_SKINNY_UNROLL
    for (int p = lane; p < Rows * Pieces; p += warp_size) {
      const int r = p / Pieces, col = p % Pieces;
      const int c = c0 + col / 4;
      const int k0 = c * skinny_gemm_chunk + 8 * (col % 4);
      const bool ok = first_row + r < count && c < last && k0 < k;  // k a multiple of 8: all in or all out
      const std::size_t at = ok ? static_cast<std::size_t>(first_row + r) * ld + static_cast<std::size_t>(k0) : 0;
      ctx.copy_async16(stage + r * Stride + col, m + at, ok);
    }
    return;
  }
  for (int p = lane; p < Rows * Pieces; p += warp_size) {
    const int r = p / Pieces, col = p % Pieces;
    const int c = c0 + col / 4;
    const bool exists = first_row + r < count && c < last;
    const T* const row = m + (exists ? static_cast<std::size_t>(first_row + r) * ld : 0);
    const int k0 = c * skinny_gemm_chunk + 8 * (col % 4);
    skinny_words v;
    for (int i = 0; i < 4; ++i) {
      const int lo = k0 + 2 * i, hi = lo + 1;
      const std::uint32_t a = exists && lo < k ? row[lo].bits() : 0u;
      const std::uint32_t b = exists && hi < k ? row[hi].bits() : 0u;
      v.w[i] = a | b << 16;
    }
    store_aligned(stage + r * Stride + col, v);
  }
}

// `plan` with `row_tiles` × `feature_tiles` blocks of `shared_bytes`: its grid, checked against the
// device's limits.
inline skinny_gemm_plan skinny_gemm_tiled(skinny_gemm_plan plan, int row_tiles, int feature_tiles, std::size_t shared_bytes) {
  const skinny_gemm_problem& p = plan.problem;
  plan.row_tiles = row_tiles;
  plan.feature_tiles = feature_tiles;
  const std::int64_t grid_x = (std::int64_t{p.n} + 16 * feature_tiles - 1) / (16 * feature_tiles);
  const std::int64_t grid_y = (std::int64_t{p.rows} + 8 * row_tiles - 1) / (8 * row_tiles) * std::int64_t{p.batch};
  if (grid_x > std::numeric_limits<int>::max() || grid_y > 65535)
    skinny_gemm_fail(launch_errc::invalid_shape, "grid of " + std::to_string(grid_x) + " x " + std::to_string(grid_y) +
                                                     " blocks is beyond the device's limits");
  plan.launch = {.grid_x = static_cast<int>(grid_x),
                 .grid_y = static_cast<int>(grid_y),
                 .threads = skinny_gemm_threads,
                 .shared_bytes = shared_bytes};
  return plan;
}

// A validated plan (`plan_skinny_gemm`) for another schedule of the body,
// `skinny_gemm_body<RT, F, S, CH>`: the grid and shared bytes it needs. bench_gemm and the tests
// run such schedules; they give the library instance's bits.
template <int RT, int F, int S, int CH>
skinny_gemm_plan skinny_gemm_rescheduled(const skinny_gemm_plan& plan) {
  return skinny_gemm_tiled(plan, RT, F, skinny_gemm_shared_bytes(RT, F, S, CH));
}

}  // namespace detail

//! Validates `p` and picks the launch.
//! @throws launch_error `invalid_shape`: a size below 1, a grid beyond the device's limits, a
//!         SwiGLU plan whose n is not a multiple of 16; `unsupported`: a SwiGLU plan with a batch
//!         of more than one GEMM.
[[nodiscard]] inline skinny_gemm_plan plan_skinny_gemm(const skinny_gemm_problem& p) {
  using detail::skinny_gemm_fail;
  if (p.n < 1 || p.k < 1 || p.rows < 1 || p.batch < 1)
    skinny_gemm_fail(launch_errc::invalid_shape, "n, k, rows and batch must be at least 1, got n " + std::to_string(p.n) +
                                                     ", k " + std::to_string(p.k) + ", rows " + std::to_string(p.rows) +
                                                     ", batch " + std::to_string(p.batch));
  if (p.swiglu && p.batch != 1)
    skinny_gemm_fail(launch_errc::unsupported, "the SwiGLU epilogue runs one GEMM, not a batch of " + std::to_string(p.batch));
  if (p.swiglu && p.n % 16 != 0)
    skinny_gemm_fail(launch_errc::invalid_shape, "a SwiGLU GEMM needs a multiple of 16 features (gate/up pairs "
                                                 "interleaved by eight), got n " + std::to_string(p.n));
  skinny_gemm_plan plan;
  plan.problem = p;
  // Three instances: up to 8 rows, up to 32, more (each further instance costs every CUDA build
  // of an engine its compile time).
  const int row_tiles = p.rows <= 8 ? 1 : p.rows <= 32 ? 4 : skinny_gemm_max_row_tiles;
  return detail::skinny_gemm_tiled(plan, row_tiles, detail::skinny_gemm_feature_tiles(row_tiles),
                                   detail::skinny_gemm_shared_bytes(row_tiles));
}

//! The plan of a SwiGLU GEMM with `columns` outputs of `k` inputs over `rows` rows (W of
//! `skinny_gemm_swiglu_features(columns)` interleaved rows).
//! @throws launch_error as `plan_skinny_gemm`
[[nodiscard]] inline skinny_gemm_plan plan_skinny_gemm_swiglu(int columns, int k, int rows) {
  skinny_gemm_problem p;
  p.n = skinny_gemm_swiglu_features(columns);
  p.k = k;
  p.rows = rows;
  p.swiglu = true;
  return plan_skinny_gemm(p);
}

//! The arguments of a SwiGLU run: W interleaved, X `[rows][k]`, h `[rows][columns]`.
template <class T>
[[nodiscard]] skinny_gemm_params<T> skinny_gemm_swiglu_params(const T* w, const T* x, T* h, int columns) noexcept {
  skinny_gemm_params<T> a;
  a.w = w;
  a.x = x;
  a.gated = h;
  a.gated_columns = columns;
  return a;
}

//! True when the arrays of `a` suit `plan`: W and X set; row strides 0 or at least a row; batch
//! strides not negative; and Y, or for a SwiGLU plan `gated` with `gated_columns` in
//! `(n/2 - 8, n/2]`.
template <class T>
[[nodiscard]] bool skinny_gemm_args_ok(const skinny_gemm_plan& plan, const skinny_gemm_params<T>& a) noexcept {
  if (a.w == nullptr || a.x == nullptr) return false;
  if ((a.ldx != 0 && a.ldx < plan.problem.k) || (a.ldy != 0 && a.ldy < plan.problem.n)) return false;
  if (a.stride_w < 0 || a.stride_x < 0 || a.stride_y < 0) return false;
  if (!plan.problem.swiglu) return a.y != nullptr;
  const int half = plan.problem.n / 2;
  return a.gated != nullptr && a.gated_columns <= half && a.gated_columns > half - 8 && a.gated_columns > 0;
}

//! True when W and X allow 16-byte loads: k, X's row stride and the batch strides of W and X
//! multiples of 8, W and X 16-byte aligned.
template <class T>
[[nodiscard]] bool skinny_gemm_aligned(const skinny_gemm_plan& plan, const skinny_gemm_params<T>& a) noexcept {
  return plan.problem.k % 8 == 0 && a.ldx % 8 == 0 && a.stride_w % 8 == 0 && a.stride_x % 8 == 0 &&
         (reinterpret_cast<std::uintptr_t>(a.w) & 15u) == 0 && (reinterpret_cast<std::uintptr_t>(a.x) & 15u) == 0;
}

//! The kernel body: block (x, y) computes features `[16·F·x, 16·F·(x+1))` of rows
//! `[8·RT·g, 8·RT·(g+1))` of GEMM `y / groups` of the batch, `g = y mod groups` (`groups` the row
//! groups of one GEMM). `RT`, `F` are the plan's tiles; `aligned` is `skinny_gemm_aligned`. `S`
//! (ring stages a warp) and `CH` (chunks a stage) default to the library's instance; other
//! schedules (`detail::skinny_gemm_rescheduled` gives their plan) reorder the copies, not an
//! element's arithmetic, so they give the same bits.
template <int RT, int F, int S = detail::skinny_gemm_stages(RT), int CH = detail::skinny_gemm_stage_chunks(RT), class T,
          class Ctx>
MEDUSA_KERNEL_FN void skinny_gemm_body(Ctx& ctx, const skinny_gemm_plan& plan, const skinny_gemm_params<T>& a,
                                       bool aligned) {
  static_assert(std::is_same_v<T, medusa::bfloat16> || std::is_same_v<T, medusa::half>,
                "the skinny GEMM multiplies bfloat16 or half");
  static_assert(RT >= 1 && F >= 1 && S >= 1 && CH >= 1, "a schedule has at least one tile, stage and chunk");
  constexpr int pieces = 4 * CH;  // 16-byte pieces of a row per stage
  constexpr int stride = detail::skinny_gemm_row_stride(CH);
  constexpr int w_rows = 16 * F, rows_per_stage = detail::skinny_gemm_stage_rows(RT, F);
  constexpr int stage_pieces = rows_per_stage * stride;
  const int n = plan.problem.n, k = plan.problem.k, rows = plan.problem.rows;
  const int lane = ctx.lane(), warp = ctx.warp();
  const int g = lane / 4, t = lane % 4;
  const int feature0 = ctx.block_x() * 16 * F;
  const int groups = (rows + 8 * RT - 1) / (8 * RT);
  const int gemm = ctx.block_y() / groups;
  const int row0 = ctx.block_y() % groups * 8 * RT;
  const std::size_t ldx = a.ldx != 0 ? static_cast<std::size_t>(a.ldx) : static_cast<std::size_t>(k);
  const std::size_t ldy = a.ldy != 0 ? static_cast<std::size_t>(a.ldy) : static_cast<std::size_t>(n);
  const T* const w = a.w + static_cast<std::size_t>(gemm) * static_cast<std::size_t>(a.stride_w);
  const T* const x = a.x + static_cast<std::size_t>(gemm) * static_cast<std::size_t>(a.stride_x);
  const int chunks = (k + skinny_gemm_chunk - 1) / skinny_gemm_chunk;
  const int first = static_cast<int>(std::int64_t{chunks} * warp / skinny_gemm_warps);
  const int last = static_cast<int>(std::int64_t{chunks} * (warp + 1) / skinny_gemm_warps);

  // This warp's ring: S stages of `rows_per_stage` rows (the block's W rows, then its X rows),
  // `stride` pieces apart.
  auto* const ring = static_cast<detail::skinny_words*>(ctx.shared()) + static_cast<std::size_t>(warp) * S * stage_pieces;
  // Chunks [c0, c0 + CH) of the warp's range into stage `slot`: W's rows, then X's.
  const auto fill = [&](int c0, int slot) {
    detail::skinny_words* const stage = ring + slot * stage_pieces;
    detail::fill_rows<w_rows, pieces, stride>(ctx, stage, w, static_cast<std::size_t>(k), feature0, n, c0, last, k, aligned);
    detail::fill_rows<8 * RT, pieces, stride>(ctx, stage + w_rows * stride, x, ldx, row0, rows, c0, last, k, aligned);
  };

  float acc[F][RT][4];
  MEDUSA_SKINNY_UNROLL
  for (int f = 0; f < F; ++f)
    MEDUSA_SKINNY_UNROLL
    for (int j = 0; j < RT; ++j)
      MEDUSA_SKINNY_UNROLL
      for (int i = 0; i < 4; ++i) acc[f][j][i] = 0.0f;

  MEDUSA_SKINNY_UNROLL
  for (int s = 0; s < S; ++s) {
    fill(first + s * CH, s);
    ctx.async_commit();
  }
  int slot = 0;
  for (int c0 = first; c0 < last; c0 += CH) {
    ctx.template async_wait<S - 1>();  // this lane's copies of the stage have landed
    ctx.sync_warp();                   // and every lane's
    const detail::skinny_words* const stage = ring + slot * stage_pieces;
    MEDUSA_SKINNY_UNROLL
    for (int u = 0; u < CH; ++u) {
      if (c0 + u >= last) break;  // the same for the whole warp
      // A's rows g and g + 8 of each feature tile, B's column g of each row tile, 8 elements of
      // chunk c0 + u from 8t.
      detail::skinny_words wr[F][2];
      MEDUSA_SKINNY_UNROLL
      for (int f = 0; f < F; ++f)
        MEDUSA_SKINNY_UNROLL
        for (int h = 0; h < 2; ++h) wr[f][h] = load_aligned<detail::skinny_words>(stage + (16 * f + 8 * h + g) * stride + 4 * u + t);
      MEDUSA_SKINNY_UNROLL
      for (int j = 0; j < RT; ++j) {
        const detail::skinny_words xr = load_aligned<detail::skinny_words>(stage + (w_rows + 8 * j + g) * stride + 4 * u + t);
        MEDUSA_SKINNY_UNROLL
        for (int step = 0; step < 2; ++step) {
          const std::uint32_t b[2] = {xr.w[2 * step], xr.w[2 * step + 1]};
          MEDUSA_SKINNY_UNROLL
          for (int f = 0; f < F; ++f) {
            const std::uint32_t af[4] = {wr[f][0].w[2 * step], wr[f][1].w[2 * step], wr[f][0].w[2 * step + 1],
                                         wr[f][1].w[2 * step + 1]};
            ctx.template mma_m16n8k16<T>(acc[f][j], af, b);
          }
        }
      }
    }
    ctx.sync_warp();  // every lane has read the stage before it is refilled
    fill(c0 + S * CH, slot);
    ctx.async_commit();
    slot = slot + 1 == S ? 0 : slot + 1;
  }
  ctx.template async_wait<0>();
  ctx.sync();  // the rings are free: their bytes take the partial sums

  // The warps' partial sums, added in warp order through one warp's worth of shared memory.
  float* partial = static_cast<float*>(ctx.shared());
  for (int w = 0; w < skinny_gemm_warps; ++w) {
    if (warp == w) {
      MEDUSA_SKINNY_UNROLL
      for (int f = 0; f < F; ++f)
        MEDUSA_SKINNY_UNROLL
        for (int j = 0; j < RT; ++j)
          MEDUSA_SKINNY_UNROLL
          for (int i = 0; i < 4; ++i) {
            float& s = partial[((f * RT + j) * 4 + i) * warp_size + lane];
            s = w == 0 ? acc[f][j][i] : s + acc[f][j][i];
          }
    }
    ctx.sync();
  }
  constexpr int elements = F * RT * 4 * warp_size;
  if (plan.problem.swiglu) {
    // A lane's registers 0/1 are gate rows g, registers 2/3 the up rows g + 8 of the same rows of X.
    for (int e = ctx.thread(); e < elements / 2; e += skinny_gemm_threads) {
      const int l = e % warp_size, i = (e / warp_size) % 2, j = (e / (2 * warp_size)) % RT, f = e / (2 * warp_size * RT);
      const int column = (feature0 + 16 * f) / 2 + mma_fragment::d_row(l, i);
      const int row = row0 + 8 * j + mma_fragment::d_col(l, i);
      if (column >= a.gated_columns || row >= rows) continue;
      const float gate = partial[((f * RT + j) * 4 + i) * warp_size + l];
      const float up = partial[((f * RT + j) * 4 + i + 2) * warp_size + l];
      a.gated[static_cast<std::size_t>(row) * static_cast<std::size_t>(a.gated_columns) + static_cast<std::size_t>(column)] =
          store_float<T>(medusa::silu(gate) * up);
    }
    return;
  }
  // The stores: thread e of the block writes elements e, e + 256, ... of the F × RT × 4 × 32 sums.
  for (int e = ctx.thread(); e < elements; e += skinny_gemm_threads) {
    const int l = e % warp_size, i = (e / warp_size) % 4, j = (e / (4 * warp_size)) % RT, f = e / (4 * warp_size * RT);
    const int feature = feature0 + 16 * f + mma_fragment::d_row(l, i);
    const int row = row0 + 8 * j + mma_fragment::d_col(l, i);
    if (feature >= n || row >= rows) continue;
    float& out = a.y[static_cast<std::size_t>(gemm) * static_cast<std::size_t>(a.stride_y) +
                     static_cast<std::size_t>(row) * ldy + static_cast<std::size_t>(feature)];
    out = a.accumulate ? out + partial[e] : partial[e];
  }
}

//! Calls `f(std::integral_constant<int, RT>, std::integral_constant<int, F>)` with the plan's
//! tiles: the one place a run picks its instance.
template <class F>
decltype(auto) with_skinny_gemm_variant(const skinny_gemm_plan& plan, F&& f) {
  const auto tiles = [&](auto rt) -> decltype(auto) {
    return f(rt, std::integral_constant<int, detail::skinny_gemm_feature_tiles(decltype(rt)::value)>{});
  };
  switch (plan.row_tiles) {
    case 1: return tiles(std::integral_constant<int, 1>{});
    case 4: return tiles(std::integral_constant<int, 4>{});
    default: return tiles(std::integral_constant<int, skinny_gemm_max_row_tiles>{});
  }
}

//! The body with the plan's instance, chosen on the host (for the emulation; `cuda/skinny_gemm.cuh`
//! launches the device's).
template <class T, class Ctx>
void skinny_gemm(Ctx& ctx, const skinny_gemm_plan& plan, const skinny_gemm_params<T>& a) {
  const bool aligned = skinny_gemm_aligned(plan, a);
  with_skinny_gemm_variant(plan, [&](auto rt, auto ft) {
    skinny_gemm_body<decltype(rt)::value, decltype(ft)::value>(ctx, plan, a, aligned);
  });
}

}  // namespace cuda::kernels
MEDUSA_NAMESPACE_END

#undef MEDUSA_SKINNY_UNROLL
