// SPDX-License-Identifier: Apache-2.0
#include <medusa_train/peft_adapter.hpp>

#include <medusa/error.hpp>
#include <medusa/io/json.hpp>
#include <medusa/io/safetensors.hpp>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <fstream>
#include <set>
#include <system_error>

namespace medusa_train {

namespace {

// A finite double as JSON: integers without a fraction (PEFT reads lora_alpha 16, not 16.0),
// others in their shortest round-trip form.
std::string json_number(double v) {
  if (v == std::trunc(v) && std::abs(v) < 1e15) return std::to_string(static_cast<long long>(v));
  char text[32];
  const auto [end, ec] = std::to_chars(text, text + sizeof text, v);
  return std::string(text, ec == std::errc{} ? end : text);
}

// PEFT matches a target against a module path as the whole path or its last components.
bool matches(const std::string& module, const std::string& target) {
  return module == target ||
         (module.size() > target.size() && module.ends_with(target) && module[module.size() - target.size() - 1] == '.');
}

void write_text(const std::filesystem::path& p, const std::string& text) {
  auto tmp = p;
  tmp += ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw medusa::io_error("cannot create " + tmp.string());
    out << text;
    out.flush();
    if (!out) throw medusa::io_error("cannot write " + tmp.string());
  }
  std::error_code ec;
  std::filesystem::rename(tmp, p, ec);
  if (ec) throw medusa::io_error("cannot rename " + tmp.string() + " to " + p.string() + ": " + ec.message());
}

}  // namespace

void save_peft_adapter(const std::filesystem::path& dir, std::span<const lora_tensor_pair> layers,
                       const peft_adapter_config& config) {
  auto fail = [](const std::string& what) { throw medusa::invalid_input("PEFT adapter: " + what); };
  if (layers.empty()) fail("no layers to write");
  if (config.rank == 0) fail("rank must be positive");
  if (!std::isfinite(config.alpha)) fail("lora_alpha must be finite");
  if (!(config.dropout >= 0.0 && config.dropout < 1.0)) fail("lora_dropout " + json_number(config.dropout) + " is outside [0, 1)");

  std::vector<std::string> targets = config.target_modules;
  if (targets.empty()) {
    std::set<std::string> names;
    for (const auto& l : layers) names.insert(l.module.substr(l.module.rfind('.') + 1));
    targets.assign(names.begin(), names.end());
  }
  for (const auto& t : targets)
    if (t.empty()) fail("empty target module name");

  std::set<std::string> seen;
  for (const auto& l : layers) {
    const std::string where = "module \"" + l.module + "\": ";
    if (l.module.empty()) fail("empty module name");
    if (!seen.insert(l.module).second) fail(where + "given twice");
    if (l.in == 0 || l.out == 0) fail(where + "in " + std::to_string(l.in) + " and out " + std::to_string(l.out) + " must be positive");
    if (l.rank != config.rank)
      fail(where + "rank " + std::to_string(l.rank) + " differs from the config's r = " + std::to_string(config.rank));
    if (l.A.size() != l.rank * l.in)
      fail(where + "lora_A has " + std::to_string(l.A.size()) + " values, [rank " + std::to_string(l.rank) + "][in " +
           std::to_string(l.in) + "] needs " + std::to_string(l.rank * l.in));
    if (l.B.size() != l.out * l.rank)
      fail(where + "lora_B has " + std::to_string(l.B.size()) + " values, [out " + std::to_string(l.out) + "][rank " +
           std::to_string(l.rank) + "] needs " + std::to_string(l.out * l.rank));
    if (std::none_of(targets.begin(), targets.end(), [&](const std::string& t) { return matches(l.module, t); }))
      fail(where + "matches no target module, so PEFT would not load it");
  }

  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw medusa::io_error("cannot create " + dir.string() + ": " + ec.message());

  medusa::safetensors_writer st;
  st.add_metadata("format", "pt");  // what PEFT itself writes
  for (const auto& l : layers) {
    const std::string pre = "base_model.model." + l.module;
    st.add(pre + ".lora_A.weight", medusa::safetensors_dtype::f32, {l.rank, l.in}, std::as_bytes(l.A));
    st.add(pre + ".lora_B.weight", medusa::safetensors_dtype::f32, {l.out, l.rank}, std::as_bytes(l.B));
  }
  st.write(dir / "adapter_model.safetensors");

  std::string targets_json;
  for (const auto& t : targets) targets_json += (targets_json.empty() ? "" : ", ") + medusa::json_quote(t);
  const std::string json = "{\n"
                           "  \"peft_type\": \"LORA\",\n"
                           "  \"task_type\": \"CAUSAL_LM\",\n"
                           "  \"base_model_name_or_path\": " + medusa::json_quote(config.base_model) + ",\n"
                           "  \"r\": " + std::to_string(config.rank) + ",\n"
                           "  \"lora_alpha\": " + json_number(config.alpha) + ",\n"
                           "  \"lora_dropout\": " + json_number(config.dropout) + ",\n"
                           "  \"target_modules\": [" + targets_json + "],\n"
                           "  \"bias\": \"none\",\n"
                           "  \"fan_in_fan_out\": false,\n"
                           "  \"inference_mode\": true,\n"
                           "  \"use_rslora\": false,\n"
                           "  \"modules_to_save\": null\n"
                           "}\n";
  write_text(dir / "adapter_config.json", json);
}

}  // namespace medusa_train
