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

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <mutex>

namespace medusa_llama {

namespace detail {
HWY_EXPORT(DispatchedTarget);

namespace {

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

std::vector<std::int64_t> available_list() {
  std::vector<std::int64_t> r;
  for (std::int64_t m = available(); m != 0; m &= m - 1) r.push_back(m & -m);  // lowest bit = best
  return r;
}

std::string names(const std::vector<std::int64_t>& targets) {
  std::string s;
  for (auto t : targets) s += (s.empty() ? "" : ", ") + std::string(hwy::TargetName(t));
  return s;
}

void limit(std::string_view name, const std::string& source) {
  (void)available();
  const std::string want = upper(name);
  if (want == "BEST") {
    hwy::DisableTargets(0);
    return;
  }
  for (auto t : available_list())
    if (want == hwy::TargetName(t)) {
      hwy::DisableTargets(t - 1);  // every better target (lower bits)
      return;
    }
  throw engine_error(engine_errc::bad_option, source + "instruction set \"" + std::string(name) +
                                                  "\" is not one this build and CPU run: " + names(available_list()) +
                                                  ", or best");
}

}  // namespace

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
  return hwy::TargetName(HWY_DYNAMIC_DISPATCH(detail::DispatchedTarget)());
}

std::vector<std::string> cpu_targets() {
  std::vector<std::string> r;
  for (auto t : detail::available_list()) r.emplace_back(hwy::TargetName(t));
  return r;
}

void set_cpu_target(std::string_view name) {
  detail::apply_cpu_target_environment();
  detail::limit(name, "");
}

}  // namespace medusa_llama
#endif
