# SPDX-License-Identifier: Apache-2.0
# Real models through the example engine: release builds only (too slow under the sanitizers).
target_link_libraries(${name} PRIVATE medusa_llama)
set_tests_properties(unit.${name} PROPERTIES LABELS "integration" TIMEOUT 900)
