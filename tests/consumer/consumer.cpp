// SPDX-License-Identifier: Apache-2.0
// A minimal engine-side program: it includes the umbrella header and uses the library.
#include <medusa/medusa.hpp>

#include <cstdio>

int main() {
  constexpr auto v = medusa::version();
  static_assert(v.major == MEDUSA_VERSION_MAJOR);
  std::printf("medusa %d.%d.%d\n", v.major, v.minor, v.patch);
  return 0;
}
