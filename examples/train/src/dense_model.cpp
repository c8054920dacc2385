// SPDX-License-Identifier: Apache-2.0
#include <medusa_train/dense_model.hpp>

#include "block_stack.hpp"
#include "common.hpp"

#include <medusa/error.hpp>

#include <algorithm>
#include <cmath>

namespace medusa_train {

namespace {

std::size_t embedding_size(const medusa_llama::model_config& c) {
  return static_cast<std::size_t>(c.vocab_size) * static_cast<std::size_t>(c.dim);
}

std::size_t total_size(const medusa_llama::model_config& c) {
  return embedding_size(c) + static_cast<std::size_t>(c.n_layers) * detail::block_size(c) + static_cast<std::size_t>(c.dim);
}

void require_shared_classifier(const medusa_llama::model_config& c) {
  if (!c.shared_classifier) throw medusa::invalid_input("dense model: only a classifier tied to the token embedding is supported");
}

}  // namespace

dense_model::dense_model(const medusa_llama::model_config& config, std::uint64_t seed) : config_(config) {
  config_.validate("dense model");
  require_shared_classifier(config_);
  params_.assign(total_size(config_), 0.0f);
  const float bound = 0.02f * std::sqrt(3.0f);  // uniform with standard deviation 0.02
  const float out_scale = 1.0f / std::sqrt(2.0f * static_cast<float>(config_.n_layers));
  auto fill = [&](float* p, std::size_t count, float b, std::uint64_t stream) {
    for (std::size_t i = 0; i < count; ++i) p[i] = static_cast<float>((2.0 * detail::unit(detail::mix(seed ^ detail::mix(stream + i))) - 1.0) * b);
  };
  fill(params_.data(), embedding_size(config_), bound, 0x5eedull << 40);
  const auto ls = layers(params_.data());
  for (std::size_t l = 0; l < ls.size(); ++l) {
    auto& w = ls[l];
    std::fill_n(const_cast<float*>(w.rms_att), config_.dim, 1.0f);
    std::fill_n(const_cast<float*>(w.rms_ffn), config_.dim, 1.0f);
    for (projection p : detail::all_projections) {
      const auto s = detail::projection_dims(config_, p);
      const bool output = p == projection::o || p == projection::down;
      fill(const_cast<float*>(detail::weight_of(w, p)), s.in * s.out, output ? bound * out_scale : bound,
           (static_cast<std::uint64_t>(l) * 8 + static_cast<std::uint64_t>(p) + 1) << 40);
    }
  }
  std::fill_n(params_.data() + final_norm_offset(), config_.dim, 1.0f);
}

dense_model::dense_model(const medusa_llama::model& m) : config_(m.config()) {
  require_shared_classifier(config_);
  params_.resize(total_size(config_));
  std::copy_n(m.token_embedding(), embedding_size(config_), params_.data());
  const auto ls = layers(params_.data());
  const auto d = static_cast<std::size_t>(config_.dim);
  for (std::size_t l = 0; l < ls.size(); ++l) {
    const auto& from = m.layer(static_cast<int>(l));
    std::copy_n(from.rms_att, d, const_cast<float*>(ls[l].rms_att));
    std::copy_n(from.rms_ffn, d, const_cast<float*>(ls[l].rms_ffn));
    for (projection p : detail::all_projections) {
      const auto s = detail::projection_dims(config_, p);
      std::copy_n(detail::weight_of(from, p), s.in * s.out, const_cast<float*>(detail::weight_of(ls[l], p)));
    }
  }
  std::copy_n(m.rms_final(), d, params_.data() + final_norm_offset());
}

std::vector<medusa_llama::layer_weights> dense_model::layers(const float* base) const {
  std::vector<medusa_llama::layer_weights> out(static_cast<std::size_t>(config_.n_layers));
  const float* p = base + embedding_size(config_);
  for (auto& w : out) {
    w = detail::block_at(config_, p);
    p += detail::block_size(config_);
  }
  return out;
}

std::size_t dense_model::final_norm_offset() const noexcept { return total_size(config_) - static_cast<std::size_t>(config_.dim); }

void dense_model::forward(std::span<const std::int32_t> tokens, sequence_state& st) const {
  detail::check_sequence(config_, tokens, "dense model");
  const auto ls = layers(params_.data());
  const std::size_t n = tokens.size();
  st.adapters = false;
  st.xa.clear();
  st.keep.clear();
  auto run = [&](std::size_t l, projection p, const float* x, float* y) {
    const auto s = detail::projection_dims(config_, p);
    detail::blas_gemm(false, true, n, s.out, s.in, 1.0f, x, s.in, detail::weight_of(ls[l], p), s.in, 0.0f, y, s.out);
  };
  detail::stack_forward(config_, params_.data(), ls, params_.data() + final_norm_offset(), tokens, st, run);
}

void dense_model::logits(const sequence_state& st, std::size_t row0, std::size_t rows, float* out) const {
  const auto d = static_cast<std::size_t>(config_.dim), V = static_cast<std::size_t>(config_.vocab_size);
  detail::blas_gemm(false, true, rows, V, d, 1.0f, st.hidden.data() + row0 * d, d, params_.data(), d, 0.0f, out, V);
}

void dense_model::backward(const sequence_state& st, std::size_t rows, const float* dlogits, float* grads) const {
  const auto d = static_cast<std::size_t>(config_.dim), V = static_cast<std::size_t>(config_.vocab_size), n = st.n;
  if (rows > n) throw medusa::invalid_input("dense model: gradients of " + std::to_string(rows) + " rows for a sequence of " + std::to_string(n));
  const auto ls = layers(params_.data());
  const auto gs = layers(grads);
  // The classifier (the embedding): d_hidden = dz E, dE += dzᵀ h.
  std::vector<float> d_hidden(n * d, 0.0f);
  detail::blas_gemm(false, false, rows, d, V, 1.0f, dlogits, V, params_.data(), d, 0.0f, d_hidden.data(), d);
  detail::blas_gemm(true, false, V, d, rows, 1.0f, dlogits, V, st.hidden.data(), d, 1.0f, grads, d);
  auto back = [&](std::size_t l, projection p, const float* x, const float* dy, float* dx) {
    const auto s = detail::projection_dims(config_, p);
    detail::blas_gemm(false, false, n, s.in, s.out, 1.0f, dy, s.out, detail::weight_of(ls[l], p), s.in, 0.0f, dx, s.in);
    detail::blas_gemm(true, false, s.out, s.in, n, 1.0f, dy, s.out, x, s.in, 1.0f, const_cast<float*>(detail::weight_of(gs[l], p)), s.in);
  };
  auto norms = [&](std::size_t l) { return detail::norm_gradients{const_cast<float*>(gs[l].rms_att), const_cast<float*>(gs[l].rms_ffn)}; };
  std::vector<float> d_input;
  detail::stack_backward(config_, ls, params_.data() + final_norm_offset(), st, d_hidden.data(), back, norms, grads + final_norm_offset(),
                         d_input);
  for (std::size_t i = 0; i < n; ++i) {
    float* row = grads + static_cast<std::size_t>(st.tokens[i]) * d;
    for (std::size_t j = 0; j < d; ++j) row[j] += d_input[i * d + j];
  }
}

medusa_llama::model dense_model::to_model() const {
  const auto ls = layers(params_.data());
  return medusa_llama::model::from_parts(config_, params_.data(), ls, params_.data() + final_norm_offset(), nullptr);
}

}  // namespace medusa_train
