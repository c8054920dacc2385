// SPDX-License-Identifier: Apache-2.0
#include <medusa_train/lora_model.hpp>

#include "common.hpp"

#include <medusa/error.hpp>

#include <algorithm>
#include <cmath>

namespace medusa_train {

namespace {

constexpr std::array<projection, projections_per_layer> all_projections{projection::q,    projection::k,  projection::v,
                                                                        projection::o,    projection::gate, projection::up,
                                                                        projection::down};

using detail::mix;
using detail::unit;

struct dims {
  std::size_t in, out;
};

dims dims_of(const medusa_llama::model_config& c, projection p) {
  const auto d = static_cast<std::size_t>(c.dim), kv = static_cast<std::size_t>(c.kv_dim()), hid = static_cast<std::size_t>(c.hidden_dim);
  switch (p) {
    case projection::q: case projection::o: return {d, d};
    case projection::k: case projection::v: return {d, kv};
    case projection::gate: case projection::up: return {d, hid};
    case projection::down: return {hid, d};
  }
  return {0, 0};
}

const float* base_weight(const medusa_llama::layer_weights& w, projection p) {
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

backbone::rope_pairs pairs_of(const medusa_llama::model_config& c) {
  return c.rope == medusa_llama::rope_style::adjacent_pairs ? backbone::rope_pairs::adjacent : backbone::rope_pairs::halves;
}

}  // namespace

std::string_view module_name(projection p) noexcept {
  switch (p) {
    case projection::q: return "q_proj";
    case projection::k: return "k_proj";
    case projection::v: return "v_proj";
    case projection::o: return "o_proj";
    case projection::gate: return "gate_proj";
    case projection::up: return "up_proj";
    case projection::down: return "down_proj";
  }
  return "?";
}

std::string module_path(std::size_t layer, projection p) {
  const bool attn = p == projection::q || p == projection::k || p == projection::v || p == projection::o;
  return "model.layers." + std::to_string(layer) + (attn ? ".self_attn." : ".mlp.") + std::string(module_name(p));
}

lora_model::lora_model(medusa_llama::model base, const lora_options& opt, std::uint64_t seed) : base_(std::move(base)), opt_(opt) {
  const auto& c = base_.config();
  if (opt.rank == 0 || opt.rank > static_cast<std::size_t>(c.dim))
    throw medusa::invalid_input("lora: rank " + std::to_string(opt.rank) + " is outside [1, d = " + std::to_string(c.dim) + "]");
  if (!(opt.alpha > 0) || !std::isfinite(opt.alpha)) throw medusa::invalid_input("lora: alpha must be positive");
  if (!(opt.dropout >= 0 && opt.dropout < 1)) throw medusa::invalid_input("lora: dropout must be in [0, 1)");
  const std::size_t L = static_cast<std::size_t>(c.n_layers), r = opt.rank;
  offsets_.resize(L * projections_per_layer);
  std::size_t n = 0;
  for (std::size_t l = 0; l < L; ++l)
    for (projection p : all_projections) {
      offsets_[l * projections_per_layer + static_cast<std::size_t>(p)] = n;
      const auto [in, out] = dims_of(c, p);
      n += r * in + out * r;
    }
  params_.assign(n, 0.0f);
  // A ~ U(±1/√in) (PEFT: kaiming_uniform with a = √5), B = 0.
  for (std::size_t l = 0; l < L; ++l)
    for (projection p : all_projections) {
      const auto in = dims_of(c, p).in;
      const std::size_t off = offset(l, p);
      const double bound = 1.0 / std::sqrt(static_cast<double>(in));
      for (std::size_t i = 0; i < r * in; ++i)
        params_[off + i] = static_cast<float>((2.0 * unit(mix(seed ^ mix(off + i + 0x10a5ull))) - 1.0) * bound);
    }
}

backbone::lora_linear<float> lora_model::adapter(std::size_t l, projection p) const {
  const auto& c = base_.config();
  const auto [in, out] = dims_of(c, p);
  backbone::lora_linear<float> ll;
  ll.in = in;
  ll.out = out;
  ll.rank = opt_.rank;
  ll.W = base_weight(base_.layer(static_cast<int>(l)), p);
  ll.A = params_.data() + offset(l, p);
  ll.B = ll.A + opt_.rank * in;
  ll.scaling = static_cast<float>(opt_.alpha / static_cast<double>(opt_.rank));
  return ll;
}

void lora_model::forward(std::span<const std::int32_t> tokens, sequence_state& st, const forward_options& fo) const {
  const auto& c = base_.config();
  const std::size_t n = tokens.size(), d = static_cast<std::size_t>(c.dim), kv = static_cast<std::size_t>(c.kv_dim()),
                    hid = static_cast<std::size_t>(c.hidden_dim), L = static_cast<std::size_t>(c.n_layers), r = opt_.rank;
  if (n == 0 || n > static_cast<std::size_t>(c.seq_len))
    throw medusa::invalid_input("lora: a sequence of " + std::to_string(n) + " tokens does not fit the context of " + std::to_string(c.seq_len));
  for (std::size_t i = 0; i < n; ++i)
    if (tokens[i] < 0 || tokens[i] >= c.vocab_size)
      throw medusa::invalid_input("lora: token " + std::to_string(tokens[i]) + " at position " + std::to_string(i) + " is outside the vocabulary");
  st.n = n;
  st.tokens.assign(tokens.begin(), tokens.end());
  st.adapters = fo.adapters;
  const bool drop = fo.adapters && fo.train && opt_.dropout > 0;
  auto sized = [](std::vector<std::vector<float>>& v, std::size_t count, std::size_t size) {
    v.resize(count);
    for (auto& e : v) e.resize(size);
  };
  st.x.resize((L + 1) * n * d);
  st.hidden.resize(n * d);
  st.final_r.resize(n);
  const backbone::attention_shape as{n, static_cast<std::size_t>(c.n_heads), static_cast<std::size_t>(c.n_kv_heads), static_cast<std::size_t>(c.head_dim())};
  for (auto* v : {&st.r_att, &st.r_ffn}) sized(*v, L, n);
  for (auto* v : {&st.xn_att, &st.q, &st.att, &st.x_mid, &st.xn_ffn}) sized(*v, L, n * d);
  for (auto* v : {&st.k, &st.v}) sized(*v, L, n * kv);
  for (auto* v : {&st.a, &st.b, &st.h}) sized(*v, L, n * hid);
  sized(st.probs, L, as.heads * n * n);
  sized(st.xa, L * projections_per_layer, n * r);
  st.keep.resize(drop ? L * projections_per_layer : 0);

  for (std::size_t i = 0; i < n; ++i)
    std::copy_n(base_.token_embedding() + static_cast<std::size_t>(tokens[i]) * d, d, st.x.data() + i * d);
  std::vector<std::int32_t> positions(n);
  for (std::size_t i = 0; i < n; ++i) positions[i] = static_cast<std::int32_t>(i);
  std::vector<float> tmp(n * d);
  const float eps = c.rms_eps;

  auto run = [&](std::size_t l, projection p, const float* x, float* y) {
    auto ll = adapter(l, p);
    if (!fo.adapters) ll.A = ll.B = nullptr;
    const std::size_t idx = l * projections_per_layer + static_cast<std::size_t>(p);
    const float* keep = nullptr;
    if (drop) {
      auto& k = st.keep[idx];
      k.resize(n * ll.in);
      const float scale = static_cast<float>(1.0 / (1.0 - opt_.dropout));
      const std::uint64_t s = mix(fo.seed ^ mix(idx + 1));
      for (std::size_t i = 0; i < k.size(); ++i) k[i] = unit(mix(s + i)) < opt_.dropout ? 0.0f : scale;
      keep = k.data();
    }
    backbone::linear_forward(ll, n, x, keep, y, st.xa[idx].data());
  };

  for (std::size_t l = 0; l < L; ++l) {
    const auto& w = base_.layer(static_cast<int>(l));
    const float* xl = st.x.data() + l * n * d;
    backbone::rmsnorm_forward(n, d, xl, w.rms_att, eps, st.xn_att[l].data(), st.r_att[l].data());
    run(l, projection::q, st.xn_att[l].data(), st.q[l].data());
    run(l, projection::k, st.xn_att[l].data(), st.k[l].data());
    run(l, projection::v, st.xn_att[l].data(), st.v[l].data());
    backbone::rope(n, as.heads, as.hd, st.q[l].data(), positions, c.rope_theta, pairs_of(c));
    backbone::rope(n, as.kv_heads, as.hd, st.k[l].data(), positions, c.rope_theta, pairs_of(c));
    backbone::attention_forward(as, st.q[l].data(), st.k[l].data(), st.v[l].data(), st.att[l].data(), st.probs[l].data());
    run(l, projection::o, st.att[l].data(), tmp.data());
    float* xm = st.x_mid[l].data();
    for (std::size_t i = 0; i < n * d; ++i) xm[i] = xl[i] + tmp[i];
    backbone::rmsnorm_forward(n, d, xm, w.rms_ffn, eps, st.xn_ffn[l].data(), st.r_ffn[l].data());
    run(l, projection::gate, st.xn_ffn[l].data(), st.a[l].data());
    run(l, projection::up, st.xn_ffn[l].data(), st.b[l].data());
    backbone::swiglu_forward(n * hid, st.a[l].data(), st.b[l].data(), st.h[l].data());
    run(l, projection::down, st.h[l].data(), tmp.data());
    float* xn = st.x.data() + (l + 1) * n * d;
    for (std::size_t i = 0; i < n * d; ++i) xn[i] = xm[i] + tmp[i];
  }
  backbone::rmsnorm_forward(n, d, st.x.data() + L * n * d, base_.rms_final(), eps, st.hidden.data(), st.final_r.data());
}

void lora_model::logits(const sequence_state& st, std::size_t row0, std::size_t rows, float* out) const {
  const auto& c = base_.config();
  const auto d = static_cast<std::size_t>(c.dim), V = static_cast<std::size_t>(c.vocab_size);
  detail::blas_gemm(false, true, rows, V, d, 1.0f, st.hidden.data() + row0 * d, d, base_.classifier(), d, 0.0f, out, V);
}

void lora_model::classifier_backward(std::size_t rows, const float* dlogits, float* d_hidden) const {
  const auto& c = base_.config();
  const auto d = static_cast<std::size_t>(c.dim), V = static_cast<std::size_t>(c.vocab_size);
  detail::blas_gemm(false, false, rows, d, V, 1.0f, dlogits, V, base_.classifier(), d, 1.0f, d_hidden, d);
}

void lora_model::backward(sequence_state& st, const float* d_hidden, float* grads) const {
  if (!st.adapters) throw medusa::invalid_input("lora: backward needs a forward with the adapters on");
  const auto& c = base_.config();
  const std::size_t n = st.n, d = static_cast<std::size_t>(c.dim), kv = static_cast<std::size_t>(c.kv_dim()),
                    hid = static_cast<std::size_t>(c.hidden_dim), L = static_cast<std::size_t>(c.n_layers);
  const backbone::attention_shape as{n, static_cast<std::size_t>(c.n_heads), static_cast<std::size_t>(c.n_kv_heads), static_cast<std::size_t>(c.head_dim())};
  std::vector<std::int32_t> positions(n);
  for (std::size_t i = 0; i < n; ++i) positions[i] = static_cast<std::int32_t>(i);
  std::vector<float> dx(n * d), dmid(n * d), dn(n * d), tmp(n * d), dh(n * hid), da(n * hid), db(n * hid), dq(n * d), dk(n * kv),
      dv(n * kv), dkv_tmp(n * d);

  auto back = [&](std::size_t l, projection p, const float* x, const float* dy, float* dxo) {
    const auto ll = adapter(l, p);
    const std::size_t idx = l * projections_per_layer + static_cast<std::size_t>(p);
    const float* keep = st.keep.empty() ? nullptr : st.keep[idx].data();
    float* dA = grads + offset(l, p);
    backbone::linear_backward(ll, n, x, keep, st.xa[idx].data(), dy, dxo, dA, dA + ll.rank * ll.in);
  };

  backbone::rmsnorm_backward(n, d, st.x.data() + L * n * d, base_.rms_final(), st.final_r.data(), d_hidden, dx.data(), static_cast<float*>(nullptr));
  for (std::size_t l = L; l-- > 0;) {
    const auto& w = base_.layer(static_cast<int>(l));
    // x_{l+1} = x_mid + down(swiglu(gate(n2), up(n2))), n2 = rmsnorm(x_mid)
    back(l, projection::down, st.h[l].data(), dx.data(), dh.data());
    backbone::swiglu_backward(n * hid, st.a[l].data(), st.b[l].data(), dh.data(), da.data(), db.data());
    back(l, projection::gate, st.xn_ffn[l].data(), da.data(), dn.data());
    back(l, projection::up, st.xn_ffn[l].data(), db.data(), tmp.data());
    for (std::size_t i = 0; i < n * d; ++i) dn[i] += tmp[i];
    backbone::rmsnorm_backward(n, d, st.x_mid[l].data(), w.rms_ffn, st.r_ffn[l].data(), dn.data(), tmp.data(), static_cast<float*>(nullptr));
    for (std::size_t i = 0; i < n * d; ++i) dmid[i] = dx[i] + tmp[i];
    // x_mid = x_l + o(attention(rope(q(n1)), rope(k(n1)), v(n1))), n1 = rmsnorm(x_l)
    back(l, projection::o, st.att[l].data(), dmid.data(), tmp.data());
    backbone::attention_backward(as, st.q[l].data(), st.k[l].data(), st.v[l].data(), st.probs[l].data(), tmp.data(), dq.data(),
                                 dk.data(), dv.data());
    backbone::rope(n, as.heads, as.hd, dq.data(), positions, c.rope_theta, pairs_of(c), true);
    backbone::rope(n, as.kv_heads, as.hd, dk.data(), positions, c.rope_theta, pairs_of(c), true);
    back(l, projection::q, st.xn_att[l].data(), dq.data(), dn.data());
    back(l, projection::k, st.xn_att[l].data(), dk.data(), dkv_tmp.data());
    for (std::size_t i = 0; i < n * d; ++i) dn[i] += dkv_tmp[i];
    back(l, projection::v, st.xn_att[l].data(), dv.data(), dkv_tmp.data());
    for (std::size_t i = 0; i < n * d; ++i) dn[i] += dkv_tmp[i];
    backbone::rmsnorm_backward(n, d, st.x.data() + l * n * d, w.rms_att, st.r_att[l].data(), dn.data(), tmp.data(), static_cast<float*>(nullptr));
    for (std::size_t i = 0; i < n * d; ++i) dx[i] = dmid[i] + tmp[i];
  }
}

medusa_llama::model lora_model::merged() const {
  const auto& c = base_.config();
  const auto L = static_cast<std::size_t>(c.n_layers);
  std::vector<std::vector<float>> store;
  store.reserve(L * projections_per_layer);
  std::vector<medusa_llama::layer_weights> layers(L);
  for (std::size_t l = 0; l < L; ++l) {
    layers[l] = base_.layer(static_cast<int>(l));
    for (projection p : all_projections) {
      store.push_back(backbone::merged_weight(adapter(l, p)));
      const float* m = store.back().data();
      auto& w = layers[l];
      switch (p) {
        case projection::q: w.wq = m; break;
        case projection::k: w.wk = m; break;
        case projection::v: w.wv = m; break;
        case projection::o: w.wo = m; break;
        case projection::gate: w.w1 = m; break;
        case projection::up: w.w3 = m; break;
        case projection::down: w.w2 = m; break;
      }
    }
  }
  return medusa_llama::model::from_parts(c, base_.token_embedding(), layers, base_.rms_final(), base_.classifier());
}

}  // namespace medusa_train
