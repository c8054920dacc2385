# SPDX-License-Identifier: Apache-2.0
# test_heads_openblas runs the head checks through examples/blas/openblas_gemm.hpp. Where the
# target has no OpenBLAS (the aarch64 cross build installs none) it is not built and ctest lists it
# as disabled.
find_library(MEDUSA_TEST_OPENBLAS NAMES openblas)
if(MEDUSA_TEST_OPENBLAS)
  target_link_libraries(${name} PRIVATE openblas)
else()
  set_target_properties(${name} PROPERTIES EXCLUDE_FROM_ALL ON)
  set_tests_properties(unit.${name} PROPERTIES DISABLED ON)
endif()
