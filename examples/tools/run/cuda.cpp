// SPDX-License-Identifier: Apache-2.0
#include "run/modes.hpp"
#include "run/report.hpp"

#include <medusa_llama/cuda_engine.hpp>

#include <chrono>
#include <span>

namespace medusa_run {

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
  eo.batch_invariant = a.cuda_gemm != "fast";
  eo.library_gemm = a.cuda_gemm == "library";
  medusa_llama::cuda_engine eng(lm.weights, eo);
  const nlohmann::json device = {{"device", "cuda"}, {"name", eng.device_name()}, {"precision", std::string(medusa::to_string(a.precision))},
                                 {"gemm", a.cuda_gemm}};
  if (!a.json)
    std::fprintf(stderr, "device: %s, %s weights, %s GEMMs\n", eng.device_name().c_str(), medusa::to_string(a.precision).data(),
                 a.cuda_gemm == "fast"                                     ? "cuBLASLt (fast)"
                 : a.cuda_gemm == "invariant" || a.precision == medusa::dtype::f32 ? "cuBLASLt (batch-invariant)"
                                                                                   : "skinny (batch-invariant)");
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
        if (r.stop == medusa::stop_reason::failed) throw medusa::decode_error(r.error);
        medusa::decode_result d;
        d.tokens = r.tokens;
        d.reason = r.stop;
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

}  // namespace medusa_run
