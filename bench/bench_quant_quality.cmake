# SPDX-License-Identifier: Apache-2.0
# Same engine and model as bench_llama.
include(${CMAKE_CURRENT_LIST_DIR}/bench_llama.cmake)
