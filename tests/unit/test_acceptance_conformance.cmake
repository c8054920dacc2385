# SPDX-License-Identifier: Apache-2.0
# The conformance port reads the golden JSON cases: it needs nlohmann_json (header-only).
find_package(nlohmann_json REQUIRED)
target_link_libraries(${name} PRIVATE nlohmann_json::nlohmann_json)
