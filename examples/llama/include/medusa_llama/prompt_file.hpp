// SPDX-License-Identifier: Apache-2.0
//! @file prompt_file.hpp
//! Prompt files: one prompt a line, `\n`, `\t` and `\\` escaped, blank lines skipped. The tools
//! (`medusa-run --prompts-file`) and the trainer (`prompt_set::from_file`) read them here.
//!
//! @code
//! std::vector<std::string> prompts = medusa_llama::read_prompt_lines("prompts.txt");
//! @endcode
#pragma once

#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace medusa_llama {

//! The prompts of `file`, unescaped, in file order.
//! @throws medusa::invalid_input when the file cannot be read or holds no prompt.
[[nodiscard]] std::vector<std::string> read_prompt_lines(const std::filesystem::path& file);

//! `s` with `\n`, `\t` and `\\` replaced by the characters they name; other backslashes stay.
[[nodiscard]] std::string unescape_prompt(std::string_view s);

}  // namespace medusa_llama
