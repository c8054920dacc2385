// SPDX-License-Identifier: Apache-2.0
// Private: the engine's hooks into its instruction-set choice (see medusa_llama/cpu.hpp).
#pragma once

namespace medusa_llama::detail {

//! Applies the environment variable MEDUSA_CPU_TARGET once per process (the first call; a later
//! call does nothing). Throws engine_error (bad_option) for a name this build or CPU lacks.
void apply_cpu_target_environment();

//! Whether the integer kernels of Highway's AVX2 and AVX3 targets may use the VNNI dot product
//! this CPU has beside them (AVX-VNNI, AVX512-VNNI): true unless the instruction set was limited to
//! "AVX2" or "AVX3" by name (the "_VNNI" names and "best" allow it).
[[nodiscard]] bool vnni_extension_allowed() noexcept;
//! This CPU has AVX-VNNI (vpdpbusd on 256-bit VEX registers: Alder Lake and later, Zen 5).
[[nodiscard]] bool cpu_has_avx_vnni() noexcept;
//! This CPU has AVX512-VNNI (Cascade Lake and later, Zen 4 and later).
[[nodiscard]] bool cpu_has_avx512_vnni() noexcept;

}  // namespace medusa_llama::detail
