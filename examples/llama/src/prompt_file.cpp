// SPDX-License-Identifier: Apache-2.0
#include <medusa_llama/prompt_file.hpp>

#include <medusa/error.hpp>

#include <fstream>

namespace medusa_llama {

std::string unescape_prompt(std::string_view s) {
  std::string o;
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 1 < s.size()) {
      const char c = s[i + 1];
      if (c == 'n' || c == 't' || c == '\\') {
        o += c == 'n' ? '\n' : c == 't' ? '\t' : '\\';
        ++i;
        continue;
      }
    }
    o += s[i];
  }
  return o;
}

std::vector<std::string> read_prompt_lines(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) throw medusa::invalid_input("cannot read prompt file " + file.string());
  std::vector<std::string> lines;
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    lines.push_back(unescape_prompt(line));
  }
  if (lines.empty()) throw medusa::invalid_input("prompt file " + file.string() + " has no prompt");
  return lines;
}

}  // namespace medusa_llama
