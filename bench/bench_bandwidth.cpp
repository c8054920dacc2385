// SPDX-License-Identifier: Apache-2.0
// Read bandwidth of this machine over a buffer the size of pycode-15m's weights (60 MB): the
// roofline of single-token decoding, which streams every weight once.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstddef>
#include <thread>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr std::size_t kBytes = 59926044;  // pycode-15m model.bin

const std::vector<float>& buffer() {
  static const std::vector<float> b = [] {
    std::vector<float> v(kBytes / sizeof(float));
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i % 7);
    return v;
  }();
  return b;
}

float stream_sum(const float* p, std::size_t n) {
#if defined(__AVX512F__)
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  std::size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    a0 = _mm512_add_ps(a0, _mm512_loadu_ps(p + i));
    a1 = _mm512_add_ps(a1, _mm512_loadu_ps(p + i + 16));
    a2 = _mm512_add_ps(a2, _mm512_loadu_ps(p + i + 32));
    a3 = _mm512_add_ps(a3, _mm512_loadu_ps(p + i + 48));
  }
  alignas(64) float t[16];
  _mm512_store_ps(t, _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  float s = 0;
  for (float x : t) s += x;
  for (; i < n; ++i) s += p[i];
  return s;
#else
  float s[16] = {};
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int k = 0; k < 16; ++k) s[k] += p[i + static_cast<std::size_t>(k)];
  float r = 0;
  for (float x : s) r += x;
  for (; i < n; ++i) r += p[i];
  return r;
#endif
}

// Streaming sum of the whole buffer split over state.range(0) threads (threads are created per
// pass: at 60 MB a pass takes milliseconds, the spawn cost is noise).
void BM_read_bandwidth(benchmark::State& state) {
  const auto& b = buffer();
  const int threads = static_cast<int>(state.range(0));
  std::vector<float> partial(static_cast<std::size_t>(threads));
  for (auto _ : state) {
    std::vector<std::thread> pool;
    const std::size_t per = b.size() / static_cast<std::size_t>(threads);
    for (int t = 1; t < threads; ++t)
      pool.emplace_back([&, t] {
        const std::size_t lo = per * static_cast<std::size_t>(t);
        const std::size_t hi = t + 1 == threads ? b.size() : lo + per;
        partial[static_cast<std::size_t>(t)] = stream_sum(b.data() + lo, hi - lo);
      });
    partial[0] = stream_sum(b.data(), threads == 1 ? b.size() : per);
    for (auto& th : pool) th.join();
    benchmark::DoNotOptimize(partial.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * static_cast<std::int64_t>(kBytes));
  state.counters["buffer_MB"] = static_cast<double>(kBytes) / 1e6;
}
BENCHMARK(BM_read_bandwidth)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
