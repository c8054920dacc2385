// SPDX-License-Identifier: Apache-2.0
// How an engine decodes with the library's device step (docs/cuda.md): `medusa::cuda::device_step`
// runs heads → candidates → the engine's forward → verify → KV commit → bookkeeping as one CUDA
// graph, replayed every step, and takes smaller trees, then plain steps, near the context's end.
// The engine supplies three things, shown here with a toy:
//
//   1. its prefill's results: each request's first token, prompt length and last hidden state;
//   2. its KV cache as a `batch_kv` (here one contiguous range of slots per request);
//   3. a capture-friendly forward over a `step_pass` (here a kernel: the toy's greedy next token
//      after t is (5t + 3) mod V, its K rows hold the token they were computed for, and its hidden
//      state is the one-hot of the token).
//
// The heads are real `head_stack` weights (identity ResBlocks, one-hot projections) that know the
// toy except for tokens t ≡ 0 (mod 5), where head 1 guesses wrong. At the end the host checks
// losslessness: every request's output equals plain greedy decoding of the toy, to the last slot
// of the context, and the cache holds the committed tokens in order. Exits 77 without a device.
#include <medusa/cuda/device_step.hpp>
#include <medusa/cuda/stream_executor.cuh>
#include <medusa/tree.hpp>

#include <cstdio>
#include <vector>

namespace mc = medusa::cuda;
namespace mk = medusa::cuda::kernels;

namespace {

constexpr int vocab = 64, batch = 3, prompt = 5, context = 96, head_dim = 4;

__host__ __device__ int next_token(int t) { return (5 * t + 3) % vocab; }

// 3. The toy forward, one block per row (request b = block y, row i = block x).
__global__ void toy_forward(mc::step_pass p, float* k, int capacity) {
  const int b = blockIdx.y, i = blockIdx.x;
  const int row = p.qo_indptr[b] + i;
  const int t = p.tokens[row];
  const int slot = p.cache_lengths[b] + i;
  if (threadIdx.x == 0 && slot < capacity) k[(static_cast<std::size_t>(b) * capacity + slot) * head_dim] = static_cast<float>(t);
  for (int c = threadIdx.x; c < vocab; c += blockDim.x) {
    p.logits[static_cast<std::size_t>(row) * vocab + c] = c == next_token(t) ? 1.0f : 0.0f;
    if (p.hidden != nullptr) p.hidden[static_cast<std::size_t>(row) * vocab + c] = c == t ? 1.0f : 0.0f;
  }
}

// Heads over the one-hot state of the last accepted token t: head h proposes next^(h+2)(t).
struct toy_heads {
  std::vector<float> zeros = std::vector<float>(vocab * vocab, 0.0f);
  std::vector<std::vector<float>> proj;
  medusa::head_stack<> stack{vocab, vocab, 4, 1, medusa::projection_kind::per_head};
  toy_heads() {
    for (int h = 0; h < 4; ++h) {
      auto& u = proj.emplace_back(vocab * vocab, 0.0f);
      for (int t = 0; t < vocab; ++t) {
        int x = t;
        for (int s = 0; s < h + 2; ++s) x = next_token(x);
        if (h == 1 && t % 5 == 0) x = (x + 1) % vocab;  // a wrong guess
        u[static_cast<std::size_t>(x * vocab + t)] = 1.0f;
      }
      stack.set_resblock(h, 0, medusa::weight_ptr::of(zeros.data()), medusa::weight_ptr::of(zeros.data()));
      stack.set_projection(h, medusa::weight_ptr::of(u.data()));
    }
  }
};

}  // namespace

int main() {
  if (mc::device_count() == 0) {
    std::puts("no CUDA device: the example needs one");
    return 77;
  }
  mc::stream_executor ex(0);
  const auto tree = medusa::tree::preset("mc_sim_7b_63");
  toy_heads heads;
  mc::device_step<mc::stream_executor, float> step(ex, tree, heads.stack);

  // 2. The cache: `capacity` slots per request, one layer, one KV head of `head_dim`.
  const int capacity = context;
  mc::executor_buffer<mc::stream_executor> k(ex, sizeof(float) * batch * capacity * head_dim),
      v(ex, sizeof(float) * batch * capacity * head_dim), bases(ex, sizeof(std::int32_t) * batch);
  mk::batch_kv kv{};
  kv.k = k.as<void>();
  kv.v = v.as<void>();
  kv.element_bytes = 4;
  kv.shape = {1, 1, head_dim};
  kv.head_stride = head_dim;
  kv.slot_stride = head_dim;
  kv.layer_stride = static_cast<std::size_t>(batch) * capacity * head_dim;
  kv.slots_per_request = capacity;
  kv.slot_bases = bases.as<const std::int32_t>();

  // 1. The prefill (on the host, for brevity): the prompts' K rows, first tokens, hidden states.
  std::vector<float> host_k(static_cast<std::size_t>(batch) * capacity * head_dim, -1.0f), hidden;
  std::vector<std::int32_t> first, slot_bases;
  std::vector<int> lengths;
  std::vector<std::vector<int>> sequences;  // each request's tokens, for the check
  for (int b = 0; b < batch; ++b) {
    std::vector<int>& seq = sequences.emplace_back();
    for (int i = 0, t = 7 * b + 1; i < prompt; ++i, t = (t * 13 + 5) % vocab) {
      seq.push_back(t);
      host_k[(static_cast<std::size_t>(b) * capacity + i) * head_dim] = static_cast<float>(t);
    }
    first.push_back(next_token(seq.back()));
    for (int c = 0; c < vocab; ++c) hidden.push_back(c == seq.back() ? 1.0f : 0.0f);
    lengths.push_back(prompt);
    slot_bases.push_back(b * capacity);
  }
  ex.upload(k.as<void>(), host_k.data(), host_k.size() * sizeof(float));
  ex.upload(bases.as<void>(), slot_bases.data(), slot_bases.size() * sizeof(std::int32_t));

  const auto results = step.generate({first, lengths, hidden}, kv, {.max_new_tokens = 1000, .max_context = context},
                                     [&](const mc::step_pass& p) {
                                       toy_forward<<<dim3(p.rows_per_request, p.batch), 64, 0, ex.stream()>>>(
                                           p, k.as<float>(), capacity);
                                       mc::check(cudaGetLastError(), "toy forward");
                                     });
  ex.download(host_k.data(), k.as<const void>(), host_k.size() * sizeof(float));
  ex.sync();

  // Lossless: each request's tokens are plain greedy decoding of the toy, every slot of the
  // context is used, and the cache holds the committed tokens in order.
  const auto& stats = step.stats();
  int failures = 0;
  for (int b = 0; b < batch; ++b) {
    const auto& r = results[static_cast<std::size_t>(b)];
    std::vector<int>& seq = sequences[static_cast<std::size_t>(b)];
    for (const std::int32_t t : r.tokens) {
      failures += t != next_token(seq.back());
      seq.push_back(t);
    }
    failures += static_cast<int>(r.tokens.size()) != context - prompt + 1;
    failures += r.stop != medusa::stop_reason::context_full;
    for (int s = 0; s < context; ++s)
      failures += host_k[(static_cast<std::size_t>(b) * capacity + s) * head_dim] != static_cast<float>(seq[static_cast<std::size_t>(s)]);
    std::printf("request %d: %zu tokens in %d steps (%.2f per step), stop: %s\n", b, r.tokens.size(), r.steps,
                static_cast<double>(r.tokens.size()) / r.steps, std::string(medusa::to_string(r.stop)).c_str());
  }
  std::printf("request steps by tree size:");
  const auto sizes = step.step_sizes();
  for (std::size_t j = 0; j < sizes.size(); ++j) std::printf(" %d nodes: %lld,", sizes[j], stats.by_size[j]);
  std::printf(" %d replays\n", stats.steps);
  std::printf(failures == 0 ? "lossless: every token equals plain greedy decoding\n" : "%d mismatches\n", failures);
  return failures == 0 ? 0 : 1;
}
