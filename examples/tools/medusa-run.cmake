# SPDX-License-Identifier: Apache-2.0
# medusa-run reads --prompts-file with the trainer's prompt reader (one prompt per line, escapes).
target_link_libraries(${name} PRIVATE medusa_llama medusa_llama_cuda medusa_train)
