// SPDX-License-Identifier: Apache-2.0
//! @file tree/preset_table.hpp
//! The nine reference preset trees as data: one table of names and path texts (verbatim from the
//! reference's preset module, in its source order). Everything else about presets is derived from
//! it: `preset_names()`, `preset_text()`, `tree::preset()`, and the compile-time trees and tag
//! types of `<medusa/tree/presets.hpp>`.
#pragma once

#include <medusa/config.hpp>
#include <medusa/tree/errors.hpp>

#include <array>
#include <cstddef>
#include <span>
#include <string>
#include <string_view>

MEDUSA_NAMESPACE_BEGIN

//! One preset: its reference name and its paths as JSON text.
struct preset_entry {
  std::string_view name;  //!< e.g. "mc_sim_7b_63"
  std::string_view text;  //!< the paths, e.g. "[[0],[0,0],...]"
};

//! The presets, in the reference's order (64 nodes each, topk 10).
inline constexpr std::array<preset_entry, 9> preset_table{{
    {"mc_sim_7b_63",
     "[[0],[0,0],[1],[0,1],[2],[0,0,0],[1,0],[0,2],[3],[0,3],[4],[0,4],[2,0],[0,5],[0,0,1],[5],[0,6],"
     "[6],[0,7],[0,1,0],[1,1],[7],[0,8],[0,0,2],[3,0],[0,9],[8],[9],[1,0,0],[0,2,0],[1,2],[0,0,3],"
     "[4,0],[2,1],[0,0,4],[0,0,5],[0,0,0,0],[0,1,1],[0,0,6],[0,3,0],[5,0],[1,3],[0,0,7],[0,0,8],"
     "[0,0,9],[6,0],[0,4,0],[1,4],[7,0],[0,1,2],[2,0,0],[3,1],[2,2],[8,0],[0,5,0],[1,5],[1,0,1],"
     "[0,2,1],[9,0],[0,6,0],[0,0,0,1],[1,6],[0,7,0]]"},
    {"vicuna_7b_stage2",
     "[[0],[0,0],[1],[0,1],[0,0,0],[1,0],[2],[0,2],[0,0,1],[0,3],[3],[0,1,0],[2,0],[4],[0,0,2],[0,4],"
     "[1,1],[1,0,0],[0,0,0,0],[5],[0,0,3],[0,5],[0,2,0],[3,0],[0,1,1],[0,6],[6],[0,7],[0,0,4],[4,0],"
     "[1,2],[0,8],[7],[0,3,0],[0,0,0,1],[0,0,5],[2,1],[0,0,6],[1,0,1],[0,0,1,0],[2,0,0],[5,0],[0,9],"
     "[0,1,2],[8],[0,4,0],[0,2,1],[1,3],[0,0,7],[0,0,0,2],[0,0,8],[1,1,0],[0,1,0,0],[6,0],[9],[0,1,3],"
     "[0,0,0,3],[1,0,2],[0,5,0],[3,1],[0,0,2,0],[7,0],[1,4]]"},
    {"vicuna_7b_stage1_ablation",
     "[[0],[0,0],[1],[0,0,0],[0,1],[1,0],[2],[0,2],[0,0,1],[3],[0,3],[0,1,0],[2,0],[0,0,2],[0,4],[4],"
     "[0,0,0,0],[1,0,0],[1,1],[0,0,3],[0,2,0],[0,5],[5],[3,0],[0,1,1],[0,6],[6],[0,0,4],[1,2],"
     "[0,0,0,1],[4,0],[0,0,5],[0,7],[0,8],[0,3,0],[0,0,1,0],[1,0,1],[7],[2,0,0],[0,0,6],[2,1],[0,1,2],"
     "[5,0],[0,2,1],[0,9],[0,0,0,2],[0,4,0],[8],[1,3],[0,0,7],[0,1,0,0],[1,1,0],[6,0],[9],[0,0,8],"
     "[0,0,9],[0,5,0],[0,0,2,0],[1,0,2],[0,1,3],[0,0,0,3],[3,0,0],[3,1]]"},
    {"vicuna_7b_stage1",
     "[[0],[0,0],[1],[2],[0,1],[1,0],[3],[0,2],[4],[0,0,0],[0,3],[5],[2,0],[0,4],[6],[0,5],[1,1],"
     "[0,0,1],[7],[3,0],[0,6],[8],[9],[0,1,0],[0,7],[0,8],[4,0],[0,0,2],[1,2],[0,9],[2,1],[5,0],"
     "[1,0,0],[0,0,3],[1,3],[0,2,0],[0,1,1],[0,0,4],[6,0],[1,4],[0,0,5],[2,2],[0,3,0],[3,1],[0,0,6],"
     "[7,0],[1,5],[1,0,1],[2,0,0],[0,0,7],[8,0],[0,0,0,0],[4,1],[0,1,2],[0,4,0],[9,0],[0,2,1],[2,3],"
     "[1,6],[0,0,8],[0,5,0],[3,2],[5,1]]"},
    {"vicuna_13b_stage2",
     "[[0],[0,0],[1],[0,0,0],[0,1],[1,0],[2],[0,2],[0,0,1],[0,1,0],[3],[0,3],[2,0],[0,0,2],[0,0,0,0],"
     "[0,4],[1,0,0],[1,1],[4],[0,0,3],[0,5],[0,2,0],[5],[3,0],[0,1,1],[0,6],[0,0,4],[0,0,0,1],[0,7],"
     "[0,0,5],[1,2],[0,0,1,0],[0,3,0],[1,0,1],[4,0],[0,0,6],[0,8],[2,0,0],[0,9],[6],[7],[2,1],[5,0],"
     "[0,1,2],[0,0,0,2],[8],[0,4,0],[0,1,0,0],[0,2,1],[0,0,7],[1,1,0],[1,3],[0,0,2,0],[9],[0,0,8],"
     "[0,5,0],[0,0,0,3],[0,0,9],[0,1,3],[1,0,2],[0,0,1,1],[3,0,0],[1,0,0,0]]"},
    {"vicuna_13b_stage1",
     "[[0],[0,0],[1],[0,1],[2],[1,0],[0,0,0],[0,2],[3],[0,3],[4],[2,0],[0,4],[0,0,1],[0,5],[5],[1,1],"
     "[0,1,0],[6],[0,6],[0,0,2],[7],[3,0],[8],[0,7],[0,8],[1,0,0],[0,0,3],[4,0],[1,2],[9],[0,9],[2,1],"
     "[0,2,0],[0,0,4],[1,3],[0,1,1],[0,0,5],[5,0],[0,3,0],[0,0,0,0],[0,0,6],[6,0],[1,4],[2,0,0],"
     "[0,1,2],[3,1],[0,4,0],[1,0,1],[2,2],[0,0,7],[1,5],[7,0],[0,0,8],[8,0],[0,5,0],[0,0,9],[0,2,1],"
     "[1,1,0],[0,1,3],[4,1],[2,3],[1,6]]"},
    {"vicuna_33b_stage2",
     "[[0],[0,0],[1],[0,1],[0,0,0],[1,0],[2],[0,2],[0,0,1],[0,3],[3],[0,1,0],[2,0],[0,4],[4],[0,0,2],"
     "[1,1],[1,0,0],[0,5],[5],[0,0,0,0],[0,0,3],[3,0],[0,2,0],[0,6],[0,1,1],[6],[0,0,4],[0,7],[7],"
     "[1,2],[4,0],[8],[0,3,0],[0,0,5],[0,0,0,1],[0,8],[2,1],[0,9],[1,0,1],[2,0,0],[0,0,6],[5,0],"
     "[0,0,1,0],[1,3],[0,1,2],[0,4,0],[0,0,7],[0,2,1],[9],[1,1,0],[0,0,0,2],[6,0],[0,0,8],[0,1,0,0],"
     "[7,0],[0,1,3],[0,5,0],[1,4],[0,0,9],[3,1],[1,0,2],[2,2]]"},
    {"vicuna_33b_stage1",
     "[[0],[1],[0,0],[2],[0,1],[3],[1,0],[4],[0,2],[5],[0,3],[0,0,0],[6],[0,4],[2,0],[7],[1,1],[0,5],"
     "[3,0],[8],[9],[0,6],[0,7],[0,0,1],[1,2],[4,0],[0,1,0],[0,8],[0,9],[2,1],[0,0,2],[5,0],[1,3],"
     "[0,0,3],[1,0,0],[1,4],[6,0],[0,2,0],[3,1],[2,2],[0,0,4],[7,0],[0,1,1],[1,5],[4,1],[0,0,5],"
     "[0,3,0],[9,0],[8,0],[1,6],[0,0,6],[2,3],[0,1,2],[3,2],[0,4,0],[2,0,0],[1,7],[1,0,1],[0,0,7],"
     "[5,1],[2,4],[0,0,8],[0,2,1]]"},
    {"zephyr_stage2",
     "[[0],[0,0],[1],[0,1],[2],[0,0,0],[1,0],[0,2],[3],[0,3],[4],[2,0],[0,0,1],[0,4],[5],[0,5],[0,1,0],"
     "[1,1],[6],[0,0,2],[3,0],[0,6],[7],[0,7],[0,8],[0,0,3],[1,0,0],[0,9],[0,2,0],[1,2],[4,0],[8],[9],"
     "[2,1],[0,1,1],[0,0,4],[0,0,0,0],[5,0],[0,3,0],[1,3],[0,0,5],[0,0,6],[6,0],[2,0,0],[1,0,1],"
     "[0,1,2],[0,4,0],[1,4],[3,1],[2,2],[0,0,7],[7,0],[0,2,1],[0,0,8],[0,1,3],[0,5,0],[1,5],[0,0,9],"
     "[1,1,0],[0,0,0,1],[0,0,1,0],[4,1],[2,3]]"},
}};

namespace detail {
inline constexpr auto preset_name_list = [] {
  std::array<std::string_view, preset_table.size()> names{};
  for (std::size_t i = 0; i < names.size(); ++i) names[i] = preset_table[i].name;
  return names;
}();

constexpr bool contains_nocase(std::string_view hay, std::string_view needle) noexcept {
  auto lower = [](char c) { return (c >= 'A' && c <= 'Z') ? static_cast<char>(c - 'A' + 'a') : c; };
  if (needle.size() > hay.size()) return false;
  for (std::size_t i = 0; i + needle.size() <= hay.size(); ++i) {
    std::size_t j = 0;
    while (j < needle.size() && lower(hay[i + j]) == needle[j]) ++j;
    if (j == needle.size()) return true;
  }
  return false;
}
}  // namespace detail

//! Index of the preset `name` in `preset_table`, or `preset_table.size()` if there is none.
constexpr std::size_t preset_index(std::string_view name) noexcept {
  std::size_t i = 0;
  while (i < preset_table.size() && preset_table[i].name != name) ++i;
  return i;
}

//! Names of the presets, in table order.
constexpr std::span<const std::string_view> preset_names() noexcept { return detail::preset_name_list; }

//! The paths text (JSON) of a preset; throws `tree_error` (`unknown_preset`) for an unknown name.
inline std::string_view preset_text(std::string_view name) {
  if (const std::size_t i = preset_index(name); i < preset_table.size()) return preset_table[i].text;
  std::string msg = "unknown tree preset '" + detail::printable(name, 64) + "'; known presets:";
  for (std::size_t i = 0; i < preset_table.size(); ++i) msg += (i ? ", " : " ") + std::string(preset_table[i].name);
  throw tree_error(tree_errc::unknown_preset, msg);
}

//! Result of `preset_for_model`.
struct preset_choice {
  std::string_view name;  //!< the preset to use
  bool matched;           //!< false when no rule matched and the fallback `mc_sim_7b_63` was chosen (warn)
};

//! The reference's automatic choice from a base model name (case-insensitive): vicuna + 7b/13b/33b
//! -> `vicuna_*_stage2`, zephyr -> `zephyr_stage2`, else `mc_sim_7b_63` with `matched == false`.
//! Never applied silently by the library.
constexpr preset_choice preset_for_model(std::string_view model_name) noexcept {
  using detail::contains_nocase;
  if (contains_nocase(model_name, "vicuna")) {
    if (contains_nocase(model_name, "7b")) return {"vicuna_7b_stage2", true};
    if (contains_nocase(model_name, "13b")) return {"vicuna_13b_stage2", true};
    if (contains_nocase(model_name, "33b")) return {"vicuna_33b_stage2", true};
  }
  if (contains_nocase(model_name, "zephyr")) return {"zephyr_stage2", true};
  return {"mc_sim_7b_63", false};
}

MEDUSA_NAMESPACE_END
