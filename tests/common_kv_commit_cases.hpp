// SPDX-License-Identifier: Apache-2.0
// The KV-commit cases shared by the emulated test (tests/unit/test_cuda_kv_commit.cpp) and the
// GPU test (tests/cuda/test_kv_commit.cu): requests with their accepted paths, random and fixed.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

namespace medusa_test {

struct request_case {
  int committed = 0;      // L
  int nodes = 1;          // N
  std::vector<int> path;  // accepted nodes, path[0] = 0
  bool valid = true;      // false: the kernel must reject it (new length -1, nothing moved)
};

// Random bit patterns (NaNs included: rows move as bytes).
template <class T>
std::vector<T> random_elements(std::size_t n, std::mt19937& rng) {
  std::vector<std::uint8_t> bytes(n * sizeof(T));
  for (auto& b : bytes) b = static_cast<std::uint8_t>(rng());
  std::vector<T> out(n);
  std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}

// A request at a random committed length with a random accepted path of a random tree size.
inline std::vector<request_case> random_requests(std::mt19937& rng, int batch, int capacity, int max_nodes) {
  std::vector<request_case> out;
  for (int b = 0; b < batch; ++b) {
    request_case r;
    r.nodes = std::uniform_int_distribution<int>(1, max_nodes)(rng);
    r.committed = std::uniform_int_distribution<int>(0, capacity - r.nodes)(rng);
    const int accepted = std::uniform_int_distribution<int>(0, r.nodes - 1)(rng);
    std::vector<int> nodes(static_cast<std::size_t>(r.nodes - 1));
    std::iota(nodes.begin(), nodes.end(), 1);
    std::shuffle(nodes.begin(), nodes.end(), rng);
    nodes.resize(static_cast<std::size_t>(accepted));
    std::sort(nodes.begin(), nodes.end());
    r.path.push_back(0);
    r.path.insert(r.path.end(), nodes.begin(), nodes.end());
    out.push_back(r);
  }
  return out;
}

// Overlapping and corner-case paths, each at its own committed length.
inline std::vector<request_case> fixed_requests() {
  return {{3, 4, {0, 2, 3}},                                       // slot L+2: source of 1, target of 2
          {0, 7, {0, 1, 5, 6}},                                    // identity prefix, then overlaps
          {5, 1, {0}},                                             // A = 0
          {2, 3, {0, 1, 2}},                                       // nothing moves
          {1, 14, {0, 1, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13}},    // two passes of loads
          {0, 16, {0, 15}},                                        // one far move
          {6, 10, {0, 2, 4, 6, 8, 9}}};                            // every other slot
}

}  // namespace medusa_test
