// SPDX-License-Identifier: Apache-2.0
// Packed-panel projections (see gemm.hpp): packing the weights, GGUF's block quantizers, and the
// routing of a GEMM to the vector kernels of its weight format (simd/), which Highway compiles
// for every instruction set and picks at run time.
#include "gemm.hpp"

#include <medusa/half.hpp>

#include <medusa_llama/thread_pool.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <new>
#include <vector>

namespace medusa_llama::detail {

namespace {
constexpr int kPanel = 16;  // output columns per panel
std::size_t sz(int v) { return static_cast<std::size_t>(v); }
}  // namespace

std::uint16_t bf16_round(float f) noexcept {
  const auto u = std::bit_cast<std::uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  return static_cast<std::uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

float bf16_to_float(std::uint16_t h) noexcept { return std::bit_cast<float>(static_cast<std::uint32_t>(h) << 16); }

void packed_matrix::free_aligned::operator()(std::byte* p) const noexcept { ::operator delete[](p, std::align_val_t{64}); }

void packed_matrix::allocate(int panels) {
  panels_ = panels;
  panel_stride_ = fmt_ == weight_format::bf16   ? bf16_stride(in_) * kPanel
                  : fmt_ == weight_format::int8 ? int8_stride(in_) * kPanel
                  : fmt_ == weight_format::q8_0 ? sz(blocks()) * 512
                  : fmt_ == weight_format::q4_0 ? sz(blocks()) * 256
                                                : sz(in_) * kPanel;
  const std::size_t elem = fmt_ == weight_format::f32 ? sizeof(float) : fmt_ == weight_format::bf16 ? sizeof(std::uint16_t) : 1;
  if (fmt_ == weight_format::int8) {
    scales_.assign(sz(panels) * kPanel, 0.0f);
    colsums_.assign(sz(panels) * kPanel, 0);
  }
  if (blocked()) block_scales_.assign(sz(panels) * sz(blocks()) * kPanel, 0);
  bytes_ = sz(panels) * panel_stride_ * elem;
  data_.reset(new (std::align_val_t{64}) std::byte[std::max<std::size_t>(bytes_, 64)]);
  // Zero weights: q = 0 is stored as 128 (q8_0) or 8 (q4_0: 0x88 holds two).
  std::memset(data_.get(), fmt_ == weight_format::q8_0 ? 0x80 : fmt_ == weight_format::q4_0 ? 0x88 : 0, bytes_);
}

std::uint16_t quantize_block_q8_0(const float* w, int n, std::int8_t (&q)[32]) noexcept {
  float amax = 0.0f;
  for (int i = 0; i < n; ++i) amax = std::max(amax, std::abs(w[i]));
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  for (int i = 0; i < 32; ++i) q[i] = static_cast<std::int8_t>(i < n ? std::round(w[i] * id) : 0.0f);
  return medusa::detail::float_to_half_bits(d);
}

std::uint16_t quantize_block_q4_0(const float* w, int n, std::int8_t (&q)[32]) noexcept {
  float amax = 0.0f, max = 0.0f;  // the weight of largest magnitude, its sign kept (first on ties)
  for (int i = 0; i < n; ++i)
    if (amax < std::abs(w[i])) {
      amax = std::abs(w[i]);
      max = w[i];
    }
  const float d = max / -8.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  for (int i = 0; i < 32; ++i) {
    const float x = i < n ? w[i] : 0.0f;
    q[i] = static_cast<std::int8_t>(std::min(15, static_cast<int>(static_cast<std::int8_t>(x * id + 8.5f))) - 8);
  }
  return medusa::detail::float_to_half_bits(d);
}

// Rows [first_row, first_row + n_rows) of W into panel `dst_panel` (n_rows ≤ 16; the rest stay 0).
void packed_matrix::pack_panel(int dst_panel, const float* W, int first_row, int n_rows) {
  const std::size_t K = sz(in_);
  if (fmt_ == weight_format::f32) {
    float* P = static_cast<float*>(static_cast<void*>(data_.get())) + sz(dst_panel) * panel_stride_;
    for (int j = 0; j < n_rows; ++j) {
      const float* w = W + sz(first_row + j) * K;
      for (std::size_t k = 0; k < K; ++k) P[k * kPanel + sz(j)] = w[k];
    }
  } else if (blocked()) {
    std::uint8_t* P = static_cast<std::uint8_t*>(static_cast<void*>(data_.get())) + sz(dst_panel) * panel_stride_;
    std::uint16_t* S = block_scales_.data() + sz(dst_panel) * sz(blocks()) * kPanel;
    const bool q4 = fmt_ == weight_format::q4_0;
    for (int j = 0; j < n_rows; ++j) {
      const float* w = W + sz(first_row + j) * K;
      for (int b = 0; b < blocks(); ++b) {
        std::int8_t q[32];
        const int k0 = 32 * b, n = std::min(32, in_ - k0);
        S[sz(b) * kPanel + sz(j)] = q4 ? quantize_block_q4_0(w + k0, n, q) : quantize_block_q8_0(w + k0, n, q);
        for (int kk = 0; kk < 32; ++kk) {
          const block_slot at = block_slot_of(fmt_, j, k0 + kk);
          std::uint8_t& byte = P[at.byte];
          if (q4) {
            const auto u = static_cast<std::uint8_t>(q[kk] + 8);
            byte = at.nibble == 0 ? static_cast<std::uint8_t>((byte & 0xf0) | u) : static_cast<std::uint8_t>((byte & 0x0f) | (u << 4));
          } else {
            byte = static_cast<std::uint8_t>(q[kk] + 128);
          }
        }
      }
    }
  } else if (fmt_ == weight_format::int8) {
    std::int8_t* P = static_cast<std::int8_t*>(static_cast<void*>(data_.get())) + sz(dst_panel) * panel_stride_;
    for (int j = 0; j < n_rows; ++j) {
      const float* w = W + sz(first_row + j) * K;
      float amax = 0.0f;
      for (std::size_t k = 0; k < K; ++k) amax = std::max(amax, std::abs(w[k]));
      const float scale = amax > 0.0f ? amax / 127.0f : 0.0f;
      scales_[sz(dst_panel) * kPanel + sz(j)] = scale;
      std::int32_t sum = 0;
      for (std::size_t k = 0; k < K; ++k) {
        const auto q = static_cast<std::int8_t>(scale > 0.0f ? std::clamp(std::nearbyint(w[k] / scale), -127.0f, 127.0f) : 0.0f);
        P[(k / 4) * 4 * kPanel + sz(j) * 4 + k % 4] = q;
        sum += q;
      }
      colsums_[sz(dst_panel) * kPanel + sz(j)] = 128 * sum;
    }
  } else {
    std::uint16_t* P = static_cast<std::uint16_t*>(static_cast<void*>(data_.get())) + sz(dst_panel) * panel_stride_;
    for (int j = 0; j < n_rows; ++j) {
      const float* w = W + sz(first_row + j) * K;
      for (std::size_t k = 0; k < K; ++k) P[(k / 2) * 2 * kPanel + sz(j) * 2 + k % 2] = bf16_round(w[k]);
    }
  }
}

packed_matrix::packed_matrix(const float* W, int rows, int in, weight_format fmt) : rows_(rows), in_(in), fmt_(fmt) {
  const int panels = (rows + kPanel - 1) / kPanel;
  allocate(panels);
  for (int p = 0; p < panels; ++p) pack_panel(p, W, p * kPanel, std::min(kPanel, rows - p * kPanel));
}

packed_matrix packed_matrix::swiglu_pair(const float* gate, const float* up, int rows, int in, weight_format fmt) {
  packed_matrix m;
  m.rows_ = rows;
  m.in_ = in;
  m.fmt_ = fmt;
  m.pair_ = true;
  const int panels = (rows + kPanel - 1) / kPanel;
  m.allocate(2 * panels);
  for (int p = 0; p < panels; ++p) {
    const int n = std::min(kPanel, rows - p * kPanel);
    m.pack_panel(2 * p, gate, p * kPanel, n);
    m.pack_panel(2 * p + 1, up, p * kPanel, n);
  }
  return m;
}

void gemm_packed(const packed_matrix& W, const gemm_input& in, float* Y, std::size_t ldy, int g0, int g1, epilogue op) {
  if (W.blocked()) {
    if (in.xq != nullptr) {
      gemm_blocks_simd(W, *in.xq, Y, ldy, g0, g1, op);
      return;
    }
    // Per call: callers sharing an input quantize it once (run_gemm_jobs).
    thread_local block_rows rows;
    quantize_blocks(in, W.in(), rows);
    gemm_blocks_simd(W, rows, Y, ldy, g0, g1, op);
    return;
  }
  if (W.format() == weight_format::int8) {
    thread_local std::vector<std::uint8_t> q;
    thread_local std::vector<float> scale;
    quantize_rows(in, W.in(), q, scale);
    gemm_int8(W, {q.data(), int8_stride(W.in()), scale.data()}, in.T, Y, ldy, g0, g1, op);
    return;
  }
  gemm_float(W, in, Y, ldy, g0, g1, op);
}

void run_gemm_jobs(thread_pool& pool, std::span<const gemm_job> jobs) {
  // Block formats: each distinct input quantized once here, not in every chunk of every GEMM.
  thread_local std::vector<block_rows> quantized;
  thread_local std::vector<gemm_job> with_quantized;
  if (std::any_of(jobs.begin(), jobs.end(), [](const gemm_job& j) { return j.W->blocked() && j.in.xq == nullptr; })) {
    with_quantized.assign(jobs.begin(), jobs.end());
    if (quantized.size() < jobs.size()) quantized.resize(jobs.size());  // before taking pointers
    std::size_t used = 0;
    for (std::size_t i = 0; i < with_quantized.size(); ++i) {
      gemm_input& in = with_quantized[i].in;
      if (!with_quantized[i].W->blocked() || in.xq != nullptr) continue;
      const int K = with_quantized[i].W->in();
      for (std::size_t j = 0; j < i && in.xq == nullptr; ++j) {
        const gemm_job& o = with_quantized[j];
        if (o.W->blocked() && o.in.x == in.x && o.in.ldx == in.ldx && o.in.T == in.T && o.W->in() == K) in.xq = o.in.xq;
      }
      if (in.xq == nullptr) {
        quantize_blocks(in, K, quantized[used]);
        in.xq = &quantized[used++];
      }
    }
    jobs = with_quantized;
  }
  int total = 0, panels = 0, rows = 0;
  for (const auto& j : jobs) {
    total += j.W->groups();
    panels += j.W->panels();
    rows = std::max(rows, j.in.T);
  }
  // About 4 chunks per thread, so that a thread the OS has not scheduled delays little; but for
  // one or two rows (a decoding step) chunks of 8 panels or more, whose kernels keep enough
  // independent sums to stream the weights (rounded down to a multiple of the threads).
  const int threads = pool.size();
  int n = threads == 1 ? 1 : 4 * threads;
  if (rows <= 2 && threads > 1) n = std::clamp(panels / 8 / threads, 1, 4) * threads;
  n = std::max(1, std::min(total, n));
  pool.run(n, [&](int chunk, int) {
    const int a = total * chunk / n, b = total * (chunk + 1) / n;
    int base = 0;
    for (const auto& j : jobs) {
      const int g0 = std::max(a - base, 0), g1 = std::min(b - base, j.W->groups());
      if (g0 < g1) gemm_packed(*j.W, j.in, j.Y, j.ldy, g0, g1, j.op);
      base += j.W->groups();
    }
  });
}

}  // namespace medusa_llama::detail
