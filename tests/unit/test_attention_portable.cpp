// SPDX-License-Identifier: Apache-2.0
// The attention tests again, on the portable (non-AVX-512) code path.
#define MEDUSA_ATTENTION_PORTABLE 1
#include "test_attention.cpp"  // NOLINT(bugprone-suspicious-include)
