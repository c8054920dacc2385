// SPDX-License-Identifier: Apache-2.0
// What the GPU tests share: device arrays. Their main (gpu_test_main.cpp, linked into each)
// reports "skipped" (exit 77, the ctest SKIP_RETURN_CODE) on machines without a CUDA device.
#pragma once
#include <doctest/doctest.h>
#include <medusa/cuda/common.cuh>

#include <algorithm>
#include <cstddef>
#include <stdexcept>
#include <vector>

namespace medusa_test {

//! Device memory for `count` elements of T, freed on scope exit; `upload` fills a prefix.
template <class T>
class device_array {
 public:
  explicit device_array(std::size_t count) : count_(count) {
    medusa::cuda::check(cudaMalloc(&data_, std::max<std::size_t>(count, 1) * sizeof(T)), "cudaMalloc");
  }
  explicit device_array(const std::vector<T>& host) : device_array(host.size()) { upload(host); }
  device_array(const device_array&) = delete;
  device_array& operator=(const device_array&) = delete;
  ~device_array() { (void)cudaFree(data_); }
  [[nodiscard]] T* get() const { return data_; }
  [[nodiscard]] std::size_t size() const { return count_; }
  void upload(const std::vector<T>& host) {
    if (host.size() > count_) throw std::invalid_argument("upload: more elements than the device array holds");
    medusa::cuda::check(cudaMemcpy(data_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), "upload");
  }
  [[nodiscard]] std::vector<T> download() const {
    std::vector<T> host(count_);
    medusa::cuda::check(cudaMemcpy(host.data(), data_, count_ * sizeof(T), cudaMemcpyDeviceToHost), "download");
    return host;
  }

 private:
  T* data_ = nullptr;
  std::size_t count_;
};

}  // namespace medusa_test
