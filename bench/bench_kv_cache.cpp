// SPDX-License-Identifier: Apache-2.0
// Accepted-path commit (docs/kv_cache.md): 32 layers x 8 KV heads x 128 dims, A = 4 accepted
// drafts out of a 64-node tree pass, for float and bfloat16, contiguous (NHD, HND) and paged
// caches.
#include <medusa/kv_cache.hpp>

#include <benchmark/benchmark.h>

#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

namespace {

constexpr int kLayers = 32, kHeads = 8, kDim = 128, kL = 200, kN = 64, kCap = kL + kN;
const std::vector<int> kPath{0, 3, 14, 37, 60};  // A = 4, every row moves (and some overlap)

template <class T>
void commit_contiguous(benchmark::State& state, medusa::kv_layout layout) {
  std::vector<T> k(static_cast<std::size_t>(kLayers) * kCap * kHeads * kDim, T(0.5f)), v(k.size(), T(0.25f));
  const auto kv = medusa::make_kv_view<T>(k, v, {kLayers, kHeads, kDim}, kCap, layout);
  for (auto _ : state) {
    benchmark::DoNotOptimize(medusa::kv_commit(kv, kL, kN, kPath));
    benchmark::ClobberMemory();
  }
  // bytes moved: read + write of (A) rows for K and V in every layer and head
  state.SetBytesProcessed(state.iterations() * 2 * 2 * static_cast<std::int64_t>(kPath.size() - 1) * kLayers *
                          kHeads * kDim * static_cast<std::int64_t>(sizeof(T)));
}

template <class T>
void commit_paged(benchmark::State& state, medusa::kv_layout layout) {
  const int page = 16, pages = (kCap + page - 1) / page + 8;
  std::vector<T> k(static_cast<std::size_t>(kLayers) * pages * page * kHeads * kDim, T(0.5f)), v(k.size(), T(0.25f));
  std::vector<std::int32_t> table(static_cast<std::size_t>(pages));
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), std::mt19937(1));
  table.resize(static_cast<std::size_t>((kCap + page - 1) / page));
  const auto kv = medusa::make_paged_kv_view<T>(k, v, {kLayers, kHeads, kDim}, page, layout, table);
  for (auto _ : state) {
    benchmark::DoNotOptimize(medusa::kv_commit(kv, kL, kN, kPath));
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * 2 * 2 * static_cast<std::int64_t>(kPath.size() - 1) * kLayers *
                          kHeads * kDim * static_cast<std::int64_t>(sizeof(T)));
}

void BM_commit_f32_nhd(benchmark::State& s) { commit_contiguous<float>(s, medusa::kv_layout::nhd); }
void BM_commit_f32_hnd(benchmark::State& s) { commit_contiguous<float>(s, medusa::kv_layout::hnd); }
void BM_commit_bf16_nhd(benchmark::State& s) { commit_contiguous<medusa::bfloat16>(s, medusa::kv_layout::nhd); }
void BM_commit_bf16_hnd(benchmark::State& s) { commit_contiguous<medusa::bfloat16>(s, medusa::kv_layout::hnd); }
void BM_commit_f32_paged16_nhd(benchmark::State& s) { commit_paged<float>(s, medusa::kv_layout::nhd); }
void BM_commit_bf16_paged16_nhd(benchmark::State& s) { commit_paged<medusa::bfloat16>(s, medusa::kv_layout::nhd); }
void BM_commit_bf16_paged16_hnd(benchmark::State& s) { commit_paged<medusa::bfloat16>(s, medusa::kv_layout::hnd); }

}  // namespace

BENCHMARK(BM_commit_f32_nhd);
BENCHMARK(BM_commit_f32_hnd);
BENCHMARK(BM_commit_bf16_nhd);
BENCHMARK(BM_commit_bf16_hnd);
BENCHMARK(BM_commit_f32_paged16_nhd);
BENCHMARK(BM_commit_bf16_paged16_nhd);
BENCHMARK(BM_commit_bf16_paged16_hnd);
