# SPDX-License-Identifier: Apache-2.0
# test_attention_x86_64_v3: its one translation unit, main included (x86_level_main.hpp), built with
# -march=x86-64-v3; medusa_doctest_main, built for the default target, is not linked in, so no
# unit of another instruction set shares the program. On other processors it only reports a skip.
set_property(TARGET ${name} PROPERTY LINK_LIBRARIES medusa::medusa doctest::doctest)
if(CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64|amd64)$")
  target_compile_options(${name} PRIVATE -march=x86-64-v3)
endif()
# Built with its own -march: not with the precompiled header of the other units.
set_target_properties(${name} PROPERTIES DISABLE_PRECOMPILE_HEADERS ON)
