# SPDX-License-Identifier: Apache-2.0
# Runs the shared conformance checker against the built tools; skipped without ../shared (the
# test's SKIP_REGULAR_EXPRESSION matches the message: cmake_language(EXIT) needs CMake 3.29).
if(NOT EXISTS "${SHARED_DIR}/conformance/check_cli.py")
  message("shared conformance cases not found at ${SHARED_DIR}: skipped")
  return()
endif()
execute_process(
  COMMAND "${PYTHON}" "${SHARED_DIR}/conformance/check_cli.py"
          --bin-dir "${BIN_DIR}" --cases "${SHARED_DIR}/conformance/cases" --only "${ONLY}"
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "conformance failed (exit ${rc})")
endif()
