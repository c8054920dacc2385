# SPDX-License-Identifier: Apache-2.0
# test_isa_mix links a second translation unit built for another instruction set (no AVX-512).
target_sources(${name} PRIVATE "${CMAKE_CURRENT_LIST_DIR}/isa_mix_other_tu.cpp")
set_source_files_properties("${CMAKE_CURRENT_LIST_DIR}/isa_mix_other_tu.cpp" PROPERTIES COMPILE_OPTIONS "-mno-avx512f")
