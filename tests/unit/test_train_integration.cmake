# SPDX-License-Identifier: Apache-2.0
# test_train_integration trains heads on ../shared/models/pycode-15m (skips without it).
if(TARGET medusa_train)
  target_link_libraries(${name} PRIVATE medusa_train)
  set_tests_properties(unit.${name} PROPERTIES LABELS "unit;integration" TIMEOUT 300)
else()
  set_target_properties(${name} PROPERTIES EXCLUDE_FROM_ALL ON)
  set_tests_properties(unit.${name} PROPERTIES DISABLED TRUE)
endif()
