# SPDX-License-Identifier: Apache-2.0
# Builds tests/fuzz/fuzz_safetensors.cpp with libFuzzer + ASan + UBSan and runs it for SECONDS
# seconds on a seed corpus of valid files written by medusa's own safetensors_writer.
#   cmake -DCLANGXX=clang++ -DSRC=<tests/fuzz/fuzz_safetensors.cpp> -DINCLUDE_DIR=<include>
#         -DWORK_DIR=<scratch> [-DSECONDS=20] -P run_fuzzer.cmake
# Exit 77 (skipped) when clang++ is missing; any crash, leak or sanitizer report fails.
if(NOT SECONDS)
  set(SECONDS 20)
endif()
if(NOT CLANGXX OR NOT EXISTS "${CLANGXX}")
  find_program(_clangxx NAMES clang++ clang++-14 clang++-15 clang++-16)
  if(NOT _clangxx)
    message("clang++ not found: fuzzing skipped")
    cmake_language(EXIT 77)
  endif()
  set(CLANGXX "${_clangxx}")
endif()
if(NOT SRC OR NOT INCLUDE_DIR OR NOT WORK_DIR)
  message(FATAL_ERROR "run_fuzzer.cmake needs SRC, INCLUDE_DIR and WORK_DIR")
endif()
file(REMOVE_RECURSE "${WORK_DIR}/corpus")
file(MAKE_DIRECTORY "${WORK_DIR}/corpus" "${WORK_DIR}/artifacts")

# 1. The seed writer (same source, plain build).
execute_process(
  COMMAND "${CLANGXX}" -std=c++20 -O1 -DMEDUSA_FUZZ_WRITE_SEEDS -I "${INCLUDE_DIR}" "${SRC}" -o "${WORK_DIR}/write_seeds"
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
          -I "${INCLUDE_DIR}" "${SRC}" -o "${WORK_DIR}/fuzz_safetensors"
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "building the fuzzer failed:\n${out}")
endif()

# 3. A dictionary of the format's tokens speeds up discovery.
file(WRITE "${WORK_DIR}/safetensors.dict"
  "\"dtype\"\n\"shape\"\n\"data_offsets\"\n\"__metadata__\"\n\"F32\"\n\"F16\"\n\"BF16\"\n\"I64\"\n\"BOOL\"\n"
  "\"medusa_head.\"\n\".linear.weight\"\n\".linear.bias\"\n\".weight\"\n\"\\\\u\"\n")

# 4. Run. libFuzzer exits non-zero on any crash/sanitizer finding and leaves the input in artifacts/.
execute_process(
  COMMAND "${WORK_DIR}/fuzz_safetensors" "${WORK_DIR}/corpus"
          -max_total_time=${SECONDS} -max_len=4096 -timeout=10 -rss_limit_mb=2048
          -dict=${WORK_DIR}/safetensors.dict -artifact_prefix=${WORK_DIR}/artifacts/ -print_final_stats=1
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
string(REGEX MATCH "stat::number_of_executed_units: *[0-9]+" runs "${out}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "fuzz_safetensors failed (${rc}):\n${out}")
endif()
message("fuzz_safetensors: no crash in ${SECONDS} s (${runs})")
