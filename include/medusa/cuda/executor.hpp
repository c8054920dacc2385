// SPDX-License-Identifier: Apache-2.0
//! @file cuda/executor.hpp
//! What `device_step` runs on: an *executor*, which owns memory, launches kernel bodies and
//! records a sequence of launches for replay. The library has two:
//! - `stream_executor` (<medusa/cuda/stream_executor.cuh>): device memory, one CUDA stream, the
//!   library's launchers and cuBLAS for the heads, CUDA graphs;
//! - `emulated_executor` (<medusa/cuda/emulated_executor.hpp>): host memory, every kernel body under
//!   the host emulation, the CPU heads, "graphs" that run the recorded function again. It needs no
//!   CUDA toolkit, so a device step and the engine around it run in CI against the CPU library.
//!
//! An engine derives its own executor from one of them to add what its forward needs (GEMMs,
//! attention), so one engine source runs on both. `step_executor` states what `device_step` calls.
#pragma once

#include <medusa/config.hpp>
#include <medusa/cuda/kernels/kv_commit.hpp>
#include <medusa/cuda/kernels/top_k.hpp>
#include <medusa/cuda/kernels/verify.hpp>
#include <medusa/cuda/launch.hpp>
#include <medusa/heads.hpp>
#include <medusa/tree.hpp>

#include <concepts>
#include <cstddef>
#include <cstdint>

MEDUSA_NAMESPACE_BEGIN
namespace cuda {

//! What `device_step<Exec, T>` calls on its executor (all on one ordered stream; nothing after
//! `make_*` may allocate or synchronise, so a step can be captured):
//! - memory: `alloc(bytes)`, `release(p)`, `upload(dst, src, bytes)`, `download(dst, src, bytes)`,
//!   `sync()` (downloads are complete after it);
//! - `launch(shape, body)`: a kernel body (`body(ctx)`, with `Body::max_threads`) over a shape;
//! - the step's kernels: `make_step_op(tree, heads, batch, vocab)` → `step_op`, then
//!   `candidates(op, head_logits, roots, lengths, node_tokens, positions, status)` and
//!   `verify(op, verify_args<float>)` (greedy); `make_argmax_op(rows, vocab)` → `argmax_op`, then
//!   `argmax(op, logits, ids, status)`; `make_heads_op<T>(stack, rows)` → `heads_op<T>`, then
//!   `heads(op, hidden, logits)`; `kv_commit(params)`;
//! - `capture(f)` → `graph` (the launches `f` makes, recorded), `replay(graph)`.
template <class E>
concept step_executor = requires(E& ex, void* p, const void* cp, std::size_t n, const medusa::tree& t) {
  { ex.alloc(n) } -> std::same_as<void*>;
  ex.release(p);
  ex.upload(p, cp, n);
  ex.download(p, cp, n);
  ex.sync();
  { ex.make_step_op(t, 1, 1, 1) } -> std::same_as<typename E::step_op>;
  { ex.make_argmax_op(1, 1) } -> std::same_as<typename E::argmax_op>;
  typename E::graph;
};

//! Executor memory that frees itself (the executor outlives it).
template <class Exec>
class executor_buffer {
 public:
  executor_buffer() = default;
  //! `bytes` of the executor's memory (none for 0).
  executor_buffer(Exec& ex, std::size_t bytes) : ex_(&ex), p_(bytes == 0 ? nullptr : ex.alloc(bytes)), bytes_(bytes) {}
  executor_buffer(const executor_buffer&) = delete;
  executor_buffer& operator=(const executor_buffer&) = delete;
  executor_buffer(executor_buffer&& o) noexcept : ex_(o.ex_), p_(o.p_), bytes_(o.bytes_) { o.p_ = nullptr; }
  executor_buffer& operator=(executor_buffer&& o) noexcept {
    if (this != &o) {
      reset();
      ex_ = o.ex_;
      p_ = o.p_;
      bytes_ = o.bytes_;
      o.p_ = nullptr;
    }
    return *this;
  }
  ~executor_buffer() { reset(); }
  //! The memory as `U*` (nullptr when empty).
  template <class U>
  [[nodiscard]] U* as() const noexcept {
    return static_cast<U*>(p_);
  }
  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }  //!< its size

 private:
  void reset() noexcept {
    if (p_ != nullptr) ex_->release(p_);
    p_ = nullptr;
  }
  Exec* ex_ = nullptr;
  void* p_ = nullptr;
  std::size_t bytes_ = 0;
};

namespace detail {
// The top-k arguments of an argmax (k = 1) of `vocab`-wide rows, one status per row.
inline kernels::top_k_args<float> argmax_args(int vocab, const float* logits, std::int32_t* ids, std::int32_t* status) {
  kernels::top_k_args<float> a;
  a.logits = logits;
  a.row_stride = vocab;
  a.out_ids = ids;
  a.status = status;
  a.rows_per_status = 1;
  return a;
}
}  // namespace detail

}  // namespace cuda
MEDUSA_NAMESPACE_END
