#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# One bad-input case of medusa-run: the tool must exit with the expected status (2 = invalid
# input, 1 = unreadable/corrupt files), print exactly one line on stderr matching a pattern, and
# never crash. Usage: medusa_run_errors.sh TOOL SHARED_DIR SCRATCH_DIR CASE
set -u
tool=$1 shared=$2 scratch=$3 case=$4
pycode="$shared/models/pycode-15m/model.bin"
if [ ! -f "$pycode" ]; then echo "shared models not found: skipped"; exit 77; fi
mkdir -p "$scratch"
printf 'short' > "$scratch/truncated.bin"
printf '{"__metadata__": 5' > "$scratch/corrupt.safetensors"
long_prompt=$(printf 'x = 1\n%.0s' $(seq 1 400))

case $case in
  missing_model)     want=1; pat='no such file';          args=(--model "$scratch/none.bin" --mode vanilla) ;;
  truncated_model)   want=1; pat='truncated.bin';         args=(--model "$scratch/truncated.bin" --tokenizer "$shared/models/pycode-15m/tokenizer.bin" --mode vanilla) ;;
  vocab_mismatch)    want=1; pat='tokenizer has 512';     args=(--model "$pycode" --tokenizer "$shared/models/stories260K/tok512.bin" --mode vanilla) ;;
  bad_tree)          want=2; pat='prefix';                args=(--model "$pycode" --heads random:4 --tree '[[0],[0,0],[1,1]]') ;;
  unknown_preset)    want=2; pat='preset';                args=(--model "$pycode" --heads random:4 --tree no_such_tree) ;;
  no_heads)          want=2; pat='needs --heads';         args=(--model "$pycode" --mode medusa) ;;
  too_few_heads)     want=2; pat='deep';                  args=(--model "$pycode" --heads random:2 --tree mc_sim_7b_63) ;;
  bad_random_heads)  want=2; pat='random:K';              args=(--model "$pycode" --heads random:x) ;;
  heads_not_medusa)  want=2; pat='no Medusa head tensors';   args=(--model "$pycode" --heads "$shared/models/tinystories-656K/model.safetensors") ;;
  heads_corrupt)     want=2; pat='corrupt.safetensors|header'; args=(--model "$pycode" --heads "$scratch/corrupt.safetensors") ;;
  long_prompt)       want=2; pat='does not fit the context'; args=(--model "$pycode" --mode vanilla --prompt "$long_prompt") ;;
  bad_mode)          want=2; pat='--mode';                args=(--model "$pycode" --mode fast) ;;
  *) echo "unknown case $case"; exit 1 ;;
esac

err=$("$tool" "${args[@]}" 2>&1 >/dev/null)
rc=$?
echo "exit $rc: $err"
if [ "$rc" -ne "$want" ]; then echo "FAIL: expected exit $want"; exit 1; fi
if [ "$(printf '%s\n' "$err" | wc -l)" -ne 1 ]; then echo "FAIL: expected exactly one line on stderr"; exit 1; fi
if ! printf '%s' "$err" | grep -Eq -- "$pat"; then echo "FAIL: stderr does not match /$pat/"; exit 1; fi
