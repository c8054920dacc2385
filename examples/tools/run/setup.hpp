// SPDX-License-Identifier: Apache-2.0
// What a medusa-run needs before it decodes: heads, the tree (given, or `--tree auto`), per-step
// drafts, the prompts' tokens, the engine's weight formats; and --calibrate-out after it.
#pragma once

#include <medusa/decoder/calibrate.hpp>
#include <medusa/dispatch/tree.hpp>
#include <medusa/draft_model.hpp>
#include <medusa/draft_tree.hpp>
#include <medusa/feature_draft.hpp>
#include <medusa/drafts.hpp>
#include <medusa/io.hpp>
#include <medusa/medusa.hpp>

#include <medusa_llama/cpu.hpp>
#include <medusa_llama/exit_projection.hpp>
#include <medusa_llama/load.hpp>
#include <medusa_llama/model.hpp>
#include <medusa_llama/packed_heads.hpp>
#include <medusa_llama/tokenizer.hpp>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "auto_tree.hpp"
#include "run/options.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace medusa_run {

// `random:K[:SEED]`: see medusa_llama::random_heads.
medusa::head_weights parse_random_heads(const std::string& spec, const medusa_llama::model& m);
// A tree file, or tree text.
medusa::tree load_tree(const std::string& spec);
// --prompt-file's text.
std::string read_text_file(const std::string& path);
// The heads `--heads` names (a file or directory, or random:K[:SEED]), checked against the model
// and the tree.
medusa::head_weights load_head_weights(const run_args& a, const medusa_llama::model& m, int min_depth);

// The heads as the engine runs them: a per-head stack, or a shared-lm_head stack over the model's
// classifier. Only the heads the tree reaches are packed.
template <class Engine>
medusa_llama::packed_heads pack_heads(Engine& eng, const medusa::head_weights& w, const run_args& a, int depth) {
  const auto stack = w.kind() == medusa::projection_kind::per_head
                         ? w.view()
                         : w.view(medusa::weight_ptr::of(eng.weights().classifier()),
                                  static_cast<std::size_t>(eng.config().vocab_size));
  // Their precision only changes which drafts are proposed (the model verifies every one), so
  // int8 is the default.
  return medusa_llama::packed_heads(eng, stack, a.head_weights, depth);
}

// The tree a run decodes with, and what `--json` says about it.
struct tree_choice {
  std::optional<medusa::tree> tree;
  nlohmann::json info;  // spec, paths, nodes, depth; for auto also the prediction and its inputs
};

nlohmann::json describe(const medusa::tree& t, const std::string& spec);

// `--tree auto` before the model loads: what it will need (errors surface before the slow parts).
struct auto_inputs {
  bool random_heads = false;
  std::optional<std::filesystem::path> calibration_file;
  std::optional<medusa::path_calibration> calibration;
  std::optional<medusa::step_cost_curve> given_cost;  // --step-cost
};

auto_inputs prepare_auto(const run_args& a);

// `--tree auto` once the engine exists: random heads get a small chain (they are never right);
// trained heads the tree `optimize_tree` picks from their calibration and this machine's step
// costs. Heads without a calibration get a chain too, with a warning saying so.
// `context`: the mean context of the run's steps (prompt + half the new tokens): attention grows
// with it, so a step's cost relative to a plain one is measured there.
template <class Engine>
tree_choice choose_auto_tree(const run_args& a, const auto_inputs& in, Engine& eng, const medusa::head_weights& head_w,
                             int batch, int max_rows, int context) {
  const int heads = static_cast<int>(head_w.num_heads());
  tree_choice c;
  if (!in.calibration) {
    const int depth = std::min(heads, 3);
    c.tree = medusa::tree::from_paths(medusa_tools::chain_paths(depth));
    c.info = describe(*c.tree, "auto");
    c.info["reason"] = in.random_heads ? "random heads: a small chain" : "no calibration.json beside the heads: a small chain";
    if (!in.random_heads)
      std::fprintf(stderr, "medusa-run: warning: no calibration.json beside %s: --tree auto uses a %d-node chain (pass --tree)\n",
                   a.heads.c_str(), depth + 1);
    return c;
  }
  const medusa::path_calibration& cal = *in.calibration;
  medusa_tools::step_cost_source src;
  medusa::step_cost_curve curve;
  if (in.given_cost) {
    curve = *in.given_cost;
    src = {"file", a.step_cost_file, 0.0};
  } else {
    std::vector<int> rows;
    for (int n : {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256})
      if (n == 1 || (n <= max_rows && n <= std::max(2, batch * a.max_nodes))) rows.push_back(n);
    const auto& eo = eng.options();
    std::string formats = medusa_llama::to_string(eo.weights);
    if (eo.classifier_weights) formats += std::string("/") + medusa_llama::to_string(*eo.classifier_weights);
    // Contexts in steps of 64 share a cached curve; the measurement clamps it to the cache.
    context = std::max(64, (context + 63) / 64 * 64);
    const std::string key = medusa_tools::step_cost_key(a.model, eng.threads(), formats, medusa_llama::to_string(a.head_weights), heads,
                                                        rows, context);
    curve = medusa_tools::cached_step_cost(
        medusa_tools::cost_cache_dir(a.cost_cache), key,
        [&] {
          auto all = pack_heads(eng, head_w, a, heads);
          return medusa::measure_step_cost(eng, all, {.rows = rows, .context = context});
        },
        src);
  }
  if (!a.step_cost_out.empty()) {
    std::ofstream out(a.step_cost_out, std::ios::binary);
    out << medusa::step_cost_json(curve);
    if (!out) throw medusa::io_error("--step-cost-out " + a.step_cost_out + ": cannot write");
  }
  const auto plan = medusa::optimize_tree(cal, medusa_tools::per_request_curve(curve, batch, a.max_nodes),
                                          {.max_nodes = a.max_nodes, .max_depth = heads});
  medusa::tree_options topt;
  topt.topk = std::max(medusa::default_topk, cal.topk());
  c.tree = medusa::tree::from_paths(plan.paths, topt);
  c.info = describe(*c.tree, "auto");
  c.info["expected_tokens_per_step"] = plan.expected_tokens;
  c.info["relative_step_cost"] = plan.relative_cost;
  c.info["predicted_speedup"] = plan.predicted_speedup;
  c.info["calibration"] = in.calibration_file->string();
  c.info["calibration_kind"] = cal.conditional() ? "path-conditional" : "independent";
  c.info["step_cost"] = {{"source", src.kind}, {"file", src.file}, {"measure_seconds", src.seconds}, {"batch", batch}};
  const std::string where = src.kind == "measured" ? fmt::format("measured in {:.2f} s", src.seconds) : src.kind + " " + src.file;
  std::fprintf(stderr, "tree auto: %s (%d nodes): %.2f tokens/step expected, a step costs %.2fx a plain one, predicted speedup %.2fx (step costs %s)\n",
               c.info["paths"].dump().c_str(), c.tree->num_nodes(), plan.expected_tokens, plan.relative_cost, plan.predicted_speedup,
               where.c_str());
  if (plan.predicted_speedup < 1.0)
    std::fprintf(stderr, "medusa-run: warning: no tree is predicted to beat plain decoding on this machine (best %.2fx)\n",
                 plan.predicted_speedup);
  return c;
}

// A drafter's chains and trees (--draft-model, --self-draft-layers: any `draft_model_branch`;
// --eagle: a `feature_draft_branch`, which reads the target's features), over the single-request
// engine or the serving engine (--prompts-file), behind one type.
struct draft_source {
  int tokens = 0;  // chain length; 0 = no drafter
  std::function<int(int, std::span<const std::int32_t>, std::span<std::int32_t>)> find;
  std::function<void(int)> release;
  std::function<void(int, int, std::span<const float>)> observe;  // set for a feature drafter
  // The `tree_draft_source` members (--draft-nodes).
  int vocab = 0;
  std::function<std::span<const float>(int, std::span<const std::int32_t>)> root;
  std::function<std::span<const float>(int, std::span<const std::int32_t>, const medusa::draft_tree_pass&)> pass;
  // The `tree_draft_batch_source` members, for a drafter over the serving engine (empty: one
  // request at a time).
  std::function<void(std::span<const medusa::draft_root_call>, std::span<std::span<const float>>)> roots;
  std::function<void(std::span<const medusa::draft_pass_call>, std::span<std::span<const float>>)> passes;

  template <class Branch>
  static draft_source of(Branch b) {
    draft_source s{b.max_tokens(),
                   [b](int request, std::span<const std::int32_t> history, std::span<std::int32_t> out) mutable {
                     return b.find(request, history, out);
                   },
                   [b](int request) mutable { b.release(request); },
                   {},
                   b.vocab_size(),
                   [b](int request, std::span<const std::int32_t> history) mutable { return b.draft_root(request, history); },
                   [b](int request, std::span<const std::int32_t> history, const medusa::draft_tree_pass& p) mutable {
                     return b.draft_pass(request, history, p);
                   },
                   {},
                   {}};
    if constexpr (requires { Branch::observes_features(); })
      s.observe = [b](int request, int position, std::span<const float> rows) mutable { b.observe(request, position, rows); };
    if constexpr (medusa::tree_draft_batch_source<Branch>) {
      s.roots = [b](std::span<const medusa::draft_root_call> calls, std::span<std::span<const float>> rows) mutable {
        b.draft_roots(calls, rows);
      };
      s.passes = [b](std::span<const medusa::draft_pass_call> calls, std::span<std::span<const float>> rows) mutable {
        b.draft_passes(calls, rows);
      };
    }
    return s;
  }
};

// What the step drafters hear about a request through its drafter: that it left, and the target's
// features (a feature drafter's). The base of `run_branch` and `run_tree_source`.
struct draft_hooks {
  draft_source draft;

  void release(int request) {
    if (draft.release) draft.release(request);
  }
  [[nodiscard]] bool observes_features() const { return static_cast<bool>(draft.observe); }
  void observe(int request, int position, std::span<const float> rows) {
    if (draft.observe) draft.observe(request, position, rows);
  }
};

// A drafter's trees (--draft-nodes): the `tree_draft_source` of a `draft_source`.
struct run_tree_source : draft_hooks {
  [[nodiscard]] int vocab_size() const { return draft.vocab; }
  std::span<const float> draft_root(int request, std::span<const std::int32_t> history) { return draft.root(request, history); }
  std::span<const float> draft_pass(int request, std::span<const std::int32_t> history, const medusa::draft_tree_pass& p) {
    return draft.pass(request, history, p);
  }
  // The batched passes, where the drafter has them (a draft model over the serving engine); the
  // tree drafter runs the others one request at a time.
  [[nodiscard]] bool batches() const { return static_cast<bool>(draft.roots); }
  void draft_roots(std::span<const medusa::draft_root_call> calls, std::span<std::span<const float>> rows) {
    draft.roots(calls, rows);
  }
  void draft_passes(std::span<const medusa::draft_pass_call> calls, std::span<std::span<const float>> rows) {
    draft.passes(calls, rows);
  }
};

// The branch of the per-step drafts: the prompt lookup's continuation where it finds one (--lookup),
// else the draft model's chain.
struct run_branch : draft_hooks {
  std::optional<medusa::ngram_lookup> lookup;

  [[nodiscard]] int max_tokens() const { return std::max(lookup ? lookup->max_tokens : 0, draft.tokens); }
  void validate() const {
    if (lookup) lookup->validate();
  }
  int find(int request, std::span<const std::int32_t> history, std::span<std::int32_t> out) {
    if (lookup) {
      const auto cap = std::min(out.size(), static_cast<std::size_t>(lookup->max_tokens));
      if (const int n = lookup->find(history, out.first(cap)); n > 0) return n;
    }
    return draft.find ? draft.find(request, history, out) : 0;
  }
};

// The per-step drafts of a run, one type for the decoders: the heads' tree (or none) with a branch
// (--lookup, a drafter's chain), or a drafter's own trees (--draft-nodes).
class run_drafter {
 public:
  explicit run_drafter(medusa::basic_step_drafter<run_branch> d) : chain_(std::move(d)) {}
  explicit run_drafter(medusa::tree_drafter<run_tree_source> d) : tree_(std::move(d)) {}

  [[nodiscard]] int max_nodes() const { return chain_ ? chain_->max_nodes() : tree_->max_nodes(); }
  [[nodiscard]] int max_depth() const { return chain_ ? chain_->max_depth() : tree_->max_depth(); }
  [[nodiscard]] int heads_depth() const { return chain_ ? chain_->heads_depth() : tree_->heads_depth(); }
  std::optional<medusa::tree> draft(int request, std::span<const std::int32_t> history, std::span<const float> head_logits,
                                    int vocab, std::span<std::int32_t> node_tokens) {
    return chain_ ? chain_->draft(request, history, head_logits, vocab, node_tokens)
                  : tree_->draft(request, history, head_logits, vocab, node_tokens);
  }
  // Every request of a step: the tree drafter's passes run for all of them together.
  void draft_batch(std::span<medusa::step_draft_call> calls, int vocab) {
    if (tree_) return tree_->draft_batch(calls, vocab);
    for (auto& c : calls) c.result = chain_->draft(c.request, c.history, c.head_logits, vocab, c.node_tokens);
  }
  [[nodiscard]] bool observes_features() const { return chain_ ? chain_->observes_features() : tree_->observes_features(); }
  void observe(int request, int position, std::span<const float> rows) {
    if (chain_) chain_->observe(request, position, rows);
    else tree_->observe(request, position, rows);
  }
  void release(int request) {
    if (chain_) chain_->release(request);
    else tree_->release(request);
  }

 private:
  std::optional<medusa::basic_step_drafter<run_branch>> chain_;
  std::optional<medusa::tree_drafter<run_tree_source>> tree_;
};

// Per-step drafts (--lookup, --dynamic, a draft model): a drafter over the chosen tree (or, with
// --draft-alone, without it), a drafter's own trees (--draft-nodes), or nothing.
std::optional<run_drafter> make_drafter(const run_args& a, const medusa::tree& t, int heads, draft_source draft = {});

// A drafter's sampled trees (--policy speculative --draft-nodes), drawn with `warp`, with the
// prompt lookup when --lookup is given.
medusa::tree_sampler<run_tree_source> make_tree_sampler(const run_args& a, draft_source draft, const medusa::sampling_warp& warp);

// The draft model's weights (--self-draft-layers: the target's first layers; --draft-model: the
// file, read with the target's tokenizer so that another vocabulary fails to load), or nothing.
std::optional<medusa_llama::model> load_draft(const run_args& a, const medusa_llama::loaded_model& lm);

// Runs `body(tree_source)` with the per-step drafter when there is one, else with the tree (a
// preset on its compile-time instantiation). `draft_sampling_policy` draws its own drafts and
// takes no per-step drafter (checked before the model loads).
template <class Policy, class F>
decltype(auto) with_tree_source(const std::optional<run_drafter>& drafter, const medusa::tree& t, F&& body) {
  if constexpr (!medusa::depth_draft_policy<Policy>)
    if (drafter) return body(*drafter);
  return medusa::dispatch_tree(t, body);
}

nlohmann::json describe_drafts(const run_args& a);

//! The draft model's work over a run (a `draft_model_branch` or `draft_model_sampler`; copies share
//! their counts): `draft_tokens_run`, `draft_passes`, `draft_seconds`, and with `run_seconds`
//! (one request's run) `draft_share`, the draft's part of it.
template <class Draft>
nlohmann::json draft_work(const Draft& d, std::optional<double> run_seconds = std::nullopt) {
  nlohmann::json j = {{"draft_tokens_run", d.tokens_run()}, {"draft_passes", d.passes()}, {"draft_seconds", d.seconds()}};
  if (run_seconds) j["draft_share"] = *run_seconds > 0 ? d.seconds() / *run_seconds : 0.0;
  return j;
}

// --calibrate-out: path-conditional counts of the heads over each prompt and its greedy output
// (real decoding, docs/tree.md), written as calibration.json version 2.
template <class Engine>
void write_calibration(const run_args& a, Engine& eng, const medusa::head_weights& head_w,
                       const std::vector<std::vector<std::int32_t>>& prompts, const std::vector<medusa::decode_result>& outputs) {
  const int heads = static_cast<int>(head_w.num_heads());
  auto all = pack_heads(eng, head_w, a, heads);
  medusa::path_counter counts(heads, medusa::default_topk);
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    std::vector<std::int32_t> seq = prompts[i];
    seq.insert(seq.end(), outputs[i].tokens.begin(), outputs[i].tokens.end());
    // The last token of a context-full request was never run: the context holds one fewer.
    const auto context = static_cast<std::size_t>(eng.config().seq_len);
    if (seq.size() > context) seq.resize(context);
    // From the last prompt position on: where decoding runs the heads.
    if (seq.size() >= 3) medusa::count_paths(eng, all, seq, counts, static_cast<int>(prompts[i].size()) - 1);
  }
  if (counts.positions() == 0) throw medusa::decode_error("--calibrate-out: no position to count (outputs too short)");
  std::ofstream out(a.calibrate_out, std::ios::binary);
  out << medusa::calibration_json(counts);
  if (!out) throw medusa::io_error("--calibrate-out " + a.calibrate_out + ": cannot write");
  std::fprintf(stderr, "calibration: %llu positions of %zu request(s) -> %s\n", static_cast<unsigned long long>(counts.positions()),
               prompts.size(), a.calibrate_out.c_str());
}

// Tokenized prompt (BOS first) that leaves room for at least one new token.
std::vector<std::int32_t> encode_prompt(const medusa_llama::tokenizer& tok, const std::string& text, int seq_len,
                                        const std::string& what);

// The engine's weight formats: as asked, else what the model file stores (GGUF Q8_0 and Q4_0
// matrices pack without loss into q8_0 and q4_0, BF16 into bf16; F16 and F32 stay float32).
medusa_llama::weight_format native_format(medusa_llama::stored_type t);

template <class Options>
nlohmann::json weights_json(const Options& eo) {
  return {{"blocks", medusa_llama::to_string(eo.weights)},
          {"classifier", medusa_llama::to_string(medusa_llama::classifier_format(eo.weights, eo.classifier_weights))}};
}

template <class Options>
void set_weight_formats(Options& eo, const run_args& a, const medusa_llama::model& m) {
  eo.weights = a.weights ? *a.weights : native_format(m.stored());
  if (a.classifier_weights) eo.classifier_weights = *a.classifier_weights;
  else if (!a.weights) eo.classifier_weights = native_format(m.classifier_stored());
}

// An --eagle drafter's format without --draft-weights: its passes stream its weights (one layer
// and the classifier, a fifth of pycode-15m's bytes in f32), and q8_0 drafts almost as the f32
// weights do at a third of the bytes (docs/performance.md).
inline constexpr medusa_llama::weight_format eagle_default_weights = medusa_llama::weight_format::q8_0;

// The pool a drafter runs on: the target's, unless --draft-threads gives it threads of its own
// (then null, and the drafter's `threads` option is `a.draft_threads`; with a pool it is ignored).
inline medusa_llama::thread_pool* draft_pool(const run_args& a, medusa_llama::thread_pool& target) noexcept {
  return a.draft_threads == 0 ? &target : nullptr;
}

// A draft model's formats: --draft-weights for its projections and classifier (the engine's rule
// for the classifier under q4), else as the target's (`set_weight_formats`).
template <class Options>
void set_draft_weight_formats(Options& eo, const run_args& a, const medusa_llama::model& m) {
  set_weight_formats(eo, a, m);
  if (a.draft_weights) {
    eo.weights = *a.draft_weights;
    eo.classifier_weights = std::nullopt;
  }
}

}  // namespace medusa_run
