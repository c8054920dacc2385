// SPDX-License-Identifier: Apache-2.0
// The arithmetic of the packed projections one column at a time, in plain C++ (see gemm.hpp):
// the reference the tests hold the vector kernels of every instruction set to. It reads the packed
// layouts through the same slots as the packers, quantizes the activations with the scalar rules
// (the vector kernels must agree bit for bit), and sums the block formats block by block in the
// kernels' order, with one fused multiply-add per block.
#include "gemm.hpp"

#include <medusa/half.hpp>
#include <medusa/heads.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace medusa_llama::detail {

namespace {
constexpr int kPanel = 16;
constexpr int kBlock = 32;
std::size_t sz(int v) { return static_cast<std::size_t>(v); }

// int8 activation rows, the scalar rule of quantize_rows.
struct int8_rows {
  std::vector<std::uint8_t> q;
  std::vector<float> scale;
  std::size_t ld = 0;
};

int8_rows quantize_int8(const gemm_input& in, int K) {
  int8_rows r;
  r.ld = int8_stride(K);
  r.q.assign(sz(in.T) * r.ld, 128);
  r.scale.assign(sz(in.T), 0.0f);
  for (int t = 0; t < in.T; ++t) {
    const float* x = in.x + sz(t) * in.ldx;
    float amax = 0.0f;
    bool finite = true;
    for (int k = 0; k < K; ++k) {
      finite = finite && std::isfinite(x[k]);
      amax = std::max(amax, std::abs(x[k]));
    }
    if (!finite) {
      r.scale[sz(t)] = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    const float s = amax / 127.0f;
    r.scale[sz(t)] = s;
    if (s == 0.0f) continue;
    for (int k = 0; k < K; ++k)
      r.q[sz(t) * r.ld + sz(k)] = static_cast<std::uint8_t>(std::clamp(std::nearbyint(x[k] / s), -127.0f, 127.0f) + 128.0f);
  }
  return r;
}

// Block activation rows, the scalar rule of quantize_blocks.
block_rows quantize_block_rows(const gemm_input& in, int K) {
  block_rows out;
  const int nb = (K + kBlock - 1) / kBlock;
  out.blocks = nb;
  out.T = in.T;
  out.ld = sz(nb) * kBlock;
  out.q.assign(sz(in.T) * out.ld, 0);
  out.scale.assign(sz(in.T) * sz(nb), 0.0f);
  out.sum.assign(sz(in.T) * sz(nb), 0);
  for (int t = 0; t < in.T; ++t) {
    const float* x = in.x + sz(t) * in.ldx;
    float* scale = out.scale.data() + sz(t) * sz(nb);
    bool finite = true;
    for (int b = 0; b < nb; ++b) {
      const int k0 = b * kBlock, n = std::min(kBlock, K - k0);
      float amax = 0.0f;
      for (int i = 0; i < n; ++i) {
        finite = finite && std::isfinite(x[k0 + i]);
        amax = std::max(amax, std::abs(x[k0 + i]));
      }
      const float d = amax / 127.0f;
      scale[b] = d;
      if (d == 0.0f || !finite) continue;
      const float id = 1.0f / d;
      std::int32_t s = 0;
      std::int8_t* row = out.q.data() + sz(t) * out.ld;
      for (int i = 0; i < n; ++i) {
        row[k0 + i] = static_cast<std::int8_t>(std::nearbyint(x[k0 + i] * id));
        s += row[k0 + i];
      }
      out.sum[sz(t) * sz(nb) + sz(b)] = s;
    }
    if (!finite) std::fill(scale, scale + nb, std::numeric_limits<float>::quiet_NaN());
  }
  return out;
}

// Signed weight q of (panel p, column j, k) of a block matrix.
int block_weight(const packed_matrix& W, int p, int j, int k) {
  const block_slot at = block_slot_of(W.format(), j, k);
  const std::uint8_t byte = W.u8()[sz(p) * W.panel_bytes() + at.byte];
  if (W.format() == weight_format::q8_0) return static_cast<int>(byte) - 128;
  return (at.nibble == 0 ? byte & 0x0f : byte >> 4) - 8;
}

// Column (p, j) of a block matrix against quantized row t, block by block.
float block_column(const packed_matrix& W, const block_rows& x, int p, int j, int t) {
  const std::uint16_t* S = W.block_scales() + sz(p) * sz(x.blocks) * kPanel;
  const std::int8_t* xq = x.q.data() + sz(t) * x.ld;
  float acc = 0.0f;
  for (int b = 0; b < x.blocks; ++b) {
    std::int32_t dot = 0;
    for (int kk = 0; kk < kBlock; ++kk) dot += block_weight(W, p, j, b * kBlock + kk) * xq[b * kBlock + kk];
    const float d = medusa::detail::half_bits_to_float(S[sz(b) * kPanel + sz(j)]);
    acc = std::fma(static_cast<float>(dot), d * x.scale[sz(t) * sz(x.blocks) + sz(b)], acc);
  }
  return acc;
}

// Column (p, j) of an int8 matrix against quantized row t: the exact integer dot product, scaled.
float int8_column(const packed_matrix& W, const int8_rows& xq, int p, int j, int t) {
  const std::int8_t* P = W.i8() + sz(p) * W.panel_stride();
  const std::uint8_t* x = xq.q.data() + sz(t) * xq.ld;
  std::int32_t acc = 0;
  for (std::size_t k = 0; k < xq.ld; ++k) acc += (static_cast<std::int32_t>(x[k]) - 128) * P[(k / 4) * 4 * kPanel + sz(j) * 4 + k % 4];
  return static_cast<float>(acc) * (xq.scale[sz(t)] * W.scales()[sz(p) * kPanel + sz(j)]);
}

// Column (p, j) of a float32 or bf16 matrix against row t, in order of k.
float float_column(const packed_matrix& W, const gemm_input& in, int p, int j, int t) {
  float s = 0.0f;
  for (int k = 0; k < W.in(); ++k) {
    const float w = W.format() == weight_format::f32
                        ? W.f32()[sz(p) * W.panel_stride() + sz(k) * kPanel + sz(j)]
                        : bf16_to_float(W.b16()[sz(p) * W.panel_stride() + sz(k / 2) * 2 * kPanel + sz(j) * 2 + sz(k % 2)]);
    s = std::fma(w, in.x[sz(t) * in.ldx + sz(k)], s);
  }
  return s;
}

}  // namespace

void gemm_reference(const packed_matrix& W, const gemm_input& in, float* Y, std::size_t ldy, int g0, int g1, epilogue op) {
  const block_rows xb = W.blocked() ? quantize_block_rows(in, W.in()) : block_rows{};
  const int8_rows xi = W.format() == weight_format::int8 ? quantize_int8(in, W.in()) : int8_rows{};
  auto column = [&](int p, int j, int t) {
    if (W.blocked()) return block_column(W, xb, p, j, t);
    if (W.format() == weight_format::int8) return int8_column(W, xi, p, j, t);
    return float_column(W, in, p, j, t);
  };
  for (int g = g0; g < g1; ++g) {
    const int p0 = W.group_panels() * g, np = std::min(W.group_panels(), W.panels() - p0);
    for (int t = 0; t < in.T; ++t) {
      float* y = Y + sz(t) * ldy;
      if (op == epilogue::swiglu) {
        const int c0 = g * kPanel, n = std::min(kPanel, W.rows() - c0);
        for (int j = 0; j < n; ++j) y[c0 + j] = medusa::silu(column(p0, j, t)) * column(p0 + 1, j, t);
        continue;
      }
      for (int b = 0; b < np; ++b) {
        const int c0 = (p0 + b) * kPanel, n = std::min(kPanel, W.rows() - c0);
        for (int j = 0; j < n; ++j) {
          const float v = column(p0 + b, j, t);
          y[c0 + j] = op == epilogue::add ? y[c0 + j] + v : v;
        }
      }
    }
  }
}

}  // namespace medusa_llama::detail
