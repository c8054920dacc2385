// SPDX-License-Identifier: Apache-2.0
#include <medusa_train/pipeline.hpp>

#include <medusa_llama/load.hpp>

#include <medusa/decoder.hpp>
#include <medusa/io/head_checkpoint.hpp>
#include <medusa/tree.hpp>

#include <medusa_llama/engine.hpp>
#include <medusa_llama/packed_heads.hpp>
#include <medusa_llama/model.hpp>
#include <medusa_llama/tokenizer.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <thread>

namespace medusa_train {

namespace {

using clock_type = std::chrono::steady_clock;
double seconds_since(clock_type::time_point t) { return std::chrono::duration<double>(clock_type::now() - t).count(); }

std::string json_str(const std::string& s) {
  std::string o = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') o += '\\', o += static_cast<char>(c);
    else if (c < 0x20) {
      char b[8];
      std::snprintf(b, sizeof b, "\\u%04x", c);
      o += b;
    } else o += static_cast<char>(c);
  }
  return o + "\"";
}

std::string fmt(const char* f, double v) {
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}

medusa_llama::model load_model(const std::filesystem::path& p) {
  std::error_code ec;
  if (std::filesystem::is_directory(p, ec)) return medusa_llama::model::load_hf(p);
  if (medusa_llama::is_gguf(p)) return medusa_llama::model::load_gguf(p);
  return medusa_llama::model::load_llama2c(p);
}

void write_text(const std::filesystem::path& p, const std::string& text) {
  const auto tmp = std::filesystem::path(p.string() + ".tmp");
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << text;
    out.flush();
    if (!out) throw medusa::io_error("cannot write " + tmp.string());
  }
  std::error_code ec;
  std::filesystem::rename(tmp, p, ec);
  if (ec) throw medusa::io_error("cannot rename " + tmp.string() + ": " + ec.message());
}

}  // namespace

std::filesystem::path resolve_tokenizer(const run_options& o) {
  if (!o.tokenizer.empty()) return o.tokenizer;
  std::error_code ec;
  if (!std::filesystem::is_directory(o.model, ec) && medusa_llama::is_gguf(o.model)) return o.model;  // its own tokenizer
  const auto dir = std::filesystem::is_directory(o.model, ec) ? o.model : o.model.parent_path();
  for (const char* name : {"tokenizer.json", "tokenizer.bin"})
    if (std::filesystem::exists(dir / name, ec)) return dir / name;
  throw medusa::invalid_input("no tokenizer given and none (tokenizer.json, tokenizer.bin) beside " + o.model.string());
}

run_report run_training(const run_options& o, const run_events& ev) {
  const auto t_start = clock_type::now();
  auto log = [&](const std::string& s) {
    if (ev.log) ev.log(s);
  };
  if (o.model.empty() || o.out.empty()) throw medusa::invalid_input("train: --model and --out are required");
  if (o.prompts.empty() == o.corpus.empty()) throw medusa::invalid_input("train: give exactly one of --prompts and --corpus");
  if (o.heads == 0 || o.heads > 16) throw medusa::invalid_input("train: heads must be in [1, 16], got " + std::to_string(o.heads));
  if (o.layers > 8) throw medusa::invalid_input("train: layers must be in [0, 8], got " + std::to_string(o.layers));
  if (o.tokens < 16) throw medusa::invalid_input("train: --tokens must be at least 16");
  if (!(o.opt.lr > 0)) throw medusa::invalid_input("train: --lr must be positive");
  if (o.budget_seconds < 0) throw medusa::invalid_input("train: --budget-seconds must be >= 0");
  if (o.cache_dtype == medusa::weight_dtype::f16) throw medusa::invalid_input("train: the cache stores f32 or bf16");
  const int threads = o.threads > 0 ? o.threads : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  std::optional<clock_type::time_point> deadline;
  if (o.budget_seconds > 0)
    deadline = t_start + std::chrono::duration_cast<clock_type::duration>(std::chrono::duration<double>(o.budget_seconds));

  run_report rep;
  auto m = load_model(o.model);
  const auto& cfg = m.config();
  const auto tok_path = resolve_tokenizer(o);
  const bool dummy_prefix = o.dummy_prefix.value_or(medusa_llama::default_dummy_prefix(tok_path));
  auto tok = medusa_llama::load_tokenizer(tok_path, dummy_prefix);
  if (tok->vocab_size() != cfg.vocab_size)
    throw medusa::invalid_input("train: tokenizer " + tok_path.string() + " has " + std::to_string(tok->vocab_size()) + " tokens, the model " +
                                std::to_string(cfg.vocab_size));
  const prompt_set prompts = o.corpus.empty() ? prompt_set::from_file(o.prompts, o.eval_fraction) : prompt_set::from_corpus(o.corpus, o.eval_fraction);
  log("model " + o.model.string() + ": d=" + std::to_string(cfg.dim) + " V=" + std::to_string(cfg.vocab_size) + " layers=" +
      std::to_string(cfg.n_layers) + " seq_len=" + std::to_string(cfg.seq_len));
  if (prompts.is_corpus())
    log("corpus " + prompts.root().string() + ": " + std::to_string(prompts.files(split::train).size()) + " train files, " +
        std::to_string(prompts.files(split::eval).size()) + " held-out files");
  else
    log("prompts " + o.prompts.string() + ": " + std::to_string(prompts.lines(split::train).size()) + " train, " +
        std::to_string(prompts.lines(split::eval).size()) + " held-out");

  // ---- cache key: everything the data depends on ---------------------------------------------
  cache_key_builder kb;
  kb.add("format", std::string("medusa-distill-cache/1"));
  std::error_code ec;
  if (!std::filesystem::is_directory(o.model, ec)) {
    kb.add_file("model", o.model);
  } else {
    kb.add("model", std::filesystem::absolute(o.model).string());
    for (const char* f : {"config.json", "model.safetensors", "model.safetensors.index.json"})
      if (std::filesystem::exists(o.model / f, ec)) kb.add_file(std::string("model/") + f, o.model / f);
  }
  kb.add_file("tokenizer", tok_path).add("dummy_prefix", dummy_prefix ? 1.0 : 0.0);
  if (prompts.is_corpus()) kb.add("corpus", prompts.root().string()).add_files("corpus_files", prompts.root(), prompts.all_files());
  else kb.add_file("prompts", o.prompts);
  kb.add("tokens", static_cast<double>(o.tokens)).add("seed", static_cast<double>(o.seed)).add("temperature", o.temperature);
  kb.add("eval_fraction", o.eval_fraction).add("gen_len", o.gen_len).add("prompt_min", o.prompt_min).add("prompt_max", o.prompt_max);
  kb.add("hidden_dtype", std::string(medusa::to_string(o.cache_dtype)));
  rep.key = kb.build();
  const auto cache_dir = o.cache_dir.empty() ? o.out / "cache" : o.cache_dir;
  std::filesystem::create_directories(cache_dir, ec);
  rep.cache_file = cache_dir / ("distill-" + rep.key.hex() + ".bin");

  // ---- data -----------------------------------------------------------------------------------
  const auto peek = distill_cache::peek_key(rep.cache_file);
  rep.cache_hit = peek && *peek == rep.key.hash;
  if (rep.cache_hit) {
    log("cache hit: " + rep.cache_file.string());
  } else {
    log("generating " + std::to_string(o.tokens) + " positions of self-distillation data -> " + rep.cache_file.string());
    medusa_llama::engine_options eo;
    eo.threads = threads;
    eo.max_batch = std::max(64, o.draft + 1);
    medusa_llama::engine e(m, eo);
    distill_options dopt;
    dopt.tokens = o.tokens;
    dopt.eval_fraction = o.eval_fraction;
    dopt.prompt_min = o.prompt_min;
    dopt.prompt_max = o.prompt_max;
    dopt.gen_len = o.gen_len;
    dopt.temperature = o.temperature;
    dopt.seed = o.seed;
    dopt.draft = o.draft;
    if (deadline) dopt.deadline = t_start + (*deadline - t_start) * 6 / 10;  // leave most of the rest for training
    dopt.on_progress = ev.on_distill;
    distill_cache_writer w(rep.cache_file, static_cast<std::size_t>(cfg.dim), static_cast<std::size_t>(cfg.vocab_size), o.cache_dtype,
                           rep.key.hash);
    rep.distill = generate_distill(e, *tok, prompts, dopt, w);
    if (rep.distill.deadline_hit) {
      // A truncated data set must not be mistaken for the full one by a later run.
      w.finish();
      const auto partial = cache_dir / ("distill-" + rep.key.hex() + ".partial.bin");
      std::filesystem::rename(rep.cache_file, partial, ec);
      if (!ec) rep.cache_file = partial;
      log("budget: data generation stopped early at " + std::to_string(rep.distill.rows) + " positions (not reusable as a full cache)");
    } else {
      w.finish();
    }
    write_text(cache_dir / ("distill-" + rep.key.hex() + ".json"), rep.key.json);
    log("generated " + std::to_string(rep.distill.rows) + " positions in " + std::to_string(rep.distill.sequences) + " sequences, " +
        fmt("%.1f s", rep.distill.seconds) + fmt(", %.0f tok/s", static_cast<double>(rep.distill.rows) / std::max(1e-9, rep.distill.seconds)) +
        fmt(", drafts accepted %.1f%%", rep.distill.drafted ? 100.0 * static_cast<double>(rep.distill.accepted) / static_cast<double>(rep.distill.drafted) : 0.0) +
        fmt(", %.2f tokens/forward", rep.distill.forwards ? static_cast<double>(rep.distill.accepted + rep.distill.forwards) / static_cast<double>(rep.distill.forwards) : 0.0));
  }
  const auto data = distill_cache::open(rep.cache_file);
  rep.cache_rows = data.rows();
  rep.cache_bytes = data.file_bytes();
  std::uint64_t eval_rows = 0;
  for (std::size_t r = 0; r < data.size(); ++r)
    if (data[r].which == split::eval) eval_rows += data[r].tokens.size();

  // ---- training -------------------------------------------------------------------------------
  const head_shape shape{static_cast<std::size_t>(cfg.dim), static_cast<std::size_t>(cfg.vocab_size), o.heads, o.layers};
  head_trainer trainer(shape, m.classifier(), o.seed, threads);
  fit_options fo;
  fo.batch = o.batch;
  fo.epochs = o.epochs;
  fo.decay = o.decay;
  fo.opt = o.opt;
  fo.seed = o.seed;
  fo.deadline = deadline;
  fo.reserve_seconds = 2.0 + static_cast<double>(eval_rows) / 4000.0 + (o.decode_prompts > 0 ? 10.0 + o.decode_prompts * 3.0 : 0.0);
  fo.on_progress = ev.on_fit;
  log("training " + std::to_string(o.heads) + " heads x " + std::to_string(o.layers) + " layers on " + std::to_string(data.rows() - eval_rows) +
      " positions (" + std::to_string(eval_rows) + " held out), " + std::to_string(threads) + " threads");
  rep.fit = fit(trainer, data, fo);

  // ---- evaluation and output ------------------------------------------------------------------
  const auto t_eval = clock_type::now();
  rep.cal = evaluate(trainer, data, split::eval, 10, m.classifier());
  rep.eval_seconds = seconds_since(t_eval);
  medusa::head_save_options so;
  so.base_model_name_or_path = o.model.string();
  rep.heads_file = medusa::save_heads(o.out, trainer.weights().view(), so);

  // ---- acceptance with the real decoder (optional) ----------------------------------------
  if (o.decode_prompts > 0 && prompts.has(split::eval)) {
    medusa_llama::engine_options eo;
    eo.threads = threads;
    eo.max_batch = 64;
    medusa_llama::engine dm(m, eo);
    // The heads run as medusa-run runs them: packed (int8) on the engine's threads.
    medusa_llama::packed_heads runner(dm, trainer.weights().view());
    std::vector<std::vector<std::int32_t>> ps;
    for (int i = 0; i < o.decode_prompts; ++i) {
      const auto p = prompts.prompt(split::eval, static_cast<std::uint64_t>(i) + 1000003, o.seed, *tok, o.prompt_min, o.prompt_max);
      ps.emplace_back(p.begin(), p.end());
    }
    medusa::decode_options dopt;
    dopt.max_new_tokens = o.decode_tokens;
    dopt.eos_token = tok->eos_id();
    std::vector<medusa::decode_result> vanilla;
    double v_tokens = 0, v_secs = 0;
    for (const auto& p : ps) {
      vanilla.push_back(medusa::generate_vanilla(dm, p, medusa::greedy_policy{}, dopt));
      v_tokens += vanilla.back().stats.new_tokens;
      v_secs += vanilla.back().stats.seconds.total;
    }
    const medusa::path_calibration path_cal = rep.cal.paths();
    std::vector<std::pair<std::string, medusa::tree>> trees;
    const std::size_t max_d = std::min<std::size_t>(o.heads, 5);
    if (o.heads >= 4) trees.emplace_back("mc_sim_7b_63", medusa::tree::preset("mc_sim_7b_63"));
    {
      std::vector<std::vector<int>> chain;
      for (std::size_t dd = 1; dd <= max_d; ++dd) chain.emplace_back(dd, 0);
      trees.emplace_back("chain_" + std::to_string(max_d), medusa::tree::from_paths(chain));
    }
    for (std::size_t budget : {7u, 15u, 31u, 63u}) trees.emplace_back("calibrated_" + std::to_string(budget + 1), medusa::tree::from_paths(best_tree(rep.cal, budget + 1, max_d)));
    for (auto& [name, tr] : trees) {
      acceptance_result ar;
      ar.tree = name;
      ar.nodes = tr.num_nodes();
      ar.predicted = path_cal.expected_tokens(tr.sorted_paths());
      ar.vanilla_tokens_per_second = v_secs > 0 ? v_tokens / v_secs : 0;
      medusa::decoder dec(dm, runner, tr, medusa::greedy_policy{});
      double toks = 0, steps = 0, secs = 0;
      for (std::size_t i = 0; i < ps.size(); ++i) {
        const auto r = dec.generate(ps[i], dopt);
        ar.identical = ar.identical && r.tokens == vanilla[i].tokens;
        toks += r.stats.new_tokens;
        steps += r.stats.steps;
        secs += r.stats.seconds.total;
      }
      ar.prompts = static_cast<int>(ps.size());
      ar.tokens_per_step = steps > 0 ? toks / steps : 0;
      ar.medusa_tokens_per_second = secs > 0 ? toks / secs : 0;
      rep.acceptance.push_back(ar);
      log("decode " + name + " (" + std::to_string(ar.nodes) + " nodes): " + fmt("%.2f tokens/step", ar.tokens_per_step) +
          fmt(" (predicted %.2f)", ar.predicted) + fmt(", %.0f tok/s", ar.medusa_tokens_per_second) +
          fmt(" vs plain %.0f tok/s", ar.vanilla_tokens_per_second) + (ar.identical ? ", identical to plain greedy" : ", DIFFERS from plain greedy"));
    }
  }

  rep.total_seconds = seconds_since(t_start);
  std::string meta;
  meta += "  \"model\": " + json_str(o.model.string()) + ",\n";
  meta += "  \"split\": \"eval\",\n";
  meta += "  \"train_positions\": " + std::to_string(rep.fit.train_positions) + ",\n";
  meta += "  \"steps\": " + std::to_string(rep.fit.steps) + ",\n";
  meta += "  \"epochs\": " + fmt("%g", o.epochs) + ",\n";
  meta += "  \"lr\": " + fmt("%g", o.opt.lr) + ",\n";
  meta += "  \"decay\": " + fmt("%g", o.decay) + ",\n";
  meta += "  \"seed\": " + std::to_string(o.seed) + ",\n";
  meta += "  \"cache_key\": \"" + rep.key.hex() + "\",\n";
  meta += "  \"train_seconds\": " + fmt("%.1f", rep.fit.seconds) + ",\n";
  meta += "  \"total_seconds\": " + fmt("%.1f", rep.total_seconds);
  if (!rep.acceptance.empty()) {
    meta += ",\n  \"acceptance\": [";
    for (std::size_t i = 0; i < rep.acceptance.size(); ++i) {
      const auto& a = rep.acceptance[i];
      meta += std::string(i ? ",\n" : "\n") + "    {\"tree\": " + json_str(a.tree) + ", \"nodes\": " + std::to_string(a.nodes) +
              ", \"tokens_per_step\": " + fmt("%.4f", a.tokens_per_step) + ", \"predicted_tokens_per_step\": " + fmt("%.4f", a.predicted) +
              ", \"tokens_per_second\": " + fmt("%.1f", a.medusa_tokens_per_second) + ", \"plain_tokens_per_second\": " +
              fmt("%.1f", a.vanilla_tokens_per_second) + ", \"identical_to_plain\": " + (a.identical ? "true" : "false") +
              ", \"prompts\": " + std::to_string(a.prompts) + "}";
    }
    meta += "\n  ]";
  }
  write_text(o.out / "calibration.json", calibration_json(rep.cal, meta));
  // Trees grown from the calibration table (docs/training.md), ready for `medusa-run --tree OUT/tree-N.json`.
  const std::size_t grow_depth = std::min<std::size_t>(o.heads, 5);
  for (std::size_t nodes : {4u, 6u, 8u, 16u, 32u, 64u}) {
    std::string text = "[";
    const auto paths = best_tree(rep.cal, nodes, grow_depth);
    for (std::size_t i = 0; i < paths.size(); ++i) {
      text += i ? "," : "";
      text += "[";
      for (std::size_t j = 0; j < paths[i].size(); ++j) {
        if (j) text += ',';
        text += std::to_string(paths[i][j]);
      }
      text += "]";
    }
    write_text(o.out / ("tree-" + std::to_string(nodes) + ".json"), text + "]\n");
  }
  return rep;
}

}  // namespace medusa_train
