// SPDX-License-Identifier: Apache-2.0
// Private: the engine's hook for MEDUSA_CPU_TARGET (see medusa_llama/cpu.hpp).
#pragma once

namespace medusa_llama::detail {

//! Applies the environment variable MEDUSA_CPU_TARGET once per process (the first call; a later
//! call does nothing). Throws engine_error (bad_option) for a name this build or CPU lacks.
void apply_cpu_target_environment();

}  // namespace medusa_llama::detail
