// SPDX-License-Identifier: Apache-2.0
// medusa-run: generate text with a Llama model on the CPU or a CUDA GPU, plainly and with Medusa
// heads, and compare the two.
//
//   medusa-run --model PATH [--tokenizer PATH] [--heads PATH|random:K[:SEED]]
//              [--tree auto|PRESET|TEXT|FILE] [--max-nodes N] [--calibration F] [--step-cost F] [--step-cost-out F]
//              [--cost-cache DIR|none] [--calibrate-out F] [--lookup N] [--lookup-ngram MIN:MAX] [--dynamic]
//              [--policy greedy|typical|rejection|sampled] [--temperature T]
//              [--top-p P] [--seed S] [--prompt TEXT | --prompt-file F] [--max-new-tokens N]
//              [--mode vanilla|medusa|both] [--weights f32|bf16|int8|q4] [--classifier-weights F] [--head-weights int8|q8_0|q4|bf16|f32]
//              [--threads N] [--json]
//   medusa-run ... --prompts-file F [--batch N]     many prompts, N at a time (continuous batching)
//   medusa-run ... --device cuda [--precision f32|f16|bf16] [--cuda-gemm invariant|fast]
//                                                  greedy decoding on the GPU, a whole step per CUDA graph
#include <medusa/decoder/calibrate.hpp>
#include <medusa/dispatch.hpp>
#include <medusa/io.hpp>
#include <medusa/medusa.hpp>

#include <medusa_llama/batch_engine.hpp>
#include <medusa_llama/cpu.hpp>
#include <medusa_llama/cuda_engine.hpp>
#include <medusa_llama/engine.hpp>
#include <medusa_llama/load.hpp>
#include <medusa_llama/packed_heads.hpp>
#include <medusa_train/selfdistill.hpp>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "auto_tree.hpp"
#include "tool_common.hpp"

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <string>
#include <type_traits>
#include <sys/resource.h>
#include <unistd.h>
#include <vector>

namespace {

using medusa_tools::usage_error;

enum class run_mode { vanilla, medusa, both };

struct run_args {
  std::string model, tokenizer, heads, tree = "auto", policy = "greedy", prompt, prompt_file, prompts_file;
  int max_nodes = 64;                                    // --tree auto: largest tree considered
  std::string step_cost_file, step_cost_out, cost_cache;  // --tree auto: the step-cost curve
  std::string calibration;                               // --tree auto: default calibration.json beside the heads
  int lookup = 0;                                        // lookup branch of up to N tokens (0 = off)
  int lookup_min = 2, lookup_max = 4;                    // n-gram sizes matched
  bool dynamic = false;                                  // per-step dynamic trees of the chosen size
  std::string calibrate_out;                             // write path counts of the greedy outputs here
  std::optional<int> batch;  // requests at once with --prompts-file (default 1)
  run_mode mode = run_mode::medusa;
  std::optional<float> temperature;  // unset: the policy's default
  float top_p = 1.0f;
  std::uint64_t seed = 0;
  int max_new_tokens = 256;
  int threads = 0;
  std::optional<medusa_llama::weight_format> weights;  // unset (auto): what the model file stores
  std::optional<medusa_llama::weight_format> classifier_weights;  // unset: the engine's rule
  medusa_llama::weight_format head_weights = medusa_llama::weight_format::int8;
  bool json = false;
  std::string device = "cpu";                                             // cpu | cuda
  medusa_llama::cuda_precision precision = medusa_llama::cuda_precision::bf16;  // --device cuda
  bool cuda_gemm_fast = false;                                            // --cuda-gemm fast
};

// `random:K[:SEED]`: see medusa_llama::random_heads.
medusa::head_weights parse_random_heads(const std::string& spec, const medusa_llama::model& m) {
  int k = 0;
  unsigned long long seed = 0;
  char extra = 0;
  const int got = std::sscanf(spec.c_str(), "random:%d:%llu%c", &k, &seed, &extra);
  if (!(got == 1 || got == 2) || k < 1 || k > 64)
    throw usage_error("--heads " + spec + ": expected random:K or random:K:SEED with 1 <= K <= 64");
  return medusa_llama::random_heads(m, k, seed);
}

medusa::tree load_tree(const std::string& spec) {
  std::error_code ec;
  if (std::filesystem::is_regular_file(spec, ec)) return medusa::tree::from_file(spec);
  return medusa::tree::from_text(spec);
}

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw usage_error("--prompt-file " + path + ": cannot open");
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Streams decoded text of generated tokens to stdout (unless quiet).
class text_sink {
 public:
  text_sink(const medusa_llama::tokenizer& tok, int prev, bool print) : tok_(tok), prev_(prev), print_(print) {}
  void operator()(std::int32_t token) {
    std::string piece = tok_.decode_piece(prev_, token);
    prev_ = token;
    text_ += piece;
    if (print_) {
      std::fwrite(piece.data(), 1, piece.size(), stdout);
      std::fflush(stdout);
    }
  }
  [[nodiscard]] const std::string& text() const noexcept { return text_; }

 private:
  const medusa_llama::tokenizer& tok_;
  int prev_;
  bool print_;
  std::string text_;
};

struct run_report {
  std::string mode;
  medusa::decode_result result;
  std::string text;
  nlohmann::json tree;  // the tree of a Medusa run (null for plain decoding)
};

nlohmann::json to_json(const run_report& r) {
  const auto& s = r.result.stats;
  nlohmann::json j;
  j["mode"] = r.mode;
  j["tokens"] = r.result.tokens;
  j["text"] = r.text;
  j["new_tokens"] = s.new_tokens;
  j["steps"] = s.steps;
  j["mean_accepted"] = s.mean_accepted();
  j["seconds"] = s.seconds.total;
  j["tokens_per_second"] = s.tokens_per_second();
  j["stop_reason"] = std::string(medusa::to_string(r.result.reason));
  j["prompt_tokens"] = s.prompt_tokens;
  if (!r.tree.is_null()) j["tree"] = r.tree;
  if (r.mode == "medusa") {
    j["accepted_histogram"] = s.accepted_histogram;
    j["accepted_at_depth"] = s.accepted_at_depth;
    j["phase_seconds"] = {{"prefill", s.seconds.prefill}, {"heads", s.seconds.heads},
                          {"candidates", s.seconds.candidates}, {"forward", s.seconds.forward},
                          {"accept", s.seconds.accept}, {"commit", s.seconds.commit}};
  }
  return j;
}

// One JSON line. Generated text may cut a UTF-8 sequence between tokens (or hold byte tokens
// that are not UTF-8): such bytes print as U+FFFD instead of failing the run.
std::string json_line(const nlohmann::json& j) {
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

// The process's peak resident set so far, in bytes (0 if the system does not say): what --json
// reports as peak_rss_bytes. ru_maxrss counts kilobytes on Linux, bytes on macOS.
std::int64_t peak_rss_bytes() {
  rusage ru{};
  if (::getrusage(RUSAGE_SELF, &ru) != 0 || ru.ru_maxrss < 0) return 0;
#if defined(__APPLE__)
  return static_cast<std::int64_t>(ru.ru_maxrss);
#else
  return static_cast<std::int64_t>(ru.ru_maxrss) * 1024;
#endif
}

// Medusa tokens/s over plain tokens/s (0 when plain decoding produced nothing).
double speedup_of(double plain_tps, double medusa_tps) { return plain_tps > 0 ? medusa_tps / plain_tps : 0.0; }

// The policies medusa-run offers (speculative_policy needs a draft distribution per node, which
// heads do not give; draft_sampling_policy draws the drafts from the heads' softmax).
using run_policies = medusa::policy_list<medusa::greedy_policy, medusa::typical_policy, medusa::rejection_policy,
                                         medusa::draft_sampling_policy>;

// The heads `--heads` names (a file or directory, or random:K[:SEED]), checked against the model
// and the tree.
medusa::head_weights load_head_weights(const run_args& a, const medusa_llama::model& m, int min_depth) {
  const auto& cfg = m.config();
  if (a.heads.empty())
    throw usage_error("--mode " + std::string(a.mode == run_mode::both ? "both" : "medusa") +
                      " needs --heads (a heads file or directory, or random:K[:SEED])");
  medusa::head_weights head_w;
  if (a.heads.rfind("random:", 0) == 0) {
    head_w = parse_random_heads(a.heads, m);
  } else {
    medusa::head_load_options opt;
    opt.hidden_size = static_cast<std::size_t>(cfg.dim);
    opt.vocab_size = static_cast<std::size_t>(cfg.vocab_size);
    opt.min_heads = static_cast<std::size_t>(min_depth);
    opt.dtype = medusa::weight_dtype::f32;
    auto loaded = medusa::load_heads(a.heads, opt);
    for (const auto& w : loaded.warnings) std::fprintf(stderr, "medusa-run: warning: %s\n", w.message.c_str());
    head_w = std::move(loaded.heads);
  }
  if (static_cast<int>(head_w.num_heads()) < min_depth)
    throw medusa::decode_error("the tree is " + std::to_string(min_depth) + " deep but only " +
                               std::to_string(head_w.num_heads()) + " heads are loaded");
  return head_w;
}

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

nlohmann::json describe(const medusa::tree& t, const std::string& spec) {
  return {{"spec", spec}, {"paths", t.sorted_paths()}, {"nodes", t.num_nodes()}, {"depth", t.depth()}};
}

// `--tree auto` before the model loads: what it will need (errors surface before the slow parts).
struct auto_inputs {
  bool random_heads = false;
  std::optional<std::filesystem::path> calibration_file;
  std::optional<medusa::path_calibration> calibration;
  std::optional<medusa::step_cost_curve> given_cost;  // --step-cost
};

auto_inputs prepare_auto(const run_args& a) {
  auto_inputs in;
  if (a.max_nodes < 2 || a.max_nodes > 256) throw usage_error("--max-nodes must be in [2, 256], got " + std::to_string(a.max_nodes));
  in.random_heads = a.heads.rfind("random:", 0) == 0;
  std::error_code ec;
  if (!a.step_cost_file.empty()) {
    if (!std::filesystem::is_regular_file(a.step_cost_file, ec)) throw usage_error("--step-cost " + a.step_cost_file + ": cannot open");
    in.given_cost = medusa::read_step_cost(a.step_cost_file);
  }
  if (!a.calibration.empty()) {
    if (!std::filesystem::is_regular_file(a.calibration, ec)) throw usage_error("--calibration " + a.calibration + ": cannot open");
    in.calibration_file = a.calibration;
  } else if (!in.random_heads && !a.heads.empty()) {
    in.calibration_file = medusa_tools::calibration_beside(a.heads);
  }
  if (in.calibration_file) in.calibration = medusa::read_calibration(*in.calibration_file);
  return in;
}

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

// Per-step drafts (--lookup, --dynamic): a step_drafter over the chosen tree, or nothing.
std::optional<medusa::step_drafter> make_drafter(const run_args& a, const medusa::tree& t, int heads) {
  if (a.lookup == 0 && !a.dynamic) return std::nullopt;
  medusa::step_drafter_options o;
  if (a.dynamic) o.dynamic_nodes = t.num_nodes();
  else o.paths = t.sorted_paths();
  o.topk = t.topk();
  if (a.lookup > 0) o.lookup = medusa::ngram_lookup{.min_ngram = a.lookup_min, .max_ngram = a.lookup_max, .max_tokens = a.lookup};
  return medusa::step_drafter(std::move(o), heads);
}

// Runs `body(tree_source)` with the per-step drafter when there is one, else with the tree (a
// preset on its compile-time instantiation). `draft_sampling_policy` draws its own drafts and
// takes no per-step drafter (checked before the model loads).
template <class Policy, class F>
decltype(auto) with_tree_source(const std::optional<medusa::step_drafter>& drafter, const medusa::tree& t, F&& body) {
  if constexpr (!medusa::depth_draft_policy<Policy>)
    if (drafter) return body(*drafter);
  return medusa::dispatch_tree(t, body);
}

nlohmann::json describe_drafts(const run_args& a) {
  return {{"dynamic", a.dynamic}, {"lookup_tokens", a.lookup}, {"lookup_ngram", {a.lookup_min, a.lookup_max}}};
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
                                        const std::string& what) {
  std::vector<std::int32_t> prompt;
  for (int id : tok.encode(text, /*bos=*/true, /*eos=*/false)) prompt.push_back(id);
  if (prompt.size() >= static_cast<std::size_t>(seq_len))
    throw medusa::decode_error(what + "of " + std::to_string(prompt.size()) + " tokens does not fit the context of " +
                               std::to_string(seq_len) + " tokens (leave room for at least one new token)");
  return prompt;
}

// One mode of a --prompts-file run: every request's result, and the wall time of the whole batch.
struct batch_report {
  std::string mode;
  std::vector<medusa::decode_result> results;
  std::vector<std::string> texts;
  double seconds = 0;
  int steps = 0;  // batch steps
  [[nodiscard]] long tokens() const {
    long n = 0;
    for (const auto& r : results) n += r.stats.new_tokens;
    return n;
  }
  [[nodiscard]] double tokens_per_second() const { return seconds > 0 ? static_cast<double>(tokens()) / seconds : 0.0; }
  // Tokens per forward pass of a request, over all requests.
  [[nodiscard]] double mean_accepted() const {
    long steps_all = 0;
    for (const auto& r : results) steps_all += r.stats.steps;
    return steps_all > 0 ? static_cast<double>(tokens()) / static_cast<double>(steps_all) : 0.0;
  }
};

nlohmann::json to_json(const batch_report& r) {
  return {{"tokens", r.tokens()},          {"seconds", r.seconds},
          {"tokens_per_second", r.tokens_per_second()}, {"mean_accepted", r.mean_accepted()},
          {"batch_steps", r.steps}};
}

// Decodes every prompt through `dec` on `eng`, at most `dec.max_batch()` at once: a request joins
// as soon as one leaves (continuous batching). Request ids are engine slots.
template <class Decoder>
batch_report serve_all(Decoder& dec, medusa_llama::batch_engine& eng, const std::vector<std::vector<std::int32_t>>& prompts,
                       const medusa::decode_options& dopt, int bos, const std::string& mode) {
  batch_report rep;
  rep.mode = mode;
  rep.results.resize(prompts.size());
  std::deque<std::size_t> waiting;
  for (std::size_t i = 0; i < prompts.size(); ++i) waiting.push_back(i);
  std::vector<std::size_t> client_of(static_cast<std::size_t>(dec.max_batch()));
  std::vector<bool> busy(client_of.size(), false);
  const auto t0 = std::chrono::steady_clock::now();
  while (!waiting.empty() || !dec.empty()) {
    for (std::size_t id = 0; id < busy.size() && !waiting.empty(); ++id) {
      if (busy[id]) continue;
      // A generated BOS starts a new document: stop there, as llama2.c's run.c does.
      dec.join(static_cast<int>(id), prompts[waiting.front()], dopt, [bos](std::int32_t t) { return t != bos; });
      client_of[id] = waiting.front();
      busy[id] = true;
      waiting.pop_front();
    }
    for (medusa::request_update& u : dec.step()) {
      if (!u.finished) continue;
      const auto id = static_cast<std::size_t>(u.request);
      if (u.error) std::rethrow_exception(u.error);
      eng.release(u.request, 0);
      rep.results[client_of[id]] = std::move(u.result);
      busy[id] = false;
    }
    ++rep.steps;
  }
  rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return rep;
}

// " (predicted N.NNx)" when the tree search chose the tree (its model is greedy acceptance).
std::string predicted_note(const nlohmann::json& info) {
  if (!info.is_object() || !info.contains("predicted_speedup")) return {};
  return fmt::format(" (predicted {:.2f}x)", info["predicted_speedup"].get<double>());
}

// The engine's weight formats: as asked, else what the model file stores (GGUF Q8_0 and Q4_0
// matrices pack without loss into q8_0 and q4_0, BF16 into bf16; F16 and F32 stay float32).
medusa_llama::weight_format native_format(medusa_llama::stored_type t) {
  using st = medusa_llama::stored_type;
  using wf = medusa_llama::weight_format;
  switch (t) {
    case st::bf16: return wf::bf16;
    case st::q8_0: return wf::q8_0;
    case st::q4_0: return wf::q4_0;
    default: return wf::f32;
  }
}

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

// The output of a many-prompt run (--prompts-file, or --device cuda): with --json one line per
// request and mode, then `summary` completed with each mode's figures and, for two modes, whether
// the tokens are identical and the speedup; else each request's text (of the last mode) and the
// figures on stderr. `greedy`: differing tokens are an error (exit 1). `note` follows the speedup.
int report_batch(const run_args& a, const std::vector<batch_report>& reports, std::size_t requests, int batch,
                 nlohmann::json summary, bool greedy, const std::string& note) {
  std::vector<std::size_t> differ;
  if (reports.size() == 2)
    for (std::size_t i = 0; i < requests; ++i)
      if (reports[0].results[i].tokens != reports[1].results[i].tokens) differ.push_back(i);
  const double speedup = reports.size() == 2 ? speedup_of(reports[0].tokens_per_second(), reports[1].tokens_per_second()) : 0.0;
  if (a.json) {
    for (const auto& r : reports)
      for (std::size_t i = 0; i < requests; ++i) {
        run_report one{r.mode, r.results[i], r.texts[i], {}};
        auto j = to_json(one);
        j["request"] = i;
        std::printf("%s\n", json_line(j).c_str());
      }
    for (const auto& r : reports) summary[r.mode].update(to_json(r));
    if (reports.size() == 2) {
      summary["identical"] = differ.empty();
      summary["differing_requests"] = differ;
      summary["speedup"] = speedup;
    }
    summary["peak_rss_bytes"] = peak_rss_bytes();
    summary["cpu_target"] = medusa_llama::cpu_target();
    std::printf("%s\n", json_line(summary).c_str());
  } else {
    const auto& last = reports.back();
    for (std::size_t i = 0; i < requests; ++i)
      std::printf("--- request %zu (%s, %s) ---\n%s\n", i, last.mode.c_str(),
                  std::string(medusa::to_string(last.results[i].reason)).c_str(), last.texts[i].c_str());
    std::fflush(stdout);
    for (const auto& r : reports)
      std::fprintf(stderr, "%-7s %zu requests, batch %d: %ld tokens in %6.3f s: %7.1f tokens/s, %5.2f tokens/step\n",
                   r.mode.c_str(), requests, batch, r.tokens(), r.seconds, r.tokens_per_second(), r.mean_accepted());
    if (reports.size() == 2)
      std::fprintf(stderr, "tokens identical: %s (%zu of %zu requests differ)%s\nspeedup (medusa / vanilla tokens per second): %.2fx%s\n",
                   differ.empty() ? "yes" : "no", differ.size(), requests,
                   greedy ? "" : " (only greedy decoding is expected to match token for token)", speedup, note.c_str());
  }
  if (greedy && !differ.empty()) {
    std::fprintf(stderr, "medusa-run: error: greedy Medusa tokens differ from plain decoding for request %zu\n", differ[0]);
    return medusa_tools::exit_failure;
  }
  return medusa_tools::exit_ok;
}

// --prompts-file: every prompt decoded plainly and/or with Medusa, `--batch` at a time, on the
// serving engine (one ragged forward per step over a paged KV pool).
template <class Policy>
int run_batch(const run_args& a, medusa_llama::loaded_model& lm, const std::vector<std::vector<std::int32_t>>& prompts,
              const std::optional<medusa::tree>& given_tree, const auto_inputs& ain, const medusa::head_weights& head_w,
              const Policy& policy) {
  const bool auto_tree = a.mode != run_mode::vanilla && !given_tree;
  medusa_llama::batch_engine_options eo;
  eo.threads = a.threads;
  eo.max_requests = *a.batch;
  eo.max_tokens = std::max(256, *a.batch * ((auto_tree ? a.max_nodes : given_tree ? given_tree->num_nodes() : 1) + a.lookup));
  set_weight_formats(eo, a, lm.weights);
  medusa_llama::batch_engine eng(std::move(lm.weights), eo);
  tree_choice choice;
  std::size_t prompt_sum = 0;
  for (const auto& p : prompts) prompt_sum += p.size();
  const int mean_context = static_cast<int>(prompt_sum / std::max<std::size_t>(1, prompts.size())) + a.max_new_tokens / 2;
  if (auto_tree) choice = choose_auto_tree(a, ain, eng, head_w, *a.batch, eo.max_tokens, mean_context);
  else if (given_tree) choice = {given_tree, describe(*given_tree, a.tree)};
  const std::optional<medusa::tree>& tree = choice.tree;
  medusa::decode_options dopt;
  dopt.max_new_tokens = a.max_new_tokens;
  dopt.eos_token = lm.tok->eos_id();
  dopt.seed = a.seed;
  const int bos = lm.tok->bos_id();

  std::vector<batch_report> reports;
  if (a.mode != run_mode::medusa) {
    medusa::no_heads none;
    medusa::batch_decoder dec(eng, none, medusa::plain_tree{}, policy, *a.batch);
    reports.push_back(serve_all(dec, eng, prompts, dopt, bos, "vanilla"));
  }
  if (a.mode != run_mode::vanilla) {
    auto heads = pack_heads(eng, head_w, a, tree->depth());
    const auto drafter = make_drafter(a, *tree, tree->depth());
    reports.push_back(with_tree_source<Policy>(drafter, *tree, [&](const auto& t) {
      medusa::batch_decoder dec(eng, heads, t, policy, *a.batch);
      return serve_all(dec, eng, prompts, dopt, bos, "medusa");
    }));
  }
  for (auto& r : reports)
    for (std::size_t i = 0; i < prompts.size(); ++i) {
      text_sink sink(*lm.tok, prompts[i].back(), false);
      for (auto t : r.results[i].tokens) sink(t);
      r.texts.push_back(sink.text());
    }

  if (!a.calibrate_out.empty()) write_calibration(a, eng, head_w, prompts, reports[0].results);

  // Lossless check: with greedy acceptance every request's Medusa tokens are its plain tokens.
  constexpr bool greedy = std::is_same_v<Policy, medusa::greedy_policy>;
  nlohmann::json summary = {{"batch", *a.batch}, {"requests", prompts.size()}, {"threads", eng.threads()},
                            {"max_new_tokens", a.max_new_tokens}, {"weights", weights_json(eng.options())}};
  if (tree) {
    summary["tree"] = choice.info;
    summary["tree"]["drafts"] = describe_drafts(a);
  }
  return report_batch(a, reports, prompts.size(), *a.batch, summary, greedy, greedy ? predicted_note(choice.info) : "");
}

// --device cuda: the GPU engine and greedy decoding with the whole step on the device (one CUDA
// graph per step), prompts --batch at a time. What the device step does not implement (other
// policies, per-step drafts, calibration counts) was refused in run() before the model loaded.
int run_cuda(const run_args& a, medusa_llama::loaded_model& lm, const std::vector<std::vector<std::int32_t>>& prompts,
             std::optional<medusa::tree> tree, const auto_inputs& ain, const medusa::head_weights& head_w) {
  const auto& cfg = lm.weights.config();
  const bool want_medusa = a.mode != run_mode::vanilla;
  const int B = static_cast<int>(std::min<std::size_t>(static_cast<std::size_t>(*a.batch), prompts.size()));
  medusa_llama::cuda_engine_options eo;
  eo.precision = a.precision;
  eo.max_requests = B;
  eo.max_tokens = std::max(512, B * (tree ? tree->num_nodes() : want_medusa ? a.max_nodes : 1));
  eo.batch_invariant = !a.cuda_gemm_fast;
  medusa_llama::cuda_engine eng(lm.weights, eo);
  const nlohmann::json device = {{"device", "cuda"}, {"name", eng.device_name()}, {"precision", medusa_llama::to_string(a.precision)},
                                 {"gemm", a.cuda_gemm_fast ? "fast" : "invariant"}};
  if (!a.json)
    std::fprintf(stderr, "device: %s, %s weights, %s GEMMs\n", eng.device_name().c_str(), medusa_llama::to_string(a.precision),
                 a.cuda_gemm_fast ? "fast" : "batch-invariant");
  std::optional<medusa::head_stack<>> stack;
  if (want_medusa)
    stack.emplace(head_w.kind() == medusa::projection_kind::per_head
                      ? head_w.view()
                      : head_w.view(medusa::weight_ptr::of(lm.weights.classifier()), static_cast<std::size_t>(cfg.vocab_size)));
  nlohmann::json tree_info;
  if (want_medusa && !tree) {
    // --tree auto: the best tree for the heads' calibration under this GPU's step-cost curve
    // (measured now, or --step-cost), or a small chain for heads without a calibration.
    const int heads = std::min(static_cast<int>(head_w.num_heads()), 5);  // the device step takes 5 heads at most
    if (ain.calibration) {
      std::vector<int> rows;
      for (int n : {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256})
        if (n == 1 || n <= std::max(2, B * a.max_nodes)) rows.push_back(n);
      int mean_prompt = 0;
      for (const auto& p : prompts) mean_prompt += static_cast<int>(p.size());
      mean_prompt /= static_cast<int>(prompts.size());
      const auto t0 = std::chrono::steady_clock::now();
      const medusa::step_cost_curve curve =
          ain.given_cost ? *ain.given_cost
                         : eng.measure_step_cost({.rows = rows, .context = mean_prompt + a.max_new_tokens / 2, .repeats = 10}, &*stack);
      const double measured = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (!a.step_cost_out.empty()) {
        std::ofstream out(a.step_cost_out, std::ios::binary);
        out << medusa::step_cost_json(curve);
        if (!out) throw medusa::io_error("--step-cost-out " + a.step_cost_out + ": cannot write");
      }
      const auto plan = medusa::optimize_tree(*ain.calibration, medusa_tools::per_request_curve(curve, B, a.max_nodes),
                                              {.max_nodes = a.max_nodes, .max_depth = heads});
      medusa::tree_options topt;
      topt.topk = std::max(medusa::default_topk, ain.calibration->topk());
      tree = medusa::tree::from_paths(plan.paths, topt);
      tree_info = describe(*tree, "auto");
      tree_info["expected_tokens_per_step"] = plan.expected_tokens;
      tree_info["relative_step_cost"] = plan.relative_cost;
      tree_info["predicted_speedup"] = plan.predicted_speedup;
      tree_info["step_cost"] = {{"source", ain.given_cost ? "file" : "measured on the device"},
                                {"file", a.step_cost_file}, {"measure_seconds", ain.given_cost ? 0.0 : measured}};
      if (!a.json)
        std::fprintf(stderr, "tree auto: %d nodes: %.2f tokens/step expected, a step costs %.2fx a plain one, predicted speedup %.2fx\n",
                     tree->num_nodes(), plan.expected_tokens, plan.relative_cost, plan.predicted_speedup);
    } else {
      tree = medusa::tree::from_paths(medusa_tools::chain_paths(std::min(heads, 3)));
      tree_info = describe(*tree, "auto");
      tree_info["reason"] = ain.random_heads ? "random heads: a small chain" : "no calibration.json beside the heads: a small chain";
    }
  } else if (want_medusa) {
    tree_info = describe(*tree, a.tree);
  }
  const int eos = lm.tok->eos_id(), bos = lm.tok->bos_id();
  auto stop_of = [](medusa_llama::cuda_stop s) {
    switch (s) {
      case medusa_llama::cuda_stop::eos: return medusa::stop_reason::eos;
      case medusa_llama::cuda_stop::stop_token: return medusa::stop_reason::callback;
      case medusa_llama::cuda_stop::context: return medusa::stop_reason::context_full;
      case medusa_llama::cuda_stop::failed: return medusa::stop_reason::failed;
      default: return medusa::stop_reason::max_tokens;
    }
  };
  std::vector<batch_report> reports;
  std::vector<long long> histogram;
  auto one = [&](const std::string& mode, medusa_llama::cuda_decoder& dec) {
    batch_report rep;
    rep.mode = mode;
    for (std::size_t first = 0; first < prompts.size(); first += static_cast<std::size_t>(B)) {
      const std::size_t n = std::min(prompts.size() - first, static_cast<std::size_t>(B));
      // A generated BOS starts a new document: stop there (emitted), as llama2.c's run.c does.
      const auto results = dec.generate(std::span(prompts).subspan(first, n), a.max_new_tokens, eos, bos);
      const medusa_llama::cuda_decode_stats& st = dec.stats();
      rep.seconds += st.prefill_seconds + st.decode_seconds;
      rep.steps += st.steps;
      if (mode == "medusa") {
        histogram.resize(std::max(histogram.size(), st.accepted.size()), 0);
        for (std::size_t i = 0; i < st.accepted.size(); ++i) histogram[i] += st.accepted[i];
      }
      for (std::size_t i = 0; i < n; ++i) {
        const auto& r = results[i];
        if (r.stop == medusa_llama::cuda_stop::failed) throw medusa::decode_error(r.error);
        medusa::decode_result d;
        d.tokens = r.tokens;
        d.reason = stop_of(r.stop);
        d.stats.prompt_tokens = static_cast<int>(prompts[first + i].size());
        d.stats.new_tokens = static_cast<int>(r.tokens.size());
        d.stats.steps = r.steps;
        d.stats.seconds.total = st.prefill_seconds + st.decode_seconds;
        text_sink sink(*lm.tok, prompts[first + i].back(), false);
        for (std::int32_t t : r.tokens) sink(t);
        rep.texts.push_back(sink.text());
        rep.results.push_back(std::move(d));
      }
    }
    reports.push_back(std::move(rep));
  };
  if (a.mode != run_mode::medusa) {
    medusa_llama::cuda_decoder plain(eng);
    one("vanilla", plain);
  }
  if (want_medusa) {
    medusa_llama::cuda_decoder med(eng, *stack, *tree);
    one("medusa", med);
  }
  nlohmann::json summary = {{"batch", B}, {"requests", prompts.size()}, {"max_new_tokens", a.max_new_tokens}, {"device", device}};
  if (want_medusa) {
    summary["tree"] = tree_info;
    summary["medusa"]["accepted_histogram"] = histogram;
  }
  return report_batch(a, reports, prompts.size(), B, summary, true, predicted_note(tree_info));
}

int run(run_args a) {
  if (a.max_new_tokens < 0) throw usage_error("--max-new-tokens must be >= 0");
  const int prompt_sources = !a.prompt.empty() + !a.prompt_file.empty() + !a.prompts_file.empty();
  if (prompt_sources > 1) throw usage_error("give one of --prompt, --prompt-file and --prompts-file");
  const bool batched = !a.prompts_file.empty();
  if (!batched && a.batch) throw usage_error("--batch needs --prompts-file");
  if (!a.batch) a.batch = 1;
  if (*a.batch < 1 || *a.batch > 256) throw usage_error("--batch must be in [1, 256], got " + std::to_string(*a.batch));
  const bool want_medusa = a.mode != run_mode::vanilla;
  if (a.lookup < 0 || a.lookup > 64) throw usage_error("--lookup must be in [0, 64], got " + std::to_string(a.lookup));
  if (a.lookup_min < 1 || a.lookup_max < a.lookup_min)
    throw usage_error("--lookup-ngram: need 1 <= MIN <= MAX, got " + std::to_string(a.lookup_min) + ":" + std::to_string(a.lookup_max));
  if (!a.calibrate_out.empty() && (a.heads.empty() || a.policy != medusa::greedy_policy::name))
    throw usage_error("--calibrate-out needs --heads and --policy greedy (it counts the heads against greedy outputs)");
  if ((a.lookup > 0 || a.dynamic) && a.policy == medusa::draft_sampling_policy::name)
    throw usage_error("--policy sampled draws its own drafts: it takes no --lookup or --dynamic");
  if (a.device != "cpu" && a.device != "cuda") throw usage_error("--device must be cpu or cuda, got " + a.device);
  const bool cuda = a.device == "cuda";
  if (cuda) {
    if (a.policy != medusa::greedy_policy::name)
      throw usage_error("--device cuda decodes greedily on the device: --policy " + a.policy + " runs on the CPU (--device cpu)");
    if (a.lookup > 0 || a.dynamic) throw usage_error("--device cuda: --lookup and --dynamic drafts run on the CPU (--device cpu)");
    if (!a.calibrate_out.empty()) throw usage_error("--device cuda: --calibrate-out runs on the CPU (--device cpu)");
    if (a.weights || a.classifier_weights)
      throw usage_error("--device cuda: the GPU engine's precision is --precision f32|f16|bf16, not --weights");
    // One line and status 1 when there is nothing to run on, before the model loads.
    if (medusa_llama::cuda_device_count() == 0) {
      std::fprintf(stderr, "medusa-run: no CUDA device%s\n",
                   medusa_llama::cuda_engine_compiled() ? "" : " (this build has no CUDA support)");
      return medusa_tools::exit_failure;
    }
  }
  medusa::policy_options popt;
  popt.temperature = a.temperature;
  popt.top_p = a.top_p;
  // An unknown policy name is reported before the slow parts start.
  medusa::dispatch_policy(a.policy, popt, [](const auto&) {}, run_policies{});

  // Everything that can be checked is checked before the slow parts start.
  const bool auto_tree = want_medusa && a.tree == "auto";
  std::optional<medusa::tree> tree;
  auto_inputs ain;
  if (auto_tree) ain = prepare_auto(a);
  else if (want_medusa) tree = load_tree(a.tree);
  std::vector<std::string> prompt_texts;
  if (batched) {
    std::error_code ec;
    if (!std::filesystem::is_regular_file(a.prompts_file, ec)) throw usage_error("--prompts-file " + a.prompts_file + ": cannot open");
    prompt_texts = medusa_train::prompt_set::from_file(a.prompts_file, 0.0).lines(medusa_train::split::train);
  } else {
    prompt_texts.push_back(a.prompt_file.empty() ? a.prompt : read_text_file(a.prompt_file));
  }

  medusa_llama::loaded_model lm = medusa_llama::load(a.model, a.tokenizer);
  const auto& cfg = lm.weights.config();
  std::vector<std::vector<std::int32_t>> prompts;
  for (std::size_t i = 0; i < prompt_texts.size(); ++i)
    prompts.push_back(encode_prompt(*lm.tok, prompt_texts[i], cfg.seq_len,
                                    batched ? "prompt #" + std::to_string(i + 1) + " " : std::string("prompt ")));
  medusa::head_weights head_w;
  if (want_medusa || !a.calibrate_out.empty()) head_w = load_head_weights(a, lm.weights, auto_tree || !tree ? 1 : tree->depth());

  if (cuda) {
    try {
      return run_cuda(a, lm, prompts, tree, ain, head_w);
    } catch (const medusa_llama::engine_error& e) {
      // A device that is missing or fails is not invalid input: status 1.
      if (e.code() != medusa_llama::engine_errc::no_device && e.code() != medusa_llama::engine_errc::device_failure) throw;
      std::fprintf(stderr, "medusa-run: %s\n", e.what());
      return medusa_tools::exit_failure;
    }
  }
  if (batched) {
    int rc = 0;
    medusa::dispatch_policy(a.policy, popt, [&](auto policy) { rc = run_batch(a, lm, prompts, tree, ain, head_w, policy); },
                            run_policies{});
    return rc;
  }
  const std::vector<std::int32_t>& prompt = prompts[0];

  medusa_llama::engine_options eo;
  eo.threads = a.threads;
  eo.max_batch = std::max(64, (auto_tree ? a.max_nodes : want_medusa ? tree->num_nodes() : 1) + a.lookup);
  eo.backend = medusa_llama::gemm_backend::builtin;
  set_weight_formats(eo, a, lm.weights);
  medusa_llama::engine model(std::move(lm.weights), eo);
  tree_choice choice;
  if (auto_tree) {
    choice = choose_auto_tree(a, ain, model, head_w, 1, eo.max_batch, static_cast<int>(prompt.size()) + a.max_new_tokens / 2);
    tree = choice.tree;
  } else if (want_medusa) {
    choice = {tree, describe(*tree, a.tree)};
  }
  std::optional<medusa_llama::packed_heads> heads;
  std::optional<medusa::step_drafter> drafter;
  if (want_medusa) {
    heads.emplace(pack_heads(model, head_w, a, tree->depth()));
    drafter = make_drafter(a, *tree, tree->depth());
    choice.info["drafts"] = describe_drafts(a);
  }

  medusa::decode_options dopt;
  dopt.max_new_tokens = a.max_new_tokens;
  dopt.eos_token = lm.tok->eos_id();
  dopt.seed = a.seed;
  const int bos = lm.tok->bos_id();
  const bool stream = !a.json;

  auto run_policy = [&](auto policy) {
    std::vector<run_report> reports;
    auto one = [&](const std::string& mode) {
      if (stream && a.mode == run_mode::both) std::printf("--- %s ---\n", mode.c_str());
      text_sink sink(*lm.tok, prompt.back(), stream);
      // A generated BOS starts a new document: stop there, as llama2.c's run.c does.
      auto on_token = [&](std::int32_t t) {
        sink(t);
        return t != bos;
      };
      run_report r;
      r.mode = mode;
      if (mode == "vanilla") {
        r.result = medusa::generate_vanilla(model, prompt, policy, dopt, on_token);
      } else {
        // A preset runs on its compile-time tree, any other tree on the run-time one.
        r.result = with_tree_source<decltype(policy)>(drafter, *tree, [&](const auto& t) {
          medusa::decoder dec(model, *heads, t, policy);
          return dec.generate(prompt, dopt, on_token);
        });
        r.tree = choice.info;
      }
      r.text = sink.text();
      if (stream) {
        std::printf("\n");
        std::fflush(stdout);  // the summary goes to stderr after this
      }
      if (a.json) {
        auto j = to_json(r);
        j["weights"] = weights_json(model.options());
        j["peak_rss_bytes"] = peak_rss_bytes();
        j["cpu_target"] = medusa_llama::cpu_target();
        std::printf("%s\n", json_line(j).c_str());
      }
      reports.push_back(std::move(r));
    };
    if (a.mode != run_mode::medusa) one("vanilla");
    if (a.mode != run_mode::vanilla) one("medusa");
    if (!a.calibrate_out.empty())
      write_calibration(a, model, head_w, std::vector<std::vector<std::int32_t>>{prompt}, std::vector<medusa::decode_result>{reports[0].result});
    if (stream) {
      for (const auto& r : reports) {
        const auto& s = r.result.stats;
        std::fprintf(stderr, "%-7s %4d tokens in %6.3f s: %7.1f tokens/s, %5.2f tokens/step (%s)\n", r.mode.c_str(),
                     s.new_tokens, s.seconds.total, s.tokens_per_second(), s.mean_accepted(),
                     std::string(medusa::to_string(r.result.reason)).c_str());
      }
      std::fprintf(stderr, "cpu kernels: %s, %d threads\n", medusa_llama::cpu_target().c_str(), model.threads());
      if (reports.size() == 2) {
        const bool same = reports[0].result.tokens == reports[1].result.tokens;
        const double speedup =
            speedup_of(reports[0].result.stats.tokens_per_second(), reports[1].result.stats.tokens_per_second());
        std::fprintf(stderr, "tokens identical: %s%s\nspeedup (medusa / vanilla tokens per second): %.2fx%s\n",
                     same ? "yes" : "no",
                     std::is_same_v<decltype(policy), medusa::greedy_policy>
                         ? ""
                         : " (only greedy decoding is expected to match token for token)",
                     speedup,
                     std::is_same_v<decltype(policy), medusa::greedy_policy> ? predicted_note(choice.info).c_str() : "");
      }
    }
  };

  medusa::dispatch_policy(a.policy, popt, run_policy, run_policies{});
  return medusa_tools::exit_ok;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Generate text with a Llama model on the CPU or a CUDA GPU, plainly and with Medusa heads", "medusa-run"};
  run_args a;
  app.add_option("--model", a.model, "llama2.c .bin file, GGUF file or Hugging Face model directory")->required();
  app.add_option("--tokenizer", a.tokenizer, "tokenizer (default: tokenizer.bin beside a .bin model, tokenizer.json in a directory, a GGUF file's own)");
  app.add_option("--heads", a.heads, "heads file or directory (medusa-train output), or random:K[:SEED]");
  app.add_option("--tree", a.tree,
                 "auto (the best tree for the heads' calibration.json and this machine), a preset name, tree text "
                 "([[0],[0,0],...]) or a file")
      ->capture_default_str();
  app.add_option("--max-nodes", a.max_nodes, "--tree auto: the largest tree considered (root included)")->capture_default_str();
  app.add_option("--lookup", a.lookup,
                 "hybrid drafts: a lookup branch of up to N tokens copied from where the request's last n-gram "
                 "occurred before (0 = off)")
      ->capture_default_str();
  app.add_option_function<std::string>(
         "--lookup-ngram",
         [&a](const std::string& v) {
           char extra = 0;
           if (std::sscanf(v.c_str(), "%d:%d%c", &a.lookup_min, &a.lookup_max, &extra) != 2)
             throw usage_error("--lookup-ngram " + v + ": expected MIN:MAX");
         },
         "n-gram sizes the lookup matches, longest first (default 2:4)");
  app.add_option("--calibrate-out", a.calibrate_out,
                 "write the heads' path-conditional calibration over the prompts and their greedy outputs to this file "
                 "(for --calibration and medusa-tree optimize)");
  app.add_flag("--dynamic", a.dynamic, "per-step dynamic trees: each step's most probable paths under the heads, as many nodes as the tree");
  app.add_option("--calibration", a.calibration, "--tree auto: the heads' calibration (default: calibration.json beside them)");
  app.add_option("--step-cost", a.step_cost_file, "--tree auto: use this step-cost curve instead of measuring one");
  app.add_option("--step-cost-out", a.step_cost_out, "--tree auto: also write the step-cost curve used to this file");
  app.add_option("--cost-cache", a.cost_cache,
                 "--tree auto: cache directory of measured step costs (default $MEDUSA_CACHE_DIR, $XDG_CACHE_HOME/medusa or "
                 "~/.cache/medusa; none = no cache)");
  app.add_option("--policy", a.policy,
                 "greedy | typical | rejection | sampled (lossless sampling with drafts drawn from the heads' softmax)")
      ->capture_default_str();
  app.add_option("--temperature", a.temperature, "temperature (default: typical 0.7, rejection and sampled 1.0)");
  app.add_option("--top-p", a.top_p, "nucleus mass for --policy rejection and sampled (1 = off)")->capture_default_str();
  app.add_option("--seed", a.seed, "random seed of the sampling policies")->capture_default_str();
  app.add_option("--prompt", a.prompt, "prompt text (\"\" = start from BOS alone)");
  app.add_option("--prompt-file", a.prompt_file, "read the prompt from a file");
  app.add_option("--prompts-file", a.prompts_file,
                 "many prompts, one per line (\\n, \\t, \\\\ escapes; blank lines skipped), decoded --batch at a time");
  app.add_option("--batch", a.batch, "requests decoded together with --prompts-file (continuous batching; default 1)");
  app.add_option("--max-new-tokens", a.max_new_tokens, "tokens to generate")->capture_default_str();
  const std::map<std::string, run_mode> modes{
      {"vanilla", run_mode::vanilla}, {"medusa", run_mode::medusa}, {"both", run_mode::both}};
  app.add_option("--mode", a.mode, "vanilla | medusa | both")
      ->transform(CLI::CheckedTransformer(modes, CLI::ignore_case))
      ->default_str("medusa");
  app.add_option("--threads", a.threads, "threads (0 = all cores)")->capture_default_str();
  using medusa_llama::weight_format;
  const std::map<std::string, weight_format> engine_formats{{"f32", weight_format::f32},   {"bf16", weight_format::bf16},
                                                           {"int8", weight_format::q8_0}, {"q8_0", weight_format::q8_0},
                                                           {"q4", weight_format::q4_0},   {"q4_0", weight_format::q4_0}};
  std::map<std::string, weight_format> head_formats = engine_formats;
  head_formats["int8"] = weight_format::int8;
  app.add_option("--weights", a.weights,
                 "engine weight format: f32 | bf16 (half the bytes, f32 arithmetic) | int8 (= q8_0: blocks of 32 with one "
                 "scale) | q4 (= q4_0); default: the model file's own (GGUF Q8_0/Q4_0/BF16 as such, else f32)")
      ->transform(CLI::CheckedTransformer(engine_formats))
      ->default_str("auto");
  app.add_option("--classifier-weights", a.classifier_weights,
                 "classifier weight format (same names); default: --weights, q8_0 under q4, the file's own without --weights")
      ->transform(CLI::CheckedTransformer(engine_formats));
  app.add_option("--head-weights", a.head_weights,
                 "Medusa head weight format: int8 (per column) | q8_0 | q4 | bf16 | f32 (drafts only: the output does not "
                 "depend on it)")
      ->transform(CLI::CheckedTransformer(head_formats))
      ->default_str("int8");
  app.add_flag("--json", a.json, "print one JSON line per run instead of streaming text");
  app.add_option("--device", a.device,
                 "cpu, or cuda: the GPU engine, greedy decoding with each step one CUDA graph (prompts --batch at a time)")
      ->capture_default_str();
  const std::map<std::string, medusa_llama::cuda_precision> precisions{{"f32", medusa_llama::cuda_precision::f32},
                                                                       {"f16", medusa_llama::cuda_precision::f16},
                                                                       {"bf16", medusa_llama::cuda_precision::bf16}};
  app.add_option("--precision", a.precision, "--device cuda: weights, GEMM inputs and KV cache in f32 | f16 | bf16")
      ->transform(CLI::CheckedTransformer(precisions))
      ->default_str("bf16");
  app.add_option_function<std::string>(
         "--cuda-gemm",
         [&a](const std::string& v) {
           if (v != "invariant" && v != "fast") throw usage_error("--cuda-gemm must be invariant or fast, got " + v);
           a.cuda_gemm_fast = v == "fast";
         },
         "--device cuda: invariant (one cuBLASLt algorithm per shape: Medusa reproduces plain decoding bit for bit; "
         "default) or fast (cuBLASLt's choice per pass size)");
  return medusa_tools::run_tool(app, argc, argv, [&] { return run(a); });
}
