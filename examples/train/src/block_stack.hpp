// SPDX-License-Identifier: Apache-2.0
// The forward and backward pass of a whole Llama stack over one sequence, with the linear layers
// left to the caller: `lora_model` runs them with frozen weights and adapters, `dense_model` with
// every weight trained. Everything else (RMSNorm, RoPE, causal attention, SwiGLU, the residual
// stream) is the same code for both.
#pragma once

#include <medusa_train/lora_model.hpp>

#include <medusa/error.hpp>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace medusa_train::detail {

//! Every projection of a block, in `projection`'s order.
inline constexpr std::array<projection, projections_per_layer> all_projections{
    projection::q, projection::k, projection::v, projection::o, projection::gate, projection::up, projection::down};

//! Input and output widths of a projection.
struct projection_shape {
  std::size_t in, out;
};

inline projection_shape projection_dims(const medusa_llama::model_config& c, projection p) {
  const auto d = static_cast<std::size_t>(c.dim), kv = static_cast<std::size_t>(c.kv_dim()), hid = static_cast<std::size_t>(c.hidden_dim);
  switch (p) {
    case projection::q: case projection::o: return {d, d};
    case projection::k: case projection::v: return {d, kv};
    case projection::gate: case projection::up: return {d, hid};
    case projection::down: return {hid, d};
  }
  return {0, 0};
}

//! The `[out][in]` weight of projection p in a block.
inline const float* weight_of(const medusa_llama::layer_weights& w, projection p) {
  switch (p) {
    case projection::q: return w.wq;
    case projection::k: return w.wk;
    case projection::v: return w.wv;
    case projection::o: return w.wo;
    case projection::gate: return w.w1;
    case projection::up: return w.w3;
    case projection::down: return w.w2;
  }
  return nullptr;
}

//! Floats of one block in a flat parameter array: two norms and the seven projections.
inline std::size_t block_size(const medusa_llama::model_config& c) {
  std::size_t n = 2 * static_cast<std::size_t>(c.dim);
  for (projection p : all_projections) {
    const auto s = projection_dims(c, p);
    n += s.in * s.out;
  }
  return n;
}

//! The weights of the block stored flat at `p` (`block_size` floats): `rms_att, wq, wk, wv, wo,
//! rms_ffn, w1 (gate), w2 (down), w3 (up)`.
inline medusa_llama::layer_weights block_at(const medusa_llama::model_config& c, const float* p) {
  auto take = [&](std::size_t count) {
    const float* r = p;
    p += count;
    return r;
  };
  auto size = [&](projection pr) {
    const auto s = projection_dims(c, pr);
    return s.in * s.out;
  };
  const auto d = static_cast<std::size_t>(c.dim);
  medusa_llama::layer_weights w;
  w.rms_att = take(d);
  w.wq = take(size(projection::q));
  w.wk = take(size(projection::k));
  w.wv = take(size(projection::v));
  w.wo = take(size(projection::o));
  w.rms_ffn = take(d);
  w.w1 = take(size(projection::gate));
  w.w2 = take(size(projection::down));
  w.w3 = take(size(projection::up));
  return w;
}

inline backbone::rope_pairs pairs_of(const medusa_llama::model_config& c) {
  return c.rope == medusa_llama::rope_style::adjacent_pairs ? backbone::rope_pairs::adjacent : backbone::rope_pairs::halves;
}

inline backbone::attention_shape attention_of(const medusa_llama::model_config& c, std::size_t n) {
  return {n, static_cast<std::size_t>(c.n_heads), static_cast<std::size_t>(c.n_kv_heads), static_cast<std::size_t>(c.head_dim())};
}

//! Throws `medusa::invalid_input` (messages start with `who`) for an empty or over-long sequence
//! or a token outside the vocabulary.
inline void check_sequence(const medusa_llama::model_config& c, std::span<const std::int32_t> tokens, const char* who) {
  const std::size_t n = tokens.size();
  if (n == 0 || n > static_cast<std::size_t>(c.seq_len))
    throw medusa::invalid_input(std::string(who) + ": a sequence of " + std::to_string(n) + " tokens does not fit the context of " +
                                std::to_string(c.seq_len));
  for (std::size_t i = 0; i < n; ++i)
    if (tokens[i] < 0 || tokens[i] >= c.vocab_size)
      throw medusa::invalid_input(std::string(who) + ": token " + std::to_string(tokens[i]) + " at position " + std::to_string(i) +
                                  " is outside the vocabulary");
}

//! Sizes `st` for a forward of `n` positions through `layers` blocks; `st.x`'s first n rows are
//! then the block input for `stack_forward_from` to read.
inline void stack_prepare(const medusa_llama::model_config& c, std::size_t layers, std::size_t n, sequence_state& st) {
  const std::size_t d = static_cast<std::size_t>(c.dim), kv = static_cast<std::size_t>(c.kv_dim()),
                    hid = static_cast<std::size_t>(c.hidden_dim), L = layers;
  auto sized = [](std::vector<std::vector<float>>& v, std::size_t count, std::size_t size) {
    v.resize(count);
    for (auto& e : v) e.resize(size);
  };
  st.n = n;
  st.x.resize((L + 1) * n * d);
  st.hidden.resize(n * d);
  st.final_r.resize(n);
  const auto as = attention_of(c, n);
  for (auto* v : {&st.r_att, &st.r_ffn}) sized(*v, L, n);
  for (auto* v : {&st.xn_att, &st.q, &st.att, &st.x_mid, &st.xn_ffn}) sized(*v, L, n * d);
  for (auto* v : {&st.k, &st.v}) sized(*v, L, n * kv);
  for (auto* v : {&st.a, &st.b, &st.h}) sized(*v, L, n * hid);
  sized(st.probs, L, as.heads * n * n);
}

//! Runs the block input already in `st` (sized by `stack_prepare`, rows [0, st.n) of `st.x`)
//! through the blocks and the final norm, keeping every activation the backward needs in `st`.
//! `linear(l, p, x, y)` computes projection p of block l: y = x Wᵀ (+ …).
template <class Linear>
void stack_forward_from(const medusa_llama::model_config& c, std::span<const medusa_llama::layer_weights> layers, const float* rms_final,
                        sequence_state& st, Linear&& linear) {
  const std::size_t n = st.n, d = static_cast<std::size_t>(c.dim), hid = static_cast<std::size_t>(c.hidden_dim), L = layers.size();
  const auto as = attention_of(c, n);
  std::vector<std::int32_t> positions(n);
  for (std::size_t i = 0; i < n; ++i) positions[i] = static_cast<std::int32_t>(i);
  std::vector<float> tmp(n * d);
  const float eps = c.rms_eps;
  for (std::size_t l = 0; l < L; ++l) {
    const auto& w = layers[l];
    const float* xl = st.x.data() + l * n * d;
    backbone::rmsnorm_forward(n, d, xl, w.rms_att, eps, st.xn_att[l].data(), st.r_att[l].data());
    linear(l, projection::q, st.xn_att[l].data(), st.q[l].data());
    linear(l, projection::k, st.xn_att[l].data(), st.k[l].data());
    linear(l, projection::v, st.xn_att[l].data(), st.v[l].data());
    backbone::rope(n, as.heads, as.hd, st.q[l].data(), positions, c.rope_theta, pairs_of(c));
    backbone::rope(n, as.kv_heads, as.hd, st.k[l].data(), positions, c.rope_theta, pairs_of(c));
    backbone::attention_forward(as, st.q[l].data(), st.k[l].data(), st.v[l].data(), st.att[l].data(), st.probs[l].data());
    linear(l, projection::o, st.att[l].data(), tmp.data());
    float* xm = st.x_mid[l].data();
    for (std::size_t i = 0; i < n * d; ++i) xm[i] = xl[i] + tmp[i];
    backbone::rmsnorm_forward(n, d, xm, w.rms_ffn, eps, st.xn_ffn[l].data(), st.r_ffn[l].data());
    linear(l, projection::gate, st.xn_ffn[l].data(), st.a[l].data());
    linear(l, projection::up, st.xn_ffn[l].data(), st.b[l].data());
    backbone::swiglu_forward(n * hid, st.a[l].data(), st.b[l].data(), st.h[l].data());
    linear(l, projection::down, st.h[l].data(), tmp.data());
    float* xn = st.x.data() + (l + 1) * n * d;
    for (std::size_t i = 0; i < n * d; ++i) xn[i] = xm[i] + tmp[i];
  }
  backbone::rmsnorm_forward(n, d, st.x.data() + L * n * d, rms_final, eps, st.hidden.data(), st.final_r.data());
}

//! Runs `tokens` (checked by the caller) through embedding, blocks and final norm.
template <class Linear>
void stack_forward(const medusa_llama::model_config& c, const float* embedding, std::span<const medusa_llama::layer_weights> layers,
                   const float* rms_final, std::span<const std::int32_t> tokens, sequence_state& st, Linear&& linear) {
  const std::size_t n = tokens.size(), d = static_cast<std::size_t>(c.dim);
  stack_prepare(c, layers.size(), n, st);
  st.tokens.assign(tokens.begin(), tokens.end());
  for (std::size_t i = 0; i < n; ++i) std::copy_n(embedding + static_cast<std::size_t>(tokens[i]) * d, d, st.x.data() + i * d);
  stack_forward_from(c, layers, rms_final, st, std::forward<Linear>(linear));
}

//! Gradients of a block's two RMSNorm weights (null: frozen).
struct norm_gradients {
  float* att = nullptr;
  float* ffn = nullptr;
};

//! Back-propagates `d_hidden` ([n][d], the loss's gradient at `st.hidden`) through the stack of a
//! `stack_forward` / `stack_forward_from`. `linear_back(l, p, x, dy, dx)` writes dx = ∂/∂x of
//! projection p of block l (and adds its own parameters' gradients); `norms(l)` names block l's
//! norm gradients; `d_rms_final` (may be null) receives the final norm's. `d_input` becomes the
//! gradient at the block input ([n][d]: the embedded tokens of `stack_forward`). Overwrites
//! nothing in `st` but reads all of it.
template <class LinearBack, class Norms>
void stack_backward(const medusa_llama::model_config& c, std::span<const medusa_llama::layer_weights> layers, const float* rms_final,
                    const sequence_state& st, const float* d_hidden, LinearBack&& linear_back, Norms&& norms, float* d_rms_final,
                    std::vector<float>& d_input) {
  const std::size_t n = st.n, d = static_cast<std::size_t>(c.dim), kv = static_cast<std::size_t>(c.kv_dim()),
                    hid = static_cast<std::size_t>(c.hidden_dim), L = layers.size();
  const auto as = attention_of(c, n);
  std::vector<std::int32_t> positions(n);
  for (std::size_t i = 0; i < n; ++i) positions[i] = static_cast<std::int32_t>(i);
  std::vector<float>& dx = d_input;
  dx.resize(n * d);
  std::vector<float> dmid(n * d), dn(n * d), tmp(n * d), dh(n * hid), da(n * hid), db(n * hid), dq(n * d), dk(n * kv), dv(n * kv),
      dkv_tmp(n * d);

  backbone::rmsnorm_backward(n, d, st.x.data() + L * n * d, rms_final, st.final_r.data(), d_hidden, dx.data(), d_rms_final);
  for (std::size_t l = L; l-- > 0;) {
    const auto& w = layers[l];
    const norm_gradients ng = norms(l);
    // x_{l+1} = x_mid + down(swiglu(gate(n2), up(n2))), n2 = rmsnorm(x_mid)
    linear_back(l, projection::down, st.h[l].data(), dx.data(), dh.data());
    backbone::swiglu_backward(n * hid, st.a[l].data(), st.b[l].data(), dh.data(), da.data(), db.data());
    linear_back(l, projection::gate, st.xn_ffn[l].data(), da.data(), dn.data());
    linear_back(l, projection::up, st.xn_ffn[l].data(), db.data(), tmp.data());
    for (std::size_t i = 0; i < n * d; ++i) dn[i] += tmp[i];
    backbone::rmsnorm_backward(n, d, st.x_mid[l].data(), w.rms_ffn, st.r_ffn[l].data(), dn.data(), tmp.data(), ng.ffn);
    for (std::size_t i = 0; i < n * d; ++i) dmid[i] = dx[i] + tmp[i];
    // x_mid = x_l + o(attention(rope(q(n1)), rope(k(n1)), v(n1))), n1 = rmsnorm(x_l)
    linear_back(l, projection::o, st.att[l].data(), dmid.data(), tmp.data());
    backbone::attention_backward(as, st.q[l].data(), st.k[l].data(), st.v[l].data(), st.probs[l].data(), tmp.data(), dq.data(), dk.data(),
                                 dv.data());
    backbone::rope(n, as.heads, as.hd, dq.data(), positions, c.rope_theta, pairs_of(c), true);
    backbone::rope(n, as.kv_heads, as.hd, dk.data(), positions, c.rope_theta, pairs_of(c), true);
    linear_back(l, projection::q, st.xn_att[l].data(), dq.data(), dn.data());
    linear_back(l, projection::k, st.xn_att[l].data(), dk.data(), dkv_tmp.data());
    for (std::size_t i = 0; i < n * d; ++i) dn[i] += dkv_tmp[i];
    linear_back(l, projection::v, st.xn_att[l].data(), dv.data(), dkv_tmp.data());
    for (std::size_t i = 0; i < n * d; ++i) dn[i] += dkv_tmp[i];
    backbone::rmsnorm_backward(n, d, st.x.data() + l * n * d, w.rms_att, st.r_att[l].data(), dn.data(), tmp.data(), ng.att);
    for (std::size_t i = 0; i < n * d; ++i) dx[i] = dmid[i] + tmp[i];
  }
}

}  // namespace medusa_train::detail
