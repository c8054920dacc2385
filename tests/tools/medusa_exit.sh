#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# medusa-train --recipe exit end to end on stories260K: it writes OUT/exit/exit.bin (an exit
# projection after 3 of the 5 layers) and a calibration with the plain first layers' figures beside
# the exit's; then medusa-run --exit decodes exactly as plain greedy decoding (chains of fixed
# length and auto, a tree), and an exit trained after other layers than --self-draft-layers says is
# refused.
# Usage: medusa_exit.sh TRAIN_TOOL RUN_TOOL SHARED_DIR SCRATCH_DIR
set -u
train=$1 run=$2 shared=$3 scratch=$4
stories="$shared/models/stories260K"
if [ ! -f "$stories/stories260K.bin" ]; then echo "shared models not found: skipped"; exit 77; fi
dir="$scratch/exit"
rm -rf "$dir" && mkdir -p "$dir"
for i in $(seq 1 40); do echo "Once upon a time there was a little dog number $i. It liked to play"; done > "$dir/prompts.txt"
if ! "$train" --model "$stories/stories260K.bin" --tokenizer "$stories/tok512.bin" --prompts "$dir/prompts.txt" --tokens 3000 \
     --gen-len 48 --prompt-min 4 --prompt-max 12 --threads 1 --no-progress --recipe exit --exit-layers 3 --exit-epochs 20 --exit-lr 3e-3 \
     --out "$dir/out" > "$dir/train.log" 2>&1; then
  echo "FAIL: training"; cat "$dir/train.log"; exit 1
fi
tail -n 12 "$dir/train.log"
for f in exit.bin calibration.json; do
  [ -f "$dir/out/exit/$f" ] || { echo "FAIL: no OUT/exit/$f"; ls -la "$dir/out" "$dir/out/exit"; exit 1; }
done
python3 - "$dir/out" "$stories/stories260K.bin" <<'PY' || exit 1
import json, os, struct, sys
out, target = sys.argv[1], sys.argv[2]
c = json.load(open(os.path.join(out, "calibration.json")))
assert c == json.load(open(os.path.join(out, "exit", "calibration.json"))), "the two calibrations differ"
assert c["recipe"] == "exit", c
acc, chain = c["acceptance_by_depth"], c["chain_tokens_per_step"]
assert len(acc) == 8 and len(chain) == 8 and len(c["without_exit"]["chain_tokens_per_step"]) == 8, c
assert 0 <= c["agreement"] <= 1 and abs(acc[0] - c["agreement"]) < 1e-3 and c["positions"] > 0, c
# Trained on these very continuations' kind, the exit agrees with the target more than the plain layers.
assert c["agreement"] > c["without_exit"]["agreement"], (c["agreement"], c["without_exit"])
p, t = 1.0, 1.0
for a, ct in zip(acc, chain):
    assert 0 <= a <= 1, acc
    p *= a; t += p
    assert abs(ct - t) < 1e-3, (ct, t)
d = struct.unpack("<7i", open(target, "rb").read(28))[0]
assert c["exit"] == {"layers": 3, "dim": d, "parameters": d * d}, c["exit"]
e = open(os.path.join(out, "exit", "exit.bin"), "rb").read()
assert e[:8] == b"MEDUSAEX" and struct.unpack("<3i", e[8:20]) == (1, 3, d) and len(e) == 20 + 4 * d * d, e[:20]
print("exit ok: agreement %.3f (without %.3f), chains of 1..8: %s" % (c["agreement"], c["without_exit"]["agreement"],
      " ".join("%.2f" % x for x in chain)))
PY
[ $? -eq 0 ] || exit 1

fail=0
common=(--model "$stories/stories260K.bin" --tokenizer "$stories/tok512.bin" --heads random:4 --exit "$dir/out/exit" --draft-alone
        --mode both --max-new-tokens 64 --threads 1 --json --prompt "Once upon a time")
for extra in "--draft-tokens 3" "--draft-tokens auto" "--draft-tokens 3 --self-draft-layers 3" "--draft-tokens 4 --draft-nodes 8 --draft-topk 2"; do
  # shellcheck disable=SC2086  # $extra holds several words
  out=$("$run" "${common[@]}" $extra 2>"$dir/run.err")
  rc=$?
  if ! printf '%s\n' "$out" | python3 -c '
import json, sys
rows = [json.loads(l) for l in sys.stdin if l.startswith("{")]
plain = [r for r in rows if r["mode"] == "vanilla"]
med = [r for r in rows if r["mode"] == "medusa"]
assert len(plain) == 1 and len(med) == 1, rows
assert med[0]["tokens"] == plain[0]["tokens"] and len(plain[0]["tokens"]) > 0, "tokens differ"
d = med[0]["tree"]["drafts"]
assert d["exit"] and d["draft_tokens_run"] > 0, d
print("%s: %d tokens identical to plain, %.2f per step, the draft ran %d tokens"
      % (sys.argv[1], len(med[0]["tokens"]), med[0]["mean_accepted"], d["draft_tokens_run"]))
' "$extra"; then echo "FAIL [$extra]: exit $rc"; cat "$dir/run.err"; fail=1; fi
done

# An exit trained after 3 layers with --self-draft-layers 2: refused, naming both.
"$run" "${common[@]}" --self-draft-layers 2 > /dev/null 2> "$dir/err.txt"
rc=$?
if [ "$rc" -ne 2 ] || ! grep -q "was trained after 3 layers, not the --self-draft-layers 2" "$dir/err.txt"; then
  echo "FAIL: a mismatched --self-draft-layers: exit $rc"; cat "$dir/err.txt"; fail=1
else
  echo "mismatched layers refused: $(cat "$dir/err.txt")"
fi
# A damaged exit.bin: refused with the reader's message.
mkdir -p "$dir/bad" && head -c 30 "$dir/out/exit/exit.bin" > "$dir/bad/exit.bin"
"$run" "${common[@]/$dir\/out\/exit/$dir/bad}" > /dev/null 2> "$dir/err.txt"
rc=$?
if [ "$rc" -eq 0 ] || ! grep -q "ends before its weights do" "$dir/err.txt"; then
  echo "FAIL: a truncated exit.bin: exit $rc"; cat "$dir/err.txt"; fail=1
else
  echo "truncated exit refused: $(cat "$dir/err.txt")"
fi
exit $fail
