// SPDX-License-Identifier: Apache-2.0
// The units' main: doctest's, after making a misdetecting OpenBLAS use its AVX-512 kernels (the
// engine's prefill and the trainer run their GEMMs through it; medusa_llama/openblas_env.hpp).
// A case that checked nothing is reported skipped, and a unit none of whose cases did exits 77.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <medusa_llama/openblas_env.hpp>

#include "checked_nothing.hpp"

int main(int argc, char** argv) {
  medusa_llama::reexec_with_fast_openblas(argv);
  return medusa_test::run(argc, argv);
}
