// SPDX-License-Identifier: Apache-2.0
//! @file cuda/emulation.hpp
//! Host emulation of the kernel context (`kernel_context.hpp`): runs a kernel body's blocks on
//! the CPU, one fiber per CUDA thread, so every kernel body executes in CI without a GPU.
//!
//! Blocks run one after another; inside a block, the threads are cooperative fibers that switch
//! only at `sync()` and at warp operations, so the emulation is deterministic. On x86-64 a switch
//! saves and restores the callee-saved registers itself (a few nanoseconds); elsewhere it goes
//! through `swapcontext`, which also saves the signal mask with a system call. A barrier that
//! some threads never reach (divergent `sync()`, a lane missing from a shuffle, a thread that
//! returned early) is reported as `emulation_error` rather than hanging. Shared memory is filled
//! with a poison pattern before each block, so a body that reads it before writing it gives wrong
//! results here as it would on the device.
//!
//! @code
//! medusa::cuda::emulate({.grid_x = rows, .threads = 128, .shared_bytes = bytes},
//!                       [&](auto& ctx) { medusa::cuda::kernels::row_top_k(ctx, params); });
//! @endcode
#pragma once

#include <medusa/config.hpp>
#include <medusa/cuda/kernel_context.hpp>
#include <medusa/cuda/launch.hpp>
#include <medusa/error.hpp>

#if !(defined(__x86_64__) && defined(__GNUC__) && !defined(__CUDACC__))
#include <ucontext.h>
#endif

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define MEDUSA_EMULATION_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MEDUSA_EMULATION_ASAN 1
#endif
#endif
#ifndef MEDUSA_EMULATION_ASAN
#define MEDUSA_EMULATION_ASAN 0
#endif
#if MEDUSA_EMULATION_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

MEDUSA_NAMESPACE_BEGIN
namespace cuda {

//! A launch that the emulation (or the device) cannot run, or a kernel body that broke the
//! context's rules (a barrier not reached by every thread).
class emulation_error : public std::logic_error, public medusa::error {
 public:
  explicit emulation_error(const std::string& what) : std::logic_error("medusa: emulation: " + what) {}
  [[nodiscard]] const char* message() const noexcept override { return what(); }
};

//! True when this translation unit is built with AddressSanitizer: emulated kernels then run
//! about 15 times slower, and tests size their sweeps by it.
inline constexpr bool emulation_sanitized = MEDUSA_EMULATION_ASAN != 0;

namespace detail {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__CUDACC__)
#define MEDUSA_EMULATION_FAST_SWITCH 1
// medusa_fiber_switch(&save_sp, load_sp): pushes the callee-saved registers and the SSE/x87
// control words (System V ABI) on the current stack, stores the stack pointer in *save_sp,
// switches to load_sp and pops the same frame there. A new fiber's stack holds such a frame
// whose return address is its entry function. Defined in a COMDAT group, so that every
// translation unit may carry it and the linker keeps one.
asm(R"(
  .pushsection .text.medusa_fiber_switch,"axG",@progbits,medusa_fiber_switch,comdat
  .weak medusa_fiber_switch
  .hidden medusa_fiber_switch
  .type medusa_fiber_switch,@function
  .p2align 4
medusa_fiber_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size medusa_fiber_switch, .-medusa_fiber_switch
  .popsection
)");
extern "C" void medusa_fiber_switch(void** save_sp, void* load_sp);
// The saved state of a fiber or of the scheduler: its stack pointer.
struct fiber_context {
  void* sp = nullptr;
};
#else
#define MEDUSA_EMULATION_FAST_SWITCH 0
using fiber_context = ucontext_t;
#endif

inline constexpr std::size_t fiber_stack_bytes = MEDUSA_EMULATION_ASAN ? 256 * 1024 : 64 * 1024;

// One block in flight: its fibers, barrier state and shared memory.
struct fiber_block {
  struct warp_sync {
    int arrived = 0;
    std::uint64_t generation = 0;
    std::uint64_t slot[warp_size] = {};
    std::uint32_t fragments[warp_size][6] = {};  // mma_m16n8k16's A and B registers, per lane
  };

  int threads = 0;
  int block_x = 0, block_y = 0, grid_x = 1, grid_y = 1;
  std::vector<unsigned char> shared;
  std::vector<fiber_context> fibers;
  fiber_context scheduler{};
  unsigned char* stacks = nullptr;  // threads × fiber_stack_bytes, from the thread's stack pool
  std::vector<char> done;
  std::vector<warp_sync> warps;
  int current = 0;
  int live = 0;
  int barrier_arrived = 0;
  std::uint64_t barrier_generation = 0;
  std::uint64_t progress = 0;  // bumped by every arrival, release and exit
  std::exception_ptr error;
  const std::function<void(int)>* body = nullptr;
  const void* scheduler_stack = nullptr;  // for the sanitizer's fiber switches
  std::size_t scheduler_stack_size = 0;

  unsigned char* stack_of(int t) const noexcept {
    return stacks + static_cast<std::size_t>(t) * fiber_stack_bytes;
  }

  // Fiber → scheduler.
  void yield() {
#if MEDUSA_EMULATION_ASAN
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, scheduler_stack, scheduler_stack_size);
#endif
#if MEDUSA_EMULATION_FAST_SWITCH
    medusa_fiber_switch(&fibers[static_cast<std::size_t>(current)].sp, scheduler.sp);
#else
    swapcontext(&fibers[static_cast<std::size_t>(current)], &scheduler);
#endif
#if MEDUSA_EMULATION_ASAN
    __sanitizer_finish_switch_fiber(fake, &scheduler_stack, &scheduler_stack_size);
#endif
  }

  // Scheduler → fiber t.
  void resume(int t) {
    current = t;
#if MEDUSA_EMULATION_ASAN
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, stack_of(t), fiber_stack_bytes);
#endif
#if MEDUSA_EMULATION_FAST_SWITCH
    medusa_fiber_switch(&scheduler.sp, fibers[static_cast<std::size_t>(t)].sp);
#else
    swapcontext(&scheduler, &fibers[static_cast<std::size_t>(t)]);
#endif
#if MEDUSA_EMULATION_ASAN
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
  }

  void block_barrier() {
    const std::uint64_t g = barrier_generation;
    ++progress;
    if (++barrier_arrived == threads) {
      barrier_arrived = 0;
      ++barrier_generation;
      return;
    }
    while (barrier_generation == g) yield();
  }

  void warp_barrier(warp_sync& w) {
    const std::uint64_t g = w.generation;
    ++progress;
    if (++w.arrived == warp_size) {
      w.arrived = 0;
      ++w.generation;
      return;
    }
    while (w.generation == g) yield();
  }

  template <class T>
  T exchange(int t, T v, int src_lane) {
    static_assert(sizeof(T) <= sizeof(std::uint64_t) && std::is_trivially_copyable_v<T>,
                  "warp shuffles move values of at most 8 bytes");
    warp_sync& w = warps[static_cast<std::size_t>(t / warp_size)];
    std::memcpy(&w.slot[t % warp_size], &v, sizeof(T));
    warp_barrier(w);  // every lane has written
    T out;
    std::memcpy(&out, &w.slot[src_lane & (warp_size - 1)], sizeof(T));
    warp_barrier(w);  // every lane has read: the slots may be reused
    return out;
  }
};

inline thread_local fiber_block* running_block = nullptr;

// The fiber stacks of the emulations running on this thread, one buffer per nesting level, kept
// from launch to launch: allocating (and faulting in) megabytes of stacks per launch would cost
// more than most emulated kernels.
class stack_pool {
 public:
  // The stacks of the next level, at least `bytes`; `release()` gives them back.
  unsigned char* acquire(std::size_t bytes) {
    if (levels_.size() <= depth_) levels_.push_back({});
    level& l = levels_[depth_++];
    if (l.bytes < bytes) {
      l.data.reset(new unsigned char[bytes]);
      l.bytes = bytes;
    } else if (l.dirty) {
#if MEDUSA_EMULATION_ASAN
      // A block that ended in an error left frames (and their poisoned redzones) on its stacks.
      ASAN_UNPOISON_MEMORY_REGION(l.data.get(), l.bytes);
#endif
    }
    l.dirty = false;
    return l.data.get();
  }
  void release(bool failed) noexcept {
    --depth_;
    levels_[depth_].dirty = failed;
  }

 private:
  struct level {
    std::unique_ptr<unsigned char[]> data;
    std::size_t bytes = 0;
    bool dirty = false;
  };
  std::vector<level> levels_;
  std::size_t depth_ = 0;
};

inline stack_pool& thread_stacks() {
  thread_local stack_pool pool;
  return pool;
}

inline void fiber_entry() {
  fiber_block* b = running_block;
#if MEDUSA_EMULATION_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &b->scheduler_stack, &b->scheduler_stack_size);
#endif
  const int t = b->current;
  try {
    (*b->body)(t);
  } catch (...) {
    if (!b->error) b->error = std::current_exception();
  }
  b->done[static_cast<std::size_t>(t)] = 1;
  --b->live;
  ++b->progress;
#if MEDUSA_EMULATION_ASAN
  __sanitizer_start_switch_fiber(nullptr, b->scheduler_stack, b->scheduler_stack_size);
#endif
#if MEDUSA_EMULATION_FAST_SWITCH
  // Back to the scheduler for good: this fiber is never resumed.
  void* unused = nullptr;
  medusa_fiber_switch(&unused, b->scheduler.sp);
  __builtin_unreachable();
#endif
  // Returning switches to uc_link, the scheduler.
}

#if MEDUSA_EMULATION_FAST_SWITCH
// A new fiber: its stack ends with the frame medusa_fiber_switch pops (control words, six
// callee-saved registers) and the address of fiber_entry, which it "returns" to with the stack
// aligned as after a call.
inline void init_fiber(fiber_block& b, int t) {
  auto top = reinterpret_cast<std::uintptr_t>(b.stack_of(t) + fiber_stack_bytes) & ~std::uintptr_t{15};
  // 11 slots: the frame starts at 8 (mod 16), so fiber_entry starts with rsp ≡ 8 (mod 16), as after a call.
  auto* frame = reinterpret_cast<std::uint64_t*>(top) - 11;
#if MEDUSA_EMULATION_ASAN
  // The previous fiber on this stack left fiber_entry's frame (it never returns) poisoned.
  ASAN_UNPOISON_MEMORY_REGION(reinterpret_cast<void*>(top - 4096), 4096);
#endif
  std::uint32_t mxcsr = 0;
  std::uint16_t fpcw = 0;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fpcw));
  frame[0] = static_cast<std::uint64_t>(mxcsr) | (static_cast<std::uint64_t>(fpcw) << 32);
  for (int i = 1; i <= 6; ++i) frame[i] = 0;  // r15, r14, r13, r12, rbx, rbp
  frame[7] = reinterpret_cast<std::uint64_t>(&fiber_entry);
  frame[8] = frame[9] = frame[10] = 0;  // fiber_entry never returns
  b.fibers[static_cast<std::size_t>(t)].sp = frame;
}
#else
// Kept out of line: getcontext returns twice, which must not touch the caller's loop state.
[[gnu::noinline]] inline void init_fiber(fiber_block& b, int t) {
  ucontext_t& f = b.fibers[static_cast<std::size_t>(t)];
  getcontext(&f);
  f.uc_stack.ss_sp = b.stack_of(t);
  f.uc_stack.ss_size = fiber_stack_bytes;
  f.uc_link = &b.scheduler;
  makecontext(&f, fiber_entry, 0);
}
#endif

}  // namespace detail

//! The host implementation of the kernel context (see `kernel_context.hpp`).
class host_context {
 public:
  host_context(detail::fiber_block& block, int thread) noexcept : block_(&block), thread_(thread) {}
  int thread() const noexcept { return thread_; }
  int threads() const noexcept { return block_->threads; }
  int block_x() const noexcept { return block_->block_x; }
  int block_y() const noexcept { return block_->block_y; }
  int grid_x() const noexcept { return block_->grid_x; }
  int grid_y() const noexcept { return block_->grid_y; }
  int lane() const noexcept { return thread_ % warp_size; }
  int warp() const noexcept { return thread_ / warp_size; }
  void sync() const { block_->block_barrier(); }
  template <class T>
  T shfl_xor(T v, int lane_mask) const {
    return block_->exchange(thread_, v, lane() ^ lane_mask);
  }
  template <class T>
  T shfl(T v, int src_lane) const {
    return block_->exchange(thread_, v, src_lane);
  }
  std::uint32_t ballot(bool p) const {
    // Every lane publishes its bit, then reads all 32.
    detail::fiber_block::warp_sync& w = block_->warps[static_cast<std::size_t>(warp())];
    w.slot[lane()] = p ? 1u : 0u;
    block_->warp_barrier(w);
    std::uint32_t bits = 0;
    for (int l = 0; l < warp_size; ++l) bits |= static_cast<std::uint32_t>(w.slot[l] != 0) << l;
    block_->warp_barrier(w);
    return bits;
  }
  void* shared() const noexcept { return block_->shared.data(); }
  void sync_warp() const { block_->warp_barrier(block_->warps[static_cast<std::size_t>(warp())]); }
  // The copies land at once; the waits have nothing to wait for.
  void copy_async16(void* dst, const void* src, bool valid) const noexcept {
    if (valid) std::memcpy(dst, src, 16);
    else std::memset(dst, 0, 16);
  }
  void async_commit() const noexcept {}
  template <int N>
  void async_wait() const noexcept {}
  // Out of line: kernel bodies unroll their mma loops, and this inlined at every site makes the
  // host compile of a GEMM body minutes long.
  template <class T>
  [[gnu::noinline]] void mma_m16n8k16(float (&d)[4], const std::uint32_t (&a)[4], const std::uint32_t (&b)[2]) const {
    static_assert(std::is_same_v<T, medusa::bfloat16> || std::is_same_v<T, medusa::half>,
                  "mma_m16n8k16 multiplies bfloat16 or half");
    // Every lane publishes its fragments, then computes its own four outputs from all of them.
    detail::fiber_block::warp_sync& w = block_->warps[static_cast<std::size_t>(warp())];
    std::uint32_t* mine = w.fragments[lane()];
    for (int i = 0; i < 4; ++i) mine[i] = a[i];
    mine[4] = b[0];
    mine[5] = b[1];
    block_->warp_barrier(w);
    const auto element = [&](int src_lane, int reg, int k) {
      const std::uint32_t bits = w.fragments[src_lane][reg] >> (16 * (k % 2)) & 0xffffu;
      return static_cast<double>(load_float(T::from_bits(static_cast<std::uint16_t>(bits))));
    };
    float out[4];
    for (int i = 0; i < 4; ++i) {
      const int row = mma_fragment::d_row(lane(), i), col = mma_fragment::d_col(lane(), i);
      double s = d[i];
      for (int k = 0; k < 16; ++k)
        s += element(mma_fragment::a_lane(row, k), mma_fragment::a_register(row, k), k) *
             element(mma_fragment::b_lane(k, col), 4 + mma_fragment::b_register(k), k);
      out[i] = static_cast<float>(s);
    }
    block_->warp_barrier(w);  // every lane has read: the fragments may be reused
    for (int i = 0; i < 4; ++i) d[i] = out[i];
  }

 private:
  detail::fiber_block* block_;
  int thread_;
};

//! Runs `body(ctx)` for every thread of every block of `shape` on the host, `ctx` a
//! `host_context`. Blocks run in order (y outer, x inner).
//! @throws emulation_error on a bad shape or a barrier that not every thread reaches; rethrows
//!         an exception thrown by the body.
template <class Body>
void emulate(const launch_shape& shape, Body&& body) {
  if (shape.threads < warp_size || shape.threads > 1024 || shape.threads % warp_size != 0)
    throw emulation_error("threads per block must be a multiple of 32 in [32, 1024], got " +
                          std::to_string(shape.threads));
  if (shape.grid_x < 1 || shape.grid_y < 1)
    throw emulation_error("grid must have at least one block, got " + std::to_string(shape.grid_x) +
                          "x" + std::to_string(shape.grid_y));
  if (shape.shared_bytes > 227 * 1024)
    throw emulation_error("dynamic shared memory of " + std::to_string(shape.shared_bytes) +
                          " bytes exceeds the 227 KiB a block can have");
  detail::fiber_block b;
  b.threads = shape.threads;
  b.grid_x = shape.grid_x;
  b.grid_y = shape.grid_y;
  b.shared.resize(shape.shared_bytes + 16);
  b.fibers.resize(static_cast<std::size_t>(shape.threads));
  b.done.resize(static_cast<std::size_t>(shape.threads));
  b.warps.resize(static_cast<std::size_t>(shape.threads / warp_size));
  detail::stack_pool& pool = detail::thread_stacks();
  b.stacks = pool.acquire(static_cast<std::size_t>(shape.threads) * detail::fiber_stack_bytes);
  const std::function<void(int)> run_thread = [&](int t) {
    host_context ctx(b, t);
    body(ctx);
  };
  b.body = &run_thread;
  detail::fiber_block* const outer = detail::running_block;
  detail::running_block = &b;
  struct restore {
    detail::fiber_block* outer;
    detail::stack_pool& pool;
    bool failed = true;  // until every block has run
    ~restore() {
      detail::running_block = outer;
      pool.release(failed);
    }
  } restore_running{outer, pool};
  for (int y = 0; y < shape.grid_y; ++y) {
    for (int x = 0; x < shape.grid_x; ++x) {
      b.block_x = x;
      b.block_y = y;
      std::memset(b.shared.data(), 0xA5, b.shared.size());
      std::fill(b.done.begin(), b.done.end(), char{0});
      for (auto& w : b.warps) w.arrived = 0;
      b.barrier_arrived = 0;
      b.live = shape.threads;
      for (int t = 0; t < shape.threads; ++t) detail::init_fiber(b, t);
      while (b.live > 0) {
        const std::uint64_t before = b.progress;
        for (int t = 0; t < shape.threads && !b.error; ++t)
          if (!b.done[static_cast<std::size_t>(t)]) b.resume(t);
        if (b.error) std::rethrow_exception(b.error);
        if (b.live > 0 && b.progress == before)
          throw emulation_error("block (" + std::to_string(x) + ", " + std::to_string(y) + "): " +
                                std::to_string(b.live) + " of " + std::to_string(shape.threads) +
                                " threads wait at a barrier that the others never reach");
      }
    }
  }
  restore_running.failed = false;
}

}  // namespace cuda
MEDUSA_NAMESPACE_END
