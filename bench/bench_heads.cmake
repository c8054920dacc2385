# SPDX-License-Identifier: Apache-2.0
# bench_heads compares the portable GEMM with examples/blas/openblas_gemm.hpp and measures an
# sgemm peak: it needs OpenBLAS.
target_link_libraries(${name} PRIVATE openblas)
