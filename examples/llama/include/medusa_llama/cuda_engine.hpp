// SPDX-License-Identifier: Apache-2.0
//! @file cuda_engine.hpp
//! The example Llama engine on a CUDA GPU, and greedy Medusa decoding with the whole step on the
//! device (docs/cuda.md walks through it). This header needs no CUDA headers; without a CUDA build
//! or without a device, construction throws `engine_error` (`no_device`).
//!
//! - `cuda_engine`: the model's weights in f32, f16 or bf16 on the device, a paged KV pool in device
//!   memory, cuBLASLt GEMMs, the library's tree attention. It is a `medusa::batch_decoder_model` that
//!   commits accepted paths itself (`commit`: the decoders never touch device memory), so
//!   `medusa::batch_decoder` drives it with any policy, drafts or tree.
//! - `cuda_decoder`: greedy decoding of a batch where a step never leaves the device: the library's
//!   `medusa::cuda::device_step` (heads, candidates, the tree forward, verification, the KV commit
//!   and the bookkeeping as one CUDA graph, replayed every step) around this engine's forward; the
//!   host reads back the committed tokens. Near the end of the context, where a whole tree no
//!   longer fits, a request takes smaller trees, then plain steps, so the tokens equal plain greedy
//!   decoding's up to the last slot.
//!
//! @code
//! medusa_llama::cuda_engine gpu(medusa_llama::model::load_llama2c("model.bin"),
//!                               {.precision = medusa::dtype::bf16});
//! auto loaded = medusa::load_heads("heads/");                  // <medusa/io.hpp>
//! auto tree = medusa::tree::preset("mc_sim_7b_63");
//! medusa_llama::cuda_decoder medusa_dec(gpu, loaded.heads.view(), tree), plain_dec(gpu);
//! auto a = medusa_dec.generate(prompts, 256);                  // the same tokens as
//! auto b = plain_dec.generate(prompts, 256);                   // plain greedy decoding
//! @endcode
#pragma once

#include <medusa/decoder/model.hpp>
#include <medusa/decoder/options.hpp>
#include <medusa/decoder/step_cost.hpp>
#include <medusa/dtype.hpp>
#include <medusa/heads.hpp>
#include <medusa/tree.hpp>
#include <medusa_llama/errors.hpp>
#include <medusa_llama/model.hpp>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace medusa_llama {

//! Sizes, device and precision of a `cuda_engine`.
struct cuda_engine_options {
  //! Element type of the weights, the GEMM inputs and the KV cache. GEMMs accumulate in f32; the
  //! residual stream, logits and hidden states are f32 in every case.
  medusa::dtype precision = medusa::dtype::bf16;
  int device = 0;          //!< CUDA device ordinal
  int page_size = 16;      //!< KV slots per page
  int num_pages = 0;       //!< pages in the pool; 0 = enough for `max_requests` full contexts
  int max_requests = 8;    //!< request ids are `0 .. max_requests-1`
  int max_context = 0;     //!< most slots of one request; 0 = the model's seq_len
  int max_tokens = 512;    //!< most tokens in one pass (sizes the activations); longer prefills run in passes
  int kv_split = 0;        //!< keys per attention split (a multiple of 32); 0 = from max_context
  //! Decode passes (one token a request) run the library's single-query attention kernel, which
  //! keeps a whole block busy on one query row; false runs the general kernel. The same bits.
  bool single_query_attention = true;
  //! One cuBLASLt algorithm per weight shape for every pass size (no split-K): a row's logits do
  //! not depend on the pass it is in, so greedy Medusa reproduces plain decoding bit for bit.
  //! `false` lets cuBLASLt pick per pass size (faster small passes; outputs may differ in the
  //! last bits, and then at near-ties in the tokens).
  bool batch_invariant = true;
  //! bf16/f16 GEMMs through the library's skinny GEMM (`medusa/cuda/skinny_gemm.cuh`: tensor
  //! cores, every row reduced in one order whatever the pass size, so batch-invariant by
  //! construction; on an H200 a 7B decode runs faster than on pinned cuBLASLt, docs/performance.md)
  //! instead of cuBLASLt (pinned or not by `batch_invariant`). f32 always uses cuBLASLt.
  bool library_gemm = true;
};

//! True when this build has the CUDA engine (nvcc was found at configure time).
[[nodiscard]] bool cuda_engine_compiled() noexcept;
//! CUDA devices visible to this process; 0 without a driver, a device or a CUDA build.
[[nodiscard]] int cuda_device_count() noexcept;

//! A model on a CUDA device: a `medusa::batch_decoder_model` with the `reserve`, `release`,
//! `max_context` and `commit` hooks.
class cuda_engine {
 public:
  //! Uploads the weights (converted to the precision), allocates the KV pool and the activations.
  //! Throws `engine_error`: `no_device` (no CUDA build, no device, or `device` out of range),
  //! `bad_option` (options out of range), `device_failure` (allocation or a CUDA call failed).
  explicit cuda_engine(const model& m, cuda_engine_options options = {});
  //! An engine of `config`'s shape with random weights made on the device (projections uniform
  //! in ±1/sqrt(inputs), norms 1): benchmarks of real shapes (7B) without their checkpoints.
  //! Throws as the constructor does, and `bad_option` for an invalid `config`.
  [[nodiscard]] static cuda_engine synthetic(const model_config& config, cuda_engine_options options = {},
                                             std::uint64_t seed = 0);
  cuda_engine(const cuda_engine&) = delete;
  cuda_engine& operator=(const cuda_engine&) = delete;
  cuda_engine(cuda_engine&&) noexcept;
  cuda_engine& operator=(cuda_engine&&) noexcept;
  ~cuda_engine();

  [[nodiscard]] const model_config& config() const noexcept;          //!< the model's configuration
  [[nodiscard]] const cuda_engine_options& options() const noexcept;  //!< after defaults were resolved
  [[nodiscard]] std::string device_name() const;                      //!< e.g. "NVIDIA H100 80GB HBM3"
  [[nodiscard]] std::size_t weight_bytes() const noexcept;            //!< bytes one forward streams
  [[nodiscard]] int vocab_size() const noexcept;
  [[nodiscard]] int hidden_size() const noexcept;
  [[nodiscard]] int max_context() const noexcept;

  //! Maps pages to `request` until slots `[0, slots)` are addressable (see `batch_engine::reserve`).
  void reserve(int request, int slots);
  //! Returns `request`'s pages wholly past slot `length` to the pool.
  void release(int request, int length);
  //! Runs a ragged batch (see `medusa::ragged_batch` and `batch_engine::forward`): inputs copied to
  //! the device, logits and hidden states copied back. Throws `engine_error` before the device is
  //! touched for any inconsistent argument.
  void forward(const medusa::ragged_batch& batch);
  //! Moves the K/V rows of `request`'s accepted `path` (a tree pass of `num_tree_nodes` at
  //! `committed_length`) to `[L, L + path.size())` on the device; returns the new length.
  int commit(int request, int committed_length, int num_tree_nodes, std::span<const int> path);

  //! The device's step-cost curve (`medusa::optimize_tree` picks a tree with it): the forward pass
  //! of each `opt.rows` tokens after `opt.context` slots of request `opt.request`, each captured as
  //! a CUDA graph and timed by CUDA events (the fastest of `opt.repeats` rounds of 5 replays), and,
  //! with `heads`, the heads' time per head on one hidden state. The request's cache is
  //! overwritten and its pages released: measure on a free request. Throws `engine_error`
  //! (`bad_option` for sizes that do not fit the engine) and `medusa::invalid_input` for rows not
  //! ascending from 1.
  [[nodiscard]] medusa::step_cost_curve measure_step_cost(const medusa::step_cost_options& opt,
                                                          const medusa::head_stack<>* heads = nullptr);

 private:
  friend class cuda_decoder;
  // The weights of `m`, or random ones of `config`'s shape when `m` is null.
  cuda_engine(const model_config& config, const model* m, cuda_engine_options options, std::uint64_t seed);
  struct impl;
  std::unique_ptr<impl> p_;
};

static_assert(medusa::batch_decoder_model<cuda_engine>);
static_assert(medusa::kv_committing_model<cuda_engine>);
static_assert(medusa::kv_reserving_model<cuda_engine>);

//! One request's output.
struct cuda_request_result {
  std::vector<std::int32_t> tokens;  //!< generated tokens
  //! `max_tokens`, `eos` (not emitted), `callback` (the stop token, emitted), `context_full` (no
  //! slot left: the token chosen at the last slot is emitted) or `failed` (`error` says why)
  medusa::stop_reason stop = medusa::stop_reason::max_tokens;
  int steps = 0;      //!< steps the request took part in
  std::string error;  //!< with `failed`: the request, the step and the status
};

//! Figures of the last `generate`.
struct cuda_decode_stats {
  int steps = 0;                    //!< graph replays
  std::vector<long long> accepted;  //!< Medusa: tree steps of requests by accepted drafts (0..depth)
  std::vector<long long> by_size;   //!< request steps by tree size, largest first, the plain step last
  double prefill_seconds = 0;       //!< the prompts' forward
  double decode_seconds = 0;        //!< capture, steps and downloads
  double step_seconds = 0;          //!< the steps alone: graph replays and their downloads
};

//! Greedy decoding of a batch on the engine's device, one CUDA graph per step (see the file
//! comment). Requests 0..B-1 of the engine are used and released again.
class cuda_decoder {
 public:
  //! Plain decoding: one token per request per step.
  explicit cuda_decoder(cuda_engine& engine);
  //! Medusa decoding over `tree` with the first `tree.depth()` of `heads` (uploaded in the
  //! engine's precision; at most 5 are used). The weights `heads` views must outlive the decoder.
  //! Throws `engine_error` (`bad_option`) for a tree of one node, too few heads, or heads of
  //! another hidden or vocabulary size.
  cuda_decoder(cuda_engine& engine, const medusa::head_stack<>& heads, const medusa::tree& tree);
  cuda_decoder(const cuda_decoder&) = delete;
  cuda_decoder& operator=(const cuda_decoder&) = delete;
  cuda_decoder(cuda_decoder&&) noexcept;
  cuda_decoder& operator=(cuda_decoder&&) noexcept;
  ~cuda_decoder();

  //! Decodes every prompt for up to `max_new_tokens` tokens (fewer at EOS, the stop token or the
  //! context's end). `eos_token` ends a request without being emitted; `stop_token` is emitted,
  //! then ends it (-1: none). Throws `engine_error` for an empty prompt, more prompts than the
  //! engine's requests, a batch of trees beyond `max_tokens`, or a device failure.
  std::vector<cuda_request_result> generate(std::span<const std::vector<std::int32_t>> prompts, int max_new_tokens,
                                            int eos_token = -1, int stop_token = -1);
  //! Figures of the last `generate`.
  [[nodiscard]] const cuda_decode_stats& stats() const noexcept;

 private:
  struct impl;
  std::unique_ptr<impl> p_;
};

}  // namespace medusa_llama
