// SPDX-License-Identifier: Apache-2.0
//! @file thread_pool.hpp
//! A tiny fork-join pool for the engine's kernels.
//!
//! A job is split into chunks that threads claim from a shared counter, so a worker that the OS
//! has not scheduled yet (the machines are shared) delays nothing: the caller takes its chunks.
//! Workers spin briefly between jobs (a decoding step issues ~40 jobs of tens of microseconds)
//! and then sleep.
#pragma once

#include <atomic>
#include <cstdint>
#include <thread>
#include <type_traits>
#include <vector>

namespace medusa_llama {

//! Fork-join pool: `run(n, f)` calls `f(chunk, tid)` once for every chunk in [0, n), on any
//! thread (tid in [0, size()), 0 = the caller; a tid runs one chunk at a time), and returns when
//! all are done. Jobs must not throw. One caller thread at a time.
class thread_pool {
 public:
  //! `n_threads` ≥ 1 including the caller; 0 picks `std::thread::hardware_concurrency()`.
  explicit thread_pool(int n_threads);
  thread_pool(const thread_pool&) = delete;
  thread_pool& operator=(const thread_pool&) = delete;
  ~thread_pool();

  //! Number of threads including the caller.
  [[nodiscard]] int size() const noexcept { return n_; }

  //! Runs `f(chunk, tid)` for every chunk in [0, n_chunks) and waits (more than 65535 chunks run
  //! on the caller alone).
  template <class F>
  void run(int n_chunks, F&& f) {
    if (n_chunks <= 0) return;
    if (n_ == 1 || n_chunks == 1 || n_chunks > 65535) {  // larger jobs run on the caller
      for (int c = 0; c < n_chunks; ++c) f(c, 0);
      return;
    }
    auto call = [](void* ctx, int chunk, int tid) { (*static_cast<std::remove_reference_t<F>*>(ctx))(chunk, tid); };
    dispatch(call, const_cast<void*>(static_cast<const void*>(&f)), n_chunks);
  }

 private:
  using job_fn = void (*)(void*, int, int);
  void dispatch(job_fn fn, void* ctx, int n_chunks);
  void work(int tid, std::uint32_t gen);
  void worker(int tid);

  int n_;
  std::uint32_t gen_ = 0;
  std::vector<std::thread> workers_;
  std::atomic<job_fn> fn_{nullptr};
  std::atomic<void*> ctx_{nullptr};
  alignas(64) std::atomic<std::uint64_t> state_{0};  // generation << 32 | chunks << 16 | next unclaimed
  alignas(64) std::atomic<int> done_{0};
  std::atomic<bool> stop_{false};
};

}  // namespace medusa_llama
