// SPDX-License-Identifier: Apache-2.0
// The GPU engine on synthetic models of real shapes (random weights made on the device, bf16):
// TinyLlama-1.1B (d 2048, 22 layers, 32/4 heads, ffn 5632, V 32000) and Llama-2-7B (d 4096,
// 32 layers, 32 heads, ffn 11008, V 32000).
//
//   BM_decode/<shape>       plain greedy decoding, batch 1, after a 512-token prompt: ms per token,
//                           tokens/s, and the fraction of the HBM roofline (weights + KV bytes a
//                           token streams, over the device's peak bandwidth)
//   BM_step_cost/<shape>    one forward pass of N = 1, 4, 8, 16, 32, 64, 128 tree tokens at context
//                           512, each a CUDA graph timed by CUDA events: counters x<N> = step(N) /
//                           step(1) (the paper: 1.22x at 64 nodes, 7B, A100)
//   BM_medusa_step/<shape>/<N>  a whole device Medusa step (heads, candidates, the N-node forward,
//                           verify, commit, bookkeeping; one graph replay and its download) against
//                           the forward alone: counter overhead = the share of the step outside the
//                           model and the heads
//   BM_expected_speedup/<shape>  with --calibration F (calibration.json of heads trained on
//                           pycode-15m): optimize_tree over the measured curve for each tree size,
//                           the expected tokens per step, relative step cost and speedup (table
//                           on stderr)
//
// --gemm library|cublaslt: the engine's bf16 GEMMs through the library's skinny GEMM (default) or
// cuBLASLt with one pinned algorithm per shape (both batch-invariant). --attention
// single-query|general: decode passes on the single-query attention kernel (default) or the
// general one (the same bits). --kv-split N: keys per attention split (default: the engine's,
// from the context). --context N: the prompt's length
// (default 512; the engine's context grows past 2048 to hold it).
//
// The measured speedup with trained heads on pycode-15m comes from medusa-run --device cuda
// --mode both --prompts-file (docs/performance.md). Exits 77 without a CUDA device.
#include <benchmark/benchmark.h>

#include <medusa_llama/cuda_engine.hpp>
#include <medusa_llama/model.hpp>

#include <medusa/io.hpp>
#include <medusa/medusa.hpp>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

using namespace medusa_llama;

namespace {

struct shape {
  const char* name;
  model_config config;
};

model_config config_of(int dim, int layers, int heads, int kv_heads, int ffn, int vocab) {
  model_config c;
  c.dim = dim;
  c.hidden_dim = ffn;
  c.n_layers = layers;
  c.n_heads = heads;
  c.n_kv_heads = kv_heads;
  c.vocab_size = vocab;
  c.seq_len = 2048;
  c.shared_classifier = false;
  return c;
}

const std::vector<shape>& shapes() {
  static const std::vector<shape> all = {
      {"tinyllama-1.1b", config_of(2048, 22, 32, 4, 5632, 32000)},
      {"llama-2-7b", config_of(4096, 32, 32, 32, 11008, 32000)},
  };
  return all;
}

int context = 512;                                    // --context N: the prompt's tokens
const std::vector<int> step_rows = {1, 4, 8, 16, 32, 64, 128};
std::optional<medusa::path_calibration> calibration;  // --calibration
std::string step_cost_out;                            // --step-cost-out (the 7B curve)
bool library_gemm = true;                             // --gemm library|cublaslt
int kv_split = 0;                                     // --kv-split N (0: the engine's default)
bool single_query_attention = true;                   // --attention single-query|general

// The context a request may reach: the prompt, 64 new tokens and a 128-node tree, at least 2048.
int max_context() { return std::max(2048, (context + 64 + 128 + 255) / 256 * 256); }

// One engine per shape, made once (the weights take seconds to make).
cuda_engine& engine_for(const shape& s) {
  static std::map<std::string, std::unique_ptr<cuda_engine>> engines;
  auto& e = engines[s.name];
  if (!e) {
    model_config c = s.config;
    c.seq_len = max_context();
    e = std::make_unique<cuda_engine>(cuda_engine::synthetic(
        c,
        {.precision = medusa::dtype::bf16, .max_requests = 1, .max_context = max_context(), .max_tokens = 512,
         .kv_split = kv_split, .single_query_attention = single_query_attention,
         .library_gemm = library_gemm},
        7));
  }
  return *e;
}

// Random per-head heads of the shape (one ResBlock each), kept for the run.
const medusa::head_weights& heads_for(const shape& s) {
  static std::map<std::string, medusa::head_weights> all;
  auto it = all.find(s.name);
  if (it != all.end()) return it->second;
  const auto d = static_cast<std::size_t>(s.config.dim), V = static_cast<std::size_t>(s.config.vocab_size);
  std::vector<float> lm_head(d * V);
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-0.02f, 0.02f);
  for (auto& x : lm_head) x = u(rng);
  return all.emplace(s.name, medusa::head_weights::random(d, V, 4, 1, medusa::weight_dtype::f32,
                                                          medusa::weight_ptr::of(lm_head.data()), 5))
      .first->second;
}

// Peak HBM bandwidth of the current device (bytes/s): memory clock × 2 (DDR) × bus width.
double peak_bandwidth() {
  int dev = 0, khz = 0, bits = 0;
  (void)cudaGetDevice(&dev);
  (void)cudaDeviceGetAttribute(&khz, cudaDevAttrMemoryClockRate, dev);
  (void)cudaDeviceGetAttribute(&bits, cudaDevAttrGlobalMemoryBusWidth, dev);
  return 2.0 * khz * 1e3 * bits / 8.0;
}

std::vector<std::int32_t> prompt_of(int n, int vocab) {
  std::vector<std::int32_t> p(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) p[static_cast<std::size_t>(i)] = 3 + (i * 7919) % (vocab - 3);
  return p;
}

// The N-node tree of the steps: a preset's first nodes (most probable first), else BFS over a
// 10-ary tree 4 deep.
medusa::tree tree_of(int nodes) {
  std::vector<std::vector<int>> paths;
  const medusa::tree big = medusa::tree::preset("mc_sim_7b_63");
  if (nodes <= big.num_nodes()) {
    const auto all = big.sorted_paths();
    paths.assign(all.begin(), all.begin() + (nodes - 1));
  } else {
    std::vector<std::vector<int>> frontier = {{}};
    while (static_cast<int>(paths.size()) < nodes - 1) {
      std::vector<std::vector<int>> next;
      for (const auto& p : frontier)
        for (int r = 0; r < 10 && static_cast<int>(paths.size()) < nodes - 1; ++r) {
          auto q = p;
          q.push_back(r);
          paths.push_back(q);
          next.push_back(q);
        }
      frontier = next;
    }
  }
  return medusa::tree::from_paths(paths);
}

void BM_decode(benchmark::State& state, const shape* s) {
  cuda_engine& e = engine_for(*s);
  cuda_decoder plain(e);
  const std::vector<std::vector<std::int32_t>> prompts = {prompt_of(context, s->config.vocab_size)};
  const int tokens = 64;
  double seconds = 0;
  int steps = 0;
  for (auto _ : state) {
    (void)plain.generate(prompts, tokens);
    state.SetIterationTime(plain.stats().step_seconds);
    seconds += plain.stats().step_seconds;
    steps += plain.stats().steps;
  }
  const double per_token = seconds / steps;
  const model_config& c = s->config;
  const double kv_bytes = 2.0 * c.n_layers * c.kv_dim() * (context + tokens / 2.0) * 2.0;
  const double bytes = static_cast<double>(e.weight_bytes()) + kv_bytes;
  state.counters["ms_per_token"] = per_token * 1e3;
  state.counters["tokens_per_s"] = 1.0 / per_token;
  state.counters["GB_per_s"] = bytes / per_token * 1e-9;
  state.counters["roofline"] = bytes / per_token / peak_bandwidth();
  state.SetLabel(e.device_name());
}

medusa::step_cost_curve curve_of(const shape& s) {
  static std::map<std::string, medusa::step_cost_curve> curves;
  auto it = curves.find(s.name);
  if (it != curves.end()) return it->second;
  cuda_engine& e = engine_for(s);
  const auto stack = heads_for(s).view();
  const auto curve = e.measure_step_cost({.rows = step_rows, .context = context, .repeats = 20}, &stack);
  return curves.emplace(s.name, curve).first->second;
}

void BM_step_cost(benchmark::State& state, const shape* s) {
  medusa::step_cost_curve curve;
  for (auto _ : state) {
    curve = curve_of(*s);
    state.SetIterationTime(curve.seconds[0]);
  }
  for (std::size_t i = 0; i < curve.rows.size(); ++i)
    state.counters["x" + std::to_string(curve.rows[i])] = curve.seconds[i] / curve.seconds[0];
  state.counters["step1_ms"] = curve.seconds[0] * 1e3;
  state.counters["head_ms"] = curve.head_seconds * 1e3;
  if (!step_cost_out.empty() && std::string(s->name) == "llama-2-7b") {
    std::FILE* f = std::fopen(step_cost_out.c_str(), "wb");
    if (f != nullptr) {
      const std::string j = medusa::step_cost_json(curve);
      std::fwrite(j.data(), 1, j.size(), f);
      std::fclose(f);
    }
  }
  state.SetLabel(engine_for(*s).device_name());
}

void BM_medusa_step(benchmark::State& state, const shape* s) {
  const int nodes = static_cast<int>(state.range(0));
  cuda_engine& e = engine_for(*s);
  const auto stack = heads_for(*s).view();
  const medusa::tree tree = tree_of(nodes);
  cuda_decoder med(e, stack, tree);
  const std::vector<std::vector<std::int32_t>> prompts = {prompt_of(context, s->config.vocab_size)};
  double seconds = 0;
  int steps = 0;
  for (auto _ : state) {
    (void)med.generate(prompts, 64);
    state.SetIterationTime(med.stats().step_seconds);
    seconds += med.stats().step_seconds;
    steps += med.stats().steps;
  }
  const medusa::step_cost_curve curve = curve_of(*s);
  const auto at = std::find(curve.rows.begin(), curve.rows.end(), nodes);
  const double step = seconds / steps;
  state.counters["step_ms"] = step * 1e3;
  if (at != curve.rows.end()) {
    const double forward = curve.seconds[static_cast<std::size_t>(at - curve.rows.begin())];
    const double heads = curve.head_seconds * tree.depth();
    state.counters["forward_ms"] = forward * 1e3;
    state.counters["overhead"] = (step - forward - heads) / step;
  }
  state.SetLabel(e.device_name());
}

void BM_expected_speedup(benchmark::State& state, const shape* s) {
  const medusa::step_cost_curve curve = curve_of(*s);
  for (auto _ : state) state.SetIterationTime(curve.seconds[0]);
  std::fprintf(stderr, "expected Medusa speedup, %s (%s), pycode-15m heads' calibration:\n%6s %10s %10s %10s\n", s->name,
               engine_for(*s).device_name().c_str(), "nodes", "tok/step", "cost", "speedup");
  for (int n : step_rows) {
    if (n < 2) continue;
    const auto plan = medusa::optimize_tree(*calibration, curve, {.max_nodes = n, .max_depth = 5});
    std::fprintf(stderr, "%6d %10.3f %10.3f %10.3f\n", n, plan.expected_tokens, plan.relative_cost, plan.predicted_speedup);
    state.counters["speedup" + std::to_string(n)] = plan.predicted_speedup;
  }
}

// Removes and returns `--name value` from argv.
std::optional<std::string> take_flag(int& argc, char** argv, const char* name) {
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], name) == 0) {
      std::string v = argv[i + 1];
      for (int j = i; j + 2 < argc; ++j) argv[j] = argv[j + 2];
      argc -= 2;
      return v;
    }
  return std::nullopt;
}

// `text` as a whole number in [lo, hi], or nothing.
std::optional<long> whole_number(const std::string& text, long lo, long hi) {
  char* end = nullptr;
  const long v = std::strtol(text.c_str(), &end, 10);
  if (end == text.c_str() || *end != '\0' || v < lo || v > hi) return std::nullopt;
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  if (cuda_device_count() == 0) {
    std::puts("no CUDA device: GPU benchmarks skipped");
    return 77;
  }
  if (auto f = take_flag(argc, argv, "--calibration")) calibration = medusa::read_calibration(*f);
  if (auto f = take_flag(argc, argv, "--step-cost-out")) step_cost_out = *f;
  if (auto f = take_flag(argc, argv, "--gemm")) {
    if (*f != "library" && *f != "cublaslt") {
      std::fprintf(stderr, "--gemm must be library or cublaslt, got %s\n", f->c_str());
      return 2;
    }
    library_gemm = *f == "library";
  }
  if (auto f = take_flag(argc, argv, "--attention")) {
    if (*f != "single-query" && *f != "general") {
      std::fprintf(stderr, "--attention must be single-query or general, got %s\n", f->c_str());
      return 2;
    }
    single_query_attention = *f == "single-query";
  }
  if (auto f = take_flag(argc, argv, "--kv-split")) {
    const std::optional<long> v = whole_number(*f, 32, 1 << 20);
    if (!v || *v % 32 != 0) {
      std::fprintf(stderr, "--kv-split must be a positive multiple of 32, got %s\n", f->c_str());
      return 2;
    }
    kv_split = static_cast<int>(*v);
  }
  if (auto f = take_flag(argc, argv, "--context")) {
    const std::optional<long> v = whole_number(*f, 1, 1 << 17);
    if (!v) {
      std::fprintf(stderr, "--context must be a number of tokens from 1 to 131072, got %s\n", f->c_str());
      return 2;
    }
    context = static_cast<int>(*v);
  }
  benchmark::Initialize(&argc, argv);
  for (const shape& s : shapes()) {
    benchmark::RegisterBenchmark((std::string("BM_decode/") + s.name).c_str(), BM_decode, &s)->UseManualTime()->Iterations(3);
    benchmark::RegisterBenchmark((std::string("BM_step_cost/") + s.name).c_str(), BM_step_cost, &s)->UseManualTime()->Iterations(1);
    for (int n : {16, 64})
      benchmark::RegisterBenchmark((std::string("BM_medusa_step/") + s.name).c_str(), BM_medusa_step, &s)
          ->Arg(n)
          ->UseManualTime()
          ->Iterations(3);
    if (calibration)
      benchmark::RegisterBenchmark((std::string("BM_expected_speedup/") + s.name).c_str(), BM_expected_speedup, &s)
          ->UseManualTime()
          ->Iterations(1);
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
