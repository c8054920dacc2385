# SPDX-License-Identifier: Apache-2.0
# test_attention_portable defines MEDUSA_PORTABLE_KERNELS before it includes the library: the
# precompiled header of the other units, which includes the library first, would hide it.
set_target_properties(${name} PROPERTIES DISABLE_PRECOMPILE_HEADERS ON)
