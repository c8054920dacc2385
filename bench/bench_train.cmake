# SPDX-License-Identifier: Apache-2.0
# bench_train measures the head trainer of examples/train (OpenBLAS GEMMs).
if(TARGET medusa_train)
  target_link_libraries(${name} PRIVATE medusa_train)
else()
  set_target_properties(${name} PROPERTIES EXCLUDE_FROM_ALL ON)
endif()
