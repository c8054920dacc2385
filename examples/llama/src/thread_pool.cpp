// SPDX-License-Identifier: Apache-2.0
#include <medusa_llama/thread_pool.hpp>

#include <medusa_llama/errors.hpp>

#include <algorithm>
#include <string>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define MEDUSA_LLAMA_PAUSE() _mm_pause()
#else
#define MEDUSA_LLAMA_PAUSE() std::this_thread::yield()
#endif

namespace medusa_llama {

namespace {
// Roughly 0.1-1 ms of spinning: longer than the gap between two jobs of one decoding step, far
// shorter than the gap between steps of an idle engine.
constexpr int kSpinIterations = 20000;
}  // namespace

thread_pool::thread_pool(int n_threads) {
  if (n_threads < 0 || n_threads > 1024)
    throw engine_error(engine_errc::bad_option, "thread count " + std::to_string(n_threads) + " is outside [0, 1024]");
  n_ = n_threads == 0 ? static_cast<int>(std::max(1u, std::thread::hardware_concurrency())) : n_threads;
  workers_.reserve(static_cast<std::size_t>(n_ - 1));
  for (int t = 1; t < n_; ++t) workers_.emplace_back([this, t] { worker(t); });
}

thread_pool::~thread_pool() {
  stop_.store(true, std::memory_order_release);
  state_.store(static_cast<std::uint64_t>(++gen_) << 32, std::memory_order_release);
  state_.notify_all();
  for (auto& w : workers_) w.join();
}

void thread_pool::work(int tid, std::uint32_t gen) {
  for (;;) {
    std::uint64_t s = state_.load(std::memory_order_acquire);
    if (static_cast<std::uint32_t>(s >> 32) != gen) return;
    // The chunk count lives in the same word as the claim counter: a count read separately could
    // belong to the next job while the word still names this one.
    const auto chunk = static_cast<int>(s & 0xffffu), n = static_cast<int>((s >> 16) & 0xffffu);
    if (chunk >= n) return;
    if (!state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel, std::memory_order_relaxed)) continue;
    // The claim succeeded, so job `gen` is still running and fn_/ctx_ are its own.
    fn_.load(std::memory_order_relaxed)(ctx_.load(std::memory_order_relaxed), chunk, tid);
    done_.fetch_add(1, std::memory_order_release);
  }
}

void thread_pool::dispatch(job_fn fn, void* ctx, int n_chunks) {
  fn_.store(fn, std::memory_order_relaxed);
  ctx_.store(ctx, std::memory_order_relaxed);
  done_.store(0, std::memory_order_relaxed);
  const std::uint32_t gen = ++gen_;
  state_.store(static_cast<std::uint64_t>(gen) << 32 | static_cast<std::uint64_t>(n_chunks) << 16, std::memory_order_release);
  state_.notify_all();
  work(0, gen);
  // Only chunks that a running thread claimed remain; wait for them.
  for (int spin = 0; done_.load(std::memory_order_acquire) != n_chunks; ++spin) {
    if (spin < kSpinIterations) MEDUSA_LLAMA_PAUSE();
    else std::this_thread::yield();
  }
}

void thread_pool::worker(int tid) {
  std::uint32_t seen = 0;
  for (;;) {
    std::uint64_t s;
    int spin = 0;
    while (static_cast<std::uint32_t>((s = state_.load(std::memory_order_acquire)) >> 32) == seen) {
      if (spin++ < kSpinIterations) MEDUSA_LLAMA_PAUSE();
      else state_.wait(s, std::memory_order_acquire);
    }
    seen = static_cast<std::uint32_t>(s >> 32);
    if (stop_.load(std::memory_order_acquire)) return;
    work(tid, seen);
  }
}

}  // namespace medusa_llama
