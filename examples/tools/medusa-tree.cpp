// SPDX-License-Identifier: Apache-2.0
//! @file medusa-tree.cpp
//! `medusa-tree (--preset NAME | --choices TEXT | --choices-file PATH) [--topk K]
//! [--max-depth D] [--format json|text|dot]`: compiles a Medusa tree and prints its buffers.
//!
//! * `json` (default): one object with `num_nodes`, `depth`, `topk`, `sorted_choices`, `parent`,
//!   `position_ids`, `tree_indices`, `retrieve_indices`, `attn_mask` (the contract is in
//!   docs/tools.md).
//! * `text`: the tree drawn for a person (node id, path, rank, depth, tree index).
//! * `dot`: Graphviz.
//!
//! `medusa-tree optimize --calibration F --cost F [--max-nodes N] [--max-depth D] [--format
//! text|json]`: the tree with the most expected tokens per second (docs/tree.md, "Choosing a
//! tree"), its expected tokens per step and predicted speedup, and the best tree of every size.
//! Invalid input: exit 2 and one line on stderr.
#include <medusa/io/tree_search_files.hpp>
#include <medusa/tree.hpp>

#include "tool_common.hpp"

#include <fmt/format.h>

#include <cstdio>
#include <string>
#include <vector>

namespace {

using medusa_tools::usage_error;

std::string path_text(const std::vector<int>& p) { return fmt::format("[{}]", fmt::join(p, ",")); }

std::string to_json(const medusa::tree& t) {
  const int n = t.num_nodes();
  std::string out;
  out.reserve(static_cast<std::size_t>(n) * static_cast<std::size_t>(n) * 2 + 1024);
  fmt::format_to(std::back_inserter(out), "{{\"num_nodes\":{},\"depth\":{},\"topk\":{},\"sorted_choices\":[", n,
                 t.depth(), t.topk());
  for (std::size_t i = 0; i < t.sorted_paths().size(); ++i)
    fmt::format_to(std::back_inserter(out), "{}{}", i ? "," : "", path_text(t.sorted_paths()[i]));
  fmt::format_to(std::back_inserter(out), "],\"parent\":[{}],\"position_ids\":[{}],\"tree_indices\":[{}]",
                 fmt::join(t.parents(), ","), fmt::join(t.node_depths(), ","), fmt::join(t.tree_indices(), ","));
  out += ",\"retrieve_indices\":[";
  const auto cols = static_cast<std::size_t>(t.depth()) + 1;
  for (int r = 0; r < t.num_leaves(); ++r)
    fmt::format_to(std::back_inserter(out), "{}[{}]", r ? "," : "",
                   fmt::join(t.retrieve_indices().subspan(static_cast<std::size_t>(r) * cols, cols), ","));
  out += "],\"attn_mask\":[";
  for (int i = 0; i < n; ++i) {
    out += i ? ",[" : "[";
    for (int j = 0; j < n; ++j) {
      if (j) out += ',';
      out += t.mask(i, j) ? '1' : '0';
    }
    out += ']';
  }
  out += "]}\n";
  return out;
}

std::string label(const medusa::tree& t, int node) {
  if (node == 0) return "0 root";
  return fmt::format("{} {}  rank {}  depth {}  tree_index {}", node,
                     path_text(t.sorted_paths()[static_cast<std::size_t>(node) - 1]), t.rank(node), t.node_depth(node),
                     t.tree_index(node));
}

std::string to_text(const medusa::tree& t) {
  std::string out = fmt::format("tree: {} nodes, depth {}, topk {}, {} leaves (retrieve rows)\n", t.num_nodes(),
                                t.depth(), t.topk(), t.num_leaves());
  out += label(t, 0) + '\n';
  // iterative pre-order walk; `prefix` holds the box-drawing guides of the ancestors
  struct frame {
    int node;
    std::string prefix;
  };
  std::vector<frame> stack;
  for (int c = t.child_begin(0) + t.child_count(0) - 1; c >= t.child_begin(0); --c) stack.push_back({c, ""});
  while (!stack.empty()) {
    frame f = std::move(stack.back());
    stack.pop_back();
    const bool last = medusa::next_sibling(t, f.node) < 0;
    out += f.prefix + (last ? "└─ " : "├─ ") + label(t, f.node) + '\n';
    const std::string child_prefix = f.prefix + (last ? "   " : "│  ");
    for (int c = t.child_begin(f.node) + t.child_count(f.node) - 1; c >= t.child_begin(f.node); --c)
      stack.push_back({c, child_prefix});
  }
  return out;
}

std::string to_dot(const medusa::tree& t) {
  std::string out = "digraph medusa_tree {\n  rankdir=LR;\n  node [shape=box, fontname=\"monospace\"];\n";
  out += "  n0 [label=\"0: root\"];\n";
  for (int i = 1; i < t.num_nodes(); ++i) {
    out += fmt::format("  n{} [label=\"{}: {}\\nrank {}, tree_index {}\"];\n", i, i,
                       path_text(t.sorted_paths()[static_cast<std::size_t>(i) - 1]), t.rank(i), t.tree_index(i));
    out += fmt::format("  n{} -> n{};\n", t.parent(i), i);
  }
  out += "}\n";
  return out;
}

std::string paths_text(const std::vector<std::vector<int>>& paths) {
  std::vector<std::string> parts;
  for (const auto& p : paths) parts.push_back(path_text(p));
  return fmt::format("[{}]", fmt::join(parts, ","));
}

std::string plan_json(const medusa::tree_plan& p, const medusa::path_calibration& cal) {
  std::string out = fmt::format(
      "{{\"paths\":{},\"nodes\":{},\"expected_tokens\":{:.6f},\"relative_cost\":{:.6f},\"predicted_speedup\":{:.6f},"
      "\"calibration\":\"{}\",\"sizes\":[",
      paths_text(p.paths), p.nodes(), p.expected_tokens, p.relative_cost, p.predicted_speedup,
      cal.conditional() ? "path-conditional" : "independent");
  for (std::size_t i = 0; i < p.sizes.size(); ++i) {
    const auto& e = p.sizes[i];
    fmt::format_to(std::back_inserter(out),
                   "{}{{\"nodes\":{},\"depth\":{},\"expected_tokens\":{:.6f},\"relative_cost\":{:.6f},\"speedup\":{:.6f}}}",
                   i ? "," : "", e.nodes, e.depth, e.expected_tokens, e.relative_cost, e.speedup);
  }
  return out + "]}\n";
}

std::string plan_text(const medusa::tree_plan& p, const medusa::path_calibration& cal) {
  std::string out = fmt::format("tree: {}\n", paths_text(p.paths));
  out += fmt::format("{} nodes; expected {:.3f} tokens per step ({} calibration{})\n", p.nodes(), p.expected_tokens,
                     cal.conditional() ? "path-conditional" : "independent-heads",
                     cal.conditional() ? fmt::format(", {} positions", cal.positions()) : std::string());
  out += fmt::format("a step costs {:.3f} plain steps: predicted speedup {:.2f}x\n", p.relative_cost, p.predicted_speedup);
  out += "nodes  depth  tokens/step  cost  speedup\n";
  for (const auto& e : p.sizes)
    out += fmt::format("{:5}  {:5}  {:11.3f}  {:4.2f}  {:6.2f}x{}\n", e.nodes, e.depth, e.expected_tokens, e.relative_cost,
                       e.speedup, e.nodes == p.nodes() ? "  <" : "");
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Compile a Medusa tree (medusa_choices) and print its buffers", "medusa-tree"};
  std::string preset, choices, choices_file, format = "json";
  medusa::tree_options opts;
  auto* o_preset = app.add_option("--preset", preset, "a reference preset, e.g. mc_sim_7b_63");
  auto* o_choices = app.add_option("--choices", choices, "the paths as JSON (or Python literal), e.g. [[0],[1],[0,0]]");
  auto* o_file = app.add_option("--choices-file", choices_file, "a file holding the paths as JSON");
  app.add_option("--topk", opts.topk, "candidates per head (default 10, the reference value)");
  app.add_option("--max-depth", opts.max_depth, "longest path allowed (default 16)");
  app.add_option("--format", format, "json (default), text or dot")->check(CLI::IsMember({"json", "text", "dot"}));
  auto* optimize = app.add_subcommand("optimize", "the tree with the most expected tokens per second on a machine");
  std::string calibration_file, cost_file, plan_format = "text";
  medusa::tree_search_options search;
  optimize->add_option("--calibration", calibration_file, "calibration.json (medusa-train writes it beside the heads)")->required();
  optimize->add_option("--cost", cost_file, "step-cost curve (medusa-run --step-cost-out F measures one)")->required();
  optimize->add_option("--max-nodes", search.max_nodes, "largest tree, root included")->capture_default_str();
  optimize->add_option("--max-depth", search.max_depth, "longest path (0 = every head of the calibration)")->capture_default_str();
  optimize->add_option("--format", plan_format, "text (default) or json")->check(CLI::IsMember({"json", "text"}));
  return medusa_tools::run_tool(app, argc, argv, [&] {
    if (optimize->parsed()) {
      if (o_preset->count() || o_choices->count() || o_file->count())
        throw usage_error("optimize takes --calibration and --cost, not a tree");
      // An unreadable file is bad input here, like an unreadable --choices-file.
      auto input = [](auto&& read) {
        try {
          return read();
        } catch (const medusa::io_error& e) {
          throw usage_error(e.what());
        }
      };
      const auto cal = input([&] { return medusa::read_calibration(calibration_file); });
      const auto cost = input([&] { return medusa::read_step_cost(cost_file); });
      const auto plan = medusa::optimize_tree(cal, cost, search);
      const std::string out = plan_format == "json" ? plan_json(plan, cal) : plan_text(plan, cal);
      std::fwrite(out.data(), 1, out.size(), stdout);
      return std::fflush(stdout) == 0 ? medusa_tools::exit_ok : medusa_tools::exit_failure;
    }
    const int sources = static_cast<int>(o_preset->count() > 0) + static_cast<int>(o_choices->count() > 0) +
                        static_cast<int>(o_file->count() > 0);
    if (sources != 1) throw usage_error("give exactly one of --preset, --choices, --choices-file");
    const medusa::tree t = [&] {
      if (o_preset->count()) return medusa::tree::from_text(medusa::preset_text(preset), opts);
      if (o_choices->count()) return medusa::tree::from_text(choices, opts);
      try {
        return medusa::tree::from_file(choices_file, opts);
      } catch (const medusa::io_error& e) {
        throw usage_error(e.what());
      }
    }();
    const std::string out = format == "text" ? to_text(t) : format == "dot" ? to_dot(t) : to_json(t);
    std::fwrite(out.data(), 1, out.size(), stdout);
    return std::fflush(stdout) == 0 ? medusa_tools::exit_ok : medusa_tools::exit_failure;
  });
}
