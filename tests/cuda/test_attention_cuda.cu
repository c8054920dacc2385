// SPDX-License-Identifier: Apache-2.0
// The tree-attention kernels on a device against the CPU `medusa::tree_attention` and a
// double-precision reference: batches with their own
// trees and lengths, causal chunks, FlashInfer custom masks, contiguous and paged caches,
// f32/f16/bf16 K and V, one split and many; a tree node with the same bits as its row decoded
// alone; a launch captured in a CUDA graph and replayed over new lengths; bad arguments refused.
// Exits 77 (ctest: skipped) without a CUDA device.
#include "gpu_test.hpp"
#include <medusa/cuda/attention_instances.cuh>

#include "../common_attention_cases.hpp"

#include <cstring>
#include <random>
#include <vector>

using namespace medusa_test;

namespace {

// The fixture's arrays in device memory.
template <class KV>
struct device_copy {
  device_array<float> q;
  device_array<KV> k, v;
  device_array<std::int32_t> slot_bases, tables, indptr, lengths, mask_offsets, mask_indptr;
  device_array<std::uint32_t> words;
  device_array<std::uint8_t> custom;
  explicit device_copy(const batch_fixture<KV>& f)
      : q(f.q), k(f.k), v(f.v), slot_bases(f.slot_bases), tables(f.tables), indptr(f.indptr), lengths(f.lengths),
        mask_offsets(f.mask_offsets), mask_indptr(f.mask_indptr), words(f.words), custom(f.custom) {}
  typename batch_fixture<KV>::arrays arrays() const {
    return {q.get(), k.get(), v.get(), slot_bases.get(), tables.get(), indptr.get(), lengths.get(),
            words.get(), mask_offsets.get(), custom.get(), mask_indptr.get()};
  }
};

// One run on the device; outputs as float.
template <class KV, class O = float>
std::vector<float> run_on_device(batch_fixture<KV>& f, float scale = 0.0f) {
  const mk::attention_plan plan = mk::plan_attention(f.problem());
  device_copy<KV> d(f);
  device_array<O> out(std::vector<O>(static_cast<std::size_t>(f.T * f.out_stride), O(1e4f)));
  device_array<unsigned char> ws(plan.workspace_bytes);
  const auto a = f.params(d.arrays(), out.get(), scale);
  mk::check_attention_args(plan, a);
  mc::check(mc::run(plan, a, ws.get(), plan.workspace_bytes, nullptr), "attention");
  mc::check(cudaDeviceSynchronize(), "attention");
  const auto host = out.download();
  std::vector<float> f32(host.size());
  for (std::size_t i = 0; i < host.size(); ++i) f32[i] = static_cast<float>(host[i]);
  return f32;
}

template <class KV, class O = float>
void check_device(const shape& s, const std::vector<request>& reqs, std::uint32_t seed) {
  std::mt19937 rng(seed);
  batch_fixture<KV> f(s, reqs, rng);
  const auto got = run_on_device<KV, O>(f);
  for (int b = 0; b < f.B; ++b) {
    CAPTURE(b);
    const auto rows = f.rows_of(got, b);
    if (s.mask != attention_mask_kind::flashinfer) check_close(rows, f.cpu(b), tolerance<KV, O>());
    check_close(rows, f.naive(b), tolerance<KV, O>());
  }
}

}  // namespace

TEST_CASE_TEMPLATE("device tree attention of a batch equals the CPU's", KV, float, medusa::half,
                   medusa::bfloat16) {
  std::mt19937 rng(21);
  for (const int page : {0, 16})
    for (const int split : {0, 32, 128}) {
      CAPTURE(page);
      CAPTURE(split);
      shape s;
      s.hq = 8;
      s.hkv = 2;
      s.dim = 64;
      s.capacity = 512;
      s.page_size = page;
      s.kv_split = split;
      check_device<KV>(s, random_batch(rng, 4, 400, 64, true), rng());
    }
}

TEST_CASE("device attention: head_dim 128 with 16-bit outputs, causal chunks, FlashInfer masks, every preset") {
  std::mt19937 rng(22);
  shape s;
  s.hq = 4;
  s.hkv = 4;
  s.dim = 128;
  s.capacity = 300;
  s.kv_split = 64;
  check_device<medusa::bfloat16, medusa::bfloat16>(s, random_batch(rng, 3, 200, 40, true), rng());
  s.mask = attention_mask_kind::causal;
  check_device<medusa::half>(s, random_batch(rng, 3, 200, 90, false), rng());
  s.mask = attention_mask_kind::flashinfer;
  check_device<float>(s, random_batch(rng, 3, 200, 30, true), rng());
  s.mask = attention_mask_kind::tree;
  s.dim = 32;
  s.capacity = 256;
  std::vector<request> presets;
  for (const auto name : medusa::preset_names()) {
    const medusa::tree t = medusa::tree::preset(name);
    presets.push_back({std::uniform_int_distribution<int>(0, 150)(rng), t.num_nodes(), parents_of(t)});
  }
  check_device<medusa::bfloat16>(s, presets, rng());
}

TEST_CASE("on the device, a tree node has the same bits as its row decoded alone") {
  std::mt19937 rng(23);
  const medusa::tree t = medusa::tree::preset("mc_sim_7b_63");
  const auto parents = parents_of(t);
  for (const int L : {0, 61, 200, 511}) {
    CAPTURE(L);
    shape s;
    s.hq = 4;
    s.hkv = 2;
    s.dim = 128;
    s.capacity = 640;
    s.page_size = 16;
    s.kv_split = 128;
    batch_fixture<medusa::bfloat16> tree(s, {{L, t.num_nodes(), parents}}, rng);
    const auto tree_out = run_on_device(tree);
    for (int u = 1; u < t.num_nodes(); u += 5) {
      batch_fixture<medusa::bfloat16> alone = alone_fixture(tree, parents, u, rng);
      const auto alone_out = run_on_device(alone);
      CAPTURE(u);
      CHECK(std::memcmp(alone_out.data(), tree_out.data() + static_cast<std::size_t>(u * tree.out_stride),
                        static_cast<std::size_t>(s.hq * s.dim) * sizeof(float)) == 0);
    }
  }
}

TEST_CASE("on the device, the single-query kernel gives the general kernel's bits") {
  // Decode batches: one query row per KV head (Llama-2-7B's heads) and groups of 4 and 8, 16-bit
  // and float caches (64 keys a stage), splits of 128 and 512 keys.
  std::mt19937 rng(25);
  const std::vector<request> reqs = {{0, 1, {-1}}, {95, 1, {-1}}, {511, 1, {-1}}, {1000, 1, {-1}}, {2046, 1, {-1}}};
  for (const int group : {1, 4, 8})
    for (const int split : {128, 512}) {
      CAPTURE(group);
      CAPTURE(split);
      shape s;
      s.hkv = 4;
      s.hq = 4 * group;
      s.dim = 128;
      s.capacity = 2048;
      s.page_size = 16;
      s.kv_split = split;
      batch_fixture<medusa::bfloat16> f(s, reqs, rng);
      const auto fast = run_on_device<medusa::bfloat16, medusa::bfloat16>(f);
      f.s.single_query = false;
      const auto general = run_on_device<medusa::bfloat16, medusa::bfloat16>(f);
      CHECK(std::memcmp(fast.data(), general.data(), fast.size() * sizeof(float)) == 0);
      for (int b = 0; b < f.B; ++b) check_close(f.rows_of(fast, b), f.naive(b), tolerance<medusa::bfloat16, medusa::bfloat16>());
      batch_fixture<float> g(s, reqs, rng);
      const auto fast32 = run_on_device(g);
      g.s.single_query = false;
      const auto general32 = run_on_device(g);
      CHECK(std::memcmp(fast32.data(), general32.data(), fast32.size() * sizeof(float)) == 0);
    }
}

TEST_CASE_TEMPLATE("on the device, small heads: the single-query kernel, the general one and a causal chunk agree", KV,
                   float, medusa::bfloat16) {
  // The shared models' heads: 8 query / 4 KV heads of 8 (stories260K) and 16 (tinystories-656K).
  std::mt19937 rng(26);
  for (const int dim : {8, 16}) {
    CAPTURE(dim);
    shape s;
    s.hq = 8;
    s.hkv = 4;
    s.dim = dim;
    s.capacity = 512;
    s.kv_split = 128;
    s.mask = attention_mask_kind::causal;
    batch_fixture<KV> f(s, {{0, 1, {}}, {130, 1, {}}, {300, 1, {}}, {511, 1, {}}}, rng);
    const auto fast = run_on_device(f);
    f.s.single_query = false;
    const auto general = run_on_device(f);
    for (std::size_t i = 0; i < fast.size(); ++i)
      if (std::memcmp(&fast[i], &general[i], sizeof(float)) != 0) {
        CAPTURE(i);
        CHECK(fast[i] == general[i]);
        break;
      }
    for (int b = 0; b < f.B; ++b) check_close(f.rows_of(fast, b), f.naive(b), tolerance<KV, float>());
    // a causal chunk of 40 tokens against its tokens decoded one at a time
    batch_fixture<KV> chunk(s, {{100, 40, {}}}, rng);
    const auto chunk_out = run_on_device(chunk);
    for (int i = 0; i < 40; i += 3) {
      batch_fixture<KV> one = one_of_chunk(chunk, i, rng);
      const auto one_out = run_on_device(one);
      CAPTURE(i);
      CHECK(std::memcmp(one_out.data(), chunk_out.data() + static_cast<std::size_t>(i * chunk.out_stride),
                        static_cast<std::size_t>(s.hq * s.dim) * sizeof(float)) == 0);
    }
  }
}

TEST_CASE("a captured attention launch replays over new lengths and queries") {
  std::mt19937 rng(24);
  auto f = replay_fixture(rng);
  const mk::attention_plan plan = mk::plan_attention(f.problem());
  device_copy<medusa::half> d(f);
  device_array<float> out(static_cast<std::size_t>(f.T * f.out_stride));
  device_array<unsigned char> ws(plan.workspace_bytes);
  const auto a = f.params(d.arrays(), out.get());
  cudaStream_t stream = nullptr;
  mc::check(cudaStreamCreate(&stream), "stream");
  cudaGraph_t graph = nullptr;
  mc::check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "capture");
  mc::check(mc::run(plan, a, ws.get(), plan.workspace_bytes, stream), "attention");
  mc::check(cudaStreamEndCapture(stream, &graph), "capture");
  cudaGraphExec_t exec = nullptr;
  mc::check(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
  for (int round = 0; round < replay_rounds; ++round) {
    // the references read the new lengths too; lengths and queries are what a replay reads anew
    // (the custom stream is not used by tree masks)
    f.set_lengths(replay_lengths(round));
    for (auto& x : f.q) x = std::uniform_real_distribution<float>(-2.0f, 2.0f)(rng);
    d.lengths.upload(f.lengths);
    d.q.upload(f.q);
    mc::check(cudaGraphLaunch(exec, stream), "replay");
    mc::check(cudaStreamSynchronize(stream), "replay");
    const auto got = out.download();
    for (int b = 0; b < 2; ++b) {
      CAPTURE(round);
      CAPTURE(b);
      check_close(f.rows_of(got, b), f.cpu(b), 2e-3f);
      check_close(f.rows_of(got, b), f.naive(b), 2e-3f);
    }
  }
  (void)cudaGraphExecDestroy(exec);
  (void)cudaGraphDestroy(graph);
  (void)cudaStreamDestroy(stream);
}

TEST_CASE("bad launch arguments are refused with nothing launched") {
  std::mt19937 rng(25);
  shape s;
  batch_fixture<float> f(s, {{10, 3, {-1, 0, 0}}}, rng);
  const mk::attention_plan plan = mk::plan_attention(f.problem());
  device_copy<float> d(f);
  device_array<float> out(static_cast<std::size_t>(f.T * f.out_stride));
  auto a = f.params(d.arrays(), out.get());
  auto bad = a;
  bad.q = nullptr;
  CHECK(mc::run(plan, bad, nullptr, 0, nullptr) == cudaErrorInvalidValue);
  bad = a;
  bad.tree_mask = nullptr;
  CHECK(mc::run(plan, bad, nullptr, 0, nullptr) == cudaErrorInvalidValue);
  bad = a;
  bad.batch = 2;
  CHECK(mc::run(plan, bad, nullptr, 0, nullptr) == cudaErrorInvalidValue);
  CHECK(mc::run(plan, a, nullptr, 0, nullptr) == cudaSuccess);
  mc::check(cudaDeviceSynchronize(), "attention");
}
