# SPDX-License-Identifier: Apache-2.0
# Compiles every public header alone. MODE=cxx: include/medusa/**/*.hpp with the C++ compiler.
# MODE=cuda: include/medusa/cuda/**/*.cuh, and every core header with MEDUSA_HOST_DEVICE code,
# with nvcc's front ends (skipped when nvcc is absent): `-cuda` parses the host side (cudafe++)
# and compiles the device side to compute_80 PTX (cicc), then stops before the host compiler
# compiles what cudafe++ wrote, which adds no check of the header and a fifth of the time.
# Self-containment does not depend on the architecture (the headers test only whether
# __CUDA_ARCH__ is defined), and every header is compiled to sm_80 and sm_90 code by the targets
# that use it. Any failure prints the compiler output and fails the test.
if(MODE STREQUAL "cuda" AND (NOT COMPILER OR NOT EXISTS "${COMPILER}"))
  message("nvcc not found: CUDA header checks skipped")
  return()  # skipped: the test matches the message (cmake_language(EXIT) needs CMake 3.29)
endif()
file(MAKE_DIRECTORY "${WORK_DIR}")
if(MODE STREQUAL "cxx")
  file(GLOB_RECURSE headers RELATIVE "${INCLUDE_DIR}" "${INCLUDE_DIR}/medusa/*.hpp")
else()
  file(GLOB_RECURSE headers RELATIVE "${INCLUDE_DIR}" "${INCLUDE_DIR}/medusa/cuda/*.cuh")
  # Core headers with host/device code must compile under nvcc too: kernels include them.
  file(GLOB_RECURSE core RELATIVE "${INCLUDE_DIR}" "${INCLUDE_DIR}/medusa/*.hpp")
  foreach(h IN LISTS core)
    file(READ "${INCLUDE_DIR}/${h}" text)
    if(text MATCHES "MEDUSA_HOST_DEVICE [a-z]")
      list(APPEND headers "${h}")
    endif()
  endforeach()
endif()
list(SORT headers)
set(failed 0)
set(count 0)
foreach(h IN LISTS headers)
  string(MAKE_C_IDENTIFIER "${h}" id)
  if(MODE STREQUAL "cxx")
    set(src "${WORK_DIR}/${id}.cpp")
    # Included twice: checks the include guard as well as self-containment.
    file(WRITE "${src}" "#include <${h}>\n#include <${h}>\nint main() { return 0; }\n")
    set(cmd "${COMPILER}" -std=c++20 -Wall -Wextra -Wpedantic -Werror -fsyntax-only
        -I "${INCLUDE_DIR}" "${src}")
  else()
    set(src "${WORK_DIR}/${id}.cu")
    file(WRITE "${src}" "#include <${h}>\n#include <${h}>\nint main() { return 0; }\n")
    set(cmd "${COMPILER}" -std=c++20 -ccbin "${HOST_COMPILER}" -Werror all-warnings
        -gencode arch=compute_80,code=compute_80
        -I "${INCLUDE_DIR}" -cuda "${src}" -o "${WORK_DIR}/${id}.ii")
  endif()
  execute_process(COMMAND ${cmd} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  math(EXPR count "${count} + 1")
  if(NOT rc EQUAL 0)
    message("FAILED: ${h}\n${out}")
    math(EXPR failed "${failed} + 1")
  else()
    message("ok: ${h}")
  endif()
endforeach()
if(count EQUAL 0)
  message(FATAL_ERROR "no headers found under ${INCLUDE_DIR}")
endif()
if(failed GREATER 0)
  message(FATAL_ERROR "${failed} of ${count} headers do not compile alone (${MODE})")
endif()
message("${count} headers compile alone (${MODE})")
