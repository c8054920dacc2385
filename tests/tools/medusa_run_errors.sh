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
printf 'def f():\\n\n\n   \n' > "$scratch/prompts.txt"
printf '\n  \n' > "$scratch/no_prompts.txt"
{ echo 'import os'; printf 'x = 1\\n%.0s' $(seq 1 400); echo; } > "$scratch/long_prompts.txt"

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
  batch_no_prompts)  want=2; pat='--batch needs --prompts-file'; args=(--model "$pycode" --mode vanilla --batch 2) ;;
  batch_zero)        want=2; pat='--batch must be in';    args=(--model "$pycode" --mode vanilla --prompts-file "$scratch/prompts.txt" --batch 0) ;;
  prompts_missing)   want=2; pat='none.txt';              args=(--model "$pycode" --mode vanilla --prompts-file "$scratch/none.txt") ;;
  prompts_empty)     want=2; pat='no prompt';             args=(--model "$pycode" --mode vanilla --prompts-file "$scratch/no_prompts.txt") ;;
  prompts_long)      want=2; pat='prompt #2 of';          args=(--model "$pycode" --mode vanilla --prompts-file "$scratch/long_prompts.txt") ;;
  prompts_and_prompt) want=2; pat='give one of';          args=(--model "$pycode" --mode vanilla --prompt x --prompts-file "$scratch/prompts.txt") ;;
  cuda_no_device)    want=1; pat='^medusa-run: no CUDA device'; args=(--model "$pycode" --mode vanilla --device cuda --max-new-tokens 4) ;;
  cuda_bad_device)   want=2; pat='--device must be cpu or cuda'; args=(--model "$pycode" --mode vanilla --device gpu) ;;
  cuda_policy)       want=2; pat='decodes greedily';      args=(--model "$pycode" --heads random:2 --device cuda --policy typical) ;;
  cuda_lookup)       want=2; pat='--lookup and --dynamic'; args=(--model "$pycode" --heads random:2 --device cuda --lookup 4) ;;
  cuda_weights)      want=2; pat='--precision';           args=(--model "$pycode" --mode vanilla --device cuda --weights bf16) ;;
  cuda_precision)    want=2; pat='--precision';           args=(--model "$pycode" --mode vanilla --device cuda --precision f8) ;;
  draft_vocab)       want=1; pat='draft model.*tokenizer has 2048 tokens, the model 512'; args=(--model "$pycode" --heads random:4 --draft-model "$shared/models/stories260K/stories260K.bin" --prompt x) ;;
  draft_pieces)      want=1; pat="draft model.s vocabulary is not the target.s .*token 300 is"
                     # The target's own weights beside a tokenizer.bin with one piece changed.
                     mkdir -p "$scratch/other-vocab"
                     ln -sf "$pycode" "$scratch/other-vocab/model.bin"
                     python3 - "$shared/models/pycode-15m/tokenizer.bin" "$scratch/other-vocab/tokenizer.bin" <<'PY'
import struct, sys
data = bytearray(open(sys.argv[1], "rb").read())
at = 4
for token in range(300):
    at += 8 + struct.unpack_from("<i", data, at + 4)[0]
data[at + 8] = ord("Q") if data[at + 8] != ord("Q") else ord("R")  # token 300's first byte
open(sys.argv[2], "wb").write(data)
PY
                     args=(--model "$pycode" --heads random:4 --draft-model "$scratch/other-vocab/model.bin" --prompt x) ;;
  draft_auto_calibration) want=2; pat='--draft-tokens auto needs the calibration.json.*is missing'
                     args=(--model "$pycode" --heads random:4 --draft-model "$pycode" --draft-tokens auto --prompt x) ;;
  draft_auto_batch)  want=2; pat='--draft-tokens auto needs --draft-model, --eagle or --exit .* and one request'
                     args=(--model "$pycode" --heads random:4 --draft-model "$pycode" --draft-tokens auto --prompts-file "$scratch/prompts.txt") ;;
  speculative_alone) want=2; pat='--policy speculative samples a drafter.s chains'
                     args=(--model "$pycode" --heads random:4 --policy speculative --self-draft-layers 2 --prompt x) ;;
  draft_layers)      want=2; pat='below the model.s 8 layers'; args=(--model "$pycode" --heads random:4 --self-draft-layers 8 --prompt x) ;;
  draft_both)        want=2; pat='give one of --draft-model, --self-draft-layers \(or --exit\) and --eagle'; args=(--model "$pycode" --heads random:4 --self-draft-layers 2 --draft-model "$pycode") ;;
  draft_tokens)      want=2; pat='--draft-tokens must be in'; args=(--model "$pycode" --heads random:4 --self-draft-layers 2 --draft-tokens 0) ;;
  draft_alone)       want=2; pat='--draft-alone needs';   args=(--model "$pycode" --heads random:4 --draft-alone) ;;
  draft_nodes_alone) want=2; pat='--draft-nodes grows a drafter.s own tree: it needs'
                     args=(--model "$pycode" --heads random:4 --self-draft-layers 2 --draft-nodes 8 --prompt x) ;;
  draft_nodes_range) want=2; pat='--draft-nodes must be in \[0, 256\], got 300'
                     args=(--model "$pycode" --heads random:4 --self-draft-layers 2 --draft-alone --draft-nodes 300 --prompt x) ;;
  draft_topk)        want=2; pat='--draft-topk must be in \[1, 64\], got 0'
                     args=(--model "$pycode" --heads random:4 --self-draft-layers 2 --draft-alone --draft-nodes 8 --draft-topk 0 --prompt x) ;;
  speculative_lookup) want=2; pat='takes --lookup only with --draft-nodes'
                     args=(--model "$pycode" --heads random:4 --self-draft-layers 2 --draft-alone --lookup 4 --policy speculative --prompt x) ;;
  *) echo "unknown case $case"; exit 1 ;;
esac

err=$("$tool" "${args[@]}" 2>&1 >/dev/null)
rc=$?
# With a CUDA device the no-device case decodes instead: nothing to check here.
if [ "$case" = cuda_no_device ] && [ "$rc" -eq 0 ]; then echo "a CUDA device is present: skipped"; exit 77; fi
echo "exit $rc: $err"
if [ "$rc" -ne "$want" ]; then echo "FAIL: expected exit $want"; exit 1; fi
if [ "$(printf '%s\n' "$err" | wc -l)" -ne 1 ]; then echo "FAIL: expected exactly one line on stderr"; exit 1; fi
if ! printf '%s' "$err" | grep -Eq -- "$pat"; then echo "FAIL: stderr does not match /$pat/"; exit 1; fi
