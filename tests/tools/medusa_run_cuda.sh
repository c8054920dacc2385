#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# medusa-run --device cuda on a device: plain and Medusa decoding of several prompts, batched, in
# f32 and bf16, give identical tokens (the tool exits 1 otherwise) and report the device.
# Exits 77 (skipped) without a CUDA device or without the shared models.
# Usage: medusa_run_cuda.sh TOOL SHARED_DIR SCRATCH_DIR
set -u
tool=$1 shared=$2 scratch=$3
pycode="$shared/models/pycode-15m/model.bin"
if [ ! -f "$pycode" ]; then echo "shared models not found: skipped"; exit 77; fi
mkdir -p "$scratch"
probe=$("$tool" --model "$pycode" --mode vanilla --device cuda --max-new-tokens 1 --json 2>&1 >/dev/null)
if [ $? -ne 0 ]; then echo "$probe: skipped"; exit 77; fi
printf 'def fib(n):\\n\nimport os\\nimport sys\\n\nclass Parser:\\n    def __init__(self\n' > "$scratch/cuda_prompts.txt"
for precision in f32 bf16; do
  out=$("$tool" --model "$pycode" --device cuda --precision "$precision" --mode both --heads random:4:7 \
        --tree mc_sim_7b_63 --prompts-file "$scratch/cuda_prompts.txt" --batch 3 --max-new-tokens 128 --json)
  rc=$?
  echo "$out" | tail -1
  if [ $rc -ne 0 ]; then echo "FAIL: exit $rc ($precision)"; exit 1; fi
  summary=$(echo "$out" | tail -1)
  echo "$summary" | grep -q '"identical":true' || { echo "FAIL: tokens differ ($precision)"; exit 1; }
  echo "$summary" | grep -q '"device":{' || { echo "FAIL: no device in the summary"; exit 1; }
done
