#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# One bad-input case of medusa-train (--recipe medusa2, draft or eagle): the expected exit status (2 = invalid input,
# 1 = I/O), the error as the last line of stderr (exactly one line when refused up front), and no
# output directory afterwards. Usage: medusa_train_errors.sh TOOL SHARED_DIR SCRATCH_DIR CASE
set -u
tool=$1 shared=$2 scratch=$3 case=$4
stories="$shared/models/stories260K"
pycode="$shared/models/pycode-15m/model.bin"
if [ ! -f "$stories/stories260K.bin" ] || [ ! -f "$pycode" ]; then echo "shared models not found: skipped"; exit 77; fi
dir="$scratch/train-$case"
rm -rf "$dir" && mkdir -p "$dir"
for i in $(seq 1 40); do echo "Once upon a time there was a little dog number $i. It liked to play"; done > "$dir/prompts.txt"
common=(--model "$stories/stories260K.bin" --tokenizer "$stories/tok512.bin" --prompts "$dir/prompts.txt" --tokens 600
        --gen-len 40 --prompt-min 4 --prompt-max 12 --epochs 0.2 --threads 1 --no-progress --cache-dir "$dir/cache")
small=("${common[@]}" --out "$dir/out" --recipe medusa2)
one_line=1
case $case in
  rank_zero)      want=2; pat='--lora-rank 0 is outside \[1, d = 64\]';  args=("${small[@]}" --lora-rank 0) ;;
  rank_above_d)   want=2; pat='--lora-rank 65 is outside \[1, d = 64\]'; args=("${small[@]}" --lora-rank 65) ;;
  backbone_lr)    want=2; pat='--backbone-lr 0.003 must be below --heads-lr 0.002'; args=("${small[@]}" --backbone-lr 3e-3) ;;
  init_heads)     want=2; pat='holds heads for d=64 V=512, the model has d=384 V=2048'
                  # Heads of stories260K, then offered to pycode-15m.
                  "$tool" "${common[@]}" --recipe medusa1 --out "$dir/stories-heads" >/dev/null 2>&1 || { echo "FAIL: could not train heads"; exit 1; }
                  args=(--model "$pycode" --corpus "$dir" --recipe medusa2 --init-heads "$dir/stories-heads" --out "$dir/out" --no-progress) ;;
  gguf)           want=2; pat='convert the GGUF model'; args=(--model "$stories/stories260K.gguf" --prompts "$dir/prompts.txt" --recipe medusa2 --out "$dir/out" --no-progress) ;;
  draft_shape)    want=2; pat='divisible by --draft-heads into heads of an even width \(got 2 layers, width 100, 3 heads\)'
                  args=("${common[@]}" --out "$dir/out" --recipe draft --draft-dim 100 --draft-heads 3) ;;
  draft_init_heads) want=2; pat='--recipe draft trains no heads'
                  args=("${common[@]}" --out "$dir/out" --recipe draft --init-heads "$dir") ;;
  eagle_reg)      want=2; pat='--eagle-reg must be a finite number >= 0, got -1'
                  args=("${common[@]}" --out "$dir/out" --recipe eagle --eagle-reg -1) ;;
  eagle_noise)    want=2; pat='--eagle-noise must be a finite number >= 0, got -0.5'
                  args=("${common[@]}" --out "$dir/out" --recipe eagle --eagle-noise -0.5) ;;
  eagle_hidden)   want=2; pat='--eagle-hidden-dim must be >= 0 \(0: the model.s\), got -4'
                  args=("${common[@]}" --out "$dir/out" --recipe eagle --eagle-hidden-dim -4) ;;
  eagle_lr)       want=2; pat='--eagle-lr, --eagle-epochs, --batch-sequences and --teacher-topk must be positive'
                  args=("${common[@]}" --out "$dir/out" --recipe eagle --eagle-lr 0) ;;
  eagle_init_heads) want=2; pat='--recipe eagle trains no heads'
                  args=("${common[@]}" --out "$dir/out" --recipe eagle --init-heads "$dir") ;;
  full_disk)      want=1; pat='disk full|cannot write|write failed'; one_line=0
                  ulimit -f 96  # KiB per file: the data fits, the teacher table and the outputs do not
                  args=("${small[@]}") ;;
  *) echo "unknown case $case"; exit 1 ;;
esac

err=$("$tool" "${args[@]}" 2>&1 >/dev/null)
rc=$?
last=$(printf '%s\n' "$err" | tail -n 1)
echo "exit $rc: $err"
if [ "$rc" -ne "$want" ]; then echo "FAIL: expected exit $want"; exit 1; fi
if [ "$one_line" = 1 ] && [ "$(printf '%s\n' "$err" | wc -l)" -ne 1 ]; then echo "FAIL: expected exactly one line on stderr"; exit 1; fi
if ! printf '%s' "$last" | grep -Eq -- "$pat"; then echo "FAIL: the last line does not match /$pat/"; exit 1; fi
if [ -e "$dir/out" ]; then echo "FAIL: $dir/out was written"; ls -la "$dir/out"; exit 1; fi
if ls -a "$dir" | grep -q '\.tmp-'; then echo "FAIL: a temporary directory was left behind"; exit 1; fi
echo "ok"
