#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# scripts/demo as a fresh clone runs it, with nothing beside the repository (no ../shared): the
# embedded model's checksum, its heads load, every prompt's Medusa tokens equal its plain tokens,
# and the report is complete. A damaged model file is refused with a message, before any decoding.
# Usage: demo_embedded.sh MEDUSA_RUN SOURCE_DIR SCRATCH_DIR
# MEDUSA_TOOL_TEST_NEW_TOKENS caps the new tokens per prompt (default 96; the sanitizer runs use
# fewer: the same code paths, in less time).
set -eu
tool=$1 source=$2 scratch=$3
export MEDUSA_CACHE_DIR="$scratch/demo-cost-cache"  # --tree auto measures into the scratch folder, not ~/.cache
new_tokens=${MEDUSA_TOOL_TEST_NEW_TOKENS:-96}

# A copy of what the demo reads, in a folder with no ../shared beside it.
rm -rf "$scratch/demo"
clone=$scratch/demo/medusa
mkdir -p "$clone"
cp -r "$source/scripts" "$source/models" "$clone/"
[ ! -e "$scratch/demo/shared" ] || { echo "$scratch/demo/shared exists"; exit 1; }

out=$(MEDUSA_RUN="$tool" MEDUSA_NEW_TOKENS="$new_tokens" MEDUSA_DEMO_RUNS=1 "$clone/scripts/demo" 2>&1) || {
  printf '%s\n' "$out"; echo "scripts/demo failed"; exit 1; }
printf '%s\n' "$out"
prompts=$(grep -c . "$clone/models/pycode-15m/prompts.txt")
[ "$(printf '%s\n' "$out" | grep -c 'tokens identical: yes$')" -eq "$prompts" ] || { echo "not every prompt reported identical tokens"; exit 1; }
printf '%s\n' "$out" | grep -q "^   tokens identical to plain decoding: yes$" || { echo "no identical-tokens summary"; exit 1; }
printf '%s\n' "$out" | grep -Eq "^   speedup: [0-9]+\.[0-9]{2}x" || { echo "no speedup line"; exit 1; }
printf '%s\n' "$out" | grep -Eq "^   Medusa decoding .* [0-9.]+ tokens per step$" || { echo "no tokens-per-step line"; exit 1; }

# One flipped byte in the model: the checksum refuses it.
model=$clone/models/pycode-15m/pycode-15m-q8_0.gguf
python3 - "$model" <<'PY'
import sys
with open(sys.argv[1], "r+b") as f:
    f.seek(1 << 20)
    b = f.read(1)
    f.seek(1 << 20)
    f.write(bytes([b[0] ^ 0x40]))
PY
if err=$(MEDUSA_RUN="$tool" "$clone/scripts/demo" 2>&1); then
  printf '%s\n' "$err"; echo "a damaged model was accepted"; exit 1
fi
printf '%s\n' "$err" | grep -q "does not match its SHA256SUMS" || { printf '%s\n' "$err"; echo "no checksum message"; exit 1; }
rm -rf "$scratch/demo"
echo "demo ok: $prompts prompts identical, damaged model refused"
