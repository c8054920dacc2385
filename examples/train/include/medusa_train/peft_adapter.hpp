// SPDX-License-Identifier: Apache-2.0
//! @file peft_adapter.hpp
//! Writes LoRA adapters in the layout of Hugging Face PEFT (`PeftModel.from_pretrained` loads the
//! directory onto the base model): `adapter_model.safetensors` and `adapter_config.json`.
//!
//! @code
//! std::vector<float> A(8 * 64), B(64 * 8);  // rank 8 on a 64 × 64 projection
//! medusa_train::lora_tensor_pair q{"model.layers.0.self_attn.q_proj", 64, 64, 8, A, B};
//! medusa_train::peft_adapter_config cfg;
//! cfg.rank = 8;
//! cfg.target_modules = {"q_proj"};
//! medusa_train::save_peft_adapter("adapter", std::span(&q, 1), cfg);
//! @endcode
#pragma once

#include <cstddef>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

namespace medusa_train {

//! One adapted linear layer: PEFT module path (e.g. "model.layers.3.self_attn.q_proj"),
//! `lora_A` `[rank][in]`, `lora_B` `[out][rank]`, f32 (the update is `B·A`, scaled by alpha/rank).
struct lora_tensor_pair {
  std::string module;          //!< module path in the base model
  std::size_t in = 0;          //!< input width of the adapted layer
  std::size_t out = 0;         //!< output width of the adapted layer
  std::size_t rank = 0;        //!< LoRA rank
  std::span<const float> A;    //!< `[rank][in]`
  std::span<const float> B;    //!< `[out][rank]`
};

//! `adapter_config.json` fields.
struct peft_adapter_config {
  std::size_t rank = 32;                    //!< `r`: every layer's rank must equal it
  double alpha = 16;                        //!< `lora_alpha`
  double dropout = 0.05;                    //!< `lora_dropout`, in [0, 1)
  std::string base_model;                   //!< `base_model_name_or_path` (may be empty)
  //! Module name suffixes PEFT adapts ("q_proj", ...); every layer's module must end in one.
  //! Empty: the last path components of the layers' modules, sorted.
  std::vector<std::string> target_modules;
};

//! Writes `dir/adapter_model.safetensors` (names "base_model.model.<module>.lora_A.weight" /
//! ".lora_B.weight", F32) and `dir/adapter_config.json` (PEFT `LoraConfig`: peft_type "LORA",
//! task_type "CAUSAL_LM", r, lora_alpha, lora_dropout, target_modules, bias "none", fan_in_fan_out
//! false, inference_mode true, base_model_name_or_path, use_rslora false, modules_to_save null);
//! creates `dir`. Throws `medusa::invalid_input` on inconsistent shapes (`A.size() != rank*in`,
//! a rank other than `config.rank`, ...), an empty or repeated module, a module no target matches
//! or a bad config value; `medusa::io_error` when writing fails.
void save_peft_adapter(const std::filesystem::path& dir, std::span<const lora_tensor_pair> layers,
                       const peft_adapter_config& config);

}  // namespace medusa_train
