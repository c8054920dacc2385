# SPDX-License-Identifier: Apache-2.0
target_link_libraries(${name} PRIVATE medusa_llama)
