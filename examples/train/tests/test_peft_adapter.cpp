// SPDX-License-Identifier: Apache-2.0
// LoRA adapters written in PEFT's layout: tensor names, shapes and values read back with the
// library's safetensors reader, adapter_config.json fields, and the shape checks.
#include <medusa_train/peft_adapter.hpp>

#include <medusa/io/json.hpp>
#include <medusa/io/safetensors.hpp>

#include <doctest/doctest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using medusa_train::lora_tensor_pair;
using medusa_train::peft_adapter_config;

namespace {

fs::path scratch(const std::string& name) {
  const fs::path p = fs::path(MEDUSA_TEST_TMPDIR) / ("peft_" + name);
  std::error_code ec;
  fs::remove_all(p, ec);
  return p;
}

std::vector<float> ramp(std::size_t n, float start) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = start + 0.25f * static_cast<float>(i);
  return v;
}

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

bool holds(const medusa::safetensors_file& f, const std::string& name, std::vector<std::uint64_t> shape,
           const std::vector<float>& values) {
  const auto* t = f.find(name);
  if (t == nullptr || t->dtype != medusa::safetensors_dtype::f32 || t->shape != shape) return false;
  const auto raw = f.data(*t);
  return raw.size() == values.size() * sizeof(float) && std::memcmp(raw.data(), values.data(), raw.size()) == 0;
}

}  // namespace

TEST_CASE("save_peft_adapter writes PEFT names, shapes, values and config") {
  const std::size_t r = 4;
  const auto qa = ramp(r * 16, 1), qb = ramp(8 * r, -3), va = ramp(r * 16, 7), vb = ramp(12 * r, 0.5f);
  const std::vector<lora_tensor_pair> layers = {
      {"model.layers.0.self_attn.q_proj", 16, 8, r, qa, qb},
      {"model.layers.1.mlp.down_proj", 16, 12, r, va, vb},
  };
  peft_adapter_config cfg;
  cfg.rank = r;
  cfg.alpha = 8;
  cfg.dropout = 0.05;
  cfg.base_model = "org/tiny-\"llama\"";
  cfg.target_modules = {"q_proj", "down_proj"};
  const auto dir = scratch("basic");
  medusa_train::save_peft_adapter(dir, layers, cfg);
  CHECK_FALSE(fs::exists(dir / "adapter_model.safetensors.tmp"));
  CHECK_FALSE(fs::exists(dir / "adapter_config.json.tmp"));

  const auto st = medusa::safetensors_file::open(dir / "adapter_model.safetensors");
  CHECK(st.tensors().size() == 4);
  CHECK(holds(st, "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", {r, 16}, qa));
  CHECK(holds(st, "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight", {8, r}, qb));
  CHECK(holds(st, "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight", {r, 16}, va));
  CHECK(holds(st, "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight", {12, r}, vb));

  const auto j = medusa::parse_json(slurp(dir / "adapter_config.json"));
  CHECK(j.find("peft_type")->as_string() == "LORA");
  CHECK(j.find("task_type")->as_string() == "CAUSAL_LM");
  CHECK(j.find("r")->as_uint64() == r);
  CHECK(j.find("lora_alpha")->as_uint64() == 8u);  // an integer, as PEFT writes it
  CHECK(j.find("lora_dropout")->as_number() == 0.05);
  CHECK(j.find("base_model_name_or_path")->as_string() == cfg.base_model);
  const auto& targets = j.find("target_modules")->as_array();
  REQUIRE(targets.size() == 2);
  CHECK(targets[0].as_string() == "q_proj");
  CHECK(targets[1].as_string() == "down_proj");
  CHECK(j.find("bias")->as_string() == "none");
  CHECK_FALSE(j.find("fan_in_fan_out")->as_bool());
  CHECK(j.find("inference_mode")->as_bool());
  CHECK_FALSE(j.find("use_rslora")->as_bool());
  CHECK(j.find("modules_to_save")->is_null());

  // No targets given: the layers' last path components, sorted; a fractional alpha as a number.
  cfg.target_modules.clear();
  cfg.alpha = 12.5;
  medusa_train::save_peft_adapter(dir, layers, cfg);
  const auto k = medusa::parse_json(slurp(dir / "adapter_config.json"));
  const auto& derived = k.find("target_modules")->as_array();
  REQUIRE(derived.size() == 2);
  CHECK(derived[0].as_string() == "down_proj");
  CHECK(derived[1].as_string() == "q_proj");
  CHECK(k.find("lora_alpha")->as_number() == 12.5);
}

TEST_CASE("save_peft_adapter rejects inconsistent shapes and configs") {
  const auto a = ramp(4 * 16, 0), b = ramp(8 * 4, 0);
  peft_adapter_config cfg;
  cfg.rank = 4;
  const auto dir = scratch("bad");
  auto rejects = [&](std::vector<lora_tensor_pair> layers, const peft_adapter_config& c) {
    CHECK_THROWS_AS(medusa_train::save_peft_adapter(dir, layers, c), medusa::invalid_input);
  };
  const lora_tensor_pair ok{"model.layers.0.self_attn.q_proj", 16, 8, 4, a, b};
  auto with = [&](auto&& edit) {
    auto p = ok;
    edit(p);
    return std::vector<lora_tensor_pair>{p};
  };
  rejects(with([](lora_tensor_pair& p) { p.in = 15; }), cfg);                          // A is not [rank][in]
  rejects(with([](lora_tensor_pair& p) { p.out = 9; }), cfg);                          // B is not [out][rank]
  rejects(with([&](lora_tensor_pair& p) { p.B = std::span(a).first(31); }), cfg);      // B too short
  rejects(with([](lora_tensor_pair& p) { p.rank = 2; p.in = 32; p.out = 16; }), cfg);  // rank other than r
  rejects(with([](lora_tensor_pair& p) { p.module.clear(); }), cfg);
  rejects({ok, ok}, cfg);  // the same module twice
  rejects({}, cfg);
  auto untargeted = cfg;
  untargeted.target_modules = {"v_proj", "_proj"};  // PEFT matches whole path components only
  rejects({ok}, untargeted);
  auto dropout = cfg;
  dropout.dropout = 1.0;
  rejects({ok}, dropout);
  CHECK_FALSE(fs::exists(dir));  // nothing written for a rejected call
  medusa_train::save_peft_adapter(dir, std::vector<lora_tensor_pair>{ok}, cfg);
  CHECK(fs::exists(dir / "adapter_model.safetensors"));
}

TEST_CASE("save_peft_adapter reports a directory it cannot create") {
  const auto file = scratch("file");
  fs::create_directories(file.parent_path());
  std::ofstream(file) << "x";
  const auto a = ramp(2 * 4, 0), b = ramp(4 * 2, 0);
  peft_adapter_config cfg;
  cfg.rank = 2;
  const std::vector<lora_tensor_pair> layers = {{"model.layers.0.self_attn.v_proj", 4, 4, 2, a, b}};
  CHECK_THROWS_AS(medusa_train::save_peft_adapter(file / "sub", layers, cfg), medusa::io_error);
}
