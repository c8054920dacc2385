// SPDX-License-Identifier: Apache-2.0
//! @file decoder_model.hpp
//! Adapts the example engine (`medusa_llama::engine`) to `medusa::decoder_model`, so that
//! `medusa::decoder` and `medusa::generate_vanilla` drive it: a forward of T tokens writes K/V at
//! slots `[L, L+T)`, under a causal or packed tree mask, and the decoder commits accepted paths
//! directly in the engine's cache (`[layer][slot][kv_head][head_dim]`, dense NHD).
//!
//! @code
//! medusa_llama::engine e(medusa_llama::model::load_llama2c("model.bin"));
//! medusa_llama::decoder_model m(e);
//! auto heads = medusa::load_heads("out").heads;
//! auto stack = heads.view();
//! medusa_blas::openblas_gemm gemm;
//! medusa::head_stack_runner<medusa::head_stack<>, medusa_blas::openblas_gemm> run{&stack, &gemm};
//! medusa::decoder dec(m, run, medusa::tree::preset("mc_sim_7b_63"), medusa::greedy_policy{});
//! auto out = dec.generate(prompt, {.max_new_tokens = 128});
//! @endcode
#pragma once

#include <medusa/decoder.hpp>
#include <medusa/kv_cache.hpp>

#include <medusa_llama/engine.hpp>

#include <algorithm>
#include <cstddef>
#include <span>
#include <string>
#include <vector>

namespace medusa_llama {

//! `medusa::decoder_model` over a `medusa_llama::engine` (not owned; must outlive this).
class decoder_model {
 public:
  //! Views the engine's whole cache.
  explicit decoder_model(medusa_llama::engine& e) : e_(&e) {
    const auto& c = e.config();
    const auto l0 = e.kv_layer(0);
    const std::size_t per_layer = static_cast<std::size_t>(l0.capacity) * l0.slot_stride;
    const std::size_t total = per_layer * static_cast<std::size_t>(c.n_layers);
    if (c.n_layers > 1 && e.kv_layer(1).k != l0.k + per_layer)
      throw medusa::invalid_input("decoder_model: the engine's KV layers are not contiguous");
    kv_ = medusa::make_kv_view<float>(std::span<float>(l0.k, total), std::span<float>(l0.v, total),
                                      medusa::kv_extents{c.n_layers, l0.n_kv_heads, l0.head_dim}, l0.capacity,
                                      medusa::kv_layout::nhd);
    rows_.resize(static_cast<std::size_t>(e.options().max_batch));
    slots_.resize(rows_.size());
  }

  //! Vocabulary size.
  [[nodiscard]] int vocab_size() const noexcept { return e_->config().vocab_size; }
  //! Hidden size d.
  [[nodiscard]] int hidden_size() const noexcept { return e_->config().dim; }
  //! The engine's KV cache.
  [[nodiscard]] medusa::kv_cache_view<float> kv_cache() const noexcept { return kv_; }
  //! Forward calls made.
  [[nodiscard]] long forward_calls() const noexcept { return calls_; }

  //! Runs a batch (causal batches longer than the engine's `max_batch` run in chunks).
  void forward(const medusa::forward_batch& b) {
    ++calls_;
    const int T = static_cast<int>(b.tokens.size());
    const int maxb = e_->options().max_batch;
    const auto V = static_cast<std::size_t>(vocab_size()), d = static_cast<std::size_t>(hidden_size());
    const int first = b.first_output_row;
    if (T <= 0 || b.positions.size() != b.tokens.size() || first < 0 || first >= T)
      throw medusa::invalid_input("decoder_model: bad batch (T=" + std::to_string(T) + ", first_output_row=" + std::to_string(first) + ")");
    const auto rows_out = static_cast<std::size_t>(T - first);
    if ((!b.logits.empty() && b.logits.size() != rows_out * V) || (!b.hidden.empty() && b.hidden.size() != rows_out * d))
      throw medusa::invalid_input("decoder_model: output buffers do not match the requested rows");
    if (!b.tree_mask.empty()) {
      if (T > maxb) throw medusa::invalid_input("decoder_model: tree of " + std::to_string(T) + " nodes exceeds the engine's max_batch " + std::to_string(maxb));
      if (b.mask_words_per_row != (T + 31) / 32 || b.tree_mask.size() < static_cast<std::size_t>(T) * static_cast<std::size_t>(b.mask_words_per_row))
        throw medusa::invalid_input("decoder_model: tree mask has " + std::to_string(b.mask_words_per_row) + " words per row for " + std::to_string(T) + " nodes");
    }
    for (int c0 = 0; c0 < T; c0 += maxb) {
      const int n = std::min(maxb, T - c0);
      if (!b.tree_mask.empty() && n != T) throw medusa::invalid_input("decoder_model: tree batches cannot be chunked");
      for (int i = 0; i < n; ++i) slots_[static_cast<std::size_t>(i)] = b.cache_length + c0 + i;
      const int r0 = std::max(first, c0);  // output rows of this chunk: [r0, c0 + n)
      std::size_t nr = 0;
      for (int r = r0; r < c0 + n; ++r) rows_[nr++] = r - c0;
      const std::size_t o0 = static_cast<std::size_t>(std::max(0, r0 - first));
      medusa_llama::forward_outputs out{std::span<const int>(rows_.data(), nr),
                                        b.logits.empty() ? std::span<float>() : b.logits.subspan(o0 * V, nr * V),
                                        b.hidden.empty() ? std::span<float>() : b.hidden.subspan(o0 * d, nr * d)};
      const auto mask = b.tree_mask.empty() ? medusa_llama::mask_source::causal(b.cache_length + c0)
                                            : medusa_llama::mask_source::tree(b.cache_length, b.tree_mask.first(static_cast<std::size_t>(T) * static_cast<std::size_t>(b.mask_words_per_row)));
      e_->forward(b.tokens.subspan(static_cast<std::size_t>(c0), static_cast<std::size_t>(n)),
                  b.positions.subspan(static_cast<std::size_t>(c0), static_cast<std::size_t>(n)),
                  std::span<const int>(slots_.data(), static_cast<std::size_t>(n)), mask, out);
    }
  }

 private:
  medusa_llama::engine* e_;
  medusa::kv_cache_view<float> kv_;
  std::vector<int> rows_, slots_;
  long calls_ = 0;
};

static_assert(medusa::decoder_model<decoder_model>);

}  // namespace medusa_llama
