# SPDX-License-Identifier: Apache-2.0
# medusa-run: the command line and its checks in medusa-run.cpp; one prompt, many prompts and the
# GPU engine each in their own translation unit (run/).
target_sources(${name} PRIVATE
  ${CMAKE_CURRENT_SOURCE_DIR}/tools/run/setup.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/tools/run/report.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/tools/run/single.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/tools/run/batch.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/tools/run/cuda.cpp)
target_link_libraries(${name} PRIVATE medusa_llama medusa_llama_cuda)
