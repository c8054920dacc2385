// SPDX-License-Identifier: Apache-2.0
#include "run/setup.hpp"

namespace medusa_run {

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

nlohmann::json describe(const medusa::tree& t, const std::string& spec) {
  return {{"spec", spec}, {"paths", t.sorted_paths()}, {"nodes", t.num_nodes()}, {"depth", t.depth()}};
}

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

namespace {

// The prompt lookup (--lookup), or nothing.
std::optional<medusa::ngram_lookup> lookup_of(const run_args& a) {
  if (a.lookup == 0) return std::nullopt;
  return medusa::ngram_lookup{.min_ngram = a.lookup_min, .max_ngram = a.lookup_max, .max_tokens = a.lookup};
}

// The shape of a drafter's own trees (--draft-nodes, --draft-tokens as their depth).
medusa::draft_tree_options draft_tree_options_of(const run_args& a) {
  return {.max_nodes = a.draft_nodes, .max_depth = a.draft_tokens, .topk = a.draft_topk, .expand = a.draft_expanded(),
          .min_prob = a.draft_min_prob};
}

}  // namespace

std::optional<run_drafter> make_drafter(const run_args& a, const medusa::tree& t, int heads, draft_source draft) {
  if (a.lookup == 0 && !a.dynamic && !draft.find) return std::nullopt;
  if (a.draft_nodes > 0)  // checked by the caller: a drafter alone
    return run_drafter(medusa::tree_drafter<run_tree_source>(run_tree_source{{std::move(draft)}}, draft_tree_options_of(a), lookup_of(a)));
  medusa::basic_step_drafter_options<run_branch> o;
  if (a.dynamic) o.dynamic_nodes = t.num_nodes();
  else if (!a.draft_alone) o.paths = t.sorted_paths();
  o.topk = t.topk();
  if (a.lookup > 0 || draft.find) {
    run_branch b;
    b.lookup = lookup_of(a);
    b.draft = std::move(draft);
    o.lookup = std::move(b);
  }
  return run_drafter(medusa::basic_step_drafter<run_branch>(std::move(o), heads));
}

medusa::tree_sampler<run_tree_source> make_tree_sampler(const run_args& a, draft_source draft, const medusa::sampling_warp& warp) {
  return medusa::tree_sampler<run_tree_source>(run_tree_source{{std::move(draft)}}, draft_tree_options_of(a), warp, lookup_of(a));
}

std::optional<medusa_llama::model> load_draft(const run_args& a, const medusa_llama::loaded_model& lm) {
  if (!a.exit.empty()) {  // the first layers with a trained exit: as many layers as it was trained for
    const auto e = medusa_llama::load_exit_projection(std::filesystem::path(a.exit) / medusa_llama::exit_projection_file);
    if (a.self_draft_layers > 0 && a.self_draft_layers != e.layers)
      throw usage_error("--exit " + a.exit + " was trained after " + std::to_string(e.layers) + " layers, not the --self-draft-layers " +
                        std::to_string(a.self_draft_layers) + " given");
    return medusa_llama::self_draft(lm.weights, e);
  }
  if (a.self_draft_layers > 0) {
    const int layers = lm.weights.config().n_layers;
    if (a.self_draft_layers >= layers)
      throw usage_error("--self-draft-layers must be below the model's " + std::to_string(layers) + " layers, got " +
                        std::to_string(a.self_draft_layers));
    return lm.weights.first_layers(a.self_draft_layers);
  }
  if (a.draft_model.empty()) return std::nullopt;
  std::optional<medusa_llama::model> weights;
  try {
    weights = medusa_llama::load(a.draft_model, lm.tokenizer_path).weights;
  } catch (const medusa_llama::load_error& e) {
    throw medusa_llama::load_error(e.code(), std::string("the draft model, read with the target's tokenizer: ") + e.what(),
                                   a.draft_model);
  }
  // Where the draft comes with a tokenizer of its own (a GGUF file's, a Hugging Face directory's,
  // a tokenizer.bin beside it), its pieces must be the target's, not only their number.
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path draft(a.draft_model);
  fs::path own;
  if (fs::is_directory(draft, ec)) own = draft / "tokenizer.json";
  else if (medusa_llama::is_gguf(draft)) own = draft;
  else own = draft.parent_path() / "tokenizer.bin";
  if (fs::is_regular_file(own, ec) && fs::weakly_canonical(own, ec) != fs::weakly_canonical(lm.tokenizer_path, ec)) {
    const auto tok = medusa_llama::load_tokenizer(own, medusa_llama::default_dummy_prefix(own));
    const std::string diff = medusa_llama::vocabulary_difference(*tok, *lm.tok, "the draft's tokenizer", "the target's");
    if (!diff.empty())
      throw medusa_llama::load_error(medusa_llama::load_errc::bad_tokenizer,
                                     "the draft model's vocabulary is not the target's (" + own.string() + " against " +
                                         lm.tokenizer_path.string() + "): " + diff,
                                     a.draft_model);
  }
  return weights;
}

nlohmann::json describe_drafts(const run_args& a) {
  nlohmann::json j = {{"dynamic", a.dynamic}, {"lookup_tokens", a.lookup}, {"lookup_ngram", {a.lookup_min, a.lookup_max}}};
  if (a.drafted()) {
    j["draft_model"] = a.draft_model.empty() ? nlohmann::json(nullptr) : nlohmann::json(a.draft_model);
    j["self_draft_layers"] = a.self_draft_layers;
    j["exit"] = a.exit.empty() ? nlohmann::json(nullptr) : nlohmann::json(a.exit);
    j["eagle"] = a.eagle.empty() ? nlohmann::json(nullptr) : nlohmann::json(a.eagle);
    j["draft_tokens"] = a.draft_tokens;
    j["draft_alone"] = a.draft_alone;
    if (a.draft_nodes > 0) j["draft_tree"] = {{"nodes", a.draft_nodes}, {"depth", a.draft_tokens}, {"topk", a.draft_topk}, {"expand", a.draft_expanded()}, {"min_prob", a.draft_min_prob}};
  }
  return j;
}

std::vector<std::int32_t> encode_prompt(const medusa_llama::tokenizer& tok, const std::string& text, int seq_len,
                                        const std::string& what) {
  std::vector<std::int32_t> prompt;
  for (int id : tok.encode(text, /*bos=*/true, /*eos=*/false)) prompt.push_back(id);
  if (prompt.size() >= static_cast<std::size_t>(seq_len))
    throw medusa::decode_error(what + "of " + std::to_string(prompt.size()) + " tokens does not fit the context of " +
                               std::to_string(seq_len) + " tokens (leave room for at least one new token)");
  return prompt;
}

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

}  // namespace medusa_run
