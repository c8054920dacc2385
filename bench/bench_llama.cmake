# SPDX-License-Identifier: Apache-2.0
# bench_llama (and bench_quant_quality) drive the example CPU Llama engine (examples/llama) on ../shared/models/pycode-15m.
if(NOT TARGET medusa_llama)
  add_subdirectory(${PROJECT_SOURCE_DIR}/examples/llama ${PROJECT_BINARY_DIR}/examples/llama-for-bench)
endif()
target_link_libraries(${name} PRIVATE medusa_llama)
target_compile_definitions(${name} PRIVATE MEDUSA_SHARED_DIR="${PROJECT_SOURCE_DIR}/../shared")
