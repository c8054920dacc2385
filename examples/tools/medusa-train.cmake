# SPDX-License-Identifier: Apache-2.0
# medusa-train links the trainer library (which brings the example engine and OpenBLAS).
if(TARGET medusa_train OR EXISTS "${CMAKE_CURRENT_SOURCE_DIR}/train/CMakeLists.txt")
  target_link_libraries(${name} PRIVATE medusa_train)
endif()
