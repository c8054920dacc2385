// SPDX-License-Identifier: Apache-2.0
#include <medusa/medusa.hpp>

#include <doctest/doctest.h>

#include <string>
#include <type_traits>

TEST_CASE("version macros and version() agree") {
  constexpr auto v = medusa::version();
  static_assert(v.major == MEDUSA_VERSION_MAJOR && v.minor == MEDUSA_VERSION_MINOR &&
                v.patch == MEDUSA_VERSION_PATCH);
  CHECK(MEDUSA_VERSION == v.major * 10000 + v.minor * 100 + v.patch);
}

// The versioned inline namespace is transparent (checked when this unit compiles).
static_assert(std::is_same_v<medusa::version_info, medusa::v0::version_info>);

TEST_CASE("typed errors carry the medusa prefix and their standard base") {
  try {
    throw medusa::invalid_input("bad tree");
  } catch (const std::invalid_argument& e) {
    CHECK(std::string(e.what()) == "medusa: bad tree");
    CHECK(dynamic_cast<const medusa::error*>(&e) != nullptr);
  }
  try {
    throw medusa::io_error("medusa: already prefixed");
  } catch (const medusa::error& e) {
    CHECK(std::string(e.message()) == "medusa: already prefixed");
  }
}
