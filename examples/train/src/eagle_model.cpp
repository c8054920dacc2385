// SPDX-License-Identifier: Apache-2.0
#include <medusa_train/eagle_model.hpp>

#include "block_stack.hpp"
#include "common.hpp"

#include <medusa/error.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>

namespace medusa_train {

namespace {

std::size_t fc_size(const medusa_llama::model_config& c) { return 2 * static_cast<std::size_t>(c.dim) * static_cast<std::size_t>(c.dim); }

medusa_llama::model_config eagle_config(const medusa_llama::model_config& target, int hidden_dim) {
  if (hidden_dim < 0) throw medusa::invalid_input("eagle: the block's hidden width must be >= 0, got " + std::to_string(hidden_dim));
  medusa_llama::model_config c = target;
  c.n_layers = 1;
  if (hidden_dim > 0) c.hidden_dim = hidden_dim;
  c.validate("eagle drafter");
  return c;
}

}  // namespace

eagle_model::eagle_model(const medusa_llama::model& target, int hidden_dim, std::uint64_t seed)
    : target_(target), config_(eagle_config(target.config(), hidden_dim)) {
  const auto d = static_cast<std::size_t>(config_.dim);
  params_.assign(fc_size(config_) + detail::block_size(config_) + d, 0.0f);
  const float bound = 0.02f * std::sqrt(3.0f);  // uniform with standard deviation 0.02
  auto fill = [&](float* p, std::size_t count, float b, std::uint64_t stream) {
    for (std::size_t i = 0; i < count; ++i) p[i] = static_cast<float>((2.0 * detail::unit(detail::mix(seed ^ detail::mix(stream + i))) - 1.0) * b);
  };
  // W_fc: the features pass through at first (the block then starts from the target's own state).
  fill(params_.data(), fc_size(config_), bound, 0xfc5eedull << 40);
  for (std::size_t r = 0; r < d; ++r) params_[r * 2 * d + d + r] += 1.0f;
  const auto w = block(params_.data());
  std::fill_n(const_cast<float*>(w.rms_att), d, 1.0f);
  std::fill_n(const_cast<float*>(w.rms_ffn), d, 1.0f);
  for (projection p : detail::all_projections) {
    const auto s = detail::projection_dims(config_, p);
    const bool output = p == projection::o || p == projection::down;
    fill(const_cast<float*>(detail::weight_of(w, p)), s.in * s.out, output ? bound / std::sqrt(2.0f) : bound,
         (static_cast<std::uint64_t>(p) + 1) << 40);
  }
  std::copy_n(target_.rms_final(), d, params_.data() + params_.size() - d);
}

std::span<const float> eagle_model::fc() const noexcept { return std::span<const float>(params_).first(fc_size(config_)); }

medusa_llama::layer_weights eagle_model::block(const float* base) const {
  return detail::block_at(config_, base + fc_size(config_));
}

void eagle_model::forward(std::span<const std::int32_t> tokens, const float* features, eagle_state& st, const eagle_forward_options& fo) const {
  detail::check_sequence(config_, tokens, "eagle drafter");
  const auto d = static_cast<std::size_t>(config_.dim);
  const std::size_t n = tokens.size();
  const float* E = target_.token_embedding();
  st.u.resize(n * 2 * d);
  for (std::size_t i = 0; i < n; ++i) {
    float* u = st.u.data() + i * 2 * d;
    std::copy_n(E + static_cast<std::size_t>(tokens[i]) * d, d, u);
    std::copy_n(features + i * d, d, u + d);
    if (fo.noise > 0)
      for (std::size_t j = 0; j < d; ++j)
        u[d + j] += static_cast<float>((2.0 * detail::unit(detail::mix(fo.seed ^ detail::mix(i * d + j))) - 1.0) * fo.noise);
  }
  auto& s = st.stack;
  s.adapters = false;
  s.xa.clear();
  s.keep.clear();
  detail::stack_prepare(config_, 1, n, s);
  s.tokens.assign(tokens.begin(), tokens.end());
  detail::blas_gemm(false, true, n, d, 2 * d, 1.0f, st.u.data(), 2 * d, params_.data(), 2 * d, 0.0f, s.x.data(), d);
  const auto w = block(params_.data());
  auto run = [&](std::size_t, projection p, const float* x, float* y) {
    const auto ps = detail::projection_dims(config_, p);
    detail::blas_gemm(false, true, n, ps.out, ps.in, 1.0f, x, ps.in, detail::weight_of(w, p), ps.in, 0.0f, y, ps.out);
  };
  detail::stack_forward_from(config_, std::span(&w, 1), params_.data() + params_.size() - d, s, run);
}

void eagle_model::logits(const eagle_state& st, std::size_t row0, std::size_t rows, float* out) const {
  const auto d = static_cast<std::size_t>(config_.dim), V = static_cast<std::size_t>(config_.vocab_size);
  detail::blas_gemm(false, true, rows, V, d, 1.0f, st.stack.hidden.data() + row0 * d, d, target_.classifier(), d, 0.0f, out, V);
}

void eagle_model::backward(const eagle_state& st, std::size_t rows, const float* dlogits, const float* dg, float* grads) const {
  const auto d = static_cast<std::size_t>(config_.dim), V = static_cast<std::size_t>(config_.vocab_size), n = st.stack.n;
  if (rows > n) throw medusa::invalid_input("eagle drafter: gradients of " + std::to_string(rows) + " rows for a sequence of " + std::to_string(n));
  const auto w = block(params_.data());
  const auto gw = block(grads);
  // The frozen classifier: d_hidden = dz W_cls (+ dg).
  std::vector<float> d_hidden(n * d, 0.0f);
  if (dg) std::copy_n(dg, rows * d, d_hidden.data());
  detail::blas_gemm(false, false, rows, d, V, 1.0f, dlogits, V, target_.classifier(), d, 1.0f, d_hidden.data(), d);
  auto back = [&](std::size_t, projection p, const float* x, const float* dy, float* dx) {
    const auto s = detail::projection_dims(config_, p);
    detail::blas_gemm(false, false, n, s.in, s.out, 1.0f, dy, s.out, detail::weight_of(w, p), s.in, 0.0f, dx, s.in);
    detail::blas_gemm(true, false, s.out, s.in, n, 1.0f, dy, s.out, x, s.in, 1.0f, const_cast<float*>(detail::weight_of(gw, p)), s.in);
  };
  auto norms = [&](std::size_t) { return detail::norm_gradients{const_cast<float*>(gw.rms_att), const_cast<float*>(gw.rms_ffn)}; };
  std::vector<float> d_input;
  detail::stack_backward(config_, std::span(&w, 1), params_.data() + params_.size() - d, st.stack, d_hidden.data(), back, norms,
                         grads + params_.size() - d, d_input);
  // x = u W_fcᵀ: dW_fc += d_xᵀ u (E and the features are not trained).
  detail::blas_gemm(true, false, d, 2 * d, n, 1.0f, d_input.data(), d, st.u.data(), 2 * d, 1.0f, grads, 2 * d);
}

void eagle_model::extend(eagle_chain& chain, std::int32_t token, const float* feature, float* g, float* logits_out) const {
  const auto& c = config_;
  const std::size_t d = static_cast<std::size_t>(c.dim), kv = static_cast<std::size_t>(c.kv_dim()), hid = static_cast<std::size_t>(c.hidden_dim),
                    V = static_cast<std::size_t>(c.vocab_size);
  if (token < 0 || token >= c.vocab_size) throw medusa::invalid_input("eagle drafter: token " + std::to_string(token) + " is outside the vocabulary");
  const std::size_t p = chain.prefix_k.size() / kv, pos = p + chain.k.size() / kv;
  if (pos >= static_cast<std::size_t>(c.seq_len)) throw medusa::invalid_input("eagle drafter: a chain past the context of " + std::to_string(c.seq_len));
  const auto w = block(params_.data());
  const float eps = c.rms_eps;
  auto gemv = [](const float* W, std::size_t out, std::size_t in, const float* x, float* y) {
    detail::blas_gemm(false, true, 1, out, in, 1.0f, x, in, W, in, 0.0f, y, out);
  };
  std::vector<float> u(2 * d), x(d), xn(d), q(d), k(kv), v(kv), att(d, 0.0f), tmp(d), a(hid), b(hid), h(hid);
  float r = 0;
  std::copy_n(target_.token_embedding() + static_cast<std::size_t>(token) * d, d, u.data());
  std::copy_n(feature, d, u.data() + d);
  gemv(params_.data(), d, 2 * d, u.data(), x.data());
  backbone::rmsnorm_forward(1, d, x.data(), w.rms_att, eps, xn.data(), &r);
  gemv(w.wq, d, d, xn.data(), q.data());
  gemv(w.wk, kv, d, xn.data(), k.data());
  gemv(w.wv, kv, d, xn.data(), v.data());
  const std::int32_t at = static_cast<std::int32_t>(pos);
  const auto as = detail::attention_of(c, 1);
  backbone::rope(1, as.heads, as.hd, q.data(), std::span(&at, 1), c.rope_theta, detail::pairs_of(c));
  backbone::rope(1, as.kv_heads, as.hd, k.data(), std::span(&at, 1), c.rope_theta, detail::pairs_of(c));
  chain.k.insert(chain.k.end(), k.begin(), k.end());
  chain.v.insert(chain.v.end(), v.begin(), v.end());
  // One query over the prefix rows and the appended ones (this row last), per head.
  const std::size_t rows = pos + 1;
  auto key = [&](std::size_t s) { return s < p ? chain.prefix_k.data() + s * kv : chain.k.data() + (s - p) * kv; };
  auto value = [&](std::size_t s) { return s < p ? chain.prefix_v.data() + s * kv : chain.v.data() + (s - p) * kv; };
  std::vector<float> sc(rows);
  const float scale = 1.0f / std::sqrt(static_cast<float>(as.hd));
  for (std::size_t hh = 0; hh < as.heads; ++hh) {
    const std::size_t off = (hh / as.group()) * as.hd;
    const float* qh = q.data() + hh * as.hd;
    float mx = -INFINITY;
    for (std::size_t s = 0; s < rows; ++s) {
      float dot = 0;
      for (std::size_t j = 0; j < as.hd; ++j) dot += qh[j] * key(s)[off + j];
      sc[s] = dot * scale;
      mx = std::max(mx, sc[s]);
    }
    float sum = 0;
    for (std::size_t s = 0; s < rows; ++s) sum += (sc[s] = std::exp(sc[s] - mx));
    float* o = att.data() + hh * as.hd;
    for (std::size_t s = 0; s < rows; ++s)
      for (std::size_t j = 0; j < as.hd; ++j) o[j] += sc[s] / sum * value(s)[off + j];
  }
  gemv(w.wo, d, d, att.data(), tmp.data());
  for (std::size_t j = 0; j < d; ++j) x[j] += tmp[j];
  backbone::rmsnorm_forward(1, d, x.data(), w.rms_ffn, eps, xn.data(), &r);
  gemv(w.w1, hid, d, xn.data(), a.data());
  gemv(w.w3, hid, d, xn.data(), b.data());
  backbone::swiglu_forward(hid, a.data(), b.data(), h.data());
  gemv(w.w2, d, hid, h.data(), tmp.data());
  for (std::size_t j = 0; j < d; ++j) x[j] += tmp[j];
  backbone::rmsnorm_forward(1, d, x.data(), params_.data() + params_.size() - d, eps, g, &r);
  if (logits_out) gemv(target_.classifier(), V, d, g, logits_out);
}

medusa_llama::model eagle_model::to_model() const {
  const auto w = block(params_.data());
  return medusa_llama::model::from_parts(config_, target_.token_embedding(), std::span(&w, 1), params_.data() + params_.size() - static_cast<std::size_t>(config_.dim),
                                         config_.shared_classifier ? nullptr : target_.classifier());
}

void eagle_model::save_fc(const std::filesystem::path& path) const {
  static_assert(std::endian::native == std::endian::little, "fc.bin is written as little-endian float32");
  const auto tmp = detail::temp_beside(path);
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) throw medusa::io_error("cannot create " + tmp.string());
  const std::int32_t head[3] = {1, 2 * config_.dim, config_.dim};
  const auto w = fc();
  bool ok = std::fwrite("MEDUSAFC", 1, 8, f) == 8 && std::fwrite(head, sizeof head, 1, f) == 1 &&
            std::fwrite(w.data(), sizeof(float), w.size(), f) == w.size();
  ok = std::fclose(f) == 0 && ok;
  std::error_code ec;
  if (ok) std::filesystem::rename(tmp, path, ec);
  if (!ok || ec) {
    std::filesystem::remove(tmp, ec);
    throw medusa::io_error("cannot write " + path.string());
  }
}

}  // namespace medusa_train
