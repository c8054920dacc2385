// SPDX-License-Identifier: Apache-2.0
// How an engine wires the CUDA step kernels into its own Medusa step (docs/cuda.md).
//
// The "model" here is a toy that fits in a kernel: its greedy next token after `t` is
// `next(t) = (5t + 3) mod V`, its K/V rows hold the token they were computed for, and its "heads"
// predict the next tokens correctly except at some (step, head) pairs. Everything else is what a
// real engine does, in the order it does it, on one stream, captured once as a CUDA graph and
// replayed every step:
//
//   1. model forward over the tree tokens of every request  (the engine's kernels; here a toy)
//   2. verify: greedy acceptance, accepted path, bonus       (step_kernels::verify)
//   3. KV commit of the accepted rows, read from verify's outputs   (cuda::run, kv_commit.cuh)
//   4. bookkeeping: committed tokens out, lengths advance   (the engine's kernels)
//   5. heads on the final hidden state                      (cuda::device_heads; here a toy)
//   6. next candidates: per-head top-k + gather             (step_kernels::candidates)
//
// At the end the host checks losslessness: every request's output equals plain greedy decoding of
// the toy model, and the cache holds the committed tokens in order. Exits 77 without a device.
#include <medusa/cuda/common.cuh>
#include <medusa/cuda/kv_commit.cuh>
#include <medusa/cuda/step_instances.cuh>

#include <cstdio>
#include <vector>

namespace mc = medusa::cuda;
namespace mk = medusa::cuda::kernels;

namespace {

using tree_tag = medusa::presets::tag_of<"mc_sim_7b_63">;
constexpr int heads = 4, vocab = 512, batch = 3, prompt = 5, steps = 12;
constexpr int layers = 2, kv_heads = 2, head_dim = 8, capacity = 256;
using kernels = mc::step_kernels<tree_tag, float>;

__host__ __device__ int next_token(int t) { return (5 * t + 3) % vocab; }

// 1. The toy forward: row (b, u) of the logits peaks at next(token), and K/V rows at slot L + u
// hold the token.
__global__ void toy_forward(const std::int32_t* tokens, const std::int32_t* lengths, float* logits, float* k,
                            float* v, int nodes) {
  const int b = blockIdx.y, u = blockIdx.x;
  const int token = tokens[b * nodes + u];
  for (int i = threadIdx.x; i < vocab; i += blockDim.x)
    logits[(static_cast<std::size_t>(b) * nodes + u) * vocab + i] = i == next_token(token) ? 4.0f : 0.0f;
  const int slot = b * capacity + lengths[b] + u;
  for (int e = threadIdx.x; e < layers * kv_heads * head_dim; e += blockDim.x) {
    const int layer = e / (kv_heads * head_dim), rest = e % (kv_heads * head_dim);
    const std::size_t at = (static_cast<std::size_t>(layer) * batch * capacity + slot) * kv_heads * head_dim + rest;
    k[at] = static_cast<float>(token);
    v[at] = -static_cast<float>(token);
  }
}

// 4. Bookkeeping: append root + accepted drafts, advance the length, count the step.
__global__ void toy_bookkeeping(const std::int32_t* path_tokens, const std::int32_t* accept_length,
                                const std::int32_t* new_lengths, std::int32_t* lengths, std::int32_t* out,
                                int stride, std::int32_t* step) {
  const int b = threadIdx.x;
  if (b >= batch) return;
  for (int j = 0; j <= accept_length[b]; ++j) out[b * capacity + lengths[b] + j] = path_tokens[b * stride + j];
  lengths[b] = new_lengths[b];
  if (b == 0) ++*step;
}

// 5. Toy heads: head h predicts next^(h+1)(root), wrong when (step + h) % 4 == 3.
__global__ void toy_heads(const std::int32_t* roots, const std::int32_t* step, float* head_logits) {
  const int b = blockIdx.y, h = blockIdx.x;
  int t = roots[b];
  for (int i = 0; i <= h; ++i) t = next_token(t);
  if ((*step + h) % 4 == 3) t = (t + 1) % vocab;
  for (int i = threadIdx.x; i < vocab; i += blockDim.x)
    head_logits[(static_cast<std::size_t>(b) * heads + h) * vocab + i] = i == t ? 2.0f : 0.0f;
}

template <class T>
T* device_alloc(std::size_t count) {
  T* p = nullptr;
  mc::check(cudaMalloc(&p, count * sizeof(T)), "cudaMalloc");
  mc::check(cudaMemset(p, 0, count * sizeof(T)), "cudaMemset");
  return p;
}

}  // namespace

int main() {
  if (mc::device_count() == 0) {
    std::puts("no CUDA device: the example needs one");
    return 77;
  }
  const auto& tree = tree_tag::tree;
  const int n = tree.num_nodes(), stride = tree.depth() + 1;

  // Once per engine: plans and buffers. Nothing below allocates again.
  const kernels::plan_type plan = kernels::plan(batch, heads, vocab, mk::verify_kind::greedy);
  void* workspace = device_alloc<unsigned char>(plan.workspace_bytes);
  auto* tokens = device_alloc<std::int32_t>(batch * n);
  auto* positions = device_alloc<std::int32_t>(batch * n);
  auto* logits = device_alloc<float>(static_cast<std::size_t>(batch) * n * vocab);
  auto* head_logits = device_alloc<float>(static_cast<std::size_t>(batch) * heads * vocab);
  const std::size_t cache_elements = static_cast<std::size_t>(layers) * batch * capacity * kv_heads * head_dim;
  auto* k = device_alloc<float>(cache_elements);
  auto* v = device_alloc<float>(cache_elements);
  auto* lengths = device_alloc<std::int32_t>(batch);
  auto* new_lengths = device_alloc<std::int32_t>(batch);
  auto* out = device_alloc<std::int32_t>(batch * capacity);
  auto* step = device_alloc<std::int32_t>(1);
  auto* results = device_alloc<std::int32_t>(batch * (6 + 2 * stride));
  auto* slot_bases = device_alloc<std::int32_t>(batch);

  mk::verify_args<float> verify{};
  verify.logits = logits;
  verify.row_stride = vocab;
  verify.node_tokens = tokens;
  verify.path_stride = stride;
  verify.accept_length = results;
  verify.next_node = results + batch;
  verify.bonus = results + 2 * batch;
  verify.eos = results + 3 * batch;
  verify.best_row = results + 4 * batch;
  verify.status = results + 5 * batch;
  verify.path_nodes = results + 6 * batch;
  verify.path_tokens = results + 6 * batch + batch * stride;

  // The commit reads the accepted paths straight from verify's outputs.
  mk::kv_commit_params commit{};
  commit.batch = {.size = batch, .committed_lengths = lengths, .paths = verify.path_nodes, .new_lengths = new_lengths,
                  .path_stride = stride, .accept_lengths = verify.accept_length};
  commit.k = k;
  commit.v = v;
  commit.element_bytes = sizeof(float);
  commit.shape = {layers, kv_heads, head_dim};
  commit.head_stride = head_dim;
  commit.slot_stride = static_cast<std::size_t>(kv_heads) * head_dim;
  commit.layer_stride = commit.slot_stride * batch * capacity;
  commit.slots_per_request = capacity;
  commit.slot_bases = slot_bases;
  const mk::kv_commit_plan commit_plan = mk::plan_kv_commit(commit);

  // Prefill (host, for brevity): the prompt's tokens and K/V rows, and the first root.
  std::vector<std::int32_t> host_out(batch * capacity, -1), host_len(batch, prompt), roots(batch), bases(batch);
  std::vector<float> host_k(cache_elements, 0.0f), host_v(cache_elements, 0.0f);
  for (int b = 0; b < batch; ++b) {
    bases[b] = b * capacity;
    int t = 7 * b + 1;
    for (int i = 0; i < prompt; ++i, t = next_token(t)) {
      host_out[b * capacity + i] = t;
      for (int l = 0; l < layers; ++l)
        for (int e = 0; e < kv_heads * head_dim; ++e) {
          const std::size_t at = (static_cast<std::size_t>(l) * batch * capacity + b * capacity + i) * kv_heads * head_dim + e;
          host_k[at] = static_cast<float>(host_out[b * capacity + i]);
          host_v[at] = -static_cast<float>(host_out[b * capacity + i]);
        }
    }
    roots[b] = next_token(host_out[b * capacity + prompt - 1]);  // greedy of the prefill's last row
  }
  mc::check(cudaMemcpy(out, host_out.data(), host_out.size() * 4, cudaMemcpyHostToDevice), "upload");
  mc::check(cudaMemcpy(lengths, host_len.data(), batch * 4, cudaMemcpyHostToDevice), "upload");
  mc::check(cudaMemcpy(verify.bonus, roots.data(), batch * 4, cudaMemcpyHostToDevice), "upload");
  mc::check(cudaMemcpy(slot_bases, bases.data(), batch * 4, cudaMemcpyHostToDevice), "upload");
  mc::check(cudaMemcpy(k, host_k.data(), cache_elements * 4, cudaMemcpyHostToDevice), "upload");
  mc::check(cudaMemcpy(v, host_v.data(), cache_elements * 4, cudaMemcpyHostToDevice), "upload");

  cudaStream_t stream;
  mc::check(cudaStreamCreate(&stream), "stream");
  // The first tree: heads on the prefill state, then candidates.
  toy_heads<<<dim3(heads, batch), 128, 0, stream>>>(verify.bonus, step, head_logits);
  mc::check(kernels::candidates(plan, {}, head_logits, vocab, verify.bonus, lengths, tokens, positions, verify.status,
                                workspace, plan.workspace_bytes, stream),
            "candidates");

  // One Medusa step, captured once.
  cudaGraph_t graph;
  mc::check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "capture");
  toy_forward<<<dim3(n, batch), 128, 0, stream>>>(tokens, lengths, logits, k, v, n);
  mc::check(kernels::verify(plan, {}, verify, workspace, plan.workspace_bytes, stream), "verify");
  mc::check(mc::run(commit_plan, commit, stream), "commit");
  toy_bookkeeping<<<1, 32, 0, stream>>>(verify.path_tokens, verify.accept_length, new_lengths, lengths, out, stride, step);
  toy_heads<<<dim3(heads, batch), 128, 0, stream>>>(verify.bonus, step, head_logits);
  mc::check(kernels::candidates(plan, {}, head_logits, vocab, verify.bonus, lengths, tokens, positions, verify.status,
                                workspace, plan.workspace_bytes, stream),
            "candidates");
  mc::check(cudaStreamEndCapture(stream, &graph), "capture");
  cudaGraphExec_t exec;
  mc::check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  for (int s = 0; s < steps; ++s) mc::check(cudaGraphLaunch(exec, stream), "launch");
  mc::check(cudaStreamSynchronize(stream), "sync");

  // Lossless: each request's tokens are plain greedy decoding, and the cache holds them in order.
  mc::check(cudaMemcpy(host_out.data(), out, host_out.size() * 4, cudaMemcpyDeviceToHost), "download");
  mc::check(cudaMemcpy(host_len.data(), lengths, batch * 4, cudaMemcpyDeviceToHost), "download");
  mc::check(cudaMemcpy(host_k.data(), k, cache_elements * 4, cudaMemcpyDeviceToHost), "download");
  int failures = 0;
  for (int b = 0; b < batch; ++b) {
    const int generated = host_len[b] - prompt;
    for (int i = 1; i < host_len[b]; ++i) {
      failures += host_out[b * capacity + i] != next_token(host_out[b * capacity + i - 1]);
      failures += host_k[(static_cast<std::size_t>(b) * capacity + i) * kv_heads * head_dim] != host_out[b * capacity + i];
    }
    std::printf("request %d: %d tokens in %d steps (%.2f per step)\n", b, generated, steps,
                static_cast<double>(generated) / steps);
    failures += generated < steps;
  }
  std::printf(failures == 0 ? "lossless: every token equals plain greedy decoding\n" : "%d mismatches\n", failures);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  return failures == 0 ? 0 : 1;
}
