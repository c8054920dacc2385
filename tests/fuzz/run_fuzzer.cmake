# SPDX-License-Identifier: Apache-2.0
# Builds a libFuzzer target (tests/fuzz/fuzz_*.cpp) with libFuzzer + ASan + UBSan and runs it for
# SECONDS seconds on a seed corpus that the same source writes when built with
# -DMEDUSA_FUZZ_WRITE_SEEDS.
#   cmake -DCLANGXX=clang++ -DSRC=<tests/fuzz/fuzz_safetensors.cpp> -DINCLUDE_DIR=<include>
#         -DWORK_DIR=<scratch> [-DSECONDS=20] [-DMAX_LEN=4096]
#         [-DEXTRA_SOURCES=a.cpp|b.cpp] [-DEXTRA_INCLUDES=dir1|dir2] [-DDICT=<file>] -P run_fuzzer.cmake
# EXTRA_SOURCES are compiled into the fuzzer only (not the seed writer); EXTRA_INCLUDES serve both;
# DICT replaces the built-in safetensors dictionary. Lists are separated by "|".
# Exit 77 (skipped) when clang++ is missing; any crash, leak or sanitizer report fails.
if(NOT SECONDS)
  set(SECONDS 20)
endif()
if(NOT MAX_LEN)
  set(MAX_LEN 4096)
endif()
string(REPLACE "|" ";" _extra_sources "${EXTRA_SOURCES}")
set(_includes -I "${INCLUDE_DIR}")
string(REPLACE "|" ";" _extra_includes "${EXTRA_INCLUDES}")
foreach(dir IN LISTS _extra_includes)
  list(APPEND _includes -I "${dir}")
endforeach()
if(NOT CLANGXX OR NOT EXISTS "${CLANGXX}")
  find_program(_clangxx NAMES clang++ clang++-14 clang++-15 clang++-16)
  if(NOT _clangxx)
    message("clang++ not found: fuzzing skipped")
    return()  # skipped: the test matches the message (cmake_language(EXIT) needs CMake 3.29)
  endif()
  set(CLANGXX "${_clangxx}")
endif()
if(NOT SRC OR NOT INCLUDE_DIR OR NOT WORK_DIR)
  message(FATAL_ERROR "run_fuzzer.cmake needs SRC, INCLUDE_DIR and WORK_DIR")
endif()
get_filename_component(_name "${SRC}" NAME_WE)
file(REMOVE_RECURSE "${WORK_DIR}/corpus")
file(MAKE_DIRECTORY "${WORK_DIR}/corpus" "${WORK_DIR}/artifacts")

# 1. The seed writer (same source, plain build).
execute_process(
  COMMAND "${CLANGXX}" -std=c++20 -O1 -DMEDUSA_FUZZ_WRITE_SEEDS ${_includes} "${SRC}" -o "${WORK_DIR}/write_seeds"
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "building the seed writer failed:\n${out}")
endif()
execute_process(COMMAND "${WORK_DIR}/write_seeds" "${WORK_DIR}/corpus" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "writing the seed corpus failed (${rc})")
endif()

# 2. The fuzzer.
execute_process(
  COMMAND "${CLANGXX}" -std=c++20 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined
          ${_includes} "${SRC}" ${_extra_sources} -o "${WORK_DIR}/${_name}"
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "building the fuzzer failed:\n${out}")
endif()

# 3. A dictionary of the format's tokens speeds up discovery.
if(DICT)
  configure_file("${DICT}" "${WORK_DIR}/fuzz.dict" COPYONLY)
else()
  file(WRITE "${WORK_DIR}/fuzz.dict"
    "\"dtype\"\n\"shape\"\n\"data_offsets\"\n\"__metadata__\"\n\"F32\"\n\"F16\"\n\"BF16\"\n\"I64\"\n\"BOOL\"\n"
    "\"medusa_head.\"\n\".linear.weight\"\n\".linear.bias\"\n\".weight\"\n\"\\\\u\"\n")
endif()

# 4. Run. libFuzzer exits non-zero on any crash/sanitizer finding and leaves the input in artifacts/.
execute_process(
  COMMAND "${WORK_DIR}/${_name}" "${WORK_DIR}/corpus"
          -max_total_time=${SECONDS} -max_len=${MAX_LEN} -timeout=10 -rss_limit_mb=2048
          -dict=${WORK_DIR}/fuzz.dict -artifact_prefix=${WORK_DIR}/artifacts/ -print_final_stats=1
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
string(REGEX MATCH "stat::number_of_executed_units: *[0-9]+" runs "${out}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${_name} failed (${rc}):\n${out}")
endif()
message("${_name}: no crash in ${SECONDS} s (${runs})")
