// SPDX-License-Identifier: Apache-2.0
// medusa-train: trains Medusa heads on the CPU by self-distillation from the base model (see
// docs/training.md): Medusa-1 (frozen backbone) or Medusa-2 (then heads and a LoRA-adapted backbone
// jointly). Writes medusa_heads.safetensors + config.json + calibration.json (+ model/ and adapter/).
#include "tool_common.hpp"

#include <medusa_llama/openblas_env.hpp>
#include <medusa_train/pipeline.hpp>

#include <fmt/format.h>

#include <cmath>
#include <csignal>
#include <cstdio>
#include <map>
#include <string>
#include <unistd.h>

namespace {

std::string duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  const long t = std::lround(s);
  return t >= 3600 ? fmt::format("{}h{:02}m", t / 3600, (t / 60) % 60) : fmt::format("{}:{:02}", t / 60, t % 60);
}

// One status line: rewritten in place on a terminal, a plain line every few seconds otherwise.
class status_line {
 public:
  status_line() : tty_(isatty(fileno(stderr)) != 0) {}
  void update(const std::string& s, bool force = false) {
    if (tty_) {
      std::fprintf(stderr, "\r\033[K%s", s.c_str());
      std::fflush(stderr);
      dirty_ = true;
      return;
    }
    const auto now = std::chrono::steady_clock::now();
    if (!force && std::chrono::duration<double>(now - last_).count() < 10.0) return;
    last_ = now;
    std::fprintf(stderr, "%s\n", s.c_str());
  }
  void line(const std::string& s) {
    if (tty_ && dirty_) std::fprintf(stderr, "\n");
    dirty_ = false;
    std::fprintf(stderr, "%s\n", s.c_str());
  }

 private:
  bool tty_;
  bool dirty_ = false;
  std::chrono::steady_clock::time_point last_{};
};

}  // namespace

int main(int argc, char** argv) {
  // A file-size limit (or quota) must fail the write with an error, not kill the process.
  std::signal(SIGXFSZ, SIG_IGN);
  // AVX-512 sgemm kernels (5x) where OpenBLAS misdetects the CPU.
  medusa_llama::reexec_with_fast_openblas(argv);
  CLI::App app{"Train Medusa heads on the CPU by self-distillation (Medusa-1: frozen backbone and lm_head)", "medusa-train"};
  medusa_train::run_options o;
  std::string cache_dtype = "bf16";
  std::string heads_dtype = "f32";
  app.add_option("--model", o.model, "base model: llama2.c model.bin, a Hugging Face directory or a .gguf file")->required();
  app.add_option("--tokenizer", o.tokenizer, "tokenizer (default: a GGUF model's own, else tokenizer.json / tokenizer.bin beside the model)");
  app.add_option("--dummy-prefix", o.dummy_prefix,
                 "llama2.c tokenizers: prepend a space to prompts (true/false; default: as the SentencePiece "
                 "model beside tokenizer.bin says, else run.c's behaviour)");
  auto* prompts = app.add_option("--prompts", o.prompts, "prompt file, one prompt per line (\\n escapes)");
  auto* corpus = app.add_option("--corpus", o.corpus, "directory of text/code files to cut prompts from");
  prompts->excludes(corpus);
  app.add_option("--heads", o.heads, "number of Medusa heads K")->capture_default_str();
  app.add_option("--layers", o.layers, "ResBlocks per head")->capture_default_str();
  app.add_option("--out", o.out, "output directory (heads, config.json, calibration.json, cache/)")->required();
  app.add_option("--cache-dir", o.cache_dir, "self-distillation cache directory (default: OUT/cache)");
  app.add_option("--tokens", o.tokens, "positions of self-distillation data (train + held-out)")->capture_default_str();
  app.add_option("--gen-len", o.gen_len, "tokens generated per prompt")->capture_default_str();
  app.add_option("--prompt-min", o.prompt_min, "shortest prompt (tokens incl. BOS)")->capture_default_str();
  app.add_option("--prompt-max", o.prompt_max, "longest prompt (tokens incl. BOS)")->capture_default_str();
  app.add_option("--draft", o.draft, "prompt-lookup draft length while generating data (0 = off)")->capture_default_str();
  app.add_option("--eval-fraction", o.eval_fraction, "held-out share of files/lines and positions")->capture_default_str();
  const std::map<std::string, medusa::dtype> cache_dtypes{{"bf16", medusa::dtype::bf16}, {"f32", medusa::dtype::f32}};
  app.add_option("--cache-dtype", cache_dtype, "hidden states on disk: bf16 or f32")
      ->check(CLI::IsMember(cache_dtypes))
      ->capture_default_str();
  const std::map<std::string, medusa::dtype> heads_dtypes{
      {"f32", medusa::dtype::f32}, {"f16", medusa::dtype::f16}, {"bf16", medusa::dtype::bf16}};
  app.add_option("--heads-dtype", heads_dtype,
                 "element type of the written heads file: f32, f16 or bf16 (half the bytes; training is in f32 either way)")
      ->check(CLI::IsMember(heads_dtypes))
      ->capture_default_str();
  app.add_option("--epochs", o.epochs, "passes over the training positions")->capture_default_str();
  app.add_option("--batch", o.batch, "positions per optimiser step")->capture_default_str();
  app.add_option("--lr", o.opt.lr, "peak learning rate (AdamW, warm-up + cosine)")->capture_default_str();
  app.add_option("--weight-decay", o.opt.weight_decay, "AdamW decoupled weight decay")->capture_default_str();
  app.add_option("--warmup", o.opt.warmup_fraction, "warm-up share of the steps")->capture_default_str();
  app.add_option("--clip", o.opt.clip_norm, "global gradient-norm clip (0 = off)")->capture_default_str();
  app.add_option("--decay", o.decay, "loss weight of head k is decay^k (1 = unweighted, the reference trainer)")->capture_default_str();
  app.add_option("--seed", o.seed, "seed of prompts, initialisation and shuffling")->capture_default_str();
  app.add_option("--threads", o.threads, "threads (0 = all cores)")->capture_default_str();
  app.add_option("--temperature", o.temperature, "data generation temperature (0 = greedy)")->capture_default_str();
  app.add_option("--budget-seconds", o.budget_seconds, "wall-clock budget of the whole run (0 = none); the cosine schedule is fitted to it")
      ->capture_default_str();
  app.add_option("--decode-prompts", o.decode_prompts, "after training, measure acceptance with the decoder on this many held-out prompts")
      ->capture_default_str();
  app.add_option("--decode-tokens", o.decode_tokens, "tokens per acceptance prompt")->capture_default_str();
  std::string recipe = "medusa1";
  app.add_option("--recipe", recipe,
                 "medusa1: heads on the frozen model; medusa2: then heads and a LoRA-adapted backbone jointly; draft: a small draft "
                 "model distilled from the model (OUT/draft/model.bin, for medusa-run --draft-model); eagle: an EAGLE-style feature "
                 "drafter, one block on the model's hidden states (OUT/eagle/model.bin + fc.bin); exit: an exit projection "
                 "for self-speculation with the model's first layers (OUT/exit/exit.bin, for medusa-run --exit)")
      ->check(CLI::IsMember({"medusa1", "medusa2", "draft", "eagle", "exit"}))
      ->capture_default_str();
  app.add_option("--init-heads", o.init_heads, "start from these trained heads (medusa2: instead of the heads-only stage)");
  app.add_option("--lora-rank", o.lora.rank, "medusa2: LoRA rank r (1..d)")->capture_default_str();
  app.add_option("--lora-alpha", o.lora.alpha, "medusa2: LoRA alpha (the update is alpha/r * B A)")->capture_default_str();
  app.add_option("--lora-dropout", o.lora.dropout, "medusa2: dropout of the adapters' input")->capture_default_str();
  app.add_option("--heads-lr", o.heads_lr, "medusa2 joint stage: peak learning rate of the heads")->capture_default_str();
  app.add_option("--backbone-lr", o.backbone_lr, "medusa2 joint stage: peak learning rate of the adapters (below --heads-lr)")->capture_default_str();
  app.add_option("--heads-coefficient", o.heads_coefficient, "medusa2: weight of the heads' loss next to the self-distillation KL")
      ->capture_default_str();
  app.add_option("--joint-epochs", o.joint_epochs, "medusa2: passes of the joint stage over the training sequences")->capture_default_str();
  app.add_option("--batch-sequences", o.batch_sequences, "medusa2, draft, eagle, exit: sequences per optimiser step")->capture_default_str();
  app.add_option("--teacher-topk", o.teacher_topk, "medusa2, draft, eagle, exit: logits of the original model kept per position for the KL")
      ->capture_default_str();
  app.add_option("--draft-layers", o.draft_layers, "draft: blocks of the draft model")->capture_default_str();
  app.add_option("--draft-dim", o.draft_dim, "draft: width of the draft model")->capture_default_str();
  app.add_option("--draft-hidden-dim", o.draft_hidden, "draft: SwiGLU width (0: 3 x the width)")->capture_default_str();
  app.add_option("--draft-heads", o.draft_heads, "draft: attention heads")->capture_default_str();
  app.add_option("--draft-lr", o.draft_lr, "draft: peak learning rate")->capture_default_str();
  app.add_option("--draft-epochs", o.draft_epochs, "draft: passes over the training sequences")->capture_default_str();
  app.add_option("--eagle-hidden-dim", o.eagle_hidden, "eagle: SwiGLU width of the drafter's block (0: the model's)")->capture_default_str();
  app.add_option("--eagle-lr", o.eagle_lr, "eagle: peak learning rate")->capture_default_str();
  app.add_option("--eagle-epochs", o.eagle_epochs, "eagle: passes over the training sequences")->capture_default_str();
  app.add_option("--eagle-reg", o.eagle_reg, "eagle: weight of the feature regression (SmoothL1) next to the KL")->capture_default_str();
  app.add_option("--eagle-noise", o.eagle_noise, "eagle: input feature noise U(-a, a) while training, a = this x the features' RMS")
      ->capture_default_str();
  app.add_option("--exit-layers", o.exit_layers, "exit: the draft's layers, the model's first (0: half of them)")->capture_default_str();
  app.add_option("--exit-lr", o.exit_lr, "exit: peak learning rate")->capture_default_str();
  app.add_option("--exit-epochs", o.exit_epochs, "exit: passes over the training sequences")->capture_default_str();
  bool quiet = false;
  app.add_flag("--no-progress", quiet, "no progress lines (errors and the summary only)");

  return medusa_tools::run_tool(app, argc, argv, [&] {
    if (o.prompts.empty() && o.corpus.empty()) throw medusa_tools::usage_error("give --prompts FILE or --corpus DIR");
    o.cache_dtype = cache_dtypes.at(cache_dtype);
    o.heads_dtype = heads_dtypes.at(heads_dtype);
    o.what = recipe == "medusa2" ? medusa_train::recipe::medusa2
             : recipe == "draft" ? medusa_train::recipe::draft
             : recipe == "eagle" ? medusa_train::recipe::eagle
             : recipe == "exit"  ? medusa_train::recipe::exit
                                 : medusa_train::recipe::medusa1;
    status_line st;
    medusa_train::run_events ev;
    ev.log = [&](const std::string& s) { st.line(s); };
    if (!quiet) {
      ev.on_distill = [&](const medusa_train::distill_progress& p) {
        st.update(fmt::format("data  {:>8}/{} positions  {:>5} seqs  {:6.0f} tok/s  elapsed {}  ETA {}", p.rows, p.target_rows,
                              p.sequences, p.tokens_per_second, duration(p.elapsed), duration(p.eta)));
      };
      ev.on_fit = [&](const medusa_train::fit_progress& p) {
        std::string acc;
        for (double a : p.head_top1) acc += fmt::format(" {:4.1f}", 100 * a);
        st.update(fmt::format("train step {:>6}/{}  loss {:.4f}  top1%{}  lr {:.2e}  {:6.0f} pos/s  elapsed {}  ETA {}", p.step,
                              p.total_steps, p.loss, acc, p.lr, p.positions_per_second, duration(p.elapsed), duration(p.eta)),
                  p.step == p.total_steps);
      };
      ev.on_joint = [&](const medusa_train::joint_progress& p) {
        std::string acc;
        for (double a : p.head_top1) acc += fmt::format(" {:4.1f}", 100 * a);
        st.update(fmt::format("joint step {:>6}/{}  KL {:.4f}  heads {:.3f}  top1%{}  lr {:.2e}  {:5.0f} pos/s  elapsed {}  ETA {}", p.step,
                              p.total_steps, p.kl, p.head_loss, acc, p.lr, p.positions_per_second, duration(p.elapsed), duration(p.eta)),
                  p.step == p.total_steps);
      };
      ev.on_draft = [&](const medusa_train::draft_progress& p) {
        st.update(fmt::format("{} step {:>6}/{}  KL {:.4f}  agreement {:4.1f}%  lr {:.2e}  {:5.0f} pos/s  elapsed {}  ETA {}", recipe, p.step,
                              p.total_steps, p.kl, 100 * p.agreement, p.lr, p.positions_per_second, duration(p.elapsed), duration(p.eta)),
                  p.step == p.total_steps);
      };
      ev.on_eagle = [&](const medusa_train::eagle_progress& p) {
        st.update(fmt::format("eagle step {:>6}/{}  KL {:.4f}  reg {:.4f}  agreement {:4.1f}%  lr {:.2e}  {:5.0f} pos/s  elapsed {}  ETA {}", p.step,
                              p.total_steps, p.kl, p.regression, 100 * p.agreement, p.lr, p.positions_per_second, duration(p.elapsed),
                              duration(p.eta)),
                  p.step == p.total_steps);
      };
    }
    const auto r = medusa_train::run_training(o, ev);
    if (o.what == medusa_train::recipe::eagle) {
      const auto& q = r.eagle_eval;
      st.line(fmt::format("eagle: {} steps ({} positions seen) in {:.1f} s{}", r.eagle_fit.steps, r.eagle_fit.positions_seen, r.eagle_fit.seconds,
                          r.eagle_fit.budget_limited ? " (shortened by the budget)" : ""));
      st.line(fmt::format("held-out: {} positions, agreement with the model's own argmax {:.1f}%", q.positions, 100 * q.agreement));
      st.line("chain  accepted  tokens/step  (teacher-forced)");
      for (std::size_t k = 0; k < q.chain_tokens.size(); ++k)
        st.line(fmt::format("{:>5}  {:7.1f}%  {:11.3f}  ({:.3f})", k + 1, 100 * q.acceptance[k], q.chain_tokens[k], q.chain_tokens_teacher_forced[k]));
      st.line(fmt::format("wrote {}, fc.bin and calibration.json ({:.1f} s total)", r.eagle_file.string(), r.total_seconds));
      return medusa_tools::exit_ok;
    }
    if (o.what == medusa_train::recipe::exit) {
      const auto& q = r.exit_eval;
      const auto& b = r.exit_base;
      st.line(fmt::format("exit: {} steps ({} positions seen) in {:.1f} s{}", r.exit_fit.steps, r.exit_fit.positions_seen, r.exit_fit.seconds,
                          r.exit_fit.budget_limited ? " (shortened by the budget)" : ""));
      st.line(fmt::format("held-out: {} positions, agreement with the model's own argmax {:.1f}% (without the exit {:.1f}%)", q.positions,
                          100 * q.agreement, 100 * b.agreement));
      st.line("chain  accepted  tokens/step  (without the exit)");
      for (std::size_t k = 0; k < q.chain_tokens.size(); ++k)
        st.line(fmt::format("{:>5}  {:7.1f}%  {:11.3f}  ({:.3f})", k + 1, 100 * q.acceptance[k], q.chain_tokens[k],
                            k < b.chain_tokens.size() ? b.chain_tokens[k] : 0.0));
      st.line(fmt::format("wrote {} and calibration.json ({:.1f} s total)", r.exit_file.string(), r.total_seconds));
      return medusa_tools::exit_ok;
    }
    if (o.what == medusa_train::recipe::draft) {
      const auto& q = r.draft_eval;
      st.line(fmt::format("draft: {} steps ({} positions seen) in {:.1f} s{}", r.draft_fit.steps, r.draft_fit.positions_seen, r.draft_fit.seconds,
                          r.draft_fit.budget_limited ? " (shortened by the budget)" : ""));
      st.line(fmt::format("held-out: {} positions, agreement with the model's own argmax {:.1f}%", q.positions, 100 * q.agreement));
      st.line("chain  accepted  tokens/step");
      for (std::size_t k = 0; k < q.chain_tokens.size(); ++k)
        st.line(fmt::format("{:>5}  {:7.1f}%  {:.3f}", k + 1, 100 * q.acceptance[k], q.chain_tokens[k]));
      st.line(fmt::format("wrote {} and calibration.json ({:.1f} s total)", r.draft_file.string(), r.total_seconds));
      return medusa_tools::exit_ok;
    }
    if (r.fit.steps > 0 || o.init_heads.empty())
      st.line(fmt::format("{}trained {} steps ({} positions seen, {} available) in {:.1f} s{}",
                          o.what == medusa_train::recipe::medusa2 ? "heads only: " : "", r.fit.steps, r.fit.positions_seen,
                          r.fit.train_positions, r.fit.seconds, r.fit.budget_limited ? " (shortened by the budget)" : ""));
    else
      st.line("heads only: skipped (the heads of --init-heads)");
    if (o.what == medusa_train::recipe::medusa2)
      st.line(fmt::format("joint: {} steps ({} positions seen) in {:.1f} s{}", r.joint.steps, r.joint.positions_seen, r.joint.seconds,
                          r.joint.budget_limited ? " (shortened by the budget)" : ""));
    st.line(fmt::format("held-out: {} sequences, {} positions; base lm_head agreement {:.1f}%", r.cal.sequences,
                        r.cal.positions.empty() ? 0 : r.cal.positions[0],
                        r.cal.base_positions ? 100.0 * static_cast<double>(r.cal.base_hits) / static_cast<double>(r.cal.base_positions) : 0.0));
    st.line("head  target  top-1   top-5   top-10  loss");
    for (std::size_t k = 0; k < r.cal.num_heads; ++k)
      st.line(fmt::format("{:>4}  t+{:<4}  {:5.1f}%  {:5.1f}%  {:5.1f}%  {:.3f}", k, k + 2, 100 * r.cal.top(k, 1), 100 * r.cal.top(k, 5),
                          100 * r.cal.top(k, 10), r.cal.mean_loss[k]));
    if (o.what == medusa_train::recipe::medusa2) {
      st.line(fmt::format("adapted model (held out): agreement {:.2f}%, mean KL {:.4f}, perplexity {:.3f} vs original {:.3f} ({:+.2f}%)",
                          100 * r.quality.agreement, r.quality.mean_kl, r.quality.perplexity_adapted, r.quality.perplexity_original,
                          r.quality.perplexity_original > 0 ? 100 * (r.quality.perplexity_adapted / r.quality.perplexity_original - 1) : 0.0));
      st.line(fmt::format("wrote the merged model {} and the adapter {}", r.model_file.string(), r.adapter_dir.string()));
    }
    st.line(fmt::format("wrote {}, config.json, calibration.json ({:.1f} s total)", r.heads_file.string(), r.total_seconds));
    return medusa_tools::exit_ok;
  });
}
