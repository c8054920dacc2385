// SPDX-License-Identifier: Apache-2.0
//! @file config.hpp
//! Version macros, the host/device annotation and the versioned namespace.
//!
//! Every medusa header includes this one first. It needs nothing beyond the standard library and
//! never includes a CUDA header: under nvcc `MEDUSA_HOST_DEVICE` expands to `__host__ __device__`,
//! elsewhere to nothing, so the same code is the CPU reference and the kernels' building block.
#pragma once

#define MEDUSA_VERSION_MAJOR 0
#define MEDUSA_VERSION_MINOR 1
#define MEDUSA_VERSION_PATCH 0
//! Single integer for comparisons: `MAJOR * 10000 + MINOR * 100 + PATCH`.
#define MEDUSA_VERSION (MEDUSA_VERSION_MAJOR * 10000 + MEDUSA_VERSION_MINOR * 100 + MEDUSA_VERSION_PATCH)

#if defined(__CUDACC__) || defined(__HIPCC__)
#define MEDUSA_HOST_DEVICE __host__ __device__
#define MEDUSA_DEVICE __device__
#else
#define MEDUSA_HOST_DEVICE
#define MEDUSA_DEVICE
#endif

//! True while compiling device code (the device pass of nvcc).
#if defined(__CUDA_ARCH__)
#define MEDUSA_IS_DEVICE_CODE 1
#else
#define MEDUSA_IS_DEVICE_CODE 0
#endif

// The ABI version lives in an inline namespace so that two incompatible medusa versions linked
// into one program cannot silently mix their types.
#define MEDUSA_NAMESPACE_BEGIN \
  namespace medusa {           \
  inline namespace v0 {
#define MEDUSA_NAMESPACE_END \
  }                          \
  }

// Inline function bodies that differ with the instruction set a translation unit is compiled for
// (`#if MEDUSA_ISA_AVX512` kernels) live in an inline namespace named after that instruction set, so
// an engine that links translation units built with different `-m` flags gets one definition per
// instruction set instead of an ODR violation. The levels: AVX-512 (`-march=x86-64-v4` and
// above), AVX2 with FMA and F16C (`-march=x86-64-v3`), AVX with F16C, portable. Each level also
// has the intrinsics of the levels below it (MEDUSA_ISA_AVX2 is 1 in an AVX-512 unit). The last
// two are split again by whether the target has a fused multiply-add (x86 FMA3, every AArch64):
// the bodies that round a·b + c once there and twice elsewhere (detail/mul_add.hpp) differ too.
// Define MEDUSA_PORTABLE_KERNELS to force the portable bodies.
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA)
#define MEDUSA_ISA_FMA 1
#else
#define MEDUSA_ISA_FMA 0
#endif
#if defined(__AVX512F__) && !defined(MEDUSA_PORTABLE_KERNELS)
#define MEDUSA_ISA_AVX512 1
#define MEDUSA_ISA_AVX2 1
#define MEDUSA_ISA_F16C 1
#define MEDUSA_ISA_NAMESPACE isa_avx512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(MEDUSA_PORTABLE_KERNELS)
#define MEDUSA_ISA_AVX512 0
#define MEDUSA_ISA_AVX2 1
#define MEDUSA_ISA_F16C 1
#define MEDUSA_ISA_NAMESPACE isa_avx2
#elif defined(__AVX__) && defined(__F16C__) && !defined(MEDUSA_PORTABLE_KERNELS)
#define MEDUSA_ISA_AVX512 0
#define MEDUSA_ISA_AVX2 0
#define MEDUSA_ISA_F16C 1
#if MEDUSA_ISA_FMA
#define MEDUSA_ISA_NAMESPACE isa_avx_f16c_fma
#else
#define MEDUSA_ISA_NAMESPACE isa_avx_f16c
#endif
#else
#define MEDUSA_ISA_AVX512 0
#define MEDUSA_ISA_AVX2 0
#define MEDUSA_ISA_F16C 0
#if MEDUSA_ISA_FMA
#define MEDUSA_ISA_NAMESPACE isa_portable_fma
#else
#define MEDUSA_ISA_NAMESPACE isa_portable
#endif
#endif
//! Opens the instruction-set namespace (inside `MEDUSA_NAMESPACE_BEGIN` or a nested namespace).
#define MEDUSA_ISA_NAMESPACE_BEGIN inline namespace MEDUSA_ISA_NAMESPACE {
//! Closes it.
#define MEDUSA_ISA_NAMESPACE_END }

MEDUSA_NAMESPACE_BEGIN

//! The library version this header belongs to.
struct version_info {
  int major;
  int minor;
  int patch;
};

//! Returns the version of the headers in use.
constexpr version_info version() noexcept {
  return {MEDUSA_VERSION_MAJOR, MEDUSA_VERSION_MINOR, MEDUSA_VERSION_PATCH};
}

MEDUSA_ISA_NAMESPACE_BEGIN
//! The instruction set the CPU kernels of this translation unit use: "avx512", "avx2",
//! "avx_f16c" or "portable".
constexpr const char* kernel_isa() noexcept {
#if MEDUSA_ISA_AVX512
  return "avx512";
#elif MEDUSA_ISA_AVX2
  return "avx2";
#elif MEDUSA_ISA_F16C
  return "avx_f16c";
#else
  return "portable";
#endif
}
MEDUSA_ISA_NAMESPACE_END

MEDUSA_NAMESPACE_END
