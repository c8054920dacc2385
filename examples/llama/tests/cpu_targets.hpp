// SPDX-License-Identifier: Apache-2.0
// Test helper: runs a body once per instruction set this build and CPU support, with the engine's
// kernels limited to it (medusa_llama/cpu.hpp), and restores the best one afterwards.
#pragma once

#include <medusa_llama/cpu.hpp>

#include <doctest/doctest.h>

#include <string>

namespace medusa_llama_test {

struct best_cpu_target_after {
  ~best_cpu_target_after() { medusa_llama::set_cpu_target("best"); }
};

//! `body(name)` for every name of `medusa_llama::cpu_targets()`, the kernels limited to it.
template <class Body>
void for_each_cpu_target(Body&& body) {
  const best_cpu_target_after restore;
  for (const std::string& target : medusa_llama::cpu_targets()) {
    CAPTURE(target);
    medusa_llama::set_cpu_target(target);
    REQUIRE(medusa_llama::cpu_target() == target);
    body(target);
  }
}

//! True for instruction sets whose float kernels fuse multiply and add (all but SSE4).
inline bool fused_multiply_add(const std::string& target) { return target != "SSE4"; }

}  // namespace medusa_llama_test
