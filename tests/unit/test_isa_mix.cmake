# SPDX-License-Identifier: Apache-2.0
# test_isa_mix links a second translation unit built for another instruction set (no AVX-512).
# On other processors (the aarch64 cross build) both units are built alike and use the portable
# kernels; the test then checks only that they agree.
# A third unit has a fused multiply-add (-mfma: the portable kernels on the default target, but
# a·b + c rounded once); on ARM, where every unit has one, it is built alike too.
target_sources(${name} PRIVATE "${CMAKE_CURRENT_LIST_DIR}/isa_mix_other_tu.cpp" "${CMAKE_CURRENT_LIST_DIR}/isa_mix_fma_tu.cpp")
if(CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64|amd64|i.86)$")
  set_source_files_properties("${CMAKE_CURRENT_LIST_DIR}/isa_mix_other_tu.cpp" PROPERTIES COMPILE_OPTIONS "-mno-avx512f")
  set_source_files_properties("${CMAKE_CURRENT_LIST_DIR}/isa_mix_fma_tu.cpp" PROPERTIES COMPILE_OPTIONS "-mfma")
endif()
# One of its units has its own instruction set: not with the precompiled header of the other units.
set_target_properties(${name} PROPERTIES DISABLE_PRECOMPILE_HEADERS ON)
