// SPDX-License-Identifier: Apache-2.0
// Which instruction set the engine's kernels run on (see medusa_llama/cpu.hpp): Highway's
// run-time dispatch, limited through hwy::DisableTargets.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "simd/targets.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/highway.h>
#include <hwy/targets.h>

HWY_BEFORE_NAMESPACE();
namespace medusa_llama::detail::HWY_NAMESPACE {
// The target a dispatched call lands in.
std::int64_t DispatchedTarget() { return HWY_TARGET; }
}  // namespace medusa_llama::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <medusa_llama/cpu.hpp>
#include <medusa_llama/errors.hpp>

#include "simd/targets.hpp"

#if HWY_ARCH_X86 && defined(__GNUC__)
#include <cpuid.h>
#endif

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <mutex>

namespace medusa_llama {

namespace detail {
HWY_EXPORT(DispatchedTarget);
// Called from this namespace: with one compiled target (aarch64: NEON) HWY_DYNAMIC_DISPATCH is
// HWY_STATIC_DISPATCH, N_NEON::FUNC, which must resolve here.
std::int64_t dispatched_target() { return HWY_DYNAMIC_DISPATCH(DispatchedTarget)(); }

namespace {

std::atomic<bool> vnni_allowed{true};

std::string upper(std::string_view s) {
  std::string r(s);
  for (char& c : r) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return r;
}

// The targets compiled here that the CPU supports, read once before any limit is set.
std::int64_t available() {
  static const std::int64_t mask = hwy::SupportedTargets() & HWY_TARGETS;
  return mask;
}

// A named choice: a Highway target, and whether its integer kernels use the VNNI extension.
struct choice {
  std::string name;
  std::int64_t target;
  bool vnni;
};

// Every choice this build and CPU offer, best first: Highway's targets, and before AVX3 and AVX2
// their "_VNNI" variants where the CPU has the extension.
std::vector<choice> choices() {
  std::vector<choice> r;
  for (std::int64_t m = available(); m != 0; m &= m - 1) {
    const std::int64_t t = m & -m;  // lowest bit = best
    const std::string name = hwy::TargetName(t);
#if HWY_ARCH_X86
    if ((t == HWY_AVX3 && cpu_has_avx512_vnni()) || (t == HWY_AVX2 && cpu_has_avx_vnni())) r.push_back({name + "_VNNI", t, true});
#endif
    r.push_back({name, t, t != HWY_AVX3 && t != HWY_AVX2});
  }
  return r;
}

std::string names() {
  std::string s;
  for (const auto& c : choices()) s += (s.empty() ? "" : ", ") + c.name;
  return s;
}

void limit(std::string_view name, const std::string& source) {
  const std::string want = upper(name);
  if (want == "BEST") {
    hwy::DisableTargets(0);
    vnni_allowed = true;
    return;
  }
  for (const auto& c : choices())
    if (want == c.name) {
      hwy::DisableTargets(c.target - 1);  // every better target (lower bits)
      vnni_allowed = c.vnni;
      return;
    }
  throw engine_error(engine_errc::bad_option, source + "instruction set \"" + std::string(name) +
                                                  "\" is not one this build and CPU run: " + names() + ", or best");
}

}  // namespace

bool vnni_extension_allowed() noexcept { return vnni_allowed.load(std::memory_order_relaxed); }

// CPUID leaf 7's feature bits (the operating system's support for the registers is Highway's
// check of the AVX2 and AVX3 targets these extensions are used with).
namespace {
[[maybe_unused]] bool cpuid7_bit(unsigned subleaf, int reg, int bit) noexcept {
#if HWY_ARCH_X86 && defined(__GNUC__)
  unsigned r[4] = {0, 0, 0, 0};
  if (__get_cpuid_count(7, subleaf, &r[0], &r[1], &r[2], &r[3]) == 0) return false;
  return ((r[reg] >> bit) & 1u) != 0;
#else
  (void)subleaf, (void)reg, (void)bit;
  return false;
#endif
}
}  // namespace

bool cpu_has_avx_vnni() noexcept {
  static const bool has = cpuid7_bit(1, 0, 4);  // leaf 7.1 EAX bit 4
  return has;
}

bool cpu_has_avx512_vnni() noexcept {
  static const bool has = cpuid7_bit(0, 2, 11);  // leaf 7.0 ECX bit 11
  return has;
}

void apply_cpu_target_environment() {
  static std::once_flag once;
  std::call_once(once, [] {
    (void)available();
    const char* env = std::getenv("MEDUSA_CPU_TARGET");
    if (env != nullptr && *env != '\0') limit(env, "MEDUSA_CPU_TARGET: ");
  });
}

}  // namespace detail

std::string cpu_target() {
  detail::apply_cpu_target_environment();
  const std::int64_t t = detail::dispatched_target();
  std::string name = hwy::TargetName(t);
#if HWY_ARCH_X86
  if (detail::vnni_extension_allowed() &&
      ((t == HWY_AVX3 && detail::cpu_has_avx512_vnni()) || (t == HWY_AVX2 && detail::cpu_has_avx_vnni())))
    name += "_VNNI";
#endif
  return name;
}

std::vector<std::string> cpu_targets() {
  std::vector<std::string> r;
  for (const auto& c : detail::choices()) r.push_back(c.name);
  return r;
}

void set_cpu_target(std::string_view name) {
  detail::apply_cpu_target_environment();
  detail::limit(name, "");
}

}  // namespace medusa_llama
#endif
