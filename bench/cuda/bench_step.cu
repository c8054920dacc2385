// SPDX-License-Identifier: Apache-2.0
// The non-model kernels of a Medusa step on a CUDA device: per-head top-k, candidate gather,
// verification (greedy, typical, rejection), at batch 1/8/32, vocab 32000/128256, the 64-node
// mc_sim_7b_63 tree, bf16 logits; and the library's whole device step (`device_step`: heads,
// candidates, verify, commit, bookkeeping as one CUDA graph) at batch 1/8/32, vocab 32000. Times are CUDA-event times of 10 back-to-back launches per iteration (manual time),
// with the inputs rotated over enough copies to defeat the 50 MB L2. Run with
// `--benchmark_repetitions=15 --benchmark_report_aggregates_only=true` for medians.
// Also times the Llama-7B linear layers (cuBLAS bf16 GEMMs) for the same tokens, the floor of a
// decode step, to put the step kernels in proportion. Exits 77 without a device.
#include <benchmark/benchmark.h>
#include <cublas_v2.h>
#include <medusa/cuda/common.cuh>
#include <medusa/cuda/device_step.hpp>
#include <medusa/cuda/kv_commit.cuh>
#include <medusa/cuda/step_instances.cuh>
#include <medusa/cuda/stream_executor.cuh>
#include <medusa/tree.hpp>

#include <algorithm>
#include <memory>
#include <cstdio>
#include <random>
#include <vector>

#include "device_benchmark_main.hpp"

namespace mc = medusa::cuda;
namespace mk = medusa::cuda::kernels;
using tag = medusa::presets::tag_of<"mc_sim_7b_63">;
using logit = medusa::bfloat16;
using step = mc::step_kernels<tag, logit>;
constexpr int head_count = 4;  // Medusa heads: the preset is 4 deep

namespace {

constexpr int launches_per_iteration = 10;
constexpr std::size_t rotate_bytes = 256ull << 20;  // ≥ 5 × L2 across the copies

struct device_bytes {
  void* p = nullptr;
  explicit device_bytes(std::size_t n) { mc::check(cudaMalloc(&p, std::max<std::size_t>(n, 1)), "cudaMalloc"); }
  ~device_bytes() { cudaFree(p); }
  device_bytes(const device_bytes&) = delete;
  device_bytes& operator=(const device_bytes&) = delete;
  template <class T>
  T* as() const { return static_cast<T*>(p); }
};

// The token whose logit is raised in row (b, u): node u's greedy successor in request b.
std::int32_t spike_token(int b, int u, int vocab) { return static_cast<std::int32_t>((b * 7919 + u * 104729) % vocab); }

// Uniform bf16 logits in [-4, 4) in device memory; with `nodes` > 0, row (b, u) of a
// [B][nodes][vocab] block also gets logit 8 at `spike_token(b, u)`, so greedy accepts the chain of
// rank-0 children (4 drafts on mc_sim_7b_63), as a well-trained head would.
void fill_logits(logit* dst, std::size_t count, std::uint32_t seed, int vocab, int nodes = 0) {
  std::uint64_t x = 0x9E3779B97F4A7C15ull * (seed + 1);
  std::vector<logit> host(count);
  for (auto& h : host) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    h = logit(static_cast<float>(x >> 40) * (8.0f / 16777216.0f) - 4.0f);
  }
  if (nodes > 0)
    for (std::size_t row = 0; row < count / static_cast<std::size_t>(vocab); ++row)
      host[row * vocab + spike_token(static_cast<int>(row / nodes), static_cast<int>(row % nodes), vocab)] = logit(8.0f);
  mc::check(cudaMemcpy(dst, host.data(), count * sizeof(logit), cudaMemcpyHostToDevice), "fill");
}

int copies_for(std::size_t bytes) {
  return static_cast<int>(std::clamp<std::size_t>((rotate_bytes + bytes - 1) / bytes, 1, 8));
}

// Times `launch(i)` for i in [0, launches) with CUDA events; seconds per launch.
template <class F>
double time_launches(cudaStream_t s, F&& launch) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  cudaEventRecord(a, s);
  for (int i = 0; i < launches_per_iteration; ++i) launch(i);
  cudaEventRecord(b, s);
  cudaEventSynchronize(b);
  float ms = 0.0f;
  cudaEventElapsedTime(&ms, a, b);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return static_cast<double>(ms) * 1e-3 / launches_per_iteration;
}

// Device inputs and outputs of one step for `batch` requests.
struct step_buffers {
  int batch, vocab, nodes, stride, copies_heads, copies_nodes;
  std::size_t head_cells, node_cells;
  step::plan_type plan;
  device_bytes heads, node_logits, tokens, next_tokens, positions, lengths, ints, ws;
  step_buffers(int b, int v, mk::verify_kind kind, float temperature)
      : batch(b), vocab(v), nodes(tag::tree.num_nodes()), stride(tag::tree.depth() + 1),
        copies_heads(copies_for(static_cast<std::size_t>(b) * head_count * v * sizeof(logit))),
        copies_nodes(copies_for(static_cast<std::size_t>(b) * nodes * v * sizeof(logit))),
        head_cells(static_cast<std::size_t>(b) * head_count * v), node_cells(static_cast<std::size_t>(b) * nodes * v),
        plan(step::plan(b, head_count, v, kind, {}, temperature)),
        heads(head_cells * copies_heads * sizeof(logit)), node_logits(node_cells * copies_nodes * sizeof(logit)),
        tokens(static_cast<std::size_t>(b) * nodes * 4), next_tokens(static_cast<std::size_t>(b) * nodes * 4),
        positions(static_cast<std::size_t>(b) * nodes * 4), lengths(static_cast<std::size_t>(b) * 4),
        ints(static_cast<std::size_t>(b) * (8 + 2 * stride) * 8), ws(plan.workspace_bytes) {
    for (int c = 0; c < copies_heads; ++c) fill_logits(heads.as<logit>() + c * head_cells, head_cells, 11u + c, v);
    for (int c = 0; c < copies_nodes; ++c)
      fill_logits(node_logits.as<logit>() + c * node_cells, node_cells, 97u + c, v, nodes);
    std::vector<std::int32_t> t(static_cast<std::size_t>(b) * nodes);
    std::mt19937 rng(5);
    const auto& tree = tag::tree;
    for (int r = 0; r < b; ++r)
      for (int u = 0; u < nodes; ++u)
        t[static_cast<std::size_t>(r) * nodes + u] = u > 0 && tree.rank(u) == 0
                                                         ? spike_token(r, tree.parent(u), v)
                                                         : static_cast<std::int32_t>(rng() % static_cast<unsigned>(v));
    mc::check(cudaMemcpy(tokens.p, t.data(), t.size() * 4, cudaMemcpyHostToDevice), "tokens");
    std::vector<std::int32_t> l(static_cast<std::size_t>(b), 100);
    mc::check(cudaMemcpy(lengths.p, l.data(), l.size() * 4, cudaMemcpyHostToDevice), "lengths");
    mc::check(cudaMemset(ints.p, 0, static_cast<std::size_t>(b) * (8 + 2 * stride) * 8), "ints");
  }
  std::int32_t* out(int i) const { return ints.as<std::int32_t>() + static_cast<std::size_t>(i) * batch; }
  mk::verify_args<logit> verify_args(int copy, float temperature) const {
    mk::verify_args<logit> a;
    a.logits = node_logits.as<logit>() + static_cast<std::size_t>(copy % copies_nodes) * node_cells;
    a.row_stride = vocab;
    a.node_tokens = tokens.as<std::int32_t>();
    a.temperature = temperature;
    a.path_stride = stride;
    a.accept_length = out(0);
    a.next_node = out(1);
    a.bonus = out(2);
    a.eos = out(3);
    a.best_row = out(4);
    a.status = out(5);
    a.path_nodes = out(6);
    a.path_tokens = out(6) + static_cast<std::size_t>(batch) * stride;
    return a;
  }
  cudaError_t candidates(int copy, cudaStream_t s) const {
    return step::candidates(plan, {}, heads.as<logit>() + static_cast<std::size_t>(copy % copies_heads) * head_cells,
                            vocab, out(2), lengths.as<std::int32_t>(), next_tokens.as<std::int32_t>(),
                            positions.as<std::int32_t>(), out(5), ws.p, plan.workspace_bytes, s);
  }
};

void set_counters(benchmark::State& state, int batch, int vocab) {
  state.counters["batch"] = batch;
  state.counters["vocab"] = vocab;
}

void BM_top_k_and_gather(benchmark::State& state) {
  const int batch = static_cast<int>(state.range(0)), vocab = static_cast<int>(state.range(1));
  step_buffers buf(batch, vocab, mk::verify_kind::greedy, 0.0f);
  cudaStream_t s;
  cudaStreamCreate(&s);
  int copy = 0;
  for (auto _ : state) {
    state.SetIterationTime(time_launches(s, [&](int) { mc::check(buf.candidates(copy++, s), "candidates"); }));
  }
  set_counters(state, batch, vocab);
  state.counters["splits"] = buf.plan.top_k.splits;
  cudaStreamDestroy(s);
}

void verify_bench(benchmark::State& state, mk::verify_kind kind, float temperature) {
  const int batch = static_cast<int>(state.range(0)), vocab = static_cast<int>(state.range(1));
  step_buffers buf(batch, vocab, kind, temperature);
  cudaStream_t s;
  cudaStreamCreate(&s);
  int copy = 0;
  for (auto _ : state) {
    state.SetIterationTime(time_launches(s, [&](int) {
      mc::check(step::verify(buf.plan, {}, buf.verify_args(copy++, temperature), buf.ws.p, buf.plan.workspace_bytes, s),
                "verify");
    }));
  }
  set_counters(state, batch, vocab);
  cudaStreamDestroy(s);
}
void BM_verify_greedy(benchmark::State& state) { verify_bench(state, mk::verify_kind::greedy, 0.0f); }
void BM_verify_typical(benchmark::State& state) { verify_bench(state, mk::verify_kind::typical, 0.7f); }
void BM_verify_rejection(benchmark::State& state) { verify_bench(state, mk::verify_kind::rejection, 0.7f); }

// Llama-7B KV cache (32 layers, 32 KV heads, head_dim 128, bf16), contiguous NHD per request;
// each request commits a 4-token path with two out-of-place rows.
struct kv_buffers {
  static constexpr int layers = 32, heads = 32, dim = 128, capacity = 512;
  int batch;
  device_bytes k, v, lengths, offsets, paths, new_lengths;
  mk::kv_commit_params params;
  mk::kv_commit_plan plan;
  explicit kv_buffers(int b)
      : batch(b), k(bytes(b)), v(bytes(b)), lengths(4 * b), offsets(4 * (b + 1)), paths(16 * b), new_lengths(4 * b) {
    std::vector<std::int32_t> l(b, 300), off(b + 1), p;
    for (int i = 0; i <= b; ++i) off[i] = 4 * i;
    for (int i = 0; i < b; ++i) p.insert(p.end(), {0, 1, 9, 40});
    mc::check(cudaMemcpy(lengths.p, l.data(), 4 * b, cudaMemcpyHostToDevice), "kv");
    mc::check(cudaMemcpy(offsets.p, off.data(), 4 * (b + 1), cudaMemcpyHostToDevice), "kv");
    mc::check(cudaMemcpy(paths.p, p.data(), 16 * b, cudaMemcpyHostToDevice), "kv");
    params.batch = {b, lengths.as<std::int32_t>(), offsets.as<std::int32_t>(), paths.as<std::int32_t>(),
                    new_lengths.as<std::int32_t>()};
    params.k = k.p;
    params.v = v.p;
    params.element_bytes = 2;
    params.shape = {layers, heads, dim};
    params.layout = mk::kv_commit_layout::strided;
    params.head_stride = dim;
    params.slot_stride = static_cast<std::size_t>(heads) * dim;
    params.layer_stride = params.slot_stride * capacity * b;
    params.slots_per_request = capacity;
    slot_bases.resize(b);
    for (int i = 0; i < b; ++i) slot_bases[i] = i * capacity;
    bases = std::make_unique<device_bytes>(4 * b);
    mc::check(cudaMemcpy(bases->p, slot_bases.data(), 4 * b, cudaMemcpyHostToDevice), "kv");
    params.slot_bases = bases->as<std::int32_t>();
    plan = mk::plan_kv_commit(params);
  }
  static std::size_t bytes(int b) { return static_cast<std::size_t>(layers) * capacity * b * heads * dim * 2; }
  std::vector<std::int32_t> slot_bases;
  std::unique_ptr<device_bytes> bases;
};

void BM_kv_commit_7b(benchmark::State& state) {
  const int batch = static_cast<int>(state.range(0));
  kv_buffers kv(batch);
  cudaStream_t s;
  cudaStreamCreate(&s);
  for (auto _ : state)
    state.SetIterationTime(time_launches(s, [&](int) { mc::check(mc::run(kv.plan, kv.params, s), "commit"); }));
  state.counters["batch"] = batch;
  cudaStreamDestroy(s);
}

// The library's whole device step without a model: `device_step<stream_executor, bf16>` with
// Llama-7B-shaped heads (hidden 4096, 4 heads of one ResBlock over a shared LM head of `vocab`
// rows, random weights), heads → candidates → verify → KV commit → bookkeeping in one CUDA graph,
// around a forward that adds nothing to the graph (its logits and hidden states are written once,
// outside the capture). The time of a step is a replay and the download of its results, as an
// engine's decode loop pays it; 100 steps a `generate`, prompts of 300 tokens.
struct head_weights_7b {
  static constexpr int hidden = 4096, heads = 4;
  std::vector<float> w, b, lm_head;
  medusa::head_stack<> stack;
  explicit head_weights_7b(int vocab)
      : w(static_cast<std::size_t>(heads) * hidden * hidden), b(static_cast<std::size_t>(heads) * hidden),
        lm_head(static_cast<std::size_t>(vocab) * hidden),
        stack(hidden, static_cast<std::size_t>(vocab), heads, 1, medusa::projection_kind::shared_lm_head) {
    std::mt19937 rng(3);
    std::uniform_real_distribution<float> u(-1.0f / 64, 1.0f / 64);
    for (auto* v : {&w, &b, &lm_head})
      for (float& x : *v) x = u(rng);
    for (int h = 0; h < heads; ++h)
      stack.set_resblock(static_cast<std::size_t>(h), 0, medusa::weight_ptr::of(w.data() + static_cast<std::size_t>(h) * hidden * hidden),
                         medusa::weight_ptr::of(b.data() + static_cast<std::size_t>(h) * hidden));
    stack.set_lm_head(medusa::weight_ptr::of(lm_head.data()));
  }
};

void BM_device_step(benchmark::State& state) {
  const int batch = static_cast<int>(state.range(0)), vocab = static_cast<int>(state.range(1));
  constexpr int prompt = 300, steps = 100;
  mc::stream_executor ex(0);
  const head_weights_7b weights(vocab);
  mc::device_step<mc::stream_executor, logit> step(ex, medusa::tree::preset("mc_sim_7b_63"), weights.stack);
  kv_buffers kv(batch);
  // The rows the forward "computes": logits with a spike per row, hidden states in [-1, 1).
  const int nodes = step.rows_per_request();
  const std::size_t rows = static_cast<std::size_t>(batch) * static_cast<std::size_t>(nodes);
  std::vector<float> host_logits(rows * static_cast<std::size_t>(vocab), 0.0f), host_hidden(rows * head_weights_7b::hidden);
  for (std::size_t r = 0; r < rows; ++r)
    host_logits[r * static_cast<std::size_t>(vocab) + static_cast<std::size_t>(spike_token(static_cast<int>(r) / nodes, static_cast<int>(r) % nodes, vocab))] = 8.0f;
  std::mt19937 rng(9);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (float& x : host_hidden) x = u(rng);
  auto forward = [&](const mc::step_pass& p) {
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    mc::check(cudaStreamIsCapturing(ex.stream(), &capturing), "cudaStreamIsCapturing");
    if (capturing != cudaStreamCaptureStatusNone) return;
    const std::size_t n = static_cast<std::size_t>(p.batch) * static_cast<std::size_t>(p.rows_per_request);
    ex.upload(p.logits, host_logits.data(), n * static_cast<std::size_t>(vocab) * sizeof(float));
    if (p.hidden != nullptr) ex.upload(p.hidden, host_hidden.data(), n * head_weights_7b::hidden * sizeof(float));
  };
  const std::vector<std::int32_t> first(static_cast<std::size_t>(batch), 1);
  const std::vector<int> lengths(static_cast<std::size_t>(batch), prompt);
  const std::vector<float> hidden(host_hidden.begin(), host_hidden.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(batch) * head_weights_7b::hidden));
  long long accepted = 0, tree_steps = 0;
  for (auto _ : state) {
    const auto r = step.generate({first, lengths, hidden}, static_cast<const mk::batch_kv&>(kv.params),
                                 {.max_new_tokens = steps, .max_context = kv_buffers::capacity}, forward);
    for (const auto& x : r)
      if (x.stop == medusa::stop_reason::failed) state.SkipWithError(x.error.c_str());
    state.SetIterationTime(step.stats().step_seconds / step.stats().steps);
    for (std::size_t a = 0; a < step.stats().accepted.size(); ++a) {
      accepted += step.stats().accepted[a] * static_cast<long long>(a);
      tree_steps += step.stats().accepted[a];
    }
  }
  set_counters(state, batch, vocab);
  state.counters["accepted"] = tree_steps > 0 ? static_cast<double>(accepted) / static_cast<double>(tree_steps) : 0.0;
}

// The linear layers of Llama-7B (32 × {q,k,v,o 4096², gate/up 11008×4096, down 4096×11008} +
// lm_head 32000×4096) for `tokens` rows, bf16 in and out, f32 accumulation: the floor of a
// decode step over that many tokens.
void BM_llama7b_linear_layers(benchmark::State& state) {
  const int tokens = static_cast<int>(state.range(0));
  struct shape {
    int out, in, count;
  };
  const shape shapes[] = {{4096, 4096, 4 * 32}, {11008, 4096, 2 * 32}, {4096, 11008, 32}, {32000, 4096, 1}};
  std::size_t weight_bytes = 0;
  for (const auto& sh : shapes) weight_bytes = std::max(weight_bytes, static_cast<std::size_t>(sh.out) * sh.in * 2);
  // One weight buffer per GEMM would be 13.5 GB; rotate over 8 copies of the largest, which
  // still streams each from HBM (8 × 90 MB ≫ L2).
  std::vector<std::unique_ptr<device_bytes>> weights;
  for (int c = 0; c < 8; ++c) weights.push_back(std::make_unique<device_bytes>(weight_bytes));
  device_bytes x(static_cast<std::size_t>(tokens) * 11008 * 2), y(static_cast<std::size_t>(tokens) * 32000 * 2);
  cudaMemset(x.p, 0, static_cast<std::size_t>(tokens) * 11008 * 2);
  for (auto& w : weights) cudaMemset(w->p, 0, weight_bytes);
  cublasHandle_t h;
  cublasCreate(&h);
  cudaStream_t s;
  cudaStreamCreate(&s);
  cublasSetStream(h, s);
  const float one = 1.0f, zero = 0.0f;
  for (auto _ : state) {
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    cudaEventRecord(a, s);
    int c = 0;
    for (const auto& sh : shapes)
      for (int i = 0; i < sh.count; ++i)
        cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, sh.out, tokens, sh.in, &one, weights[c++ % 8]->p, CUDA_R_16BF, sh.in,
                     x.p, CUDA_R_16BF, sh.in, &zero, y.p, CUDA_R_16BF, sh.out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    cudaEventRecord(b, s);
    cudaEventSynchronize(b);
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, a, b);
    state.SetIterationTime(static_cast<double>(ms) * 1e-3);
    cudaEventDestroy(a);
    cudaEventDestroy(b);
  }
  state.counters["tokens"] = tokens;
  cublasDestroy(h);
  cudaStreamDestroy(s);
}

void step_sizes(benchmark::internal::Benchmark* b) {
  for (const int vocab : {32000, 128256})
    for (const int batch : {1, 8, 32}) b->Args({batch, vocab});
  b->UseManualTime()->Unit(benchmark::kMicrosecond);
}

BENCHMARK(BM_top_k_and_gather)->Apply(step_sizes);
BENCHMARK(BM_verify_greedy)->Apply(step_sizes);
BENCHMARK(BM_verify_typical)->Apply(step_sizes);
BENCHMARK(BM_verify_rejection)->Apply(step_sizes);
BENCHMARK(BM_kv_commit_7b)->Arg(1)->Arg(8)->Arg(32)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_device_step)->Args({1, 32000})->Args({8, 32000})->Args({32, 32000})->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_llama7b_linear_layers)->Arg(1)->Arg(32)->Arg(64)->Arg(512)->Arg(2048)->UseManualTime()->Unit(benchmark::kMicrosecond);

}  // namespace

MEDUSA_DEVICE_BENCHMARK_MAIN()
