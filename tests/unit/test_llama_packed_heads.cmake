# SPDX-License-Identifier: Apache-2.0
# Tests of the example CPU Llama engine (examples/llama): link its static library, building it here
# when the examples are disabled.
if(NOT TARGET medusa_llama)
  add_subdirectory(${PROJECT_SOURCE_DIR}/examples/llama ${PROJECT_BINARY_DIR}/examples/llama-for-tests)
endif()
find_package(nlohmann_json REQUIRED)
target_link_libraries(${name} PRIVATE medusa_llama nlohmann_json::nlohmann_json)
