// SPDX-License-Identifier: Apache-2.0
//! @file cuda/common.cuh
//! Shared pieces of the CUDA layer: error type and status checks for host launchers.
//!
//! Launchers in `include/medusa/cuda/` return `cudaError_t` and never synchronise; engines that
//! prefer exceptions wrap calls in `medusa::cuda::check`.
#pragma once

#include <medusa/config.hpp>
#include <medusa/error.hpp>

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <mutex>
#include <string>

MEDUSA_NAMESPACE_BEGIN
namespace cuda {

//! A CUDA runtime call failed; carries the status.
class cuda_error : public std::runtime_error, public medusa::error {
 public:
  cuda_error(cudaError_t status, const std::string& what)
      : std::runtime_error("medusa: " + what + ": " + cudaGetErrorName(status) + " (" +
                           cudaGetErrorString(status) + ")"),
        status_(status) {}
  [[nodiscard]] const char* message() const noexcept override { return what(); }
  [[nodiscard]] cudaError_t status() const noexcept { return status_; }

 private:
  cudaError_t status_;
};

//! Throws `cuda_error` naming `what` unless `status` is `cudaSuccess`.
inline void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw cuda_error(status, what);
}

//! Number of visible CUDA devices; 0 when there is no device or no driver (never throws).
inline int device_count() noexcept {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no device" status
    return 0;
  }
  return count;
}

}  // namespace cuda

namespace detail {

//! Dynamic shared memory beyond the 48 KiB a block gets without asking, granted to one kernel on
//! each device it runs on: a function's attributes belong to the current device's context, so a
//! process that launches on several devices must ask on each. A launcher keeps one grant per
//! kernel instance (a function-local static) and calls `ensure` before each launch; after the
//! first launch on a device that costs `cudaGetDevice` and one atomic load. Thread-safe; the grant
//! only grows. (In `medusa::detail`: a `cuda::detail` here would hide `medusa::detail` from the
//! CUDA headers' unqualified `detail::`.)
class cuda_shared_memory_grant {
 public:
  //! Lets `kernel` take `bytes` of dynamic shared memory on the current device.
  //! @return the status of `cudaGetDevice` or `cudaFuncSetAttribute` (a device without that much
  //!         shared memory refuses here; the next call asks again).
  cudaError_t ensure(const void* kernel, int bytes) {
    int device = 0;
    if (const cudaError_t status = cudaGetDevice(&device); status != cudaSuccess) return status;
    const bool tracked = device >= 0 && device < max_devices;
    if (tracked && granted_[static_cast<std::size_t>(device)].load(std::memory_order_acquire) >= bytes)
      return cudaSuccess;
    const std::lock_guard<std::mutex> lock(mutex_);
    // Under the lock the grant cannot shrink: a smaller request after a larger one asks for the larger.
    const int want = tracked ? std::max(bytes, granted_[static_cast<std::size_t>(device)].load()) : bytes;
    const cudaError_t status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, want);
    if (status == cudaSuccess && tracked)
      granted_[static_cast<std::size_t>(device)].store(want, std::memory_order_release);
    return status;
  }

 private:
  static constexpr int max_devices = 64;  // beyond it, every launch asks again (still correct)
  std::array<std::atomic<int>, max_devices> granted_{};
  std::mutex mutex_;
};

}  // namespace detail

MEDUSA_NAMESPACE_END
