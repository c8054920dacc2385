// SPDX-License-Identifier: Apache-2.0
//! @file openblas_env.hpp
//! Makes Debian's DYNAMIC_ARCH OpenBLAS use its AVX-512 kernels where it fails to detect them.
//!
//! On CPUs whose CPUID it does not know (e.g. virtual machines reporting a generic "Intel Xeon
//! Processor"), OpenBLAS 0.3.21 falls back to its "Prescott" (SSE3) kernels: sgemm runs about 5×
//! slower than with "SkylakeX". The kernel table is chosen when the library loads, from the
//! `OPENBLAS_CORETYPE` environment variable, so the only safe fix is to set it and re-execute the
//! program before any work is done. Programs call `reexec_with_fast_openblas(argv)` first thing
//! (the tools, soak, and the mains of the tests and benchmarks). OpenBLAS is looked up in the
//! running process, so a program that does not load it is left alone.
//!
//! @code
//! int main(int argc, char** argv) {
//!   medusa_llama::reexec_with_fast_openblas(argv);   // returns only when no re-exec is needed
//!   ...
//! }
//! @endcode
#pragma once

#include <dlfcn.h>
#include <unistd.h>
#include <cstdlib>
#include <cstring>

namespace medusa_llama {

//! True when the process has OpenBLAS loaded and it runs its generic x86 kernels on a CPU that
//! has AVX-512 (F, BW, DQ, VL).
inline bool openblas_kernels_too_generic() noexcept {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  using corename_fn = char* (*)();
  const auto corename =
      reinterpret_cast<corename_fn>(::dlsym(RTLD_DEFAULT, "openblas_get_corename"));
  if (corename == nullptr) return false;  // no OpenBLAS in this process
  const char* core = corename();
  if (core == nullptr) return false;
  const bool generic = std::strcmp(core, "Prescott") == 0 || std::strcmp(core, "Core2") == 0 ||
                       std::strcmp(core, "Nehalem") == 0 || std::strcmp(core, "Sandybridge") == 0 ||
                       std::strcmp(core, "Haswell") == 0;
  __builtin_cpu_init();
  return generic && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
#else
  return false;
#endif
}

//! If OpenBLAS picked generic kernels on an AVX-512 CPU and `OPENBLAS_CORETYPE` is unset, sets it
//! to `SkylakeX` and re-executes `/proc/self/exe` with `argv`. Returns false (and does nothing)
//! otherwise, or if the re-exec fails.
inline bool reexec_with_fast_openblas(char** argv) noexcept {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr || !openblas_kernels_too_generic()) return false;
  if (::setenv("OPENBLAS_CORETYPE", "SkylakeX", 1) != 0) return false;
  ::execv("/proc/self/exe", argv);
  return false;  // exec failed: continue with the slow kernels
}

}  // namespace medusa_llama
