// SPDX-License-Identifier: Apache-2.0
// The step kernels on a CUDA device against the CPU library: candidates (top-k + gather) and the
// four verification policies, compile-time and run-time trees, batches, data errors, and a whole
// step captured in a CUDA graph and replayed. Exits 77 (skipped) without a device.
#include "gpu_test.hpp"
#include <medusa/acceptance.hpp>
#include <medusa/candidates.hpp>
#include <medusa/cuda/common.cuh>
#include <medusa/cuda/step_instances.cuh>
#include <medusa/tree.hpp>
#include <medusa/tree/presets.hpp>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

namespace mc = medusa::cuda;
namespace mk = medusa::cuda::kernels;
using preset_tag = medusa::presets::tag_of<"mc_sim_7b_63">;

namespace {

template <class T>
using device_buffer = medusa_test::device_array<T>;

template <class T>
std::vector<T> converted(const std::vector<float>& f) {
  std::vector<T> out(f.size());
  for (std::size_t i = 0; i < f.size(); ++i) out[i] = T(f[i]);
  return out;
}

template <class T>
std::vector<float> rounded(const std::vector<float>& f) {
  std::vector<float> out(f.size());
  for (std::size_t i = 0; i < f.size(); ++i) out[i] = static_cast<float>(T(f[i]));
  return out;
}

std::vector<float> random_logits(std::size_t n, std::uint32_t seed, float grid) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 2.0f);
  std::vector<float> out(n);
  for (auto& x : out) x = grid > 0 ? std::round(d(rng) / grid) * grid : d(rng);
  return out;
}

template <class T>
void check_candidates(int batch, int vocab) {
  using kernels = mc::step_kernels<preset_tag, T>;
  const auto& t = preset_tag::tree;
  const int heads = 4, n = t.num_nodes();
  const auto plan = kernels::plan(batch, heads, vocab, mk::verify_kind::greedy);
  const auto logits = rounded<T>(random_logits(static_cast<std::size_t>(batch) * heads * vocab, 5u, 0.05f));
  std::vector<std::int32_t> roots(static_cast<std::size_t>(batch)), lengths(roots.size());
  for (int b = 0; b < batch; ++b) {
    roots[static_cast<std::size_t>(b)] = (b * 7919) % vocab;
    lengths[static_cast<std::size_t>(b)] = 3 * b + 1;
  }
  device_buffer<T> d_logits(converted<T>(logits));
  device_buffer<std::int32_t> d_roots(roots), d_lengths(lengths), d_tokens(static_cast<std::size_t>(batch * n)),
      d_positions(static_cast<std::size_t>(batch * n)), d_status(std::vector<std::int32_t>(static_cast<std::size_t>(batch), 0));
  device_buffer<unsigned char> ws(plan.workspace_bytes);
  REQUIRE(kernels::candidates(plan, {}, d_logits.get(), vocab, d_roots.get(), d_lengths.get(), d_tokens.get(), d_positions.get(), d_status.get(),
                              ws.get(), ws.size(), nullptr) == cudaSuccess);
  const auto tokens = d_tokens.download();
  const auto positions = d_positions.download();
  const auto status = d_status.download();
  for (int b = 0; b < batch; ++b) {
    std::vector<std::int32_t> flat(medusa::flat_candidates_size(t, heads)), expect(static_cast<std::size_t>(n));
    medusa::generate_candidates(t, roots[static_cast<std::size_t>(b)],
                                std::span<const float>(logits).subspan(static_cast<std::size_t>(b) * heads * vocab,
                                                                       static_cast<std::size_t>(heads * vocab)),
                                vocab, flat, expect);
    CHECK(status[static_cast<std::size_t>(b)] == 0);
    for (int u = 0; u < n; ++u) {
      CHECK(tokens[static_cast<std::size_t>(b * n + u)] == expect[static_cast<std::size_t>(u)]);
      CHECK(positions[static_cast<std::size_t>(b * n + u)] == lengths[static_cast<std::size_t>(b)] + t.node_depth(u));
    }
  }
}

struct step_data {
  int batch, nodes, vocab;
  std::vector<float> logits, drafts;
  std::vector<std::int32_t> tokens, eos;
  std::vector<std::uint64_t> seeds, steps;
};

template <class Tree>
step_data make_step(const Tree& t, int batch, int vocab, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  step_data d{batch, t.num_nodes(), vocab, {}, {}, {}, {}, {}, {}};
  const auto cells = static_cast<std::size_t>(batch) * d.nodes * vocab;
  d.logits.resize(cells);
  d.drafts.resize(cells);
  for (auto& x : d.logits) x = normal(rng);
  for (std::size_t r = 0; r < cells / vocab; ++r) {
    double sum = 0.0;
    float* q = d.drafts.data() + r * vocab;
    for (int i = 0; i < vocab; ++i) sum += q[i] = std::exp(normal(rng));
    for (int i = 0; i < vocab; ++i) q[i] = static_cast<float>(q[i] / sum);
  }
  for (int b = 0; b < batch; ++b) {
    for (int u = 0; u < d.nodes; ++u) {
      auto token = static_cast<std::int32_t>(rng() % static_cast<unsigned>(vocab));
      if (u > 0 && unit(rng) < 0.8) {
        const float* z = d.logits.data() + static_cast<std::size_t>(b * d.nodes + t.parent(u)) * vocab;
        token = static_cast<std::int32_t>(std::max_element(z, z + vocab) - z);
      }
      d.tokens.push_back(token);
    }
    d.seeds.push_back(77 + static_cast<std::uint64_t>(b));
    d.steps.push_back(static_cast<std::uint64_t>(b) * 3);
    d.eos.push_back(b == 1 ? d.tokens[static_cast<std::size_t>(b * d.nodes + 1)] : -1);
  }
  return d;
}

struct device_outputs {
  device_buffer<std::int32_t> accept_length, next_node, bonus, eos, best_row, nodes, tokens, status;
  device_outputs(int batch, int stride)
      : accept_length(batch), next_node(batch), bonus(batch), eos(batch), best_row(batch),
        nodes(static_cast<std::size_t>(batch * stride)), tokens(static_cast<std::size_t>(batch * stride)), status(batch) {}
};

template <class T>
mk::verify_args<T> args_for(const step_data&, const T* logits, const std::int32_t* tokens, const float* drafts,
                            const std::uint64_t* seeds, const std::uint64_t* steps, const std::int32_t* eos,
                            float temperature, int stride, device_outputs& o) {
  mk::verify_args<T> a;
  a.logits = logits;
  a.row_stride = 0;
  a.node_tokens = tokens;
  a.draft_probs = drafts;
  a.seeds = seeds;
  a.steps = steps;
  a.eos_tokens = eos;
  a.temperature = temperature;
  a.path_stride = stride;
  a.accept_length = o.accept_length.get();
  a.next_node = o.next_node.get();
  a.bonus = o.bonus.get();
  a.eos = o.eos.get();
  a.best_row = o.best_row.get();
  a.path_nodes = o.nodes.get();
  a.path_tokens = o.tokens.get();
  a.status = o.status.get();
  return a;
}

// Runs verify on the device for `Tag` (compile-time or run-time) and compares with the CPU.
template <class Tag, class T, class Policy>
int check_verify(mk::verify_kind kind, const Policy& policy, float temperature, int batch, int vocab) {
  const auto cpu_tree = medusa::tree::preset("mc_sim_7b_63");
  using kernels = mc::step_kernels<Tag, T>;
  const std::vector<int> packed = mc::pack_tree(cpu_tree);
  device_buffer<int> d_packed(packed);
  typename kernels::kernel_tree kt{};
  if constexpr (std::is_same_v<Tag, mc::runtime_tree>) kt = mc::tree_arrays::over(cpu_tree, d_packed.get());
  auto d = make_step(cpu_tree, batch, vocab, 41u);
  d.logits = rounded<T>(d.logits);
  const int stride = cpu_tree.depth() + 1;
  const auto plan = kernels::plan(batch, 4, vocab, kind, cpu_tree, temperature);
  device_buffer<T> d_logits(converted<T>(d.logits));
  device_buffer<float> d_drafts(d.drafts);
  device_buffer<std::int32_t> d_tokens(d.tokens), d_eos(d.eos);
  device_buffer<std::uint64_t> d_seeds(d.seeds), d_steps(d.steps);
  device_buffer<unsigned char> ws(plan.workspace_bytes);
  device_outputs o(batch, stride);
  auto a = args_for<T>(d, d_logits.get(), d_tokens.get(), d_drafts.get(), d_seeds.get(), d_steps.get(), d_eos.get(), temperature, stride, o);
  a.row_stride = vocab;
  REQUIRE(kernels::verify(plan, kt, a, ws.get(), ws.size(), nullptr) == cudaSuccess);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  const auto len = o.accept_length.download(), next = o.next_node.download(), bonus = o.bonus.download(),
             eos = o.eos.download(), row = o.best_row.download(), nodes = o.nodes.download(),
             tokens = o.tokens.download(), status = o.status.download();
  medusa::acceptance_workspace cpu_ws;
  int accepted = 0;
  const auto n = static_cast<std::size_t>(d.nodes), v = static_cast<std::size_t>(vocab);
  for (int b = 0; b < batch; ++b) {
    CAPTURE(b);
    const auto bb = static_cast<std::size_t>(b);
    medusa::verify_request req{.node_tokens = std::span<const std::int32_t>(d.tokens).subspan(bb * n, n),
                               .logits = std::span<const float>(d.logits).subspan(bb * n * v, n * v),
                               .vocab = vocab,
                               .draft_probs = std::span<const float>(d.drafts).subspan(bb * n * v, n * v),
                               .seed = d.seeds[bb],
                               .step = d.steps[bb],
                               .eos_token = d.eos[bb]};
    const auto r = medusa::verify(cpu_tree, req, policy, cpu_ws);
    CHECK(status[bb] == 0);
    CHECK(len[bb] == r.accept_length);
    CHECK(next[bb] == r.next_node);
    CHECK(bonus[bb] == r.bonus);
    CHECK(eos[bb] == (r.eos ? 1 : 0));
    CHECK(row[bb] == r.best_row);
    for (int j = 0; j <= r.accept_length; ++j) {
      CHECK(nodes[bb * stride + j] == r.node_ids[static_cast<std::size_t>(j)]);
      CHECK(tokens[bb * stride + j] == r.token_ids[static_cast<std::size_t>(j)]);
    }
    accepted += r.accept_length;
  }
  return accepted;
}

}  // namespace

TEST_CASE("device candidates equal the CPU's: one split and split rows, f32/bf16/f16") {
  check_candidates<float>(8, 1000);
  check_candidates<float>(1, 128256);
  check_candidates<medusa::bfloat16>(32, 32000);
  check_candidates<medusa::half>(2, 32000);
}

TEST_CASE("device verification equals the CPU's for every policy, compile-time and run-time trees") {
  int accepted = 0;
  accepted += check_verify<preset_tag, float>(mk::verify_kind::greedy, medusa::greedy_policy{}, 0.0f, 8, 1000);
  accepted += check_verify<mc::runtime_tree, medusa::bfloat16>(mk::verify_kind::greedy, medusa::greedy_policy{}, 0.0f, 8, 32000);
  check_verify<preset_tag, medusa::half>(mk::verify_kind::greedy, medusa::greedy_policy{}, 0.0f, 4, 32000);
  for (const float temp : {0.0f, 0.7f}) {
    CAPTURE(temp);
    check_verify<preset_tag, float>(mk::verify_kind::typical, medusa::typical_policy{.temperature = temp}, temp, 8, 2000);
    check_verify<mc::runtime_tree, float>(mk::verify_kind::rejection, medusa::rejection_policy{{.temperature = temp}}, temp, 8, 500);
    check_verify<preset_tag, float>(mk::verify_kind::speculative, medusa::speculative_policy{{.temperature = temp}}, temp, 8, 500);
  }
  CHECK(accepted > 16);
}

TEST_CASE("a NaN logit marks only its request on the device") {
  using kernels = mc::step_kernels<preset_tag, float>;
  const auto& t = preset_tag::tree;
  const int batch = 3, vocab = 700, stride = t.depth() + 1;
  auto d = make_step(t, batch, vocab, 3u);
  d.logits[static_cast<std::size_t>(2 * d.nodes) * vocab + 11] = std::nanf("");
  const auto plan = kernels::plan(batch, 4, vocab, mk::verify_kind::greedy);
  device_buffer<float> d_logits(d.logits);
  device_buffer<std::int32_t> d_tokens(d.tokens);
  device_buffer<unsigned char> ws(plan.workspace_bytes);
  device_outputs o(batch, stride);
  auto a = args_for<float>(d, d_logits.get(), d_tokens.get(), nullptr, nullptr, nullptr, nullptr, 0.0f, stride, o);
  a.row_stride = vocab;
  REQUIRE(kernels::verify(plan, {}, a, ws.get(), ws.size(), nullptr) == cudaSuccess);
  const auto status = o.status.download();
  CHECK(status[0] == 0);
  CHECK(status[1] == 0);
  CHECK(status[2] == static_cast<std::int32_t>(mc::request_status::non_finite_logit));
  // Bad arguments launch nothing.
  CHECK(kernels::verify(plan, {}, a, ws.get(), ws.size() - 1, nullptr) == cudaErrorInvalidValue);
}

TEST_CASE("verify + candidates captured in a CUDA graph replay with the same results") {
  using kernels = mc::step_kernels<preset_tag, medusa::bfloat16>;
  const auto& t = preset_tag::tree;
  const int batch = 8, vocab = 32000, stride = t.depth() + 1, n = t.num_nodes();
  auto d = make_step(t, batch, vocab, 9u);
  const auto plan = kernels::plan(batch, 4, vocab, mk::verify_kind::greedy);
  device_buffer<medusa::bfloat16> d_logits(converted<medusa::bfloat16>(d.logits));
  device_buffer<medusa::bfloat16> d_heads(converted<medusa::bfloat16>(random_logits(static_cast<std::size_t>(batch) * 4 * vocab, 4u, 0.0f)));
  device_buffer<std::int32_t> d_tokens(d.tokens), d_next_tokens(static_cast<std::size_t>(batch * n)),
      d_positions(static_cast<std::size_t>(batch * n)), d_lengths(std::vector<std::int32_t>(batch, 5));
  device_buffer<unsigned char> ws(plan.workspace_bytes);
  device_outputs o(batch, stride);
  auto a = args_for<medusa::bfloat16>(d, d_logits.get(), d_tokens.get(), nullptr, nullptr, nullptr, nullptr, 0.0f, stride, o);
  a.row_stride = vocab;
  cudaStream_t stream;
  REQUIRE(cudaStreamCreate(&stream) == cudaSuccess);
  // Eager run: the reference.
  REQUIRE(kernels::verify(plan, {}, a, ws.get(), ws.size(), stream) == cudaSuccess);
  REQUIRE(kernels::candidates(plan, {}, d_heads.get(), vocab, o.bonus.get(), d_lengths.get(), d_next_tokens.get(), d_positions.get(),
                              o.status.get(), ws.get(), ws.size(), stream) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
  const auto eager_tokens = d_next_tokens.download();
  const auto eager_len = o.accept_length.download();
  REQUIRE(cudaMemset(d_next_tokens.get(), 0, d_next_tokens.size() * sizeof(std::int32_t)) == cudaSuccess);
  cudaGraph_t graph;
  REQUIRE(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal) == cudaSuccess);
  REQUIRE(kernels::verify(plan, {}, a, ws.get(), ws.size(), stream) == cudaSuccess);
  REQUIRE(kernels::candidates(plan, {}, d_heads.get(), vocab, o.bonus.get(), d_lengths.get(), d_next_tokens.get(), d_positions.get(),
                              o.status.get(), ws.get(), ws.size(), stream) == cudaSuccess);
  REQUIRE(cudaStreamEndCapture(stream, &graph) == cudaSuccess);
  cudaGraphExec_t exec;
  REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
  for (int replay = 0; replay < 3; ++replay) REQUIRE(cudaGraphLaunch(exec, stream) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
  CHECK(d_next_tokens.download() == eager_tokens);
  CHECK(o.accept_length.download() == eager_len);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}
