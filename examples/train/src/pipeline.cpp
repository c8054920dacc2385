// SPDX-License-Identifier: Apache-2.0
#include <medusa_train/pipeline.hpp>

#include "common.hpp"

#include <medusa_llama/load.hpp>

#include <medusa/decoder.hpp>
#include <medusa/io/head_checkpoint.hpp>
#include <medusa/tree.hpp>

#include <medusa_llama/engine.hpp>
#include <medusa_llama/exit_projection.hpp>
#include <medusa_llama/packed_heads.hpp>
#include <medusa_llama/model.hpp>
#include <medusa_llama/tokenizer.hpp>
#include <medusa_train/peft_adapter.hpp>

#include <fcntl.h>  // AT_FDCWD
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <thread>

namespace medusa_train {

namespace {

using detail::clock_type;
using detail::seconds_since;

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
  const auto tmp = detail::temp_beside(p);
  std::error_code ec;
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out << text;
    out.flush();
    if (!out) {
      out.close();
      std::filesystem::remove(tmp, ec);
      throw medusa::io_error("cannot write " + tmp.string());
    }
  }
  std::filesystem::rename(tmp, p, ec);
  if (ec) {
    std::error_code ignored;
    std::filesystem::remove(tmp, ignored);
    throw medusa::io_error("cannot rename " + tmp.string() + ": " + ec.message());
  }
}

// Swaps two existing directories in one step where the system can (Linux renameat2 with
// RENAME_EXCHANGE); false where it cannot, and the caller renames in two steps.
bool exchange_paths(const std::filesystem::path& a, const std::filesystem::path& b) {
#if defined(__linux__) && defined(RENAME_EXCHANGE)
  return ::renameat2(AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), RENAME_EXCHANGE) == 0;
#else
  (void)a, (void)b;
  return false;
#endif
}

// The output directory is built as a hidden sibling and swapped in at the end, so that a failed
// run (a full disk, an error, an interrupt) never leaves half of its files in `out`.
class output_dir {
 public:
  explicit output_dir(const std::filesystem::path& out) {
    auto o = std::filesystem::absolute(out).lexically_normal();
    if (o.filename().empty()) o = o.parent_path();
    final_ = o;
    std::error_code ec0;
    if (std::filesystem::exists(o, ec0) && !std::filesystem::is_directory(o, ec0))
      throw medusa::invalid_input("train: --out " + o.string() + " exists and is not a directory");
    work_ = o.parent_path() / ("." + o.filename().string() + ".tmp-" + std::to_string(::getpid()));
    std::error_code ec;
    std::filesystem::remove_all(work_, ec);
    std::filesystem::create_directories(work_, ec);
    if (ec) throw medusa::io_error("cannot create " + work_.string() + ": " + ec.message());
  }
  ~output_dir() {
    if (committed_) return;
    std::error_code ec;
    std::filesystem::remove_all(work_, ec);
  }
  output_dir(const output_dir&) = delete;
  output_dir& operator=(const output_dir&) = delete;

  [[nodiscard]] const std::filesystem::path& path() const noexcept { return work_; }
  [[nodiscard]] const std::filesystem::path& final_path() const noexcept { return final_; }

  // Moves `keep` (a directory inside the old output, e.g. its cache) into the new one, then
  // replaces the old output directory with the new one.
  void commit(const std::filesystem::path& keep) {
    std::error_code ec;
    const auto keep_abs = keep.empty() ? keep : std::filesystem::absolute(keep).lexically_normal();
    if (!keep_abs.empty() && keep_abs.parent_path() == final_ && std::filesystem::exists(keep_abs, ec)) {
      std::filesystem::rename(keep_abs, work_ / keep_abs.filename(), ec);
      if (ec) throw medusa::io_error("cannot move " + keep_abs.string() + " into " + work_.string() + ": " + ec.message());
    }
    const bool had_old = std::filesystem::exists(final_, ec);
    if (had_old && exchange_paths(work_, final_)) {
      // One atomic step: `final_` is the new output at every instant; `work_` now holds the old one.
      committed_ = true;
      std::filesystem::remove_all(work_, ec);
      return;
    }
    const auto old = final_.parent_path() / ("." + final_.filename().string() + ".old-" + std::to_string(::getpid()));
    if (had_old) {
      std::filesystem::rename(final_, old, ec);
      if (ec) throw medusa::io_error("cannot move the previous " + final_.string() + " aside: " + ec.message());
    }
    std::filesystem::rename(work_, final_, ec);
    if (ec) throw medusa::io_error("cannot rename " + work_.string() + " to " + final_.string() + ": " + ec.message());
    committed_ = true;
    if (had_old) std::filesystem::remove_all(old, ec);
  }

 private:
  std::filesystem::path final_, work_;
  bool committed_ = false;
};

// Held-out text for perplexity: the held-out corpus files (or prompt lines), BOS first, at most a
// context each.
std::vector<std::vector<std::int32_t>> held_out_texts(const prompt_set& prompts, const medusa_llama::tokenizer& tok, int count, int context) {
  std::vector<std::vector<std::int32_t>> out;
  auto add = [&](const std::string& text) {
    auto ids = tok.encode(text, true, false);
    if (ids.size() < 16) return;
    if (ids.size() > static_cast<std::size_t>(context)) ids.resize(static_cast<std::size_t>(context));
    out.emplace_back(ids.begin(), ids.end());
  };
  if (prompts.is_corpus()) {
    for (const auto& f : prompts.files(split::eval)) {
      if (static_cast<int>(out.size()) >= count) break;
      add(detail::read_file(f));
    }
  } else {
    for (const auto& line : prompts.lines(split::eval)) {
      if (static_cast<int>(out.size()) >= count) break;
      add(line);
    }
  }
  return out;
}

void copy_beside(const std::filesystem::path& from_dir, const std::filesystem::path& to_dir, std::initializer_list<const char*> names) {
  std::error_code ec;
  for (const char* n : names)
    if (std::filesystem::exists(from_dir / n, ec)) {
      std::filesystem::copy_file(from_dir / n, to_dir / n, std::filesystem::copy_options::overwrite_existing, ec);
      if (ec) throw medusa::io_error("cannot copy " + (from_dir / n).string() + " to " + to_dir.string() + ": " + ec.message());
    }
}

// The self-distillation settings of a run (the caller sets the budget and callbacks).
distill_options distill_options_of(const run_options& o) {
  distill_options d;
  d.tokens = o.tokens;
  d.eval_fraction = o.eval_fraction;
  d.prompt_min = o.prompt_min;
  d.prompt_max = o.prompt_max;
  d.gen_len = o.gen_len;
  d.temperature = o.temperature;
  d.seed = o.seed;
  d.draft = o.draft;
  return d;
}

// The engine that generates self-distillation data (verifies `draft` tokens at once).
medusa_llama::engine_options generation_engine(int threads, int draft) {
  medusa_llama::engine_options eo;
  eo.threads = threads;
  eo.max_batch = std::max(64, draft + 1);
  return eo;
}

// The original model's top-k logits over `seqs`: read from the cache directory when a run with
// the same data made them, else computed and saved there.
teacher_table teacher_for(const medusa_llama::model& m, std::span<const backbone_sequence> seqs, const run_report& rep,
                          const std::filesystem::path& cache_dir, std::size_t k, int threads, const std::function<void(const std::string&)>& log) {
  const bool partial = rep.cache_file.string().find(".partial") != std::string::npos;
  const auto file = cache_dir / ("teacher-" + rep.key.hex() + (partial ? ".partial" : "") + "-k" + std::to_string(k) + ".bin");
  if (auto t = teacher_table::load(file, seqs, k)) {
    log("teacher: " + file.string());
    return std::move(*t);
  }
  const auto t0 = clock_type::now();
  // The adapters stay off: this is the original model.
  const lora_model original(m, {.rank = 1, .alpha = 1, .dropout = 0}, 0);
  auto t = teacher_table::compute(original, seqs, k, threads);
  t.save(file);
  log("teacher: top-" + std::to_string(k) + " logits of the original model for " + std::to_string(seqs.size()) + " sequences in " +
      fmt("%.1f s", seconds_since(t0)) + " -> " + file.string());
  return t;
}

// Held-out prompts, one per line with \n, \t, \\ escapes (medusa-run --prompts-file, bench/speedup.py).
void write_heldout_prompts(const std::filesystem::path& work, const prompt_set& prompts, const medusa_llama::tokenizer& tok, const run_options& o) {
  if (!prompts.has(split::eval)) return;
  std::string text;
  for (std::uint64_t i = 0; i < 48; ++i) {
    const auto p = prompts.prompt(split::eval, i + 2000003, o.seed, tok, o.prompt_min, o.prompt_max);
    const std::string s = tok.decode(std::span<const int>(p));
    std::string line;
    for (char c : s) {
      if (c == '\\') line += "\\\\";
      else if (c == '\n') line += "\\n";
      else if (c == '\t') line += "\\t";
      else if (c != '\r') line += c;
    }
    if (line.find_first_not_of(' ') != std::string::npos) text += line + "\n";
  }
  write_text(work / "heldout-prompts.txt", text);
}

// The target's tokenizer files beside a model written into `dir`.
void copy_tokenizer(const std::filesystem::path& tok_path, const std::filesystem::path& dir) {
  copy_beside(tok_path.parent_path(), dir, {"tokenizer.bin", "tokenizer.model", "tokenizer.json", "tokenizer_config.json"});
  if (!medusa_llama::is_gguf(tok_path)) {  // a tokenizer of another name (tok512.bin), under its own name
    std::error_code ec;
    std::filesystem::copy_file(tok_path, dir / tok_path.filename(), std::filesystem::copy_options::overwrite_existing, ec);
    if (ec) throw medusa::io_error("cannot copy " + tok_path.string() + " to " + dir.string() + ": " + ec.message());
  }
}

std::string json_list(const std::vector<double>& v) {
  std::string t;
  for (std::size_t i = 0; i < v.size(); ++i) t += (i ? ", " : "") + fmt("%.4f", v[i]);
  return "[" + t + "]";
}

// The draft model's shape: the options' width and depth, the target's vocabulary and conventions.
medusa_llama::model_config draft_config(const run_options& o, const medusa_llama::model_config& target) {
  medusa_llama::model_config c = target;
  c.dim = o.draft_dim;
  c.hidden_dim = o.draft_hidden > 0 ? o.draft_hidden : 3 * o.draft_dim;
  c.n_layers = o.draft_layers;
  c.n_heads = o.draft_heads;
  c.n_kv_heads = o.draft_heads;
  c.shared_classifier = true;
  return c;
}

// The options the distillation recipes share (draft model, feature drafter, exit): the run's
// batch, optimiser, seed, threads and deadline (5 s kept for the rest), this recipe's rate and epochs.
template <class FitOptions>
FitOptions distill_options(const run_options& o, double lr, double epochs, int threads, std::optional<clock_type::time_point> deadline,
                           double progress_interval) {
  FitOptions fo;
  fo.lr = lr;
  fo.epochs = epochs;
  fo.batch_sequences = o.batch_sequences;
  fo.opt = o.opt;
  fo.seed = o.seed;
  fo.threads = threads;
  fo.deadline = deadline;
  fo.reserve_seconds = 5.0;
  fo.progress_interval = progress_interval;
  return fo;
}

// --recipe draft: distil the draft, score it on the held-out continuations, write it as
// OUT/draft/model.bin (llama2.c; a Hugging Face directory OUT/draft for a target with RoPE on halves),
// with the target's tokenizer beside it, and OUT/calibration.json.
void train_draft(const run_options& o, const medusa_llama::model& m, const distill_cache& data, const prompt_set& prompts,
                 const medusa_llama::tokenizer& tok, const std::filesystem::path& tok_path, const std::filesystem::path& cache_dir,
                 const std::filesystem::path& work, int threads, std::optional<clock_type::time_point> deadline, run_report& rep,
                 const run_events& ev, const std::function<void(const std::string&)>& log) {
  const auto seqs = cache_sequences(data, prompts, tok, o.seed, o.prompt_min, o.prompt_max);
  const auto teacher = teacher_for(m, seqs, rep, cache_dir, o.teacher_topk, threads, log);
  const auto cfg = draft_config(o, m.config());
  dense_model draft(cfg, o.seed ^ 0xd7a2full);
  auto fo = distill_options<draft_fit_options>(o, o.draft_lr, o.draft_epochs, threads, deadline, ev.progress_interval);
  fo.on_progress = ev.on_draft;
  log("draft model: " + std::to_string(cfg.n_layers) + " layers, d=" + std::to_string(cfg.dim) + ", hidden " + std::to_string(cfg.hidden_dim) +
      ", " + std::to_string(cfg.n_heads) + " heads (" + std::to_string(draft.params().size()) + " parameters), lr " + fmt("%g", o.draft_lr));
  rep.draft_fit = fit_draft(draft, seqs, teacher, fo);
  log("draft: " + std::to_string(rep.draft_fit.steps) + " steps in " + fmt("%.1f s", rep.draft_fit.seconds) + fmt(", KL %.4f", rep.draft_fit.final_kl) +
      fmt(", agreement %.1f%%", 100 * rep.draft_fit.final_agreement) + (rep.draft_fit.budget_limited ? " (shortened by the budget)" : ""));
  const auto t_eval = clock_type::now();
  rep.draft_eval = measure_draft(draft, seqs, teacher, threads);
  rep.eval_seconds = seconds_since(t_eval);
  const auto& q = rep.draft_eval;
  std::string chain;
  for (std::size_t k = 0; k < q.chain_tokens.size(); ++k) chain += fmt(k ? " / %.2f" : "%.2f", q.chain_tokens[k]);
  log("draft, held out: agreement " + fmt("%.1f%%", 100 * q.agreement) + " on " + std::to_string(q.positions) +
      " positions; tokens per step of greedy chains of 1…" + std::to_string(q.chain_tokens.size()) + ": " + chain);
  std::error_code ec;
  const auto dir = work / "draft";
  std::filesystem::create_directories(dir, ec);
  if (cfg.rope == medusa_llama::rope_style::adjacent_pairs) {
    draft.to_model().save_llama2c(dir / "model.bin");
    rep.draft_file = o.out / "draft" / "model.bin";
  } else {  // llama2.c files hold adjacent-pair RoPE only
    draft.to_model().save_hf(dir);
    rep.draft_file = o.out / "draft";
  }
  copy_tokenizer(tok_path, dir);

  std::string j = "{\n";
  j += "  \"recipe\": \"draft\",\n";
  j += "  \"model\": " + json_str(o.model.string()) + ",\n";
  j += "  \"draft_model\": " + json_str(rep.draft_file.string()) + ",\n";
  j += "  \"draft\": {\"n_layers\": " + std::to_string(cfg.n_layers) + ", \"dim\": " + std::to_string(cfg.dim) + ", \"hidden_dim\": " +
       std::to_string(cfg.hidden_dim) + ", \"n_heads\": " + std::to_string(cfg.n_heads) + ", \"parameters\": " + std::to_string(draft.params().size()) +
       "},\n";
  j += "  \"split\": \"eval\",\n";
  j += "  \"positions\": " + std::to_string(q.positions) + ",\n";
  j += "  \"agreement\": " + fmt("%.5f", q.agreement) + ",\n";
  j += "  \"acceptance_by_depth\": " + json_list(q.acceptance) + ",\n";
  j += "  \"chain_tokens_per_step\": " + json_list(q.chain_tokens) + ",\n";
  j += "  \"steps\": " + std::to_string(rep.draft_fit.steps) + ",\n";
  j += "  \"epochs\": " + fmt("%g", o.draft_epochs) + ",\n";
  j += "  \"lr\": " + fmt("%g", o.draft_lr) + ",\n";
  j += "  \"final_kl\": " + fmt("%.5f", rep.draft_fit.final_kl) + ",\n";
  j += "  \"seed\": " + std::to_string(o.seed) + ",\n";
  j += "  \"cache_key\": \"" + rep.key.hex() + "\",\n";
  j += "  \"train_seconds\": " + fmt("%.1f", rep.draft_fit.seconds) + "\n}\n";
  write_text(work / "calibration.json", j);
  write_text(dir / "calibration.json", j);  // the draft's directory is complete on its own
}

// --recipe eagle: the target's features once, then the one-block drafter on them; scored on the
// held-out continuations with chains drafted on its own predicted features; written as
// OUT/eagle/model.bin (llama2.c; a Hugging Face directory OUT/eagle for a target with RoPE on
// halves) + OUT/eagle/fc.bin, the tokenizer beside them, and OUT/calibration.json.
void train_eagle(const run_options& o, const medusa_llama::model& m, const distill_cache& data, const prompt_set& prompts,
                 const medusa_llama::tokenizer& tok, const std::filesystem::path& tok_path, const std::filesystem::path& cache_dir,
                 const std::filesystem::path& work, int threads, std::optional<clock_type::time_point> deadline, run_report& rep,
                 const run_events& ev, const std::function<void(const std::string&)>& log) {
  const auto seqs = cache_sequences(data, prompts, tok, o.seed, o.prompt_min, o.prompt_max);
  const auto teacher = teacher_for(m, seqs, rep, cache_dir, o.teacher_topk, threads, log);
  const auto t_features = clock_type::now();
  const lora_model original(m, {.rank = 1, .alpha = 1, .dropout = 0}, 0);
  const auto features = feature_table::compute(original, seqs, threads);
  rep.feature_rms = features.rms(seqs);
  log("features: the target's final-normed hidden states of " + std::to_string(seqs.size()) + " sequences in " +
      fmt("%.1f s", seconds_since(t_features)) + fmt(", RMS %.4f", rep.feature_rms));
  eagle_model em(m, o.eagle_hidden, o.seed ^ 0xea61eull);
  const auto& cfg = em.config();
  auto fo = distill_options<eagle_fit_options>(o, o.eagle_lr, o.eagle_epochs, threads, deadline, ev.progress_interval);
  fo.reg = o.eagle_reg;
  fo.noise = o.eagle_noise * rep.feature_rms;
  // The held-out chains are drafted row by row: about 2 ms per scored position on 2 cores.
  std::uint64_t scored = 0;
  for (const auto& sq : seqs)
    if (sq.which == split::eval && sq.tokens.size() > sq.row0 + 1) scored += sq.tokens.size() - 1 - sq.row0;
  fo.reserve_seconds = 5.0 + 2e-3 * static_cast<double>(scored);
  fo.on_progress = ev.on_eagle;
  log("eagle drafter: 1 block, d=" + std::to_string(cfg.dim) + ", hidden " + std::to_string(cfg.hidden_dim) + ", " + std::to_string(cfg.n_heads) +
      " heads (" + std::to_string(em.params().size()) + " parameters), lr " + fmt("%g", o.eagle_lr) + fmt(", reg %g", o.eagle_reg) +
      fmt(", noise %g", fo.noise));
  rep.eagle_fit = fit_eagle(em, seqs, features, teacher, fo);
  log("eagle: " + std::to_string(rep.eagle_fit.steps) + " steps in " + fmt("%.1f s", rep.eagle_fit.seconds) + fmt(", KL %.4f", rep.eagle_fit.final_kl) +
      fmt(", regression %.4f", rep.eagle_fit.final_regression) + fmt(", agreement %.1f%%", 100 * rep.eagle_fit.final_agreement) +
      (rep.eagle_fit.budget_limited ? " (shortened by the budget)" : ""));
  const auto t_eval = clock_type::now();
  rep.eagle_eval = measure_eagle(em, seqs, features, teacher, threads);
  rep.eval_seconds = seconds_since(t_eval);
  const auto& q = rep.eagle_eval;
  std::string chain, chain_tf;
  for (std::size_t k = 0; k < q.chain_tokens.size(); ++k) chain += fmt(k ? " / %.2f" : "%.2f", q.chain_tokens[k]);
  for (std::size_t k = 0; k < q.chain_tokens_teacher_forced.size(); ++k) chain_tf += fmt(k ? " / %.2f" : "%.2f", q.chain_tokens_teacher_forced[k]);
  log("eagle, held out: agreement " + fmt("%.1f%%", 100 * q.agreement) + " on " + std::to_string(q.positions) +
      " positions; tokens per step of chains of 1…" + std::to_string(q.chain_tokens.size()) + ": " + chain + " (teacher-forced: " + chain_tf + ")");
  std::error_code ec;
  const auto dir = work / "eagle";
  std::filesystem::create_directories(dir, ec);
  if (cfg.rope == medusa_llama::rope_style::adjacent_pairs) {
    em.to_model().save_llama2c(dir / "model.bin");
    rep.eagle_file = o.out / "eagle" / "model.bin";
  } else {  // llama2.c files hold adjacent-pair RoPE only
    em.to_model().save_hf(dir);
    rep.eagle_file = o.out / "eagle";
  }
  em.save_fc(dir / "fc.bin");
  copy_tokenizer(tok_path, dir);

  std::string j = "{\n";
  j += "  \"recipe\": \"eagle\",\n";
  j += "  \"model\": " + json_str(o.model.string()) + ",\n";
  j += "  \"eagle_model\": " + json_str(rep.eagle_file.string()) + ",\n";
  j += "  \"eagle\": {\"n_layers\": 1, \"dim\": " + std::to_string(cfg.dim) + ", \"hidden_dim\": " + std::to_string(cfg.hidden_dim) +
       ", \"n_heads\": " + std::to_string(cfg.n_heads) + ", \"n_kv_heads\": " + std::to_string(cfg.n_kv_heads) + ", \"fc\": [" +
       std::to_string(cfg.dim) + ", " + std::to_string(2 * cfg.dim) + "], \"parameters\": " + std::to_string(em.params().size()) + "},\n";
  j += "  \"split\": \"eval\",\n";
  j += "  \"positions\": " + std::to_string(q.positions) + ",\n";
  j += "  \"agreement\": " + fmt("%.5f", q.agreement) + ",\n";
  j += "  \"chain_estimate\": \"autoregressive\",\n";
  j += "  \"acceptance_by_depth\": " + json_list(q.acceptance) + ",\n";
  j += "  \"chain_tokens_per_step\": " + json_list(q.chain_tokens) + ",\n";
  j += "  \"chain_tokens_per_step_teacher_forced\": " + json_list(q.chain_tokens_teacher_forced) + ",\n";
  j += "  \"feature_regression\": " + fmt("%.5f", q.regression) + ",\n";
  j += "  \"steps\": " + std::to_string(rep.eagle_fit.steps) + ",\n";
  j += "  \"epochs\": " + fmt("%g", o.eagle_epochs) + ",\n";
  j += "  \"lr\": " + fmt("%g", o.eagle_lr) + ",\n";
  j += "  \"reg\": " + fmt("%g", o.eagle_reg) + ",\n";
  j += "  \"noise\": " + fmt("%g", o.eagle_noise) + ",\n";
  j += "  \"feature_rms\": " + fmt("%.5f", rep.feature_rms) + ",\n";
  j += "  \"final_kl\": " + fmt("%.5f", rep.eagle_fit.final_kl) + ",\n";
  j += "  \"seed\": " + std::to_string(o.seed) + ",\n";
  j += "  \"cache_key\": \"" + rep.key.hex() + "\",\n";
  j += "  \"train_seconds\": " + fmt("%.1f", rep.eagle_fit.seconds) + "\n}\n";
  write_text(work / "calibration.json", j);
  write_text(dir / "calibration.json", j);  // the drafter's directory is complete on its own
}

// --recipe exit: the first layers' final-normed states once, then the projection on them; scored
// (and the plain first layers, for comparison) on the held-out continuations; written as
// OUT/exit/exit.bin and OUT/exit/calibration.json (also OUT/calibration.json).
void train_exit(const run_options& o, const medusa_llama::model& m, const distill_cache& data, const prompt_set& prompts,
                const medusa_llama::tokenizer& tok, const std::filesystem::path& cache_dir, const std::filesystem::path& work, int threads,
                std::optional<clock_type::time_point> deadline, run_report& rep, const run_events& ev,
                const std::function<void(const std::string&)>& log) {
  const auto seqs = cache_sequences(data, prompts, tok, o.seed, o.prompt_min, o.prompt_max);
  const auto teacher = teacher_for(m, seqs, rep, cache_dir, o.teacher_topk, threads, log);
  const int k = o.exit_layers > 0 ? o.exit_layers : std::max(1, m.config().n_layers / 2);
  const auto t_states = clock_type::now();
  const lora_model first(m.first_layers(k), {.rank = 1, .alpha = 1, .dropout = 0}, 0);
  const auto states = feature_table::compute(first, seqs, threads);
  log("states: the first " + std::to_string(k) + " layers' final-normed hidden states of " + std::to_string(seqs.size()) + " sequences in " +
      fmt("%.1f s", seconds_since(t_states)));
  std::vector<float> w = identity_exit(m.config().dim);
  rep.exit_base = measure_exit(w, m, states, seqs, teacher, threads);
  auto fo = distill_options<draft_fit_options>(o, o.exit_lr, o.exit_epochs, threads, deadline, ev.progress_interval);
  fo.on_progress = ev.on_draft;
  log("exit projection after " + std::to_string(k) + " of " + std::to_string(m.config().n_layers) + " layers: " + std::to_string(w.size()) +
      " parameters, lr " + fmt("%g", o.exit_lr));
  rep.exit_fit = fit_exit(w, m, states, seqs, teacher, fo);
  log("exit: " + std::to_string(rep.exit_fit.steps) + " steps in " + fmt("%.1f s", rep.exit_fit.seconds) + fmt(", KL %.4f", rep.exit_fit.final_kl) +
      fmt(", agreement %.1f%%", 100 * rep.exit_fit.final_agreement) + (rep.exit_fit.budget_limited ? " (shortened by the budget)" : ""));
  const auto t_eval = clock_type::now();
  rep.exit_eval = measure_exit(w, m, states, seqs, teacher, threads);
  rep.eval_seconds = seconds_since(t_eval);
  const auto& q = rep.exit_eval;
  const auto& b = rep.exit_base;
  std::string chain, base;
  for (std::size_t i = 0; i < q.chain_tokens.size(); ++i) chain += fmt(i ? " / %.2f" : "%.2f", q.chain_tokens[i]);
  for (std::size_t i = 0; i < b.chain_tokens.size(); ++i) base += fmt(i ? " / %.2f" : "%.2f", b.chain_tokens[i]);
  log("exit, held out: agreement " + fmt("%.1f%%", 100 * q.agreement) + " (the plain first layers: " + fmt("%.1f%%", 100 * b.agreement) +
      ") on " + std::to_string(q.positions) + " positions; tokens per step of greedy chains of 1…" + std::to_string(q.chain_tokens.size()) +
      ": " + chain + " (plain: " + base + ")");
  std::error_code ec;
  const auto dir = work / "exit";
  std::filesystem::create_directories(dir, ec);
  medusa_llama::save_exit_projection(dir / medusa_llama::exit_projection_file, {k, m.config().dim, w});
  rep.exit_file = o.out / "exit" / medusa_llama::exit_projection_file;

  std::string j = "{\n";
  j += "  \"recipe\": \"exit\",\n";
  j += "  \"model\": " + json_str(o.model.string()) + ",\n";
  j += "  \"exit\": {\"layers\": " + std::to_string(k) + ", \"dim\": " + std::to_string(m.config().dim) + ", \"parameters\": " +
       std::to_string(w.size()) + "},\n";
  j += "  \"split\": \"eval\",\n";
  j += "  \"positions\": " + std::to_string(q.positions) + ",\n";
  j += "  \"agreement\": " + fmt("%.5f", q.agreement) + ",\n";
  j += "  \"acceptance_by_depth\": " + json_list(q.acceptance) + ",\n";
  j += "  \"chain_tokens_per_step\": " + json_list(q.chain_tokens) + ",\n";
  j += "  \"without_exit\": {\"agreement\": " + fmt("%.5f", b.agreement) + ", \"chain_tokens_per_step\": " + json_list(b.chain_tokens) + "},\n";
  j += "  \"steps\": " + std::to_string(rep.exit_fit.steps) + ",\n";
  j += "  \"epochs\": " + fmt("%g", o.exit_epochs) + ",\n";
  j += "  \"lr\": " + fmt("%g", o.exit_lr) + ",\n";
  j += "  \"final_kl\": " + fmt("%.5f", rep.exit_fit.final_kl) + ",\n";
  j += "  \"seed\": " + std::to_string(o.seed) + ",\n";
  j += "  \"cache_key\": \"" + rep.key.hex() + "\",\n";
  j += "  \"train_seconds\": " + fmt("%.1f", rep.exit_fit.seconds) + "\n}\n";
  write_text(work / "calibration.json", j);
  write_text(dir / "calibration.json", j);  // the exit's directory is complete on its own
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
  // ---- Medusa-2 and --init-heads: refused before any long work ----------------------------------
  const bool m2 = o.what == recipe::medusa2;
  std::error_code ec;
  const bool hf_input = std::filesystem::is_directory(o.model, ec);
  if (m2) {
    if (!hf_input && medusa_llama::is_gguf(o.model))
      throw medusa::invalid_input("train: --recipe medusa2 writes the merged model as llama2.c or Hugging Face files; convert the GGUF model "
                                  "to one of them first");
    if (o.lora.rank == 0 || o.lora.rank > static_cast<std::size_t>(cfg.dim))
      throw medusa::invalid_input("train: --lora-rank " + std::to_string(o.lora.rank) + " is outside [1, d = " + std::to_string(cfg.dim) + "]");
    if (!(o.lora.alpha > 0) || !std::isfinite(o.lora.alpha)) throw medusa::invalid_input("train: --lora-alpha must be positive");
    if (!(o.lora.dropout >= 0 && o.lora.dropout < 1)) throw medusa::invalid_input("train: --lora-dropout must be in [0, 1)");
    if (!(o.heads_lr > 0) || !(o.backbone_lr > 0)) throw medusa::invalid_input("train: --heads-lr and --backbone-lr must be positive");
    if (!(o.backbone_lr < o.heads_lr))
      throw medusa::invalid_input("train: --backbone-lr " + fmt("%g", o.backbone_lr) + " must be below --heads-lr " + fmt("%g", o.heads_lr) +
                                  " (the backbone moves slower than the heads)");
    if (o.joint_epochs <= 0 || o.batch_sequences == 0 || o.teacher_topk == 0)
      throw medusa::invalid_input("train: --joint-epochs, --batch-sequences and --teacher-topk must be positive");
  }
  if (o.what == recipe::draft) {
    if (o.draft_layers < 1 || o.draft_dim < 8 || o.draft_heads < 1 || o.draft_hidden < 0 || o.draft_dim % o.draft_heads != 0 ||
        (o.draft_dim / o.draft_heads) % 2 != 0)
      throw medusa::invalid_input("train: the draft needs --draft-layers >= 1 and --draft-dim >= 8 divisible by --draft-heads into heads of an even "
                                  "width (got " + std::to_string(o.draft_layers) + " layers, width " + std::to_string(o.draft_dim) + ", " +
                                  std::to_string(o.draft_heads) + " heads)");
    if (!(o.draft_lr > 0) || !(o.draft_epochs > 0) || o.batch_sequences == 0 || o.teacher_topk == 0)
      throw medusa::invalid_input("train: --draft-lr, --draft-epochs, --batch-sequences and --teacher-topk must be positive");
    if (!o.init_heads.empty()) throw medusa::invalid_input("train: --recipe draft trains no heads; --init-heads does not apply");
    if (!cfg.shared_classifier)
      throw medusa::invalid_input("train: --recipe draft ties the draft's classifier to its embedding; the target has a separate classifier, "
                                  "which is not supported yet");
  }
  if (o.what == recipe::eagle) {
    if (o.eagle_hidden < 0) throw medusa::invalid_input("train: --eagle-hidden-dim must be >= 0 (0: the model's), got " + std::to_string(o.eagle_hidden));
    if (!(o.eagle_lr > 0) || !std::isfinite(o.eagle_lr) || !(o.eagle_epochs > 0) || !std::isfinite(o.eagle_epochs) || o.batch_sequences == 0 ||
        o.teacher_topk == 0)
      throw medusa::invalid_input("train: --eagle-lr, --eagle-epochs, --batch-sequences and --teacher-topk must be positive");
    if (!(o.eagle_reg >= 0) || !std::isfinite(o.eagle_reg))
      throw medusa::invalid_input("train: --eagle-reg must be a finite number >= 0, got " + fmt("%g", o.eagle_reg));
    if (!(o.eagle_noise >= 0) || !std::isfinite(o.eagle_noise))
      throw medusa::invalid_input("train: --eagle-noise must be a finite number >= 0, got " + fmt("%g", o.eagle_noise));
    if (!o.init_heads.empty()) throw medusa::invalid_input("train: --recipe eagle trains no heads; --init-heads does not apply");
  }
  if (o.what == recipe::exit) {
    if (o.exit_layers < 0 || o.exit_layers >= cfg.n_layers)
      throw medusa::invalid_input("train: --exit-layers must be in [1, " + std::to_string(cfg.n_layers - 1) + "] (0: half the model's " +
                                  std::to_string(cfg.n_layers) + "), got " + std::to_string(o.exit_layers));
    if (cfg.n_layers < 2) throw medusa::invalid_input("train: --recipe exit needs a model of 2 layers or more");
    if (!(o.exit_lr > 0) || !std::isfinite(o.exit_lr) || !(o.exit_epochs > 0) || !std::isfinite(o.exit_epochs) || o.batch_sequences == 0 ||
        o.teacher_topk == 0)
      throw medusa::invalid_input("train: --exit-lr, --exit-epochs, --batch-sequences and --teacher-topk must be positive");
    if (!o.init_heads.empty()) throw medusa::invalid_input("train: --recipe exit trains no heads; --init-heads does not apply");
  }
  std::optional<medusa::head_weights> init_heads;
  if (!o.init_heads.empty()) {
    auto loaded = medusa::load_heads(o.init_heads);
    const auto& h = loaded.heads;
    if (h.hidden_size() != static_cast<std::size_t>(cfg.dim) || h.vocab_size() != static_cast<std::size_t>(cfg.vocab_size))
      throw medusa::invalid_input("train: --init-heads " + o.init_heads.string() + " holds heads for d=" + std::to_string(h.hidden_size()) +
                                  " V=" + std::to_string(h.vocab_size()) + ", the model has d=" + std::to_string(cfg.dim) + " V=" +
                                  std::to_string(cfg.vocab_size));
    init_heads = std::move(loaded.heads);
  }
  log("model " + o.model.string() + ": d=" + std::to_string(cfg.dim) + " V=" + std::to_string(cfg.vocab_size) + " layers=" +
      std::to_string(cfg.n_layers) + " seq_len=" + std::to_string(cfg.seq_len));
  if (prompts.is_corpus())
    log("corpus " + prompts.root().string() + ": " + std::to_string(prompts.files(split::train).size()) + " train files, " +
        std::to_string(prompts.files(split::eval).size()) + " held-out files");
  else
    log("prompts " + o.prompts.string() + ": " + std::to_string(prompts.lines(split::train).size()) + " train, " +
        std::to_string(prompts.lines(split::eval).size()) + " held-out");

  output_dir outdir(o.out);
  const auto& work = outdir.path();

  // ---- cache key: everything the data depends on ---------------------------------------------
  cache_key_builder kb;
  kb.add("format", std::string("medusa-distill-cache/1"));
  if (!hf_input) {
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
  // A data set the budget cut short lives under its own name (`.partial.bin`), never under the
  // full one; a later run with the same key continues it (see docs/training.md#cache).
  const auto partial_file = cache_dir / ("distill-" + rep.key.hex() + ".partial.bin");
  const auto peek = distill_cache::peek_key(rep.cache_file);
  rep.cache_hit = peek && *peek == rep.key.hash;
  if (rep.cache_hit) {
    log("cache hit: " + rep.cache_file.string());
  } else {
    std::optional<distill_cache> prior;
    if (std::filesystem::exists(partial_file, ec)) {
      // Whatever is wrong with it (truncated, corrupt, other settings), the data starts over and
      // this run's file replaces it.
      auto not_reused = [&](const std::string& why) {
        log("partial cache " + partial_file.string() + " not reused (" + why + "): generating from the start");
      };
      try {
        auto c = distill_cache::open(partial_file);
        if (c.key_hash() != rep.key.hash)
          not_reused("its header names other settings, key " + cache_key{{}, c.key_hash()}.hex());
        else if (c.hidden_size() != static_cast<std::size_t>(cfg.dim) || c.vocab_size() != static_cast<std::size_t>(cfg.vocab_size))
          not_reused("it holds d=" + std::to_string(c.hidden_size()) + " V=" + std::to_string(c.vocab_size()) + ", the model has d=" +
                     std::to_string(cfg.dim) + " V=" + std::to_string(cfg.vocab_size));
        else if (c.dtype() != o.cache_dtype)
          not_reused("its hidden states are " + std::string(medusa::to_string(c.dtype())) + ", this run stores " +
                     std::string(medusa::to_string(o.cache_dtype)));
        else
          prior.emplace(std::move(c));
      } catch (const medusa::io_error& e) {
        not_reused(e.what());
      }
    }
    if (prior)
      log("resuming " + partial_file.string() + ": " + std::to_string(prior->rows()) + " of " + std::to_string(o.tokens) + " positions in " +
          std::to_string(prior->size()) + " sequences");
    log("generating " + std::to_string(o.tokens - (prior ? std::min<std::uint64_t>(o.tokens, prior->rows()) : 0)) +
        " positions of self-distillation data -> " + rep.cache_file.string());
    medusa_llama::engine e(m, generation_engine(threads, o.draft));
    auto dopt = distill_options_of(o);
    if (deadline) dopt.deadline = t_start + (*deadline - t_start) * 6 / 10;  // leave most of the rest for training
    dopt.on_progress = ev.on_distill;
    dopt.progress_interval = ev.progress_interval;
    distill_cache_writer w(rep.cache_file, static_cast<std::size_t>(cfg.dim), static_cast<std::size_t>(cfg.vocab_size), o.cache_dtype,
                           rep.key.hash);
    rep.distill = generate_distill(e, *tok, prompts, dopt, w, prior ? &*prior : nullptr);
    const bool resumed = prior.has_value();
    prior.reset();
    if (rep.distill.deadline_hit) {
      // Nothing new after the resumed records: the partial file stays as it is (the writer's copy is dropped).
      rep.cache_file = resumed && rep.distill.sequences == rep.distill.reused_sequences ? partial_file : w.finish(partial_file);
      log("budget: data generation stopped early at " + std::to_string(rep.distill.rows) + " of " + std::to_string(o.tokens) +
          " positions, kept as " + rep.cache_file.filename().string() + " (a later run with the same settings continues it)");
    } else {
      w.finish();
      std::filesystem::remove(partial_file, ec);  // superseded by the complete data
    }
    write_text(cache_dir / ("distill-" + rep.key.hex() + ".json"), rep.key.json);
    const std::uint64_t new_rows = rep.distill.rows - rep.distill.reused_rows;
    log("generated " + std::to_string(new_rows) + " positions in " + std::to_string(rep.distill.sequences - rep.distill.reused_sequences) +
        " sequences" + (rep.distill.reused_sequences ? " after the " + std::to_string(rep.distill.reused_rows) + " reused" : std::string()) + ", " +
        fmt("%.1f s", rep.distill.seconds) + fmt(", %.0f tok/s", static_cast<double>(new_rows) / std::max(1e-9, rep.distill.seconds)) +
        fmt(", drafts accepted %.1f%%", rep.distill.drafted ? 100.0 * static_cast<double>(rep.distill.accepted) / static_cast<double>(rep.distill.drafted) : 0.0) +
        fmt(", %.2f tokens/forward", rep.distill.forwards ? static_cast<double>(rep.distill.accepted + rep.distill.forwards) / static_cast<double>(rep.distill.forwards) : 0.0));
  }
  const auto data = distill_cache::open(rep.cache_file);
  rep.cache_rows = data.rows();
  rep.cache_bytes = data.file_bytes();
  std::uint64_t eval_rows = 0;
  for (std::size_t r = 0; r < data.size(); ++r)
    if (data[r].which == split::eval) eval_rows += data[r].tokens.size();

  // ---- a draft model instead of heads ----------------------------------------------------------
  if (o.what == recipe::draft) {
    train_draft(o, m, data, prompts, *tok, tok_path, cache_dir, work, threads, deadline, rep, ev, log);
    write_heldout_prompts(work, prompts, *tok, o);
    rep.total_seconds = seconds_since(t_start);
    outdir.commit(cache_dir);
    return rep;
  }

  // ---- an EAGLE-style feature drafter instead of heads ------------------------------------------
  if (o.what == recipe::eagle) {
    train_eagle(o, m, data, prompts, *tok, tok_path, cache_dir, work, threads, deadline, rep, ev, log);
    write_heldout_prompts(work, prompts, *tok, o);
    rep.total_seconds = seconds_since(t_start);
    outdir.commit(cache_dir);
    return rep;
  }

  // ---- an exit projection for self-speculation instead of heads -------------------------------------
  if (o.what == recipe::exit) {
    train_exit(o, m, data, prompts, *tok, cache_dir, work, threads, deadline, rep, ev, log);
    write_heldout_prompts(work, prompts, *tok, o);
    rep.total_seconds = seconds_since(t_start);
    outdir.commit(cache_dir);
    return rep;
  }

  // ---- training -------------------------------------------------------------------------------
  const head_shape shape{static_cast<std::size_t>(cfg.dim), static_cast<std::size_t>(cfg.vocab_size), o.heads, o.layers};
  auto trainer_ptr = init_heads ? std::make_unique<head_trainer>(*init_heads, threads)
                                : std::make_unique<head_trainer>(shape, m.classifier(), o.seed, threads);
  head_trainer& trainer = *trainer_ptr;
  const std::size_t heads_k = trainer.shape().K;
  fit_options fo;
  fo.batch = o.batch;
  fo.epochs = o.epochs;
  fo.decay = o.decay;
  fo.opt = o.opt;
  fo.seed = o.seed;
  const double reserve = 2.0 + static_cast<double>(eval_rows) / 4000.0 + (o.decode_prompts > 0 ? 10.0 + o.decode_prompts * 3.0 : 0.0);
  fo.deadline = deadline;
  fo.reserve_seconds = reserve;
  if (m2 && deadline) {  // the heads-only stage gets a fifth of what is left; the joint stage the rest
    const auto now = clock_type::now();
    fo.deadline = now + (*deadline - now) / 5;
    fo.reserve_seconds = 0;
  }
  fo.on_progress = ev.on_fit;
  fo.progress_interval = ev.progress_interval;
  if (init_heads) {
    log("heads: " + std::to_string(heads_k) + " x " + std::to_string(trainer.shape().L) + " layers from " + o.init_heads.string() +
        (m2 ? " (no heads-only stage)" : ", trained further"));
  }
  if (!init_heads || !m2) {
    log(std::string(m2 ? "stage 1 (heads only): " : "") + "training " + std::to_string(heads_k) + " heads x " + std::to_string(trainer.shape().L) +
        " layers on " + std::to_string(data.rows() - eval_rows) + " positions (" + std::to_string(eval_rows) + " held out), " +
        std::to_string(threads) + " threads");
    rep.fit = fit(trainer, data, fo);
  }

  // ---- Medusa-2: the heads and a LoRA-adapted backbone together ---------------------------------
  medusa_llama::model final_model = m;
  std::vector<backbone_sequence> seqs;
  if (m2) {
    seqs = cache_sequences(data, prompts, *tok, o.seed, o.prompt_min, o.prompt_max);
    lora_model lm(m, o.lora, o.seed ^ 0x10a0a0ull);
    const auto teacher = teacher_for(m, seqs, rep, cache_dir, o.teacher_topk, threads, log);
    joint_options jo;
    jo.heads_lr = o.heads_lr;
    jo.backbone_lr = o.backbone_lr;
    jo.heads_coefficient = o.heads_coefficient;
    jo.decay = o.decay;
    jo.epochs = o.joint_epochs;
    jo.batch_sequences = o.batch_sequences;
    jo.opt = o.opt;
    jo.seed = o.seed;
    jo.deadline = deadline;
    // After it: the quality measurement (two forwards of the held-out data and texts) and the
    // adapted model's own held-out data, about 2 s per 1000 held-out positions on pycode-15m.
    jo.reserve_seconds = reserve + 10.0 + 2.0 * static_cast<double>(eval_rows) / 1000.0;
    jo.on_progress = ev.on_joint;
    jo.progress_interval = ev.progress_interval;
    log("stage 2 (joint): LoRA rank " + std::to_string(o.lora.rank) + fmt(", alpha %g", o.lora.alpha) + fmt(", dropout %g", o.lora.dropout) +
        " on q,k,v,o,gate,up,down (" + std::to_string(lm.params().size()) + " parameters), heads lr " + fmt("%g", o.heads_lr) +
        ", backbone lr " + fmt("%g", o.backbone_lr));
    rep.joint = fit_joint(lm, trainer, seqs, teacher, jo);
    log("joint: " + std::to_string(rep.joint.steps) + " steps in " + fmt("%.1f s", rep.joint.seconds) + fmt(", KL %.4f", rep.joint.final_kl) +
        fmt(", head loss %.4f", rep.joint.final_head_loss) + (rep.joint.budget_limited ? " (shortened by the budget)" : ""));
    const auto texts = held_out_texts(prompts, *tok, o.perplexity_texts, cfg.seq_len);
    rep.quality = measure_quality(lm, seqs, texts, threads);
    log(fmt("adapted model, held out: agreement %.2f%%", 100 * rep.quality.agreement) + fmt(", mean KL %.4f", rep.quality.mean_kl) +
        fmt(", perplexity %.3f", rep.quality.perplexity_adapted) + fmt(" (original %.3f", rep.quality.perplexity_original) + " on " +
        std::to_string(rep.quality.text_tokens) + " tokens)");
    final_model = lm.merged();
    // The merged model, in the input's format, with its tokenizer beside it.
    const auto model_dir = work / "model";
    std::filesystem::create_directories(model_dir, ec);
    if (hf_input) {
      final_model.save_hf(model_dir);
      copy_beside(o.model, model_dir, {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"});
      rep.model_file = o.out / "model";
    } else {
      final_model.save_llama2c(model_dir / "model.bin");
      copy_beside(tok_path.parent_path(), model_dir, {"tokenizer.bin", "tokenizer.model", "tokenizer.json"});
      rep.model_file = o.out / "model" / "model.bin";
    }
    // The adapter, in PEFT's layout and Hugging Face's row order (as `save_hf` orders wq and wk).
    std::vector<std::vector<float>> permuted;
    permuted.reserve(2 * static_cast<std::size_t>(cfg.n_layers));
    std::vector<lora_tensor_pair> pairs;
    for (std::size_t l = 0; l < static_cast<std::size_t>(cfg.n_layers); ++l)
      for (std::size_t p = 0; p < projections_per_layer; ++p) {
        const auto pr = static_cast<projection>(p);
        const auto ll = lm.adapter(l, pr);
        std::span<const float> B(ll.B, ll.out * ll.rank);
        if (cfg.rope == medusa_llama::rope_style::adjacent_pairs && (pr == projection::q || pr == projection::k)) {
          const auto hd = static_cast<std::size_t>(cfg.head_dim());
          permuted.push_back(medusa_llama::adjacent_to_halves(ll.B, ll.out / hd, hd, ll.rank));
          B = permuted.back();
        }
        pairs.push_back({module_path(l, pr), ll.in, ll.out, ll.rank, std::span<const float>(ll.A, ll.rank * ll.in), B});
      }
    peft_adapter_config pc;
    pc.rank = o.lora.rank;
    pc.alpha = o.lora.alpha;
    pc.dropout = o.lora.dropout;
    pc.base_model = o.model.string();
    pc.target_modules = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
    save_peft_adapter(work / "adapter", pairs, pc);
    rep.adapter_dir = o.out / "adapter";
  }

  // ---- evaluation and output ------------------------------------------------------------------
  const auto t_eval = clock_type::now();
  if (!m2) {
    rep.cal = evaluate(trainer, data, split::eval, 10, m.classifier());
  } else {
    // The heads now read the adapted model's hidden states: held-out data from the merged model
    // itself (its own continuations of the held-out prompts).
    const auto eval_file = work / "adapted-eval.bin";
    {
      medusa_llama::engine e(final_model, generation_engine(threads, o.draft));
      auto dopt = distill_options_of(o);
      dopt.tokens = std::max<std::uint64_t>(eval_rows, 16);
      dopt.eval_fraction = 1.0;  // held-out prompts only, from the first one, as the original data's
      distill_cache_writer w(eval_file, static_cast<std::size_t>(cfg.dim), static_cast<std::size_t>(cfg.vocab_size), o.cache_dtype, 0);
      generate_distill(e, *tok, prompts, dopt, w);
      w.finish();
    }
    {
      const auto adapted = distill_cache::open(eval_file);
      rep.cal = evaluate(trainer, adapted, split::eval, 10, final_model.classifier());
    }
    std::filesystem::remove(eval_file, ec);
    // For comparison, the heads on the original model's held-out continuations (what they trained
    // on), read through the merged model: the gap between the two is the distribution shift.
    const auto forced_file = work / "forced-eval.bin";
    {
      medusa_llama::engine_options eo;
      eo.threads = threads;
      eo.max_batch = cfg.seq_len;
      medusa_llama::engine e(final_model, eo);
      distill_cache_writer w(forced_file, static_cast<std::size_t>(cfg.dim), static_cast<std::size_t>(cfg.vocab_size), o.cache_dtype, 0);
      const auto d = static_cast<std::size_t>(cfg.dim);
      std::vector<float> hidden;
      std::vector<int> toks, pos;
      for (const auto& sq : seqs) {
        if (sq.which != split::eval) continue;
        const std::size_t n = sq.tokens.size();
        toks.assign(sq.tokens.begin(), sq.tokens.end());
        pos.resize(n);
        for (std::size_t i = 0; i < n; ++i) pos[i] = static_cast<int>(i);
        hidden.resize(n * d);
        medusa::forward_batch fb;
        fb.tokens = toks;
        fb.positions = pos;
        fb.cache_length = 0;
        fb.hidden = hidden;
        e.forward(fb);
        w.add(std::span<const std::int32_t>(sq.tokens).subspan(sq.row0), std::span<const float>(hidden).subspan(sq.row0 * d), split::eval,
              static_cast<std::uint32_t>(sq.row0 + 1));
      }
      w.finish();
    }
    {
      const auto forced = distill_cache::open(forced_file);
      rep.cal_original_text = evaluate(trainer, forced, split::eval, 10, final_model.classifier());
    }
    std::filesystem::remove(forced_file, ec);
    std::string a, b;
    for (std::size_t k = 0; k < rep.cal.num_heads; ++k) {
      a += fmt(k ? " / %.1f" : "%.1f", 100 * rep.cal.top(k, 1));
      b += fmt(k ? " / %.1f" : "%.1f", 100 * rep.cal_original_text.top(k, 1));
    }
    log("heads, held-out top-1 %: " + a + " on the merged model's own continuations, " + b + " on the original's (teacher-forced)");
  }
  rep.eval_seconds = seconds_since(t_eval);
  medusa::head_save_options so;
  so.dtype = o.heads_dtype;
  so.base_model_name_or_path = m2 ? rep.model_file.string() : o.model.string();
  rep.heads_file = o.out / medusa::save_heads(work, trainer.weights().view(), so).filename();

  // ---- acceptance with the real decoder (optional) ----------------------------------------
  if (o.decode_prompts > 0 && prompts.has(split::eval)) {
    medusa_llama::engine_options eo;
    eo.threads = threads;
    eo.max_batch = 64;
    medusa_llama::engine dm(final_model, eo);
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
    const std::size_t max_d = std::min<std::size_t>(heads_k, 5);
    if (heads_k >= 4) trees.emplace_back("mc_sim_7b_63", medusa::tree::preset("mc_sim_7b_63"));
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
  meta += ",\n  \"recipe\": \"" + std::string(m2 ? "medusa2" : "medusa1") + "\"";
  if (m2) {
    const auto& q = rep.quality;
    meta += ",\n  \"medusa2\": {\"lora_rank\": " + std::to_string(o.lora.rank) + ", \"lora_alpha\": " + fmt("%g", o.lora.alpha) +
            ", \"lora_dropout\": " + fmt("%g", o.lora.dropout) + ", \"heads_lr\": " + fmt("%g", o.heads_lr) + ", \"backbone_lr\": " +
            fmt("%g", o.backbone_lr) + ", \"heads_coefficient\": " + fmt("%g", o.heads_coefficient) + ", \"joint_steps\": " +
            std::to_string(rep.joint.steps) + ", \"joint_seconds\": " + fmt("%.1f", rep.joint.seconds) + ", \"heads_stage_seconds\": " +
            fmt("%.1f", rep.fit.seconds) + ",\n    \"agreement\": " + fmt("%.5f", q.agreement) + ", \"mean_kl\": " + fmt("%.6f", q.mean_kl) +
            ", \"positions\": " + std::to_string(q.positions) + ", \"perplexity_original\": " + fmt("%.4f", q.perplexity_original) +
            ", \"perplexity_adapted\": " + fmt("%.4f", q.perplexity_adapted) + ", \"perplexity_tokens\": " + std::to_string(q.text_tokens) +
            ",\n    \"top1_on_original_continuations\": [" + [&] {
              std::string t;
              for (std::size_t k = 0; k < rep.cal_original_text.num_heads; ++k) t += (k ? ", " : "") + fmt("%.4f", rep.cal_original_text.top(k, 1));
              return t;
            }() + "]" + ",\n    \"model\": " + json_str(rep.model_file.string()) + ", \"adapter\": " + json_str(rep.adapter_dir.string()) + "}";
  }
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
  write_text(work / "calibration.json", calibration_json(rep.cal, meta));
  // Trees grown from the calibration table (docs/training.md), ready for `medusa-run --tree OUT/tree-N.json`.
  const std::size_t grow_depth = std::min<std::size_t>(heads_k, 5);
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
    write_text(work / ("tree-" + std::to_string(nodes) + ".json"), text + "]\n");
  }
  write_heldout_prompts(work, prompts, *tok, o);
  outdir.commit(cache_dir);
  return rep;
}

}  // namespace medusa_train
