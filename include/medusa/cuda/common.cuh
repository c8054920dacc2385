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
MEDUSA_NAMESPACE_END
