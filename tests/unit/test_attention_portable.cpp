// SPDX-License-Identifier: Apache-2.0
// The attention tests again, on the portable (non-AVX-512) code path.
#define MEDUSA_PORTABLE_KERNELS 1
#include "test_attention.cpp"  // NOLINT(bugprone-suspicious-include)
