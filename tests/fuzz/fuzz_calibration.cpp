// SPDX-License-Identifier: Apache-2.0
// libFuzzer target for the tree-search files (include/medusa/io/tree_search_files.hpp):
// calibration.json (parse_calibration, versions 1 and 2) and step-cost curves (parse_step_cost),
// each read from the whole input. An input with a form feed is also split there: calibration
// before, cost after; when both parse, optimize_tree runs on them (small search limits) and its
// plan must be a valid tree. Whatever parses must write back (calibration_json, step_cost_json)
// to text that parses again. Any crash, sanitizer report, broken invariant or exception other
// than medusa's typed errors is a bug.
#include <medusa/io/tree_search_files.hpp>
#include <medusa/tree.hpp>

#include "fuzz_common.hpp"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace {

std::optional<medusa::path_calibration> calibration(std::string_view text) {
  try {
    return medusa::parse_calibration(text);
  } catch (const medusa::error&) {
    return std::nullopt;
  }
}

std::optional<medusa::step_cost_curve> cost(std::string_view text) {
  try {
    auto c = medusa::parse_step_cost(text);
    // What is accepted is valid and reads back from what the writer makes of it.
    c.validate();
    const auto again = medusa::parse_step_cost(medusa::step_cost_json(c, "fuzz"));
    MEDUSA_FUZZ_CHECK(again.rows == c.rows && again.seconds.size() == c.seconds.size());
    return c;
  } catch (const medusa::error&) {
    return std::nullopt;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  if (const auto cal = calibration(text)) {
    MEDUSA_FUZZ_CHECK(cal->num_heads() >= 1 && cal->topk() >= 1);
    const std::vector<int> first{0};
    const double p = cal->probability(first);
    MEDUSA_FUZZ_CHECK(p >= 0.0 && p <= 1.0);
  }
  (void)cost(text);
  const auto split = text.find('\f');
  if (split == std::string_view::npos) return 0;
  const auto cal = calibration(text.substr(0, split));
  const auto c = cost(text.substr(split + 1));
  if (!cal || !c || cal->topk() > 256) return 0;
  try {
    const auto plan = medusa::optimize_tree(*cal, *c, {.max_nodes = 16, .max_depth = 4});
    MEDUSA_FUZZ_CHECK(plan.nodes() >= 2 && plan.nodes() <= 16);
    MEDUSA_FUZZ_CHECK(std::isfinite(plan.predicted_speedup) && plan.predicted_speedup > 0.0);
    const auto t = medusa::tree::from_paths(plan.paths, {.topk = cal->topk(), .max_depth = 4});
    MEDUSA_FUZZ_CHECK(t.num_nodes() == plan.nodes());
  } catch (const medusa::error&) {
  }
  return 0;
}
