// SPDX-License-Identifier: Apache-2.0
#include <medusa_train/lora_model.hpp>

#include "block_stack.hpp"
#include "common.hpp"

#include <medusa/error.hpp>

#include <algorithm>
#include <cmath>

namespace medusa_train {

namespace {

using detail::all_projections;
using detail::mix;
using detail::unit;

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
      const auto [in, out] = detail::projection_dims(c, p);
      n += r * in + out * r;
    }
  params_.assign(n, 0.0f);
  // A ~ U(±1/√in) (PEFT: kaiming_uniform with a = √5), B = 0.
  for (std::size_t l = 0; l < L; ++l)
    for (projection p : all_projections) {
      const auto in = detail::projection_dims(c, p).in;
      const std::size_t off = offset(l, p);
      const double bound = 1.0 / std::sqrt(static_cast<double>(in));
      for (std::size_t i = 0; i < r * in; ++i)
        params_[off + i] = static_cast<float>((2.0 * unit(mix(seed ^ mix(off + i + 0x10a5ull))) - 1.0) * bound);
    }
}

backbone::lora_linear<float> lora_model::adapter(std::size_t l, projection p) const {
  const auto& c = base_.config();
  const auto [in, out] = detail::projection_dims(c, p);
  backbone::lora_linear<float> ll;
  ll.in = in;
  ll.out = out;
  ll.rank = opt_.rank;
  ll.W = detail::weight_of(base_.layer(static_cast<int>(l)), p);
  ll.A = params_.data() + offset(l, p);
  ll.B = ll.A + opt_.rank * in;
  ll.scaling = static_cast<float>(opt_.alpha / static_cast<double>(opt_.rank));
  return ll;
}

std::vector<medusa_llama::layer_weights> lora_model::layers() const {
  std::vector<medusa_llama::layer_weights> out(static_cast<std::size_t>(base_.config().n_layers));
  for (std::size_t l = 0; l < out.size(); ++l) out[l] = base_.layer(static_cast<int>(l));
  return out;
}

void lora_model::forward(std::span<const std::int32_t> tokens, sequence_state& st, const forward_options& fo) const {
  const auto& c = base_.config();
  detail::check_sequence(c, tokens, "lora");
  const std::size_t n = tokens.size(), L = static_cast<std::size_t>(c.n_layers), r = opt_.rank;
  st.adapters = fo.adapters;
  const bool drop = fo.adapters && fo.train && opt_.dropout > 0;
  st.xa.resize(L * projections_per_layer);
  for (auto& e : st.xa) e.resize(n * r);
  st.keep.resize(drop ? L * projections_per_layer : 0);
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
  detail::stack_forward(c, base_.token_embedding(), layers(), base_.rms_final(), tokens, st, run);
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
  auto back = [&](std::size_t l, projection p, const float* x, const float* dy, float* dxo) {
    const auto ll = adapter(l, p);
    const std::size_t idx = l * projections_per_layer + static_cast<std::size_t>(p);
    const float* keep = st.keep.empty() ? nullptr : st.keep[idx].data();
    float* dA = grads + offset(l, p);
    backbone::linear_backward(ll, st.n, x, keep, st.xa[idx].data(), dy, dxo, dA, dA + ll.rank * ll.in);
  };
  std::vector<float> d_input;
  detail::stack_backward(base_.config(), layers(), base_.rms_final(), st, d_hidden, back, [](std::size_t) { return detail::norm_gradients{}; },
                         nullptr, d_input);
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
