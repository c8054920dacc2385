#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# medusa-run --eagle with a feature drafter medusa-train --recipe eagle wrote for stories260K: its
# chains alone (fixed length and auto, f32 and bf16 weights, on the target's threads and on a thread
# of its own), its trees (--draft-nodes, with a lookup too), with a prompt lookup, beside the heads'
# tree, and for a batch of requests (chains and trees), every
# request's tokens equal to plain greedy decoding and the drafter ran;
# --policy speculative samples its chains (every token asked for, at T = 0 the greedy tokens); a
# drafter for another width and speculative sampling beside a lookup are refused with errors that
# say why.
# Usage: medusa_run_eagle.sh TRAIN_TOOL RUN_TOOL SHARED_DIR SCRATCH_DIR
set -u
train=$1 run=$2 shared=$3 scratch=$4
stories="$shared/models/stories260K"
if [ ! -f "$stories/stories260K.bin" ]; then echo "shared models not found: skipped"; exit 77; fi
dir="$scratch/run-eagle"
rm -rf "$dir" && mkdir -p "$dir"
for i in $(seq 1 40); do echo "Once upon a time there was a little dog number $i. It liked to play"; done > "$dir/prompts.txt"
if ! "$train" --model "$stories/stories260K.bin" --tokenizer "$stories/tok512.bin" --prompts "$dir/prompts.txt" --tokens 3000 \
     --gen-len 48 --prompt-min 4 --prompt-max 12 --threads 1 --no-progress --recipe eagle --eagle-hidden-dim 96 \
     --eagle-epochs 20 --out "$dir/out" > "$dir/train.log" 2>&1; then
  echo "FAIL: training"; cat "$dir/train.log"; exit 1
fi
eagle="$dir/out/eagle"
common=(--model "$stories/stories260K.bin" --tokenizer "$stories/tok512.bin" --heads random:4 --eagle "$eagle" --mode both
        --max-new-tokens 64 --threads 1 --json)

check_single() {  # $1: a name; stdin: medusa-run's JSON lines
  python3 -c '
import json, sys
rows = [json.loads(l) for l in sys.stdin if l.startswith("{")]
plain = [r for r in rows if r["mode"] == "vanilla"]
med = [r for r in rows if r["mode"] == "medusa"]
assert len(plain) == 1 and len(med) == 1, rows
assert med[0]["tokens"] == plain[0]["tokens"] and len(plain[0]["tokens"]) > 0, "tokens differ"
d = med[0]["tree"]["drafts"]
assert d["eagle"] and d["draft_tokens_run"] > 0 and d["draft_passes"] > 0 and 0 < d["draft_share"] < 1, d
if "--draft-nodes" in sys.argv[1]:
    assert d["draft_tree"]["nodes"] > 0 and d["draft_passes"] > 0, d
if "auto" in sys.argv[1]:
    a = d["draft_tokens_auto"]
    assert 1 <= a["chosen"] <= 8 and d["draft_tokens"] == a["chosen"] and a["draft_pass_seconds"] > 0, a
print("%s: %d tokens identical to plain, %.2f per step, the drafter ran %d rows in %d passes"
      % (sys.argv[1], len(med[0]["tokens"]), med[0]["mean_accepted"], d["draft_tokens_run"], d["draft_passes"]))
' "$1"
}

fail=0
for extra in "--draft-alone --draft-tokens 3" "--draft-alone --draft-tokens auto" "--draft-alone --draft-tokens 4 --lookup 6" \
             "--draft-tokens 3 --tree mc_sim_7b_63" "--draft-alone --draft-tokens 3 --draft-weights bf16" \
             "--draft-alone --draft-tokens 3 --draft-threads 1" "--draft-alone --draft-tokens 4 --draft-nodes 10 --draft-topk 3" \
             "--draft-alone --draft-tokens 5 --draft-nodes 8 --draft-topk 2 --draft-expand 1 --lookup 6"; do
  out=$("$run" "${common[@]}" $extra --prompt "Once upon a time" 2>"$dir/run.err")
  rc=$?
  if ! printf '%s\n' "$out" | check_single "$extra"; then echo "FAIL [$extra]: exit $rc"; cat "$dir/run.err"; fail=1; fi
done

# A batch: each request its own drafter cache, requests joining as others finish.
printf 'Once upon a time\nThe little cat\nTom and Lily went\nOne day a bird\nThe sun was\n' > "$dir/batch_prompts.txt"
for extra in "--draft-threads 1" "--draft-nodes 8"; do
out=$("$run" "${common[@]}" --draft-alone --draft-tokens 3 $extra --prompts-file "$dir/batch_prompts.txt" --batch 2 \
      2>"$dir/run.err")
rc=$?
if ! printf '%s\n' "$out" | python3 -c '
import json, sys
rows = [json.loads(l) for l in sys.stdin if l.startswith("{")]
s = [r for r in rows if "requests" in r]
assert len(s) == 1 and s[0]["requests"] == 5, rows
s = s[0]
assert s["identical"] is True and s["vanilla"]["tokens"] == s["medusa"]["tokens"] > 0, s
d = s["tree"]["drafts"]
assert d["eagle"] and d["draft_tokens_run"] > 0, d
print("batch of 2 over 5 requests: tokens identical to plain, the drafter ran %d rows" % d["draft_tokens_run"])
'; then echo "FAIL [batch $extra]: exit $rc"; cat "$dir/run.err"; fail=1; fi
done

# Speculative sampling from the drafter's own distribution: T = 0 is greedy decoding, T = 0.8 gives
# every token asked for.
for temp in 0 0.8; do
  out=$("$run" "${common[@]}" --draft-alone --draft-tokens 3 --policy speculative --temperature $temp --seed 3 \
        --prompt "Once upon a time" 2>"$dir/run.err")
  rc=$?
  if ! printf '%s\n' "$out" | python3 -c '
import json, sys
rows = [json.loads(l) for l in sys.stdin if l.startswith("{")]
plain = [r for r in rows if r["mode"] == "vanilla"][0]
med = [r for r in rows if r["mode"] == "medusa"][0]
d = med["tree"]["drafts"]
assert len(med["tokens"]) == 64 and d.get("sampled") is True and d["draft_tokens_run"] > 0, (med, d)
if float(sys.argv[1]) == 0: assert med["tokens"] == plain["tokens"], "T = 0 differs from greedy"
print("--policy speculative --temperature %s: %d tokens, %.2f per step" % (sys.argv[1], len(med["tokens"]), med["mean_accepted"]))
' "$temp"; then echo "FAIL [speculative T=$temp]: exit $rc"; cat "$dir/run.err"; fail=1; fi
done

# Refusals: a drafter for another target width, and speculative sampling beside a lookup.
tiny="$shared/models/tinystories-656K"
"$run" --model "$tiny" --heads random:4 --eagle "$eagle" --draft-alone --prompt "Once" --max-new-tokens 8 --threads 1 \
  > /dev/null 2>"$dir/err1.txt"
rc=$?
if [ $rc -eq 0 ] || ! grep -q "feature drafter has width" "$dir/err1.txt"; then
  echo "FAIL: a drafter of another width: exit $rc"; cat "$dir/err1.txt"; fail=1
else echo "another width refused: $(head -c 200 "$dir/err1.txt")"; fi
"$run" "${common[@]}" --draft-alone --policy speculative --lookup 4 --prompt "Once" > /dev/null 2>"$dir/err2.txt"
rc=$?
if [ $rc -eq 0 ] || ! grep -q "policy speculative" "$dir/err2.txt"; then
  echo "FAIL: --policy speculative with --eagle and --lookup: exit $rc"; cat "$dir/err2.txt"; fail=1
else echo "--policy speculative refused: $(head -c 200 "$dir/err2.txt")"; fi
exit $fail
