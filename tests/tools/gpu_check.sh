#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# scripts/gpu-check's mechanics, with or without a device: bad arguments exit 2; with a stand-in
# nvidia-smi listing one GPU, the `tests` part runs every GPU program of the build and logs each
# one's status (77, skipped, here without a device; 0 on one).
# Usage: gpu_check.sh SOURCE_DIR BUILD_DIR SCRATCH_DIR
set -u
src=$1 build=$2 scratch=$3
check=$src/scripts/gpu-check
"$check" --no-such-option > /dev/null 2>&1
[ $? -eq 2 ] || { echo "FAIL: a bad argument must exit 2"; exit 1; }
"$check" --build "$scratch/no-such-build" > /dev/null 2>&1
[ $? -eq 2 ] || { echo "FAIL: a missing build must exit 2"; exit 1; }
mkdir -p "$scratch/fake-bin"
printf '#!/bin/sh\necho "GPU 0: stand-in"\n' > "$scratch/fake-bin/nvidia-smi"
chmod +x "$scratch/fake-bin/nvidia-smi"
log=$scratch/gpu-check.log
PATH="$scratch/fake-bin:$PATH" "$check" --build "$build" --log "$log" tests > /dev/null 2>&1
rc=$?
cat "$log"
[ $rc -eq 0 ] || { echo "FAIL: gpu-check exited $rc"; exit 1; }
for t in test_attention_cuda test_skinny_gemm_cuda test_heads_cuda medusa_cuda_step gpu_test_llama_cuda; do
  grep -Eq -- "^--- $t .*\(exit (0|77), " "$log" || { echo "FAIL: no status of $t in the log"; exit 1; }
done
echo "gpu-check ran and logged every GPU program"
