// SPDX-License-Identifier: Apache-2.0
// Private: the projection kernels of the engine on weights packed once at load into 16-column
// panels, read linearly by register-blocked small-M kernels that stream each panel once per tile
// of tokens (the re-reads for more tokens hit L2). The kernels are compiled for every instruction
// set Highway targets and chosen at run time (simd/gemm_float.cpp, simd/gemm_int.cpp; cpu.hpp);
// a token's results never depend on how many tokens the pass holds.
//
// Panel layouts (p = panel, 16 output columns c = 16p + j; K = in):
//  * f32:  [p][k][j]            float,  K × 16 per panel;
//  * bf16: [p][k/2][j][k%2]     bf16,   ceil(K/2) × 32 per panel, K padded with 0 (64 bytes =
//    2 k × 16 columns; a shift and a mask widen them to float32).
//  * int8: [p][k/4][j][k%4]     int8,   ceil(K/4) × 64 bytes per panel, K padded with 0, plus per
//    column a float scale (w ≈ q · scale, scale = max |w| / 127) and 128 · Σ_k q. The activations
//    of each row are quantized the same way (x ≈ q_x · s_x) and the products summed exactly in
//    int32 (4 k of a column per int32 lane; with AVX512-VNNI `vpdpbusd` the activations are offset
//    by 128 to unsigned and the offset removed with the column sums).
//  * q8_0: [p][b][k%32/4][j][k%4] uint8 = q + 128, blocks b of 32 k (K padded to 32 with q = 0),
//    512 bytes per block; the block's binary16 scales d (w ≈ d · q) in `block_scales()`
//    [p][b][j]. GGUF Q8_0's numbers in the kernel's order.
//  * q4_0: [p][b][i][j][k%4] uint8, 4 × 64 bytes per block: the byte holds q of k-quad 2i in
//    its low nibble and of k-quad 2i + 1 in its high one (q in 0..15, w ≈ d · (q − 8)); 64
//    bytes and two masks give two k-quads. Scales as q8_0. GGUF Q4_0's numbers.
//    Both block formats take activations quantized per row and block (int8, float scale) and
//    sum Σ q_w · q_x exactly in int32 per block (simd/gemm_int.cpp).
// Rows beyond `rows` in the last panel are zero. A fused SwiGLU matrix interleaves the panels of w1
// and w3 (panel 2p = w1 panel p, 2p + 1 = w3 panel p).
#pragma once

#include <medusa_llama/engine.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

namespace medusa_llama::detail {

//! What the kernel does with a result column: Y = r, Y += r, or (fused pair) Y = silu(r_w1) · r_w3.
enum class epilogue { store, add, swiglu };

//! A weight matrix `[rows][in]` (float, row-major) repacked into panels of 16 output columns.
class packed_matrix {
 public:
  packed_matrix() = default;
  //! Packs W (`rows` × `in`, row-major). `fmt` picks float32 or bf16 (round to nearest even).
  packed_matrix(const float* W, int rows, int in, weight_format fmt);
  //! The SwiGLU pair: panels of `gate` and `up` (both `rows` × `in`) interleaved.
  static packed_matrix swiglu_pair(const float* gate, const float* up, int rows, int in, weight_format fmt);

  [[nodiscard]] int rows() const noexcept { return rows_; }     //!< output columns (per matrix of a pair)
  [[nodiscard]] int in() const noexcept { return in_; }         //!< reduction length K
  [[nodiscard]] int panels() const noexcept { return panels_; } //!< 16-column panels stored
  [[nodiscard]] bool pair() const noexcept { return pair_; }    //!< SwiGLU interleaved pair
  [[nodiscard]] weight_format format() const noexcept { return fmt_; }
  //! Panels per unit of work: 3 for float32 (48 columns: 24 accumulators at 8 tokens), 2 for bf16
  //! (its widened weights need the registers) and for a SwiGLU pair (16 columns of gate and up).
  [[nodiscard]] int group_panels() const noexcept {
    return pair_ || fmt_ == weight_format::bf16 || blocked() ? 2 : 3;
  }
  //! q8_0 or q4_0: blocks of 32 weights along K, each with its own scale.
  [[nodiscard]] bool blocked() const noexcept { return fmt_ == weight_format::q8_0 || fmt_ == weight_format::q4_0; }
  //! Blocks of 32 along K (block formats).
  [[nodiscard]] int blocks() const noexcept { return (in_ + 31) / 32; }
  //! binary16 scale of every (panel, block, column) (block formats; [p][b][16]).
  [[nodiscard]] const std::uint16_t* block_scales() const noexcept { return block_scales_.data(); }
  //! Bytes of packed weights per panel (block formats).
  [[nodiscard]] std::size_t panel_bytes() const noexcept { return panel_stride_; }
  //! The packed bytes (block formats).
  [[nodiscard]] const std::uint8_t* u8() const noexcept { return static_cast<const std::uint8_t*>(static_cast<const void*>(data_.get())); }
  //! Scale of each output column (int8 only; `panels() × 16` floats, 0 beyond `rows`).
  [[nodiscard]] const float* scales() const noexcept { return scales_.data(); }
  //! 128 · Σ_k q of each output column (int8 only).
  [[nodiscard]] const std::int32_t* colsums() const noexcept { return colsums_.data(); }
  //! Units of work for the threads: `group_panels()` panels each (the last one may have fewer).
  [[nodiscard]] int groups() const noexcept { return (panels_ + group_panels() - 1) / group_panels(); }
  //! Bytes of packed weights.
  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }
  //! Bytes of the scales and sums beside them (int8, q8_0, q4_0).
  [[nodiscard]] std::size_t block_bytes_extra() const noexcept {
    return scales_.size() * sizeof(float) + colsums_.size() * sizeof(std::int32_t) + block_scales_.size() * sizeof(std::uint16_t);
  }
  //! Elements (float or bf16) per panel.
  [[nodiscard]] std::size_t panel_stride() const noexcept { return panel_stride_; }
  [[nodiscard]] const float* f32() const noexcept { return static_cast<const float*>(static_cast<const void*>(data_.get())); }
  [[nodiscard]] const std::uint16_t* b16() const noexcept { return static_cast<const std::uint16_t*>(static_cast<const void*>(data_.get())); }
  [[nodiscard]] const std::int8_t* i8() const noexcept { return static_cast<const std::int8_t*>(static_cast<const void*>(data_.get())); }

 private:
  struct free_aligned {
    void operator()(std::byte* p) const noexcept;
  };
  void allocate(int panels);
  void pack_panel(int dst_panel, const float* W, int first_row, int n_rows);

  int rows_ = 0, in_ = 0, panels_ = 0;
  bool pair_ = false;
  weight_format fmt_ = weight_format::f32;
  std::size_t panel_stride_ = 0, bytes_ = 0;
  std::unique_ptr<std::byte[], free_aligned> data_;
  std::vector<float> scales_;         // int8: per output column
  std::vector<std::int32_t> colsums_;  // int8: 128 · Σ_k q per output column
  std::vector<std::uint16_t> block_scales_;  // q8_0, q4_0: [p][b][16] binary16
};

//! Where weight k of column j (< 16) sits in a q8_0 / q4_0 panel (the layouts above): its byte
//! from the panel's start and, for q4_0, its nibble (0 low, 1 high).
struct block_slot {
  std::size_t byte;
  int nibble;
};
[[nodiscard]] inline block_slot block_slot_of(weight_format fmt, int j, int k) noexcept {
  const auto b = static_cast<std::size_t>(k / 32), kk = static_cast<std::size_t>(k % 32);
  const std::size_t m = static_cast<std::size_t>(j) * 4 + kk % 4;  // byte within a k-quad's 64
  if (fmt == weight_format::q8_0) return {b * 512 + kk / 4 * 64 + m, 0};
  return {b * 256 + kk / 8 * 64 + m, static_cast<int>(kk / 4 % 2)};
}

//! GGUF's reference quantizers for one block of 32 weights (fewer: the rest taken as 0). Return
//! the binary16 scale; `q` gets the signed values (q8_0: −127..127; q4_0: −8..7, w ≈ d · q).
std::uint16_t quantize_block_q8_0(const float* w, int n, std::int8_t (&q)[32]) noexcept;
std::uint16_t quantize_block_q4_0(const float* w, int n, std::int8_t (&q)[32]) noexcept;

struct block_rows;

//! The activations of one GEMM: T float rows X[t*ldx + k] (float32 for both weight formats: bf16
//! weights are widened exactly in registers, so only the weights are rounded). For the block
//! formats `xq` may hold them already quantized (`quantize_blocks`): several GEMMs of one input
//! then quantize it once.
struct gemm_input {
  const float* x = nullptr;
  std::size_t ldx = 0;
  int T = 0;
  const block_rows* xq = nullptr;
};

//! Activation rows quantized per block of 32 for the block formats: int8 values (`ld` bytes a row,
//! zero padding), and per (row, block) the float scale and Σ q. A row holding a non-finite value
//! gets NaN scales, so its outputs are NaN.
struct block_rows {
  std::vector<std::int8_t> q;
  std::vector<float> scale;      // [t][blocks]
  std::vector<std::int32_t> sum;  // [t][blocks]
  std::size_t ld = 0;
  int blocks = 0;
  int T = 0;
};

//! Quantizes the `in.T` rows of `K` activations of `in` into `out` (reusing its storage).
void quantize_blocks(const gemm_input& in, int K, block_rows& out);

//! The activation rows of an int8 GEMM, quantized like the weights: q + 128 as unsigned bytes
//! (`ld` = `int8_stride(K)` a row, padding 128 = zero) and one scale per row. A row with a
//! non-finite value gets a NaN scale, so its outputs are NaN rather than garbage.
struct quantized_rows {
  const std::uint8_t* q;
  std::size_t ld;
  const float* scale;
};

//! Quantizes the `in.T` rows of `K` activations of `in` for an int8 GEMM into `q` and `scale`.
void quantize_rows(const gemm_input& in, int K, std::vector<std::uint8_t>& q, std::vector<float>& scale);

//! bf16 elements per packed panel row pair count: `in` rounded up to even.
[[nodiscard]] inline std::size_t bf16_stride(int in) noexcept { return static_cast<std::size_t>((in + 1) / 2 * 2); }
//! int8 reduction length: `in` rounded up to a multiple of 4.
[[nodiscard]] inline std::size_t int8_stride(int in) noexcept { return static_cast<std::size_t>((in + 3) / 4 * 4); }

//! Y[t*ldy + c] (op)= Σ_k X[t][k] · W[c][k] for t < T and the columns of groups [g0, g1) of W
//! (with `epilogue::swiglu` W must be a pair and Y gets silu(gate) · up for its `rows` columns).
void gemm_packed(const packed_matrix& W, const gemm_input& in, float* Y, std::size_t ldy, int g0, int g1, epilogue op);

//! The vector kernels behind `gemm_packed`, one per weight family (dispatched at run time):
//! float32 and bf16 weights;
void gemm_float(const packed_matrix& W, const gemm_input& in, float* Y, std::size_t ldy, int g0, int g1, epilogue op);
//! int8 weights against rows quantized by `quantize_rows`;
void gemm_int8(const packed_matrix& W, const quantized_rows& xq, int T, float* Y, std::size_t ldy, int g0, int g1,
               epilogue op);
//! q8_0 and q4_0 weights against rows quantized by `quantize_blocks`.
void gemm_blocks_simd(const packed_matrix& W, const block_rows& x, float* Y, std::size_t ldy, int g0, int g1, epilogue op);

//! The arithmetic of `gemm_packed` one column at a time, in plain C++ (gemm_reference.cpp): the
//! tests' reference. Block formats give the same bits as the vector kernels of targets with fused
//! multiply-add, the SwiGLU epilogue aside (its exponential is approximated in the kernels).
void gemm_reference(const packed_matrix& W, const gemm_input& in, float* Y, std::size_t ldy, int g0, int g1, epilogue op);

//! One GEMM of a fork-join: all column groups of `W` against `in`, into Y (rows `ldy` apart).
struct gemm_job {
  const packed_matrix* W;
  gemm_input in;
  float* Y;
  std::size_t ldy;
  epilogue op;
};

//! Runs `jobs` in one fork-join on `pool`: their column groups, concatenated, are cut into about
//! 4 chunks per thread (so a thread the OS has not scheduled delays little), fewer for passes of
//! one or two rows (chunks of at least 8 panels, whose kernels then keep enough independent sums).
void run_gemm_jobs(thread_pool& pool, std::span<const gemm_job> jobs);

//! Scalar reference of one bf16 rounding (nearest even; NaN kept quiet).
[[nodiscard]] std::uint16_t bf16_round(float f) noexcept;
//! float of a bf16.
[[nodiscard]] float bf16_to_float(std::uint16_t h) noexcept;

}  // namespace medusa_llama::detail
