// SPDX-License-Identifier: Apache-2.0
// One prompt on the CPU engine, plainly and/or with Medusa.
#include "run/modes.hpp"
#include "run/draft_tokens.hpp"
#include "run/report.hpp"

#include <medusa_llama/eagle_engine.hpp>
#include <medusa_llama/engine.hpp>

#include <medusa/draft_model.hpp>
#include <medusa/draft_sampler.hpp>

#include <type_traits>

namespace medusa_run {

int run_single(const run_args& a, medusa_llama::loaded_model& lm, const std::vector<std::int32_t>& prompt,
               std::optional<medusa::tree> tree, const auto_inputs& ain, const medusa::head_weights& head_w,
               const medusa::policy_options& popt) {
  const bool auto_tree = a.mode != run_mode::vanilla && a.tree == "auto";
  const bool want_medusa = a.mode != run_mode::vanilla;

  medusa_llama::engine_options eo;
  eo.threads = a.threads;
  const bool drafted = want_medusa && a.drafted();
  eo.max_batch = std::max(64, (auto_tree ? a.max_nodes : want_medusa ? tree->num_nodes() : 1) +
                                  a.draft_rows());
  eo.backend = medusa_llama::gemm_backend::builtin;
  set_weight_formats(eo, a, lm.weights);
  // The draft model (--draft-model, --self-draft-layers): its own engine and cache; passes as
  // large as a prompt, which it runs in its first call. It runs on the target's threads unless
  // --draft-threads gives it its own (a pool of several would spin on the cores the target's next
  // pass needs; one runs in the calling thread).
  std::optional<medusa_llama::model> draft_weights;
  if (drafted) draft_weights = load_draft(a, lm);
  const int seq_len = lm.weights.config().seq_len;
  medusa_llama::engine model(std::move(lm.weights), eo);
  std::optional<medusa_llama::engine> draft_engine;
  if (draft_weights) {
    medusa_llama::engine_options deo = eo;
    deo.max_batch = std::max(eo.max_batch, seq_len);
    deo.pool = draft_pool(a, model.pool());
    deo.threads = a.draft_threads;
    set_draft_weight_formats(deo, a, *draft_weights);
    draft_engine.emplace(std::move(*draft_weights), deo);
  }
  // The feature drafter (--eagle): on the target's threads, one cache per request.
  std::optional<medusa_llama::eagle_engine> eagle_engine;
  if (want_medusa && !a.eagle.empty())
    eagle_engine.emplace(medusa_llama::eagle_engine::load(
        a.eagle, model.config(), {.threads = a.draft_threads, .pool = draft_pool(a, model.pool()),
         .weights = a.draft_weights.value_or(eagle_default_weights), .max_rows = std::max(64, a.draft_pass_rows())}));
  tree_choice choice;
  if (auto_tree) {
    choice = choose_auto_tree(a, ain, model, head_w, 1, eo.max_batch, static_cast<int>(prompt.size()) + a.max_new_tokens / 2);
    tree = choice.tree;
  } else if (want_medusa) {
    choice = {tree, describe(*tree, a.tree)};
  }
  std::optional<medusa_llama::packed_heads> heads;
  std::optional<run_drafter> drafter;
  std::optional<medusa::draft_model_branch<medusa_llama::engine>> draft;
  std::optional<medusa::feature_draft_branch<medusa_llama::eagle_engine>> eagle;
  int draft_tokens = a.draft_tokens;
  if (want_medusa) {
    heads.emplace(pack_heads(model, head_w, a, tree->depth()));
    nlohmann::json draft_auto;
    if (a.draft_tokens_auto) {
      const int context = std::min(static_cast<int>(prompt.size()) + a.max_new_tokens / 2, seq_len / 2);
      const auto c = eagle_engine
                         ? choose_draft_tokens_for(a.draft_chain, model, measure_feature_pass(*eagle_engine, context), context)
                         : choose_draft_tokens(a.draft_chain, model, *draft_engine, context);
      draft_tokens = c.tokens;
      draft_auto = c.info;
    }
    if (draft_engine) draft.emplace(*draft_engine, model.vocab_size(), medusa::draft_model_options{.max_tokens = draft_tokens});
    if (eagle_engine)
      eagle.emplace(*eagle_engine, model.vocab_size(), model.hidden_size(), medusa::feature_draft_options{.max_tokens = draft_tokens});
    drafter = make_drafter(a, *tree, tree->depth(), draft ? draft_source::of(*draft) : eagle ? draft_source::of(*eagle) : draft_source{});
    choice.info["drafts"] = describe_drafts(a);
    if (!draft_auto.is_null()) {
      choice.info["drafts"]["draft_tokens"] = draft_tokens;
      choice.info["drafts"]["draft_tokens_auto"] = draft_auto;
    }
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
      } else if constexpr (std::is_same_v<decltype(policy), medusa::speculative_policy>) {
        // Chains sampled from the drafter's own distribution, verified against it.
        const medusa::draft_sampler_options so{.max_tokens = draft_tokens, .warp = policy};
        auto sampled = [&](const auto& sampler) {
          medusa::decoder dec(model, *heads, sampler, policy);
          r.result = dec.generate(prompt, dopt, on_token);
          const double run = r.result.stats.seconds.total;
          if constexpr (requires { sampler.passes(); }) choice.info["drafts"].update(draft_work(sampler, run));
          else choice.info["drafts"].update(draft ? draft_work(*draft, run) : draft_work(*eagle, run));  // trees: the branch's counts
        };
        if (a.draft_nodes > 0)  // trees of sampled tokens
          sampled(make_tree_sampler(a, draft ? draft_source::of(*draft) : draft_source::of(*eagle), policy));
        else if (eagle_engine)
          sampled(medusa::feature_draft_sampler<medusa_llama::eagle_engine>(*eagle_engine, model.vocab_size(), model.hidden_size(), so));
        else sampled(medusa::draft_model_sampler<medusa_llama::engine>(*draft_engine, model.vocab_size(), so));
        if (draft) draft->release(0);
        if (eagle) eagle->release(0);
        choice.info["drafts"]["sampled"] = true;
        r.tree = choice.info;
      } else {
        // A preset runs on its compile-time tree, any other tree on the run-time one.
        r.result = with_tree_source<decltype(policy)>(drafter, *tree, [&](const auto& t) {
          medusa::decoder dec(model, *heads, t, policy);
          return dec.generate(prompt, dopt, on_token);
        });
        if (draft) {  // the draft's work over the request
          choice.info["drafts"].update(draft_work(*draft, r.result.stats.seconds.total));
          draft->release(0);
        }
        if (eagle) {
          choice.info["drafts"].update(draft_work(*eagle, r.result.stats.seconds.total));
          eagle->release(0);
        }
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

}  // namespace medusa_run
