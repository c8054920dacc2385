#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# medusa-train --recipe draft end to end on stories260K: it writes OUT/draft/model.bin beside the
# target's tokenizer and a calibration whose chain figures are consistent, and medusa-run decodes
# with that draft exactly as plain greedy decoding does, with a fixed chain and with
# --draft-tokens auto (a chain length chosen from that calibration).
# Usage: medusa_train_draft.sh TRAIN_TOOL RUN_TOOL SHARED_DIR SCRATCH_DIR
set -u
train=$1 run=$2 shared=$3 scratch=$4
stories="$shared/models/stories260K"
if [ ! -f "$stories/stories260K.bin" ]; then echo "shared models not found: skipped"; exit 77; fi
dir="$scratch/train-draft"
rm -rf "$dir" && mkdir -p "$dir"
for i in $(seq 1 40); do echo "Once upon a time there was a little dog number $i. It liked to play"; done > "$dir/prompts.txt"
if ! "$train" --model "$stories/stories260K.bin" --tokenizer "$stories/tok512.bin" --prompts "$dir/prompts.txt" --tokens 3000 \
     --gen-len 48 --prompt-min 4 --prompt-max 12 --threads 1 --no-progress --recipe draft --draft-layers 1 --draft-dim 32 \
     --draft-heads 4 --draft-epochs 3 --out "$dir/out" > "$dir/train.log" 2>&1; then
  echo "FAIL: training"; cat "$dir/train.log"; exit 1
fi
tail -n 12 "$dir/train.log"
if [ ! -f "$dir/out/draft/model.bin" ] || [ ! -f "$dir/out/draft/tok512.bin" ]; then
  echo "FAIL: no draft model written"; ls -la "$dir/out" "$dir/out/draft"; exit 1
fi
python3 - "$dir/out/calibration.json" <<'PY' || exit 1
import json, sys
c = json.load(open(sys.argv[1]))
assert c["recipe"] == "draft", c
acc, chain = c["acceptance_by_depth"], c["chain_tokens_per_step"]
assert len(acc) == 8 and len(chain) == 8, c
assert 0 <= c["agreement"] <= 1 and abs(acc[0] - c["agreement"]) < 1e-3, c
p, t = 1.0, 1.0
for a, ct in zip(acc, chain):
    p *= a; t += p
    assert abs(ct - t) < 1e-3, (ct, t)
assert c["draft"]["n_layers"] == 1 and c["draft"]["dim"] == 32 and c["positions"] > 0, c
print("calibration ok: agreement %.3f, chains of 1..8: %s" % (c["agreement"], " ".join("%.2f" % x for x in chain)))
PY
[ -f "$dir/out/draft/calibration.json" ] || { echo "FAIL: no calibration.json beside the draft"; exit 1; }
for tokens in 3 auto; do
  out=$("$run" --model "$stories/stories260K.bin" --tokenizer "$stories/tok512.bin" --heads random:4 \
        --draft-model "$dir/out/draft/model.bin" --draft-alone --draft-tokens $tokens --mode both \
        --prompt "Once upon a time" --max-new-tokens 64 --threads 1 --json 2>"$dir/run.err")
  rc=$?
  printf '%s\n' "$out" | python3 -c '
import json, sys
rows = [json.loads(l) for l in sys.stdin if l.startswith("{")]
plain = [r for r in rows if r["mode"] == "vanilla"]
med = [r for r in rows if r["mode"] == "medusa"]
assert len(plain) == 1 and len(med) == 1, rows
assert med[0]["tokens"] == plain[0]["tokens"] and len(plain[0]["tokens"]) > 0, "tokens differ"
d = med[0]["tree"]["drafts"]
assert d["draft_tokens_run"] > 0, "the draft did not run"
auto = d.get("draft_tokens_auto")
if sys.argv[1] == "auto":
    assert auto and 1 <= auto["chosen"] <= 8 and d["draft_tokens"] == auto["chosen"], d
    assert len(auto["predicted_speedups"]) == 8 and len(auto["target_step_seconds"]) == 9, auto
print("decode ok (--draft-tokens %s, chains of %d): %d tokens identical to plain, %.2f per step"
      % (sys.argv[1], d["draft_tokens"], len(med[0]["tokens"]), med[0]["mean_accepted"]))
' "$tokens" || { echo "FAIL: medusa-run exit $rc"; cat "$dir/run.err"; exit 1; }
done
