# SPDX-License-Identifier: Apache-2.0
# test_train exercises examples/train (the trainer library, the example engine, OpenBLAS).
if(TARGET medusa_train)
  target_link_libraries(${name} PRIVATE medusa_train)
else()
  set_target_properties(${name} PROPERTIES EXCLUDE_FROM_ALL ON)
  set_tests_properties(unit.${name} PROPERTIES DISABLED TRUE)
endif()
