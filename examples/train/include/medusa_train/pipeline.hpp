// SPDX-License-Identifier: Apache-2.0
//! @file pipeline.hpp
//! The whole `medusa-train` run as one function: load the base model, build or reuse the
//! self-distillation cache, train the heads, evaluate them on the held-out split, save
//! `medusa_heads.safetensors` + `config.json` + `calibration.json` in the output directory, and
//! optionally measure real acceptance with `medusa::decoder`.
//!
//! @code
//! medusa_train::run_options o;
//! o.model = "/work/shared/models/pycode-15m/model.bin";
//! o.corpus = "/usr/lib/python3.11";
//! o.out = "heads-out";
//! auto r = medusa_train::run_training(o, {});
//! std::printf("head-0 top-1 %.1f%%\n", 100 * r.calibration.top(0, 1));
//! @endcode
#pragma once

#include <medusa_train/distill_cache.hpp>
#include <medusa_train/draft_distill.hpp>
#include <medusa_train/eagle_distill.hpp>
#include <medusa_train/exit_distill.hpp>
#include <medusa_train/medusa2.hpp>
#include <medusa_train/selfdistill.hpp>
#include <medusa_train/trainer.hpp>

#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace medusa_train {

//! What `run_training` trains.
enum class recipe {
  medusa1,  //!< heads on the frozen backbone
  medusa2,  //!< heads, then heads and a LoRA-adapted backbone jointly (docs/training.md)
  draft,    //!< a small draft model distilled from the target (no heads; docs/training.md)
  eagle,    //!< an EAGLE-style feature drafter: one block on the target's features (docs/training.md)
  exit,     //!< an exit projection for self-speculation: the target's first layers as the draft
};

//! Everything `medusa-train` can be told.
struct run_options {
  recipe what = recipe::medusa1;     //!< the training recipe
  std::filesystem::path model;       //!< llama2.c `model.bin`, a Hugging Face directory or a GGUF file
  std::filesystem::path tokenizer;   //!< empty: a GGUF model's own, else `tokenizer.json` / `tokenizer.bin` beside the model
  //! llama2.c tokenizers: prepend a space (run.c). Unset: medusa_llama::default_dummy_prefix
  //! (the SentencePiece model beside tokenizer.bin decides; pycode-15m's says no).
  std::optional<bool> dummy_prefix;
  std::filesystem::path prompts;     //!< prompt file (one per line), or
  std::filesystem::path corpus;      //!< corpus directory
  std::filesystem::path out;         //!< output directory
  std::filesystem::path cache_dir;   //!< empty: `out/cache`
  std::size_t heads = 4;             //!< K
  std::size_t layers = 1;            //!< ResBlocks per head
  std::uint64_t tokens = 200000;     //!< positions of self-distillation data (train + held-out)
  double eval_fraction = 0.1;        //!< held-out share
  int gen_len = 192;                 //!< tokens generated per prompt
  int prompt_min = 16;               //!< prompt length range (tokens incl. BOS)
  int prompt_max = 64;               //!< prompt length range
  int draft = 12;                    //!< prompt-lookup drafting during generation (0 = off)
  float temperature = 0.0f;          //!< 0 = greedy continuations
  medusa::weight_dtype cache_dtype = medusa::weight_dtype::bf16;  //!< hidden states on disk
  medusa::weight_dtype heads_dtype = medusa::weight_dtype::f32;   //!< the written heads file's elements
  double epochs = 2.0;               //!< passes over the training positions
  std::size_t batch = 256;           //!< positions per step
  optimizer_options opt;             //!< lr, AdamW, schedule, clipping
  float decay = 0.8f;                //!< loss weight decay^k (1 = unweighted)
  std::uint64_t seed = 0;            //!< data, initialisation and shuffling
  int threads = 0;                   //!< 0 = hardware threads
  double budget_seconds = 0;         //!< wall-clock budget for the whole run (0 = none)
  int decode_prompts = 0;            //!< held-out prompts for the acceptance measurement (0 = skip)
  int decode_tokens = 128;           //!< tokens generated per decode prompt
  // Medusa-2 (recipe::medusa2):
  std::filesystem::path init_heads;  //!< start from these trained heads instead of the heads-only stage
  lora_options lora;                 //!< rank, α, dropout of the adapters
  double heads_lr = 2e-3;            //!< joint stage: peak learning rate of the heads
  double backbone_lr = 1e-4;         //!< joint stage: peak learning rate of the adapters (< heads_lr)
  double heads_coefficient = 0.2;    //!< λ0, the heads' share of the joint loss
  double joint_epochs = 1.0;         //!< joint stage: passes over the training sequences
  std::size_t batch_sequences = 8;   //!< joint stage: sequences per step
  std::size_t teacher_topk = 32;     //!< logits of the original model kept per position
  int perplexity_texts = 40;         //!< held-out texts scored for perplexity
  // Draft model (recipe::draft); it shares the target's vocabulary, context, norm and RoPE settings:
  int draft_layers = 2;              //!< blocks
  int draft_dim = 128;               //!< width
  int draft_hidden = 0;              //!< SwiGLU width (0: 3 × width)
  int draft_heads = 4;               //!< attention heads (key/value heads the same)
  double draft_lr = 3e-3;            //!< peak learning rate
  double draft_epochs = 4.0;         //!< passes over the training sequences
  // EAGLE-style feature drafter (recipe::eagle); one block of the target's shape:
  int eagle_hidden = 0;              //!< the block's SwiGLU width (0: the target's)
  double eagle_lr = 2e-3;            //!< peak learning rate
  double eagle_epochs = 4.0;         //!< passes over the training sequences
  double eagle_reg = 1.0;            //!< weight of the feature regression (SmoothL1) next to the KL
  double eagle_noise = 0.1;          //!< input feature noise U(−a, a), a = this × the features' RMS
  // Exit projection (recipe::exit): a [dim][dim] layer after the first layers' final norm:
  int exit_layers = 0;               //!< the draft's layers (0: half the target's)
  double exit_lr = 1e-3;             //!< peak learning rate
  double exit_epochs = 8.0;          //!< passes over the training sequences
};

//! Acceptance of one tree measured with `medusa::decoder` (greedy) against plain decoding.
struct acceptance_result {
  std::string tree;                 //!< tree name
  int nodes = 0;                    //!< nodes incl. root
  double tokens_per_step = 0;       //!< emitted tokens per forward pass (1 + accepted drafts)
  double predicted = 0;             //!< 1 + calibration estimate of accepted drafts
  double medusa_tokens_per_second = 0;  //!< decoding speed with the tree
  double vanilla_tokens_per_second = 0; //!< plain decoding speed
  bool identical = true;            //!< Medusa output == plain greedy output for every prompt
  int prompts = 0;                  //!< prompts decoded
};

//! What `run_training` did.
struct run_report {
  cache_key key;                       //!< what the data depends on
  std::filesystem::path cache_file;    //!< the cache used
  bool cache_hit = false;              //!< reused an existing cache
  distill_stats distill;               //!< generation (zero on a cache hit; `reused_*`: a `.partial.bin` resumed)
  std::uint64_t cache_rows = 0;        //!< positions in the cache
  std::uint64_t cache_bytes = 0;       //!< cache file size
  fit_result fit;                      //!< training
  calibration cal;                     //!< held-out evaluation
  std::vector<acceptance_result> acceptance;  //!< decoder measurements (if asked)
  std::filesystem::path heads_file;    //!< saved weights
  // Medusa-2:
  joint_result joint;                  //!< the joint stage
  adapted_quality quality;             //!< the adapted model against the original (held out)
  calibration cal_original_text;       //!< the heads on the original model's held-out continuations (`cal`: on the merged model's own)
  std::filesystem::path model_file;    //!< the merged model (OUT/model/…)
  std::filesystem::path adapter_dir;   //!< the PEFT adapter (OUT/adapter)
  // Draft model:
  draft_fit_result draft_fit;          //!< its training
  draft_quality draft_eval;            //!< its held-out agreement and chain acceptance
  std::filesystem::path draft_file;    //!< OUT/draft/model.bin (OUT/draft, a Hugging Face directory, for RoPE on halves)
  // EAGLE-style feature drafter:
  eagle_fit_result eagle_fit;          //!< its training
  eagle_quality eagle_eval;            //!< its held-out agreement and chain acceptance
  std::filesystem::path eagle_file;    //!< OUT/eagle/model.bin (OUT/eagle, a Hugging Face directory, for RoPE on halves)
  double feature_rms = 0;              //!< RMS of the target's features (the noise's scale)
  // Exit projection:
  draft_fit_result exit_fit;           //!< its training
  draft_quality exit_base;             //!< the plain first layers, held out (the identity exit)
  draft_quality exit_eval;             //!< the trained exit, held out
  std::filesystem::path exit_file;     //!< OUT/exit/exit.bin
  double eval_seconds = 0;             //!< evaluation time
  double total_seconds = 0;            //!< whole run
};

//! Callbacks of `run_training` (all optional).
struct run_events {
  std::function<void(const std::string&)> log;                 //!< one-line messages
  std::function<void(const distill_progress&)> on_distill;     //!< generation progress
  std::function<void(const fit_progress&)> on_fit;             //!< training progress
  std::function<void(const joint_progress&)> on_joint;         //!< Medusa-2 joint-stage progress
  std::function<void(const draft_progress&)> on_draft;         //!< draft-model training progress
  std::function<void(const eagle_progress&)> on_eagle;         //!< feature-drafter training progress
  double progress_interval = 0.5;  //!< seconds between progress callbacks (0: after every sequence or step)
};

//! Runs everything (see the file comment). The output directory is written as a temporary
//! sibling directory and renamed over `o.out` at the end (the cache directory, when inside it,
//! moves with it), so a failed run leaves `o.out` as it was. Throws `medusa::invalid_input` for bad options or
//! inputs, `medusa::io_error` / engine errors otherwise.
run_report run_training(const run_options& o, const run_events& ev);

//! The tokenizer `run_training` uses for `o` (explicit path, a GGUF model itself, or beside the model).
[[nodiscard]] std::filesystem::path resolve_tokenizer(const run_options& o);

}  // namespace medusa_train
