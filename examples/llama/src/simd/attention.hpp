// SPDX-License-Identifier: Apache-2.0
// Private: the engine's kernels for the library's tree attention (simd/attention.cpp), dispatched
// to the best instruction set at run time (see medusa_llama/cpu.hpp).
#pragma once

#include <medusa/attention.hpp>

namespace medusa_llama::detail {

//! The engine's attention kernels, for `medusa::attention_options::kernels`.
[[nodiscard]] const medusa::attention_kernels& attention_kernels() noexcept;

}  // namespace medusa_llama::detail
