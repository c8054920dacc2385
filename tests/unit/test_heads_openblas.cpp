// SPDX-License-Identifier: Apache-2.0
// The same head and GEMM checks through the OpenBLAS policy of examples/blas (linked by the
// .cmake hook beside this file).
#include "test_heads_common.hpp"

#include "../../examples/blas/openblas_gemm.hpp"

#include <doctest/doctest.h>

TEST_CASE("openblas gemm: all op combinations, alpha/beta, f32/bf16/f16") {
  medusa_blas::openblas_gemm g;
  heads_test::check_gemm_ops(g);
  // Tiny panels force the panel loop for 16-bit weights.
  g.panel_bytes = 64;
  heads_test::check_gemm_ops(g);
}

TEST_CASE("head_stack forward matches the float64 reference (openblas gemm)") {
  medusa_blas::openblas_gemm g;
  heads_test::check_forward_against_reference(g);
}
