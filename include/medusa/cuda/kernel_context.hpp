// SPDX-License-Identifier: Apache-2.0
//! @file cuda/kernel_context.hpp
//! The execution context every Medusa kernel body is written against, so that one source runs on
//! a CUDA device and, in CI, on the host (docs/cuda.md).
//!
//! A kernel body is a function template `template <class Ctx> MEDUSA_KERNEL_FN void body(Ctx& ctx,
//! const params&)`. It reaches the hardware only through `ctx`:
//!
//! | member                    | CUDA                          | meaning                          |
//! |---------------------------|-------------------------------|----------------------------------|
//! | `thread()`, `threads()`   | `threadIdx.x`, `blockDim.x`   | this thread, threads per block   |
//! | `block_x()`, `block_y()`  | `blockIdx.x`, `blockIdx.y`    | this block                       |
//! | `grid_x()`, `grid_y()`    | `gridDim.x`, `gridDim.y`      | blocks in the grid               |
//! | `lane()`, `warp()`        | `threadIdx.x % 32`, `/ 32`    | place in the warp                |
//! | `sync()`                  | `__syncthreads()`             | block barrier                    |
//! | `shfl_xor(v, m)`          | `__shfl_xor_sync(~0u, v, m)`  | butterfly exchange in the warp   |
//! | `shfl(v, src)`            | `__shfl_sync(~0u, v, src)`    | broadcast from lane `src`        |
//! | `ballot(p)`               | `__ballot_sync(~0u, p)`       | predicate bits of the warp       |
//! | `shared()`                | `extern __shared__` storage   | the block's dynamic shared bytes |
//! | `mma_m16n8k16<T>(d, a, b)`| `mma.sync...m16n8k16` (sm_80+)| warp tensor-core product, below  |
//! | `sync_warp()`             | `__syncwarp()`                | warp barrier                     |
//! | `copy_async16(d, s, ok)`  | `cp.async.cg` 16 bytes (sm_80+)| global → shared, zeros if `!ok`  |
//! | `async_commit()`          | `cp.async.commit_group`       | closes a group of copies         |
//! | `async_wait<N>()`         | `cp.async.wait_group N`       | all but the last N groups landed |
//!
//! The asynchronous copies let a body keep many loads in flight without registers: a thread sees
//! its own copies after `async_wait`, the warp's after a further `sync_warp()`, the block's after
//! `sync()`. The emulation copies at once, so it checks the arithmetic, not the waits' placement.
//!
//! Rules for bodies: blocks have a multiple of 32 threads; every thread of a block reaches each
//! `sync()` and every lane of a warp each warp operation (the host emulation checks both and
//! reports a divergent barrier instead of hanging); shuffled values are at most 8 bytes. CUB block
//! primitives do not run on the host, so bodies use these members instead.
//!
//! `mma_m16n8k16<T>(d, a, b)` is the warp-wide tensor-core product `D += A·B` of PTX's
//! `mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}`: A is 16 × 16, B 16 × 8, both of `T`
//! (`medusa::bfloat16` or `medusa::half`), D 16 × 8 in float, each lane holding PTX's fragments
//! (`a`: 4 registers of 2 elements, `b`: 2, `d`: 4 floats; `mma_fragment` below names the layout).
//! The products are exact and summed in float on the device in an order the hardware fixes; the
//! emulation sums them in double and rounds once, so the two agree to float rounding of the sum.
//!
//! `device_context` (here, under nvcc) is the CUDA implementation; `emulation.hpp` holds the host
//! one. Kernel bodies themselves live in `cuda/kernels/`.
#pragma once

#include <medusa/config.hpp>
#include <medusa/half.hpp>

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

//! Marks a kernel body or a helper it calls: device code under nvcc, plain C++ elsewhere.
#if defined(__CUDACC__)
#define MEDUSA_KERNEL_FN __device__ inline
#else
#define MEDUSA_KERNEL_FN inline
#endif

//! Marks an element helper that host code calls too (conversions, aligned loads). nvcc gives a
//! `__device__` function's host side a body that calls `exit(1)`, and does not reject a call to it
//! from a host function template, so a helper the host uses must be `__host__ __device__`.
#define MEDUSA_ELEMENT_FN MEDUSA_HOST_DEVICE inline

//! Unrolls the next loop fully (nvcc) or up to 16 times (g++/clang), without unknown-pragma
//! warnings on either.
#if defined(__CUDACC__)
#define MEDUSA_UNROLL _Pragma("unroll")
#elif defined(__clang__)
#define MEDUSA_UNROLL _Pragma("clang loop unroll(full)")
#else
#define MEDUSA_UNROLL _Pragma("GCC unroll 16")
#endif

MEDUSA_NAMESPACE_BEGIN
namespace cuda {

//! Threads per warp, on the device and in the emulation.
inline constexpr int warp_size = 32;

//! Logit/activation element → float, using the hardware conversion on the device.
MEDUSA_ELEMENT_FN float load_float(float x) noexcept { return x; }
MEDUSA_ELEMENT_FN float load_float(medusa::half x) noexcept {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(x.bits()));
#else
  return static_cast<float>(x);
#endif
}
MEDUSA_ELEMENT_FN float load_float(medusa::bfloat16 x) noexcept {
  return detail::bits_to_float(static_cast<std::uint32_t>(x.bits()) << 16);
}

//! False for NaN and ±Inf (an exponent test, the same on both sides).
MEDUSA_ELEMENT_FN bool is_finite(float x) noexcept {
  return (detail::float_to_bits(x) & 0x7f800000u) != 0x7f800000u;
}

//! False for the logits a row may not hold, NaN and +Inf; -Inf is a masked token (as on the CPU).
MEDUSA_ELEMENT_FN bool is_valid_logit(float x) noexcept {
  const std::uint32_t u = detail::float_to_bits(x);
  return (u & 0x7fffffffu) <= 0x7f800000u && u != 0x7f800000u;
}

//! float → element, round to nearest even (hardware conversion on the device).
template <class T>
MEDUSA_ELEMENT_FN T store_float(float x) noexcept {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
#if defined(__CUDA_ARCH__)
    if constexpr (std::is_same_v<T, medusa::half>)
      return medusa::half::from_bits(__half_as_ushort(__float2half_rn(x)));
    else
      return medusa::bfloat16::from_bits(__bfloat16_as_ushort(__float2bfloat16_rn(x)));
#else
    return T(x);
#endif
  }
}

//! 16 bytes of elements, the unit of a vector load.
template <class T>
struct alignas(16) vector16 {
  static constexpr int size = static_cast<int>(16 / sizeof(T));
  T e[size];
};

//! Loads a `V` from memory aligned to `alignof(V)`: one vector access on the device (`V` of 16
//! bytes: `ld.global.v4`), `memcpy` on the host (same bytes, no aliasing questions).
template <class V>
MEDUSA_ELEMENT_FN V load_aligned(const void* p) noexcept {
#if defined(__CUDA_ARCH__)
  return *static_cast<const V*>(p);
#else
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
#endif
}

//! Stores a `V` to memory aligned to `alignof(V)` (the counterpart of `load_aligned`).
template <class V>
MEDUSA_ELEMENT_FN void store_aligned(void* p, const V& v) noexcept {
#if defined(__CUDA_ARCH__)
  *static_cast<V*>(p) = v;
#else
  std::memcpy(p, &v, sizeof v);
#endif
}

//! Loads 16 aligned bytes of elements.
template <class T>
MEDUSA_ELEMENT_FN vector16<T> load_vector16(const T* p) noexcept {
  return load_aligned<vector16<T>>(p);
}

//! Calls `f(float value, int index)` for every element of `x[begin, end)`, strided over the
//! block's threads. Where `x + begin` is 16-byte aligned, each thread loads 16 bytes at a time, two
//! loads in flight, which is what keeps a row scan at memory speed with 2-byte logits; elements
//! left over go one by one.
template <class Ctx, class T, class F>
MEDUSA_KERNEL_FN void for_each_element(Ctx& ctx, const T* x, int begin, int end, F&& f) {
  constexpr int per = vector16<T>::size;
  const T* const base = x + begin;
  int i = begin + ctx.thread();
  if ((reinterpret_cast<std::uintptr_t>(base) & 15u) == 0) {
    const int vectors = (end - begin) / per;
    const int step = ctx.threads();
    int j = ctx.thread();
    for (; j + step < vectors; j += 2 * step) {
      const vector16<T> w0 = load_vector16(base + j * per);
      const vector16<T> w1 = load_vector16(base + (j + step) * per);
      MEDUSA_UNROLL
      for (int e = 0; e < per; ++e) f(load_float(w0.e[e]), begin + j * per + e);
      MEDUSA_UNROLL
      for (int e = 0; e < per; ++e) f(load_float(w1.e[e]), begin + (j + step) * per + e);
    }
    if (j < vectors) {
      const vector16<T> w = load_vector16(base + j * per);
      MEDUSA_UNROLL
      for (int e = 0; e < per; ++e) f(load_float(w.e[e]), begin + j * per + e);
    }
    i = begin + vectors * per + ctx.thread();
  }
  for (; i < end; i += ctx.threads()) f(load_float(x[i]), i);
}

//! Where the elements of an `mma_m16n8k16` live: lane and register (each 32-bit register holds two
//! elements, the lower k in the lower half), as PTX's ISA lays out the m16n8k16 fragments.
struct mma_fragment {
  //! A(row, k), row and k in [0, 16): lane `4·(row mod 8) + (k mod 8)/2`, register
  //! `(row ≥ 8) + 2·(k ≥ 8)`.
  MEDUSA_HOST_DEVICE static constexpr int a_lane(int row, int k) noexcept { return 4 * (row % 8) + (k % 8) / 2; }
  MEDUSA_HOST_DEVICE static constexpr int a_register(int row, int k) noexcept { return (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0); }
  //! B(k, col), k in [0, 16), col in [0, 8): lane `4·col + (k mod 8)/2`, register `k ≥ 8`.
  MEDUSA_HOST_DEVICE static constexpr int b_lane(int k, int col) noexcept { return 4 * col + (k % 8) / 2; }
  MEDUSA_HOST_DEVICE static constexpr int b_register(int k) noexcept { return k >= 8 ? 1 : 0; }
  //! D(row, col) of lane l, register i in [0, 4): row `l/4 + 8·(i ≥ 2)`, col `2·(l mod 4) + i mod 2`.
  MEDUSA_HOST_DEVICE static constexpr int d_row(int lane, int i) noexcept { return lane / 4 + (i >= 2 ? 8 : 0); }
  MEDUSA_HOST_DEVICE static constexpr int d_col(int lane, int i) noexcept { return 2 * (lane % 4) + i % 2; }
};

#if defined(__CUDACC__)
//! The CUDA implementation of the kernel context (see the table above).
struct device_context {
  __device__ int thread() const noexcept { return static_cast<int>(threadIdx.x); }
  __device__ int threads() const noexcept { return static_cast<int>(blockDim.x); }
  __device__ int block_x() const noexcept { return static_cast<int>(blockIdx.x); }
  __device__ int block_y() const noexcept { return static_cast<int>(blockIdx.y); }
  __device__ int grid_x() const noexcept { return static_cast<int>(gridDim.x); }
  __device__ int grid_y() const noexcept { return static_cast<int>(gridDim.y); }
  __device__ int lane() const noexcept { return static_cast<int>(threadIdx.x) & (warp_size - 1); }
  __device__ int warp() const noexcept { return static_cast<int>(threadIdx.x) / warp_size; }
  __device__ void sync() const noexcept { __syncthreads(); }
  template <class T>
  __device__ T shfl_xor(T v, int lane_mask) const noexcept {
    return __shfl_xor_sync(0xffffffffu, v, lane_mask);
  }
  template <class T>
  __device__ T shfl(T v, int src_lane) const noexcept {
    return __shfl_sync(0xffffffffu, v, src_lane);
  }
  __device__ std::uint32_t ballot(bool p) const noexcept { return __ballot_sync(0xffffffffu, p); }
  __device__ void* shared() const noexcept {
    extern __shared__ __align__(16) unsigned char medusa_dynamic_shared[];
    return medusa_dynamic_shared;
  }
  __device__ void sync_warp() const noexcept { __syncwarp(); }
  __device__ void copy_async16(void* dst, const void* src, bool valid) const noexcept {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const auto s = static_cast<std::uint32_t>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(valid ? 16 : 0));
#else
    __trap();  // the library's CUDA targets are sm_80 and later
#endif
  }
  __device__ void async_commit() const noexcept {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::);
#endif
  }
  // Only the wait is a compiler barrier: reads of the copied bytes stay after it, while the
  // copies themselves (ordered among the asm statements) need not pin other memory accesses.
  template <int N>
  __device__ void async_wait() const noexcept {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
  }
  template <class T>
  __device__ void mma_m16n8k16(float (&d)[4], const std::uint32_t (&a)[4], const std::uint32_t (&b)[2]) const noexcept {
    static_assert(std::is_same_v<T, medusa::bfloat16> || std::is_same_v<T, medusa::half>,
                  "mma_m16n8k16 multiplies bfloat16 or half");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    if constexpr (std::is_same_v<T, medusa::bfloat16>)
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    else
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    __trap();  // the library's CUDA targets are sm_80 and later
#endif
  }
};
#endif

}  // namespace cuda
MEDUSA_NAMESPACE_END
