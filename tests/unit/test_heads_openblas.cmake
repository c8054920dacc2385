# SPDX-License-Identifier: Apache-2.0
# test_heads_openblas runs the head checks through examples/blas/openblas_gemm.hpp.
target_link_libraries(${name} PRIVATE openblas)
