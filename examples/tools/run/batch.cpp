// SPDX-License-Identifier: Apache-2.0
// --prompts-file on the CPU batch engine: every prompt, --batch at a time.
#include "run/modes.hpp"
#include "run/report.hpp"

#include <medusa_llama/batch_engine.hpp>
#include <medusa_llama/eagle_engine.hpp>

#include <medusa/draft_sampler.hpp>

#include <chrono>
#include <deque>
#include <exception>
#include <type_traits>

namespace medusa_run {
namespace {

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
  const int branch_tokens = a.draft_rows();
  eo.max_tokens =
      std::max(256, *a.batch * ((auto_tree ? a.max_nodes : given_tree ? given_tree->num_nodes() : 1) + branch_tokens));
  set_weight_formats(eo, a, lm.weights);
  // The draft model (--draft-model, --self-draft-layers): a serving engine of its own with the
  // same request ids, a cache per request; passes as large as a prompt, which it runs in its
  // first call. It runs on the target's threads unless --draft-threads gives it its own (a pool
  // of several would spin on the cores the target's next pass needs; one runs in the calling thread).
  std::optional<medusa_llama::model> draft_weights;
  if (a.mode != run_mode::vanilla && a.drafted()) draft_weights = load_draft(a, lm);
  const int seq_len = lm.weights.config().seq_len;
  medusa_llama::batch_engine eng(std::move(lm.weights), eo);
  std::optional<medusa_llama::batch_engine> draft_engine;
  if (draft_weights) {
    medusa_llama::batch_engine_options deo = eo;
    deo.max_tokens = std::max(eo.max_tokens, seq_len);
    deo.pool = draft_pool(a, eng.pool());
    deo.threads = a.draft_threads;
    set_draft_weight_formats(deo, a, *draft_weights);
    draft_engine.emplace(std::move(*draft_weights), deo);
  }
  // The feature drafter (--eagle): on the target's threads, one cache per request id.
  std::optional<medusa_llama::eagle_engine> eagle_engine;
  if (a.mode != run_mode::vanilla && !a.eagle.empty())
    eagle_engine.emplace(medusa_llama::eagle_engine::load(
        a.eagle, eng.config(), {.threads = a.draft_threads, .pool = draft_pool(a, eng.pool()),
         .weights = a.draft_weights.value_or(eagle_default_weights), .max_rows = std::max(64, a.draft_pass_rows())}));
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
  nlohmann::json draft_cost;  // the draft model's work, when there is one
  if (a.mode != run_mode::medusa) {
    medusa::no_heads none;
    medusa::batch_decoder dec(eng, none, medusa::plain_tree{}, policy, *a.batch);
    reports.push_back(serve_all(dec, eng, prompts, dopt, bos, "vanilla"));
  }
  if (a.mode != run_mode::vanilla) {
    auto heads = pack_heads(eng, head_w, a, tree->depth());
    if constexpr (std::is_same_v<Policy, medusa::speculative_policy>) {
      // Each request's chains (or trees) sampled from the drafter's distribution, verified against it.
      const medusa::draft_sampler_options so{.max_tokens = a.draft_tokens, .warp = policy};
      auto sampled = [&](const auto& sampler) {
        medusa::batch_decoder dec(eng, heads, sampler, policy, *a.batch);
        reports.push_back(serve_all(dec, eng, prompts, dopt, bos, "medusa"));
        draft_cost = draft_work(sampler);
      };
      if (a.draft_nodes > 0) {  // trees of sampled tokens; the branch keeps the counts
        std::optional<medusa::draft_model_branch<medusa_llama::batch_engine>> draft;
        std::optional<medusa::feature_draft_branch<medusa_llama::eagle_engine>> eagle;
        if (draft_engine) draft.emplace(*draft_engine, eng.vocab_size(), medusa::draft_model_options{.max_tokens = a.draft_tokens});
        else eagle.emplace(*eagle_engine, eng.vocab_size(), eng.hidden_size(), medusa::feature_draft_options{.max_tokens = a.draft_tokens});
        medusa::batch_decoder dec(eng, heads, make_tree_sampler(a, draft ? draft_source::of(*draft) : draft_source::of(*eagle), policy),
                                  policy, *a.batch);
        reports.push_back(serve_all(dec, eng, prompts, dopt, bos, "medusa"));
        draft_cost = draft ? draft_work(*draft) : draft_work(*eagle);
      } else if (eagle_engine)
        sampled(medusa::feature_draft_sampler<medusa_llama::eagle_engine>(*eagle_engine, eng.vocab_size(), eng.hidden_size(), so));
      else sampled(medusa::draft_model_sampler<medusa_llama::batch_engine>(*draft_engine, eng.vocab_size(), so));
    } else {
      std::optional<medusa::draft_model_branch<medusa_llama::batch_engine>> draft;
      std::optional<medusa::feature_draft_branch<medusa_llama::eagle_engine>> eagle;
      if (draft_engine) draft.emplace(*draft_engine, eng.vocab_size(), medusa::draft_model_options{.max_tokens = a.draft_tokens});
      if (eagle_engine)
        eagle.emplace(*eagle_engine, eng.vocab_size(), eng.hidden_size(), medusa::feature_draft_options{.max_tokens = a.draft_tokens});
      const auto drafter =
          make_drafter(a, *tree, tree->depth(), draft ? draft_source::of(*draft) : eagle ? draft_source::of(*eagle) : draft_source{});
      reports.push_back(with_tree_source<Policy>(drafter, *tree, [&](const auto& t) {
        medusa::batch_decoder dec(eng, heads, t, policy, *a.batch);
        return serve_all(dec, eng, prompts, dopt, bos, "medusa");
      }));
      if (draft) draft_cost = draft_work(*draft);
      if (eagle) draft_cost = draft_work(*eagle);
    }
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
    if (!draft_cost.is_null()) summary["tree"]["drafts"].update(draft_cost);
  }
  return report_batch(a, reports, prompts.size(), *a.batch, summary, greedy, greedy ? predicted_note(choice.info) : "");
}

}  // namespace

int run_batched(const run_args& a, medusa_llama::loaded_model& lm, const std::vector<std::vector<std::int32_t>>& prompts,
                const std::optional<medusa::tree>& tree, const auto_inputs& ain, const medusa::head_weights& head_w,
                const medusa::policy_options& popt) {
  int rc = 0;
  medusa::dispatch_policy(a.policy, popt, [&](auto policy) { rc = run_batch(a, lm, prompts, tree, ain, head_w, policy); },
                          run_policies{});
  return rc;
}

}  // namespace medusa_run
