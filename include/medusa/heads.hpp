// SPDX-License-Identifier: Apache-2.0
//! @file heads.hpp
//! `head_stack`: non-owning views of K Medusa heads and their CPU forward pass (docs/heads.md).
//!
//! Head `k` maps a final-normed hidden state `h` (length d) to vocabulary logits:
//!
//!     x_0 = h ;  x_{l+1} = x_l + SiLU(W_{k,l} x_l + b_{k,l})   (W [d,d] PyTorch [out,in], b [d])
//!     logits_k = U_k x_L                                        (U_k [V,d], no bias)
//!              = lm_head(x_L)                                   (shared-projection "version 2" heads)
//!
//! The head and layer counts are template parameters (`head_stack<4, 1>`: kernels instantiated per
//! count) or `std::dynamic_extent` (`head_stack<>`: run-time), with one interface. Weights are
//! `weight_ptr` views (f32, f16 or bf16) that the caller keeps alive; `head_weights` in
//! `medusa/io/head_checkpoint.hpp` owns loaded weights and hands out views.
//!
//! The forward is written against a `gemm_policy` (`portable_gemm` by default, a BLAS one in
//! `examples/blas/openblas_gemm.hpp`). When the first-layer matrices of all heads are contiguous
//! (`W_{k,0}` at `W_{0,0} + k·d·d`, as `head_weights` stores them) the first layer of all heads runs
//! as one [K·d, d] GEMM; the shared-projection variant runs `lm_head` once over all K·M rows.
//!
//! @code
//! // K = 2 heads, one ResBlock each, d = 4, V = 8, f32 weights owned by the caller.
//! std::vector<float> w(4 * 4), b(4), u(8 * 4), h(4), logits(2 * 8);
//! medusa::head_stack<2, 1> heads(4, 8, medusa::projection_kind::per_head);
//! for (std::size_t k = 0; k < 2; ++k) {
//!   heads.set_resblock(k, 0, medusa::weight_ptr::of(w.data()), medusa::weight_ptr::of(b.data()));
//!   heads.set_projection(k, medusa::weight_ptr::of(u.data()));
//! }
//! medusa::portable_gemm<> gemm;
//! heads.forward(gemm, h, 1, logits);   // logits [1][2][8]
//! @endcode
#pragma once

#include <medusa/config.hpp>
#include <medusa/error.hpp>
#include <medusa/gemm.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

MEDUSA_NAMESPACE_BEGIN

//! Where head logits come from after the ResBlocks.
enum class projection_kind : std::uint8_t {
  per_head,        //!< each head has its own U_k [V,d] (Medusa-1 / HF Medusa-2 checkpoints)
  shared_lm_head,  //!< "version 2" heads: the base model's lm_head [V,d] is applied to every head
};

//! Name of `k` ("per_head", "shared_lm_head").
constexpr std::string_view to_string(projection_kind k) noexcept {
  return k == projection_kind::per_head ? "per_head" : "shared_lm_head";
}

//! Weights of one ResBlock: `x + SiLU(W x + b)`.
struct resblock_weights {
  weight_ptr weight;  //!< W [d,d], PyTorch Linear layout [out, in]
  weight_ptr bias;    //!< b [d]
};

//! Tuning switches of `head_stack::forward` (defaults are the fast choices).
struct head_forward_options {
  //! Run layer 0 of all heads as one [K·d, d] GEMM when the matrices are contiguous.
  bool fuse_first_layer = true;
};

//! SiLU(x) = x·σ(x), in float (also used by device code).
MEDUSA_HOST_DEVICE inline float silu(float x) noexcept { return x / (1.0f + std::exp(-x)); }

namespace detail {
template <class T, std::size_t N>
using maybe_array = std::conditional_t<N == std::dynamic_extent, std::vector<T>, std::array<T, N>>;

constexpr std::size_t static_product(std::size_t a, std::size_t b) noexcept {
  return a == std::dynamic_extent || b == std::dynamic_extent ? std::dynamic_extent : a * b;
}
}  // namespace detail

//! Non-owning views of K Medusa heads with L ResBlocks each, and their CPU forward.
//! @tparam Heads  head count K, or `std::dynamic_extent` (set in the constructor)
//! @tparam Layers ResBlocks per head L (0 allowed), or `std::dynamic_extent`
template <std::size_t Heads = std::dynamic_extent, std::size_t Layers = std::dynamic_extent>
class head_stack {
 public:
  static constexpr std::size_t static_heads = Heads;    //!< K, or dynamic_extent
  static constexpr std::size_t static_layers = Layers;  //!< L, or dynamic_extent

  //! Heads of `hidden` × `vocab` with K = `heads` and L = `layers` (must equal the static counts
  //! where those are given). All weights start unset; `forward` checks they were set.
  head_stack(std::size_t hidden, std::size_t vocab, std::size_t heads, std::size_t layers, projection_kind kind)
      : d_(hidden), v_(vocab), h_(heads), l_(layers), kind_(kind) {
    if (Heads != std::dynamic_extent && heads != Heads)
      throw invalid_input("head_stack: " + std::to_string(heads) + " heads given, the type fixes " + std::to_string(Heads));
    if (Layers != std::dynamic_extent && layers != Layers)
      throw invalid_input("head_stack: " + std::to_string(layers) + " layers given, the type fixes " + std::to_string(Layers));
    if (hidden == 0 || vocab == 0 || heads == 0)
      throw invalid_input("head_stack: hidden size, vocab size and head count must be positive (got d=" + std::to_string(hidden) +
                          ", V=" + std::to_string(vocab) + ", K=" + std::to_string(heads) + ")");
    if constexpr (detail::static_product(Heads, Layers) == std::dynamic_extent) blocks_.resize(heads * layers);
    if constexpr (Heads == std::dynamic_extent) proj_.resize(heads);
  }

  //! Constructor for fully static counts.
  head_stack(std::size_t hidden, std::size_t vocab, projection_kind kind)
    requires(Heads != std::dynamic_extent && Layers != std::dynamic_extent)
      : head_stack(hidden, vocab, Heads, Layers, kind) {}

  [[nodiscard]] constexpr std::size_t num_heads() const noexcept { return Heads != std::dynamic_extent ? Heads : h_; }    //!< K
  [[nodiscard]] constexpr std::size_t num_layers() const noexcept { return Layers != std::dynamic_extent ? Layers : l_; } //!< L
  [[nodiscard]] std::size_t hidden_size() const noexcept { return d_; }  //!< d
  [[nodiscard]] std::size_t vocab_size() const noexcept { return v_; }   //!< V
  [[nodiscard]] projection_kind kind() const noexcept { return kind_; }  //!< per-head or shared projection

  //! Sets W_{h,l} [d,d] and b_{h,l} [d].
  void set_resblock(std::size_t h, std::size_t l, weight_ptr weight, weight_ptr bias) {
    check_index(h, l);
    blocks_[h * num_layers() + l] = {weight, bias};
  }
  //! Sets U_h [V,d] (per-head variant only).
  void set_projection(std::size_t h, weight_ptr u) {
    if (kind_ != projection_kind::per_head) throw invalid_input("head_stack: shared-projection heads have no per-head projection");
    check_index(h, 0, false);
    proj_[h] = u;
  }
  //! Sets the base model's lm_head [V,d] (shared-projection variant only).
  void set_lm_head(weight_ptr u) {
    if (kind_ != projection_kind::shared_lm_head) throw invalid_input("head_stack: per-head projections do not use lm_head");
    lm_head_ = u;
  }
  //! W_{h,l} and b_{h,l}.
  [[nodiscard]] resblock_weights resblock(std::size_t h, std::size_t l) const {
    check_index(h, l);
    return blocks_[h * num_layers() + l];
  }
  //! The projection head `h` uses (its own U_h or the shared lm_head).
  [[nodiscard]] weight_ptr projection(std::size_t h) const {
    check_index(h, 0, false);
    return kind_ == projection_kind::per_head ? proj_[h] : lm_head_;
  }

  //! Throws `invalid_input` naming the first weight that is still unset.
  void validate() const {
    for (std::size_t h = 0; h < num_heads(); ++h) {
      for (std::size_t l = 0; l < num_layers(); ++l) {
        const auto& b = blocks_[h * num_layers() + l];
        if (b.weight.data == nullptr || b.bias.data == nullptr)
          throw invalid_input("head_stack: head " + std::to_string(h) + " layer " + std::to_string(l) + " has no weights set");
      }
      if (projection(h).data == nullptr)
        throw invalid_input(kind_ == projection_kind::per_head ? "head_stack: head " + std::to_string(h) + " has no projection set"
                                                               : std::string("head_stack: lm_head is not set"));
    }
  }

  //! Floats of scratch `forward` needs for `batch` hidden states (0 when L = 0).
  [[nodiscard]] std::size_t workspace_size(std::size_t batch) const noexcept {
    return num_layers() == 0 ? 0 : 2 * batch * num_heads() * d_;
  }

  //! Head logits for `batch` hidden states.
  //! @param hidden    [batch][d] final-normed hidden states
  //! @param logits    [batch][K][V] output (request-major: row `m·K + k` is head k of request m)
  //! @param workspace at least `workspace_size(batch)` floats (no allocation inside)
  template <gemm_policy Gemm>
  void forward(Gemm& gemm, std::span<const float> hidden, std::size_t batch, std::span<float> logits,
               std::span<float> workspace, head_forward_options opt = {}) const {
    validate();
    const std::size_t d = d_, K = num_heads(), L = num_layers(), V = v_, M = batch;
    if (hidden.size() < M * d) throw invalid_input("head_stack::forward: hidden has " + std::to_string(hidden.size()) + " floats, needs " + std::to_string(M * d));
    if (logits.size() < M * K * V) throw invalid_input("head_stack::forward: logits has " + std::to_string(logits.size()) + " floats, needs " + std::to_string(M * K * V));
    if (workspace.size() < workspace_size(M)) throw invalid_input("head_stack::forward: workspace has " + std::to_string(workspace.size()) + " floats, needs " + std::to_string(workspace_size(M)));
    if (M == 0) return;
    constexpr auto N = gemm_op::none;
    constexpr auto T = gemm_op::transpose;
    if (L == 0) {  // heads are bare projections of h
      if (kind_ == projection_kind::shared_lm_head) {
        gemm.gemm(N, T, M, V, d, 1.0f, hidden.data(), d, lm_head_, d, 0.0f, logits.data(), K * V);
        for (std::size_t m = 0; m < M; ++m)
          for (std::size_t k = 1; k < K; ++k)
            std::copy_n(logits.data() + m * K * V, V, logits.data() + (m * K + k) * V);
      } else {
        for (std::size_t k = 0; k < K; ++k)
          gemm.gemm(N, T, M, V, d, 1.0f, hidden.data(), d, proj_[k], d, 0.0f, logits.data() + k * V, K * V);
      }
      return;
    }
    // x and t are [M][K][d]: x the residual stream, t the linear output.
    float* x = workspace.data();
    float* t = x + M * K * d;
    const std::size_t ld = K * d;
    if (opt.fuse_first_layer && first_layer_contiguous()) {
      gemm.gemm(N, T, M, K * d, d, 1.0f, hidden.data(), d, blocks_[0].weight, d, 0.0f, t, ld);
    } else {
      for (std::size_t k = 0; k < K; ++k)
        gemm.gemm(N, T, M, d, d, 1.0f, hidden.data(), d, blocks_[k * L].weight, d, 0.0f, t + k * d, ld);
    }
    for (std::size_t m = 0; m < M; ++m)
      for (std::size_t k = 0; k < K; ++k)
        residual(hidden.data() + m * d, t + m * ld + k * d, blocks_[k * L].bias, x + m * ld + k * d, d);
    for (std::size_t l = 1; l < L; ++l)
      for (std::size_t k = 0; k < K; ++k) {
        const auto& blk = blocks_[k * L + l];
        gemm.gemm(N, T, M, d, d, 1.0f, x + k * d, ld, blk.weight, d, 0.0f, t + k * d, ld);
        for (std::size_t m = 0; m < M; ++m) residual(x + m * ld + k * d, t + m * ld + k * d, blk.bias, x + m * ld + k * d, d);
      }
    if (kind_ == projection_kind::shared_lm_head) {
      // Rows (m, k) of x are contiguous with stride d: lm_head runs once over all M·K rows.
      gemm.gemm(N, T, M * K, V, d, 1.0f, x, d, lm_head_, d, 0.0f, logits.data(), V);
    } else {
      for (std::size_t k = 0; k < K; ++k) gemm.gemm(N, T, M, V, d, 1.0f, x + k * d, ld, proj_[k], d, 0.0f, logits.data() + k * V, K * V);
    }
  }

  //! Same as above with an internally allocated workspace.
  template <gemm_policy Gemm>
  void forward(Gemm& gemm, std::span<const float> hidden, std::size_t batch, std::span<float> logits,
               head_forward_options opt = {}) const {
    std::vector<float> ws(workspace_size(batch));
    forward(gemm, hidden, batch, logits, ws, opt);
  }

  //! True when W_{k,0} of all heads form one [K·d, d] matrix of one dtype (first layer fusable).
  [[nodiscard]] bool first_layer_contiguous() const noexcept {
    if (num_layers() == 0) return false;
    const weight_ptr w0 = blocks_[0].weight;
    for (std::size_t k = 1; k < num_heads(); ++k)
      if (blocks_[k * num_layers()].weight != w0.offset(k * d_ * d_)) return false;
    return true;
  }

 private:
  void check_index(std::size_t h, std::size_t l, bool layer = true) const {
    if (h >= num_heads() || (layer && l >= num_layers()))
      throw invalid_input("head_stack: head " + std::to_string(h) + (layer ? " layer " + std::to_string(l) : std::string()) +
                          " out of range (K=" + std::to_string(num_heads()) + ", L=" + std::to_string(num_layers()) + ")");
  }

  // out = in + SiLU(t + b); `out` may alias `in`.
  static void residual(const float* in, const float* t, weight_ptr bias, float* out, std::size_t d) noexcept {
    switch (bias.dtype) {
      case weight_dtype::f32: {
        const float* b = static_cast<const float*>(bias.data);
        for (std::size_t i = 0; i < d; ++i) out[i] = in[i] + silu(t[i] + b[i]);
        break;
      }
      default:
        for (std::size_t i = 0; i < d; ++i) out[i] = in[i] + silu(t[i] + bias.load(i));
    }
  }

  std::size_t d_, v_, h_, l_;
  projection_kind kind_;
  detail::maybe_array<resblock_weights, detail::static_product(Heads, Layers)> blocks_{};
  detail::maybe_array<weight_ptr, Heads> proj_{};
  weight_ptr lm_head_{};
};

MEDUSA_NAMESPACE_END
