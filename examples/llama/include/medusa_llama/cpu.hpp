// SPDX-License-Identifier: Apache-2.0
//! @file cpu.hpp
//! The instruction sets the engine's CPU kernels run on.
//!
//! One build of the engine holds its kernels (the GEMMs of every weight format, the activation
//! quantizers, attention, RMSNorm, SwiGLU, RoPE, the heads' blocks) compiled for several
//! instruction sets, through Google Highway: on x86-64 AVX-512 of Ice Lake and Zen 4 class
//! ("AVX3_DL"), AVX-512 ("AVX3"), AVX2 with FMA ("AVX2") and SSE4 ("SSE4"); on aarch64 NEON
//! ("NEON"). Where the CPU has a VNNI dot product beside AVX-512 or AVX2 (AVX512-VNNI on Cascade
//! Lake, AVX-VNNI on Alder Lake and later), the integer kernels use it: "AVX3_VNNI", "AVX2_VNNI".
//! At run time the best choice this CPU supports is used, unless limited by `set_cpu_target` or
//! the environment variable `MEDUSA_CPU_TARGET` (read when the first engine is made).
//!
//! Results differ between instruction sets in the last bits (fused or separate multiply-adds,
//! another order of the partial sums), never between runs on one: on each of them a token's
//! outputs do not depend on how many tokens a pass holds, so greedy Medusa decoding stays
//! identical to plain decoding.
//!
//! @code
//! #include <medusa_llama/cpu.hpp>
//! #include <cstdio>
//! int main() {
//!   for (const auto& t : medusa_llama::cpu_targets()) std::printf("%s\n", t.c_str());  // best first
//!   medusa_llama::set_cpu_target("AVX2");   // throws engine_error if this CPU or build lacks it
//!   std::printf("kernels: %s\n", medusa_llama::cpu_target().c_str());
//!   medusa_llama::set_cpu_target("best");
//! }
//! @endcode
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace medusa_llama {

//! The instruction set the kernels use now ("AVX3_DL", "AVX3_VNNI", "AVX3", "AVX2_VNNI", "AVX2",
//! "SSE4", "NEON").
[[nodiscard]] std::string cpu_target();

//! The instruction sets compiled into this build that this CPU supports, best first.
[[nodiscard]] std::vector<std::string> cpu_targets();

//! Limits the kernels to the instruction set `name` (one of `cpu_targets()`, any case) or
//! lifts the limit (`"best"`). Throws `engine_error` (`bad_option`) naming the choices for any
//! other name. Process-wide: call it while no engine is running a pass.
void set_cpu_target(std::string_view name);

}  // namespace medusa_llama
