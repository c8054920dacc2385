// SPDX-License-Identifier: Apache-2.0
// medusa-run: generate text with a Llama model on the CPU or a CUDA GPU, plainly and with Medusa
// heads, and compare the two.
//
//   medusa-run --model PATH [--tokenizer PATH] [--heads PATH|random:K[:SEED]]
//              [--tree auto|PRESET|TEXT|FILE] [--max-nodes N] [--calibration F] [--step-cost F] [--step-cost-out F]
//              [--cost-cache DIR|none] [--calibrate-out F] [--lookup N] [--lookup-ngram MIN:MAX] [--dynamic]
//              [--draft-model F | --self-draft-layers K | --exit DIR | --eagle DIR] [--draft-tokens N|auto] [--draft-alone]
//              [--draft-nodes N [--draft-topk K] [--draft-expand E] [--draft-min-prob P]]
//              [--policy greedy|typical|rejection|sampled] [--temperature T]
//              [--top-p P] [--seed S] [--prompt TEXT | --prompt-file F] [--max-new-tokens N]
//              [--mode vanilla|medusa|both] [--weights f32|bf16|int8|q4] [--classifier-weights F] [--draft-weights F] [--draft-threads N] [--head-weights int8|q8_0|q4|bf16|f32]
//              [--threads N] [--json]
//   medusa-run ... --prompts-file F [--batch N]     many prompts, N at a time (continuous batching)
//   medusa-run ... --device cuda [--precision f32|f16|bf16] [--cuda-gemm library|invariant|fast]
//                                                  greedy decoding on the GPU, a whole step per CUDA graph
#include <medusa/dispatch/policy.hpp>
#include <medusa/tree.hpp>

#include <medusa_llama/cuda_engine.hpp>
#include <medusa_llama/load.hpp>
#include <medusa_llama/openblas_env.hpp>
#include <medusa_llama/prompt_file.hpp>

#include "run/draft_tokens.hpp"
#include "run/modes.hpp"
#include "run/options.hpp"
#include "run/setup.hpp"
#include "tool_common.hpp"

#include <cstdio>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace medusa_run {
namespace {

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
  const bool drafted = a.drafted();
  if (!a.draft_model.empty() + (a.self_draft_layers != 0 || !a.exit.empty()) + !a.eagle.empty() > 1)
    throw usage_error("give one of --draft-model, --self-draft-layers (or --exit) and --eagle");
  if (a.self_draft_layers < 0) throw usage_error("--self-draft-layers must be >= 1, got " + std::to_string(a.self_draft_layers));
  if (a.draft_tokens < 1 || a.draft_tokens > 64)
    throw usage_error("--draft-tokens must be in [1, 64], got " + std::to_string(a.draft_tokens));
  if (a.draft_alone && !drafted) throw usage_error("--draft-alone needs --draft-model, --self-draft-layers, --exit or --eagle");
  if (a.draft_tokens_auto && ((a.draft_model.empty() && a.eagle.empty() && a.exit.empty()) || batched))
    throw usage_error("--draft-tokens auto needs --draft-model, --eagle or --exit (with its calibration.json) and one request (not "
                      "--prompts-file)");
  if (a.draft_tokens_auto) {  // the longest chain it may choose sizes the engines
    a.draft_chain = medusa_run::draft_chain_calibration(!a.eagle.empty() ? a.eagle : !a.exit.empty() ? a.exit : a.draft_model);
    a.draft_tokens = static_cast<int>(a.draft_chain.size());
  }
  if (a.draft_alone && a.dynamic) throw usage_error("--draft-alone drafts no heads' tree: it takes no --dynamic");
  if (a.draft_nodes < 0 || a.draft_nodes > 256)
    throw usage_error("--draft-nodes must be in [0, 256], got " + std::to_string(a.draft_nodes));
  if (a.draft_topk < 1 || a.draft_topk > 64) throw usage_error("--draft-topk must be in [1, 64], got " + std::to_string(a.draft_topk));
  if (!(a.draft_min_prob >= 0.0 && a.draft_min_prob < 1.0))
    throw usage_error("--draft-min-prob must be in [0, 1), got " + std::to_string(a.draft_min_prob));
  if (a.draft_expand && (*a.draft_expand < 1 || *a.draft_expand > 64))
    throw usage_error("--draft-expand must be in [1, 64], got " + std::to_string(*a.draft_expand));
  if (a.draft_nodes > 0) {
    if (!drafted || !a.draft_alone)
      throw usage_error("--draft-nodes grows a drafter's own tree: it needs --draft-model, --self-draft-layers or --eagle with "
                        "--draft-alone");
    if (a.draft_tokens_auto) throw usage_error("--draft-tokens auto chooses a chain: give --draft-nodes a number of tokens (its depth)");
  }
  if (a.policy == medusa::speculative_policy::name && want_medusa && (!drafted || !a.draft_alone || (a.lookup > 0 && a.draft_nodes == 0)))
    throw usage_error("--policy speculative samples a drafter's chains (or trees, with --draft-nodes) and verifies them against "
                      "the drafter's own distribution: it needs --draft-model, --self-draft-layers or --eagle with --draft-alone, "
                      "and takes --lookup only with --draft-nodes");
  if (drafted) {
    if (a.policy == medusa::draft_sampling_policy::name)
      throw usage_error("--policy sampled draws its own drafts: it takes no draft model");
    if (a.device != "cpu") throw usage_error("--draft-model, --self-draft-layers and --eagle run on the CPU (--device cpu)");
  }
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
    prompt_texts = medusa_llama::read_prompt_lines(a.prompts_file);
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
  if (batched) return run_batched(a, lm, prompts, tree, ain, head_w, popt);
  return run_single(a, lm, prompts[0], tree, ain, head_w, popt);
}

}  // namespace
}  // namespace medusa_run

using medusa_run::run_args;
using medusa_run::run_mode;
using medusa_run::usage_error;

int main(int argc, char** argv) {
  // AVX-512 sgemm kernels (the prefill's) where OpenBLAS misdetects the CPU.
  medusa_llama::reexec_with_fast_openblas(argv);
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
  app.add_option("--draft-model", a.draft_model,
                 "a draft model (same formats as --model, the target's vocabulary) whose greedy chain of "
                 "--draft-tokens joins each step's tree");
  app.add_option("--eagle", a.eagle,
                 "an EAGLE-style feature drafter (the directory medusa-train --recipe eagle writes: model.bin, fc.bin): "
                 "one layer over the target's own hidden states whose greedy chain of --draft-tokens joins each step's tree")
      ->check(CLI::ExistingDirectory);
  app.add_option("--self-draft-layers", a.self_draft_layers,
                 "self-speculation: the target's first K layers (then its final norm and classifier) as the draft");
  app.add_option("--exit", a.exit,
                 "self-speculation with a trained exit (the directory medusa-train --recipe exit writes: exit.bin): the target's "
                 "first layers, as many as it was trained after, then its final norm, the exit projection and its classifier")
      ->check(CLI::ExistingDirectory);
  app.add_option_function<std::string>(
         "--draft-tokens",
         [&a](const std::string& v) {
           a.draft_tokens_auto = v == "auto";
           if (a.draft_tokens_auto) return;
           char extra = 0;
           if (std::sscanf(v.c_str(), "%d%c", &a.draft_tokens, &extra) != 1)
             throw usage_error("--draft-tokens " + v + ": expected a number or auto");
         },
         "the draft's chain length, or auto: the fastest on this machine from the draft's calibration.json "
         "(medusa-train --recipe draft) and measured step costs (default 4)");
  app.add_option("--draft-nodes", a.draft_nodes,
                 "with --draft-alone: the drafter grows each step's tree best first by its own joint probability, this many "
                 "nodes, --draft-tokens deep (one drafter pass a depth); 0 = a chain (default)");
  app.add_option("--draft-topk", a.draft_topk, "--draft-nodes: children scored under a node (default 4)");
  app.add_option("--draft-min-prob", a.draft_min_prob,
                 "--draft-nodes: leave out nodes whose joint probability under the drafter is below this (default 0)");
  app.add_option("--draft-expand", a.draft_expand, "--draft-nodes: nodes expanded a depth, the most probable (default: --draft-topk)");
  app.add_flag("--draft-alone", a.draft_alone, "the step's tree is the draft's chain (and --lookup) only, without the heads' tree");
  app.add_flag("--dynamic", a.dynamic, "per-step dynamic trees: each step's most probable paths under the heads, as many nodes as the tree");
  app.add_option("--calibration", a.calibration, "--tree auto: the heads' calibration (default: calibration.json beside them)");
  app.add_option("--step-cost", a.step_cost_file, "--tree auto: use this step-cost curve instead of measuring one");
  app.add_option("--step-cost-out", a.step_cost_out, "--tree auto: also write the step-cost curve used to this file");
  app.add_option("--cost-cache", a.cost_cache,
                 "--tree auto: cache directory of measured step costs (default $MEDUSA_CACHE_DIR, $XDG_CACHE_HOME/medusa or "
                 "~/.cache/medusa; none = no cache)");
  app.add_option("--policy", a.policy,
                 "greedy | typical | rejection | speculative (lossless sampling: a draft model's chains sampled from its own "
                 "distribution, with --draft-alone) | sampled (lossless sampling with drafts drawn from the heads' softmax)")
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
  app.add_option("--draft-weights", a.draft_weights,
                 "weight format of a draft model or --eagle drafter (same names); default: the target engine's, q8_0 for "
                 "--eagle (drafts only: the output does not depend on it)")
      ->transform(CLI::CheckedTransformer(engine_formats))
      ->default_str("auto");
  app.add_option("--draft-threads", a.draft_threads,
                 "threads of a draft model or --eagle drafter, on its own (1: in the calling thread); default: 0, the "
                 "target's threads (drafts only: the output does not depend on it)")
      ->check(CLI::Range(0, 1024))
      ->capture_default_str();
  app.add_option("--head-weights", a.head_weights,
                 "Medusa head weight format: int8 (per column) | q8_0 | q4 | bf16 | f32 (drafts only: the output does not "
                 "depend on it)")
      ->transform(CLI::CheckedTransformer(head_formats))
      ->default_str("int8");
  app.add_flag("--json", a.json, "print one JSON line per run instead of streaming text");
  app.add_option("--device", a.device,
                 "cpu, or cuda: the GPU engine, greedy decoding with each step one CUDA graph (prompts --batch at a time)")
      ->capture_default_str();
  app.add_option_function<std::string>(
         "--precision",
         [&a](const std::string& v) {
           if (v == "f32") a.precision = medusa::dtype::f32;
           else if (v == "f16") a.precision = medusa::dtype::f16;
           else if (v == "bf16") a.precision = medusa::dtype::bf16;
           else throw usage_error("--precision must be f32, f16 or bf16, got " + v);
         },
         "--device cuda: weights, GEMM inputs and KV cache in f32 | f16 | bf16")
      ->default_str("bf16");
  app.add_option_function<std::string>(
         "--cuda-gemm",
         [&a](const std::string& v) {
           if (v != "library" && v != "invariant" && v != "fast")
             throw usage_error("--cuda-gemm must be library, invariant or fast, got " + v);
           a.cuda_gemm = v;
         },
         "--device cuda: library (the library's batch-invariant skinny GEMM for f16/bf16, heads and SwiGLU "
         "included; as invariant for f32; default), invariant (one cuBLASLt algorithm per shape) or fast (cuBLASLt's choice per pass "
         "size); invariant and library make Medusa reproduce plain decoding bit for bit");
  return medusa_tools::run_tool(app, argc, argv, [&] { return medusa_run::run(a); });
}
