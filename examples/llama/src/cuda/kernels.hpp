// SPDX-License-Identifier: Apache-2.0
// Private: the GPU engine's own kernel bodies, around the GEMMs and the library's attention and
// step kernels: embedding, RMSNorm, RoPE with the K/V writes and SwiGLU. Each is a functor over
// the execution context of <medusa/cuda/kernel_context.hpp>, so one source runs on the device
// (device_executor.cuh) and in the host emulation (host_executor.hpp, the CI tests). Residual adds
// are the GEMMs' beta = 1.
#pragma once

#include <medusa/cuda/kernel_context.hpp>
#include <medusa/cuda/kernels/batch_kv.hpp>
#include <medusa/cuda/launch.hpp>
#include <medusa/half.hpp>
#include <medusa/heads.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

namespace medusa_llama::cuda_detail {

namespace mc = medusa::cuda;
namespace mk = medusa::cuda::kernels;

// Launch shapes of the element-wise work, so that a decode pass of one row still spreads over the
// GPU: row reductions (RMSNorm) and per-token work (RoPE + K/V write) take a block of up to 1024
// threads, each about four elements; purely element-wise work (embedding, SwiGLU) takes blocks of
// `elementwise_threads` over a row's columns (block x) and its rows (block y). A shape depends on
// the model's sizes only, never on the number of rows, so a row's result does not depend on the
// pass it is in.
inline constexpr int row_threads = 1024;       // most threads of a per-row block
inline constexpr int elementwise_threads = 256;

// Threads of a block that walks `work` items of one row: about four each, a multiple of 32.
constexpr int threads_for(int work) noexcept {
  const int t = ((work + 3) / 4 + 31) / 32 * 32;
  return t < 32 ? 32 : t > row_threads ? row_threads : t;
}
// One block per row, `threads_for(work)` threads, and the 32 floats of `block_sum`'s scratch.
constexpr mc::launch_shape row_shape(int rows, int work) noexcept {
  return {.grid_x = rows, .grid_y = 1, .threads = threads_for(work), .shared_bytes = 32 * sizeof(float)};
}
// Blocks of `elementwise_threads` over `cols` columns (x) of `rows` rows (y).
constexpr mc::launch_shape elementwise_shape(int rows, int cols) noexcept {
  return {.grid_x = (cols + elementwise_threads - 1) / elementwise_threads, .grid_y = rows, .threads = elementwise_threads,
          .shared_bytes = 0};
}
inline constexpr float nan_value = std::numeric_limits<float>::quiet_NaN();  // a value device code may read

// Block-wide sum of one float per thread (the block a multiple of 32 threads, at most 1024);
// every thread gets the result. `scratch` holds 32 floats of shared memory.
template <class Ctx>
MEDUSA_KERNEL_FN float block_sum(Ctx& ctx, float v, float* scratch) {
  for (int m = mc::warp_size / 2; m > 0; m /= 2) v += ctx.shfl_xor(v, m);
  if (ctx.lane() == 0) scratch[ctx.warp()] = v;
  ctx.sync();
  const int warps = ctx.threads() / mc::warp_size;
  float t = ctx.lane() < warps ? scratch[ctx.lane()] : 0.0f;
  for (int m = mc::warp_size / 2; m > 0; m /= 2) t += ctx.shfl_xor(t, m);
  ctx.sync();  // scratch is free again
  return t;
}

// The request of token t of a ragged batch: the last b with qo_indptr[b] <= t.
MEDUSA_KERNEL_FN int request_of(const std::int32_t* qo_indptr, int batch, int t) noexcept {
  int lo = 0, hi = batch - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (qo_indptr[mid] <= t) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// Synthetic weights made where they live: uniform in [-scale, scale) from a hash of (seed, index),
// or `value` everywhere when scale is 0. Any grid (a grid-stride loop).
template <class T>
struct fill_body {
  static constexpr int max_threads = 256;
  T* out = nullptr;
  std::size_t n = 0;
  float scale = 0.0f;
  float value = 0.0f;
  std::uint64_t seed = 0;

  template <class Ctx>
  MEDUSA_KERNEL_FN void operator()(Ctx& ctx) const {
    const std::size_t step = static_cast<std::size_t>(ctx.grid_x()) * static_cast<std::size_t>(ctx.threads());
    for (std::size_t i = static_cast<std::size_t>(ctx.block_x()) * static_cast<std::size_t>(ctx.threads()) +
                         static_cast<std::size_t>(ctx.thread());
         i < n; i += step) {
      std::uint64_t x = seed ^ (i * 0x9E3779B97F4A7C15ull);  // splitmix64
      x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
      x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
      x ^= x >> 31;
      const float u = static_cast<float>(x >> 40) * (2.0f / 16777216.0f) - 1.0f;
      out[i] = mc::store_float<T>(scale != 0.0f ? scale * u : value);
    }
  }
};

// x[t] = embedding[tokens[t]] as float over `elementwise_shape(T, dim)`. A token outside the
// vocabulary gives a NaN row, which the verify and top-k kernels then report as the request's status.
template <class T>
struct embed_body {
  static constexpr int max_threads = elementwise_threads;
  const T* embedding = nullptr;  // [vocab][dim]
  const std::int32_t* tokens = nullptr;
  float* x = nullptr;  // [T][dim]
  int dim = 0, vocab = 0;

  template <class Ctx>
  MEDUSA_KERNEL_FN void operator()(Ctx& ctx) const {
    const int t = ctx.block_y();
    const int c = ctx.block_x() * ctx.threads() + ctx.thread();
    if (c >= dim) return;
    const std::int32_t token = tokens[t];
    float* dst = x + static_cast<std::size_t>(t) * static_cast<std::size_t>(dim);
    if (token < 0 || token >= vocab) {
      dst[c] = nan_value;
      return;
    }
    dst[c] = mc::load_float(embedding[static_cast<std::size_t>(token) * static_cast<std::size_t>(dim) + static_cast<std::size_t>(c)]);
  }
};

// RMSNorm of rows: out = w ⊙ (x · 1/sqrt(mean(x²) + eps)), as the CPU engine computes it, to the
// activation type T (GEMM input) and/or float (the hidden states the heads and the caller read).
// Output row r reads input row `rows[r]` (or r when `rows` is null). `row_shape(R, dim)`: one block
// per output row.
template <class T>
struct rmsnorm_body {
  static constexpr int max_threads = row_threads;
  const float* x = nullptr;          // [.][dim]
  const float* weight = nullptr;     // [dim]
  const std::int32_t* rows = nullptr;  // optional input row of each output row
  T* out = nullptr;                  // [R][dim] or null
  float* out_f32 = nullptr;          // [R][dim] or null
  int dim = 0;
  float eps = 1e-5f;

  template <class Ctx>
  MEDUSA_KERNEL_FN void operator()(Ctx& ctx) const {
    const int r = ctx.block_x();
    const int src_row = rows != nullptr ? rows[r] : r;
    const float* xr = x + static_cast<std::size_t>(src_row) * static_cast<std::size_t>(dim);
    float ss = 0.0f;
    for (int c = ctx.thread(); c < dim; c += ctx.threads()) ss += xr[c] * xr[c];
    auto* scratch = static_cast<float*>(ctx.shared());
    ss = block_sum(ctx, ss, scratch);
    const float inv = 1.0f / sqrtf(ss / static_cast<float>(dim) + eps);
    const std::size_t base = static_cast<std::size_t>(r) * static_cast<std::size_t>(dim);
    for (int c = ctx.thread(); c < dim; c += ctx.threads()) {
      const float y = weight[c] * (inv * xr[c]);
      if (out != nullptr) out[base + static_cast<std::size_t>(c)] = mc::store_float<T>(y);
      if (out_f32 != nullptr) out_f32[base + static_cast<std::size_t>(c)] = y;
    }
  }
};

// RoPE at each token's position on the query and key heads of the fused QKV projection (in place,
// float), then the token's K and V rows written to its cache slot `L_b + i` (request b, i-th new
// token) in the cache's type. `rope_shape(T, hq, hkv, head_dim)`: one block per token and query or
// key head (a decoded token spreads over hq + hkv blocks); the block of key head j also writes
// value head j. Each thread takes whole rotation pairs, so a pair's values go from its registers
// to the cache.
template <class T>
struct rope_kv_body {
  static constexpr int max_threads = row_threads;
  float* qkv = nullptr;  // [T][(hq + 2·hkv)·head_dim]: q heads, k heads, v heads
  const std::int32_t* positions = nullptr;
  const std::int32_t* qo_indptr = nullptr;
  const std::int32_t* cache_lengths = nullptr;
  int batch = 0;
  const float* cos = nullptr;  // [seq_len][head_dim / 2]
  const float* sin = nullptr;
  int seq_len = 0;
  int hq = 0, hkv = 0, head_dim = 0;
  bool split_halves = false;  // Hugging Face `rotate_half` pairs (i, i + D/2); else (2i, 2i+1)
  mk::batch_kv kv;
  int layer = 0;

  template <class Ctx>
  MEDUSA_KERNEL_FN void operator()(Ctx& ctx) const {
    const int t = ctx.block_x(), head = ctx.block_y();
    const int D = head_dim, half = head_dim / 2;
    const int cols = (hq + 2 * hkv) * D;
    float* row = qkv + static_cast<std::size_t>(t) * static_cast<std::size_t>(cols);
    float* v = row + static_cast<std::size_t>(head) * static_cast<std::size_t>(D);
    const int pos = positions[t];
    const bool pos_ok = pos >= 0 && pos < seq_len;
    const float* cs = cos + static_cast<std::size_t>(pos_ok ? pos : 0) * static_cast<std::size_t>(half);
    const float* sn = sin + static_cast<std::size_t>(pos_ok ? pos : 0) * static_cast<std::size_t>(half);
    const bool key = head >= hq;
    int b = 0, slot = -1;
    if (key) {
      b = request_of(qo_indptr, batch, t);
      slot = cache_lengths[b] + (t - qo_indptr[b]);
    }
    // The host checks slots before a pass; a slot outside the cache writes nothing.
    const bool write = key && mk::batch_kv_slot_ok(kv, b, slot);
    // Key head j's cache row (K and V share the offset) and its value head's row in the projection.
    const int j = head - hq;
    const std::size_t at = write ? mk::batch_kv_row_offset(kv, b, layer, slot, j) : 0;
    const float* const vsrc = row + static_cast<std::size_t>(hq + hkv + (write ? j : 0)) * static_cast<std::size_t>(D);
    T* const k = static_cast<T*>(kv.k);
    T* const vv = static_cast<T*>(kv.v);
    for (int i = ctx.thread(); i < half; i += ctx.threads()) {
      const int a = split_halves ? i : 2 * i;
      const int c = split_halves ? i + half : 2 * i + 1;
      const float v0 = v[a], v1 = v[c];
      const float r0 = pos_ok ? v0 * cs[i] - v1 * sn[i] : nan_value;
      const float r1 = pos_ok ? v0 * sn[i] + v1 * cs[i] : nan_value;
      v[a] = r0;
      v[c] = r1;
      if (!write) continue;
      k[at + static_cast<std::size_t>(a)] = mc::store_float<T>(r0);
      k[at + static_cast<std::size_t>(c)] = mc::store_float<T>(r1);
      vv[at + static_cast<std::size_t>(a)] = mc::store_float<T>(vsrc[a]);
      vv[at + static_cast<std::size_t>(c)] = mc::store_float<T>(vsrc[c]);
    }
  }
};

// One block per token (x) and query or key head (y), a thread per rotation pair (at least 32).
constexpr mc::launch_shape rope_shape(int tokens, int hq, int hkv, int head_dim) noexcept {
  const int half = head_dim / 2;
  const int threads = (half + 31) / 32 * 32;
  return {.grid_x = tokens, .grid_y = hq + hkv, .threads = threads < row_threads ? threads : row_threads, .shared_bytes = 0};
}

// h = SiLU(gate) ⊙ up from the fused W1/W3 projection ([T][2·hidden]: gate, then up), to T, over
// `elementwise_shape(T, hidden)`.
template <class T>
struct swiglu_body {
  static constexpr int max_threads = elementwise_threads;
  const float* gate_up = nullptr;
  T* out = nullptr;  // [T][hidden]
  int hidden = 0;

  template <class Ctx>
  MEDUSA_KERNEL_FN void operator()(Ctx& ctx) const {
    const int t = ctx.block_y();
    const int i = ctx.block_x() * ctx.threads() + ctx.thread();
    if (i >= hidden) return;
    const float* g = gate_up + static_cast<std::size_t>(t) * 2 * static_cast<std::size_t>(hidden);
    out[static_cast<std::size_t>(t) * static_cast<std::size_t>(hidden) + static_cast<std::size_t>(i)] =
        mc::store_float<T>(medusa::silu(g[i]) * g[hidden + i]);
  }
};

}  // namespace medusa_llama::cuda_detail
