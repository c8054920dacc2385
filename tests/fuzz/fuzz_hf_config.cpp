// SPDX-License-Identifier: Apache-2.0
// libFuzzer target for Hugging Face config.json files (examples/llama: parse_hf_config, what
// model::load_hf reads). When a config is accepted and small, a model.safetensors with every
// tensor it names (F32, the shapes it implies) is written beside it and model::load_hf must load
// the pair with the same config. Any crash, sanitizer report, broken invariant or exception other
// than medusa_llama::load_error is a bug.
#include <medusa_llama/model.hpp>

#include <medusa/io/safetensors.hpp>

#include "fuzz_common.hpp"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <list>
#include <string>
#include <string_view>
#include <vector>

namespace {

// model.safetensors for config `c` (tied configs store only the embedding).
void write_weights(const medusa_llama::model_config& c, const std::filesystem::path& path) {
  const std::uint64_t d = static_cast<std::uint64_t>(c.dim), h = static_cast<std::uint64_t>(c.hidden_dim),
                      kv = static_cast<std::uint64_t>(c.kv_dim()), V = static_cast<std::uint64_t>(c.vocab_size);
  medusa::safetensors_writer w;
  std::list<std::vector<float>> store;
  auto add = [&](const std::string& name, std::vector<std::uint64_t> shape) {
    std::uint64_t n = 1;
    for (auto s : shape) n *= s;
    auto& buf = store.emplace_back(static_cast<std::size_t>(n), 0.5f);
    w.add(name, medusa::safetensors_dtype::f32, std::move(shape), std::as_bytes(std::span<const float>(buf)));
  };
  add("model.embed_tokens.weight", {V, d});
  for (int i = 0; i < c.n_layers; ++i) {
    const std::string pre = "model.layers." + std::to_string(i) + ".";
    add(pre + "input_layernorm.weight", {d});
    add(pre + "self_attn.q_proj.weight", {d, d});
    add(pre + "self_attn.k_proj.weight", {kv, d});
    add(pre + "self_attn.v_proj.weight", {kv, d});
    add(pre + "self_attn.o_proj.weight", {d, d});
    add(pre + "post_attention_layernorm.weight", {d});
    add(pre + "mlp.gate_proj.weight", {h, d});
    add(pre + "mlp.down_proj.weight", {d, h});
    add(pre + "mlp.up_proj.weight", {h, d});
  }
  add("model.norm.weight", {d});
  if (!c.shared_classifier) add("lm_head.weight", {V, d});
  w.write(path);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  medusa_llama::model_config c;
  try {
    c = medusa_llama::parse_hf_config(text, "config.json");
  } catch (const medusa_llama::load_error&) {
    return 0;  // typed rejection: the expected outcome for almost every input
  }
  // Accepted: a valid shape (validate() again must pass) with split-halves RoPE.
  c.validate("config.json");
  MEDUSA_FUZZ_CHECK(c.rope == medusa_llama::rope_style::split_halves);
  MEDUSA_FUZZ_CHECK(c.rms_eps > 0.0f && std::isfinite(c.rope_theta));
  // Small ones only (load_hf also allocates the unused RoPE tables, seq_len x head_dim floats).
  if (c.parameter_count() > (1u << 14) || static_cast<std::uint64_t>(c.seq_len) * static_cast<std::uint64_t>(c.head_dim()) > (1u << 16))
    return 0;

  medusa_fuzz::clear_scratch();
  const auto& dir = medusa_fuzz::scratch_dir();
  medusa_fuzz::write_file(dir / "config.json", text);
  write_weights(c, dir / "model.safetensors");
  const auto m = medusa_llama::model::load_hf(dir);  // a load_error here is a finding
  const auto& mc = m.config();
  MEDUSA_FUZZ_CHECK(mc.dim == c.dim && mc.hidden_dim == c.hidden_dim && mc.n_layers == c.n_layers &&
                    mc.n_heads == c.n_heads && mc.n_kv_heads == c.n_kv_heads && mc.vocab_size == c.vocab_size &&
                    mc.seq_len == c.seq_len && mc.shared_classifier == c.shared_classifier);
  MEDUSA_FUZZ_CHECK(m.token_embedding()[0] == 0.5f && m.classifier()[0] == 0.5f);
  return 0;
}
