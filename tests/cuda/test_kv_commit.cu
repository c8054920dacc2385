// SPDX-License-Identifier: Apache-2.0
// The device KV-cache commit against the CPU `medusa::kv_commit`, bit for bit: overlapping paths,
// batches of mixed lengths, NHD/HND contiguous and paged caches, f32/f16/bf16, every move width,
// bad requests rejected alone, null pointers refused, and a launch captured in a CUDA graph and
// replayed over new paths. Exits 77 (ctest: skipped) without a CUDA device.
#include "gpu_test.hpp"
#include <medusa/cuda/kv_commit.cuh>
#include <medusa/half.hpp>
#include <medusa/kv_cache.hpp>

#include "../common_kv_commit_cases.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <span>
#include <vector>

namespace mc = medusa::cuda;
namespace mk = medusa::cuda::kernels;
using medusa::kv_extents;
using medusa::kv_layout;

namespace {

using medusa_test::device_array;
using medusa_test::fixed_requests;
using medusa_test::random_elements;
using medusa_test::random_requests;
using medusa_test::request_case;

// The batch arrays of the kernel, packed, on the host and on the device.
struct device_batch {
  std::vector<std::int32_t> lengths, offsets, paths;
  device_array<std::int32_t> d_lengths, d_offsets, d_paths, d_new_lengths;
  device_batch(const std::vector<request_case>& requests, std::size_t path_capacity = 0)
      : d_lengths(requests.size()),
        d_offsets(requests.size() + 1),
        d_paths(std::max(path_capacity, total_nodes(requests))),
        d_new_lengths(requests.size()) {
    set(requests);
  }
  static std::size_t total_nodes(const std::vector<request_case>& requests) {
    std::size_t n = 0;
    for (const auto& r : requests) n += r.path.size();
    return n;
  }
  // Writes new requests (same batch size) into the same device arrays.
  void set(const std::vector<request_case>& requests) {
    lengths.clear();
    offsets.assign(1, 0);
    paths.clear();
    for (const auto& r : requests) {
      lengths.push_back(r.committed);
      paths.insert(paths.end(), r.path.begin(), r.path.end());
      offsets.push_back(static_cast<std::int32_t>(paths.size()));
    }
    d_lengths.upload(lengths);
    d_offsets.upload(offsets);
    if (!paths.empty()) d_paths.upload(paths);
    d_new_lengths.upload(std::vector<std::int32_t>(lengths.size(), -7));
    mc::check(cudaDeviceSynchronize(), "upload");  // pageable copies may still be in flight
  }
  mk::kv_commit_batch view() const {
    return {.size = static_cast<int>(lengths.size()),
            .committed_lengths = d_lengths.get(),
            .path_offsets = d_offsets.get(),
            .paths = d_paths.get(),
            .new_lengths = d_new_lengths.get()};
  }
};


// The CPU commit of every valid request on `views` (one per request); the expected new lengths.
template <class View>
std::vector<std::int32_t> cpu_commit(const std::vector<View>& views, const std::vector<request_case>& requests) {
  std::vector<std::int32_t> expected;
  for (std::size_t b = 0; b < requests.size(); ++b) {
    const auto& r = requests[b];
    expected.push_back(r.valid ? medusa::kv_commit(views[b], r.committed, r.nodes, r.path) : -1);
  }
  return expected;
}

// Commits on the device (params' k/v/tables replaced by device copies) and on the CPU (through
// `views_of` on host copies); compares both caches bit for bit and the new lengths.
template <class T, class ViewsOf>
void check_on_device(const std::vector<T>& k, const std::vector<T>& v, std::size_t shift, mk::kv_commit_params params,
                     const std::vector<std::int32_t>& index_table, const std::vector<request_case>& requests,
                     ViewsOf views_of, int expect_vector_bytes) {
  device_array<T> dk(k), dv(v);
  device_array<std::int32_t> d_table(index_table);
  device_batch batch(requests);
  params.batch = batch.view();
  params.k = dk.get() + shift;
  params.v = dv.get() + shift;
  if (params.layout == mk::kv_commit_layout::paged)
    params.block_tables = d_table.get();
  else
    params.slot_bases = d_table.get();
  CHECK(mk::kv_commit_vector_bytes(params) == expect_vector_bytes);
  const mk::kv_commit_plan plan = mk::plan_kv_commit(params);
  mc::check(mc::run(plan, params, nullptr), "kv commit");
  mc::check(cudaDeviceSynchronize(), "kv commit (kernel)");

  std::vector<T> ref_k = k, ref_v = v;
  const auto expected = cpu_commit(views_of(ref_k.data() + shift, ref_v.data() + shift), requests);
  const std::vector<T> out_k = dk.download(), out_v = dv.download();
  CHECK(std::memcmp(out_k.data(), ref_k.data(), k.size() * sizeof(T)) == 0);
  CHECK(std::memcmp(out_v.data(), ref_v.data(), v.size() * sizeof(T)) == 0);
  CHECK(batch.d_new_lengths.download() == expected);
}

// A contiguous cache `[layers][B·capacity][heads][dim]` (NHD) or `[layers][heads][B·capacity][dim]`
// (HND); request b owns slots [b·capacity, (b+1)·capacity). `shift` elements misalign it.
template <class T>
void check_contiguous(kv_layout layout, kv_extents ext, int capacity, const std::vector<request_case>& requests,
                      std::uint32_t seed, int expect_vector_bytes, std::size_t shift = 0) {
  using mapping = medusa::layout_kv_strided::mapping;
  const int batch = static_cast<int>(requests.size());
  const mapping whole = mapping::dense(ext, batch * capacity, layout);
  const mapping per_request = mapping::strided(ext, capacity, whole.layer_stride, whole.slot_stride, whole.head_stride);
  std::mt19937 rng(seed);
  const std::size_t n = whole.required_span_size() + shift;
  const std::vector<T> k = random_elements<T>(n, rng), v = random_elements<T>(n, rng);
  const auto views_of = [&](T* kp, T* vp) {
    std::vector<medusa::kv_cache_view<T>> views;
    for (int b = 0; b < batch; ++b) {
      const std::size_t first = static_cast<std::size_t>(b * capacity) * whole.slot_stride;
      views.emplace_back(kp + first, vp + first, per_request);
    }
    return views;
  };
  std::vector<std::int32_t> slot_bases(static_cast<std::size_t>(batch));
  for (int b = 0; b < batch; ++b) slot_bases[static_cast<std::size_t>(b)] = b * capacity;
  // Geometry from a view; the pointers are replaced by device ones.
  const auto params = mk::make_kv_commit_params(medusa::kv_cache_view<T>(nullptr, nullptr, whole), {}, nullptr, capacity);
  check_on_device(k, v, shift, params, slot_bases, requests, views_of, expect_vector_bytes);
}

// A page pool `[layers][pages][page]` with a scrambled block table per request.
template <class T>
void check_paged(kv_layout page_layout, kv_extents ext, int page_size, int blocks,
                 const std::vector<request_case>& requests, std::uint32_t seed, int expect_vector_bytes,
                 std::int32_t bad_entry = -1) {
  const int batch = static_cast<int>(requests.size());
  const int pages = batch * blocks + 3;
  std::mt19937 rng(seed);
  const std::size_t n = static_cast<std::size_t>(ext.num_layers) * static_cast<std::size_t>(pages) *
                        static_cast<std::size_t>(page_size * ext.num_kv_heads * ext.head_dim);
  const std::vector<T> k = random_elements<T>(n, rng), v = random_elements<T>(n, rng);
  std::vector<std::int32_t> order(static_cast<std::size_t>(pages));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<std::int32_t> tables(order.begin(), order.begin() + batch * blocks);
  if (bad_entry >= 0) tables[static_cast<std::size_t>(bad_entry)] = pages + 100;
  const auto views_of = [&](T* kp, T* vp) {
    std::vector<medusa::paged_kv_cache_view<T>> views;
    for (int b = 0; b < batch; ++b)
      views.push_back(medusa::make_paged_kv_view<T>(
          std::span<T>(kp, n), std::span<T>(vp, n), ext, page_size, page_layout,
          std::span<const std::int32_t>(tables.data() + b * blocks, static_cast<std::size_t>(blocks))));
    return views;
  };
  std::vector<T> host_k = k;
  const auto params = mk::make_kv_commit_params(views_of(host_k.data(), host_k.data())[0], {}, tables.data(), blocks);
  check_on_device(k, v, 0, params, tables, requests, views_of, expect_vector_bytes);
}

}  // namespace

TEST_CASE("overlapping and corner-case paths commit as on the CPU") {
  check_contiguous<float>(kv_layout::nhd, {2, 3, 8}, 24, fixed_requests(), 1, 16);
  check_contiguous<float>(kv_layout::hnd, {2, 3, 8}, 24, fixed_requests(), 2, 16);
  check_contiguous<medusa::half>(kv_layout::nhd, {2, 3, 6}, 24, fixed_requests(), 3, 4);
}

TEST_CASE("random batches: NHD/HND, f32/f16/bf16, every move width") {
  std::mt19937 rng(42);
  for (kv_layout layout : {kv_layout::nhd, kv_layout::hnd}) {
    for (auto [dim, width] : {std::pair{8, 16}, {6, 4}, {3, 2}, {12, 8}, {128, 16}}) {
      INFO("16-bit head_dim ", dim);
      const auto requests = random_requests(rng, 6, 40, 16);
      check_contiguous<medusa::half>(layout, {3, 2, dim}, 40, requests, rng(), width);
      check_contiguous<medusa::bfloat16>(layout, {2, 5, dim}, 40, requests, rng(), width);
    }
    for (auto [dim, width] : {std::pair{4, 16}, {6, 8}, {5, 4}, {64, 16}}) {
      INFO("f32 head_dim ", dim);
      check_contiguous<float>(layout, {2, 3, dim}, 30, random_requests(rng, 5, 30, 12), rng(), width);
    }
  }
}

TEST_CASE("a model-sized batch: 8 layers, 8 KV heads of 128, bf16, 32 requests") {
  std::mt19937 rng(17);
  check_contiguous<medusa::bfloat16>(kv_layout::nhd, {8, 8, 128}, 128, random_requests(rng, 32, 128, 64), rng(), 16);
  check_contiguous<medusa::bfloat16>(kv_layout::hnd, {8, 8, 128}, 128, random_requests(rng, 32, 128, 64), rng(), 16);
  check_paged<medusa::half>(kv_layout::nhd, {8, 8, 128}, 16, 8, random_requests(rng, 32, 128, 64), rng(), 16);
}

TEST_CASE("paged caches: scrambled block tables, page sizes that do not divide the lengths") {
  std::mt19937 rng(7);
  for (kv_layout layout : {kv_layout::nhd, kv_layout::hnd}) {
    for (int page_size : {1, 3, 4, 5, 16}) {
      INFO("page_size ", page_size);
      const int blocks = (33 + page_size - 1) / page_size;
      const int capacity = blocks * page_size;
      check_paged<float>(layout, {2, 2, 8}, page_size, blocks, random_requests(rng, 4, capacity, 16), rng(), 16);
      check_paged<medusa::half>(layout, {2, 2, 6}, page_size, blocks, random_requests(rng, 3, capacity, 16), rng(), 4);
      check_paged<medusa::bfloat16>(layout, {1, 3, 8}, page_size, blocks, fixed_requests(), rng(), 16);
    }
  }
}

TEST_CASE("a misaligned cache falls back to narrower moves") {
  std::mt19937 rng(5);
  check_contiguous<medusa::half>(kv_layout::nhd, {2, 2, 8}, 16, random_requests(rng, 3, 16, 10), rng(), 2, 1);
  check_contiguous<float>(kv_layout::hnd, {2, 2, 8}, 16, random_requests(rng, 3, 16, 10), rng(), 4, 1);
  check_contiguous<float>(kv_layout::nhd, {2, 2, 8}, 16, fixed_requests(), rng(), 8, 2);
}

TEST_CASE("a request with bad data is rejected alone") {
  std::vector<request_case> requests = fixed_requests();
  requests.push_back({2, 4, {1, 2}, false});        // does not start at the root
  requests.push_back({2, 4, {0, 3, 3}, false});     // not strictly increasing
  requests.push_back({20, 6, {0, 5}, false});       // beyond the request's 24 slots
  requests.push_back({-1, 3, {0, 1}, false});       // negative committed length
  requests.push_back({24, 1, {0}, false});          // L + 1 beyond the capacity
  requests.push_back({4, 5, {}, false});            // empty path
  std::mt19937 rng(9);
  check_contiguous<float>(kv_layout::nhd, {2, 2, 8}, 24, requests, rng(), 16);
  // A block-table entry outside the pool: request 1's second block.
  check_paged<float>(kv_layout::nhd, {1, 2, 4}, 4, 3, {{1, 6, {0, 1, 5}}, {0, 8, {0, 2, 7}, false}, {4, 3, {0, 2}}},
                     rng(), 16, /*bad_entry*/ 3 + 1);
}

TEST_CASE("null pointers and aliased lengths are refused without a launch") {
  const std::vector<request_case> requests = {{1, 3, {0, 2}}};
  device_batch batch(requests);
  std::mt19937 rng(1);
  const std::vector<float> host = random_elements<float>(2 * 8 * 8, rng);
  device_array<float> dk(host), dv(host);
  const auto ext = kv_extents{2, 1, 8};
  const auto m = medusa::layout_kv_strided::mapping::dense(ext, 8, kv_layout::nhd);
  mk::kv_commit_params params = mk::make_kv_commit_params(medusa::kv_cache_view<float>(dk.get(), dv.get(), m), batch.view());
  const mk::kv_commit_plan plan = mk::plan_kv_commit(params);
  auto p = params;
  p.k = nullptr;
  CHECK(mc::run(plan, p, nullptr) == cudaErrorInvalidValue);
  p = params;
  p.batch.paths = nullptr;
  CHECK(mc::run(plan, p, nullptr) == cudaErrorInvalidValue);
  p = params;
  p.batch.new_lengths = const_cast<std::int32_t*>(p.batch.committed_lengths);
  CHECK(mc::run(plan, p, nullptr) == cudaErrorInvalidValue);
  p = params;
  p.layout = mk::kv_commit_layout::paged;  // without block tables
  CHECK(mc::run(plan, p, nullptr) == cudaErrorInvalidValue);
  mc::check(cudaDeviceSynchronize(), "sync");
  CHECK(std::memcmp(dk.download().data(), host.data(), host.size() * sizeof(float)) == 0);
  CHECK(batch.d_new_lengths.download() == std::vector<std::int32_t>{-7});
  // The valid launch then works.
  mc::check(mc::run(plan, params, nullptr), "kv commit");
  mc::check(cudaDeviceSynchronize(), "sync");
  CHECK(batch.d_new_lengths.download() == std::vector<std::int32_t>{3});
}

TEST_CASE("a commit captured in a CUDA graph replays over new paths") {
  using T = medusa::half;
  const kv_extents ext{4, 2, 64};
  const int batch_size = 6, capacity = 48;
  const auto whole = medusa::layout_kv_strided::mapping::dense(ext, batch_size * capacity, kv_layout::hnd);
  const auto per_request =
      medusa::layout_kv_strided::mapping::strided(ext, capacity, whole.layer_stride, whole.slot_stride, whole.head_stride);
  std::mt19937 rng(23);
  std::vector<T> ref_k = random_elements<T>(whole.required_span_size(), rng);
  std::vector<T> ref_v = random_elements<T>(whole.required_span_size(), rng);
  device_array<T> dk(ref_k), dv(ref_v);
  std::vector<std::int32_t> slot_bases;
  for (int b = 0; b < batch_size; ++b) slot_bases.push_back(b * capacity);
  device_array<std::int32_t> d_bases(slot_bases);
  std::vector<medusa::kv_cache_view<T>> views;
  for (int b = 0; b < batch_size; ++b) {
    const std::size_t first = static_cast<std::size_t>(b * capacity) * whole.slot_stride;
    views.emplace_back(ref_k.data() + first, ref_v.data() + first, per_request);
  }
  const int max_nodes = 16;
  device_batch batch(random_requests(rng, batch_size, capacity, max_nodes),
                     static_cast<std::size_t>(batch_size * max_nodes));
  const auto params = mk::make_kv_commit_params(medusa::kv_cache_view<T>(dk.get(), dv.get(), whole), batch.view(),
                                                d_bases.get(), capacity);
  const mk::kv_commit_plan plan = mk::plan_kv_commit(params);

  cudaStream_t stream = nullptr;
  mc::check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  mc::check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "cudaStreamBeginCapture");
  const cudaError_t launched = mc::run(plan, params, stream);
  mc::check(cudaStreamEndCapture(stream, &graph), "cudaStreamEndCapture");
  mc::check(launched, "kv commit (capture)");
  mc::check(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");

  // Each replay commits new requests on top of the previous state (the graph reads the arrays).
  for (int step = 0; step < 4; ++step) {
    INFO("replay ", step);
    const auto requests = random_requests(rng, batch_size, capacity, max_nodes);
    batch.set(requests);
    mc::check(cudaGraphLaunch(exec, stream), "cudaGraphLaunch");
    mc::check(cudaStreamSynchronize(stream), "replay");
    const auto expected = cpu_commit(views, requests);
    CHECK(std::memcmp(dk.download().data(), ref_k.data(), ref_k.size() * sizeof(T)) == 0);
    CHECK(std::memcmp(dv.download().data(), ref_v.data(), ref_v.size() * sizeof(T)) == 0);
    CHECK(batch.d_new_lengths.download() == expected);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}
