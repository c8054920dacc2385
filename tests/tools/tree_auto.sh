#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# `medusa-run --tree auto` and `medusa-tree optimize`: with a calibration the run measures a
# step-cost curve, caches it, picks a tree, reports it in --json, and stays lossless; a second run
# reads the cache; `medusa-tree optimize` on the same curve picks the same tree; random heads
# without a calibration get a small chain; bad calibration and cost files exit 2 with one line.
# MEDUSA_TOOL_TEST_NEW_TOKENS caps the new tokens of the decoding runs (defaults 48 and 64; the
# sanitizer runs use 16).
# Usage: tree_auto.sh MEDUSA_RUN MEDUSA_TREE SHARED_DIR SCRATCH_DIR
set -u
capped() { local cap=${MEDUSA_TOOL_TEST_NEW_TOKENS:-$1}; if [ "$cap" -lt "$1" ]; then echo "$cap"; else echo "$1"; fi; }
run=$1 tree=$2 shared=$3 scratch=$4
pycode="$shared/models/pycode-15m/model.bin"
if [ ! -f "$pycode" ]; then echo "shared models not found: skipped"; exit 77; fi
rm -rf "$scratch/tree-auto"; mkdir -p "$scratch/tree-auto"; d="$scratch/tree-auto"
fail() { echo "FAIL: $*"; exit 1; }
# Heads right together: the chain [0],[0,0],[0,0,0] is right half the time, rank 1 rarely.
cat > "$d/calibration.json" <<'JSON'
{"format": "medusa-calibration", "version": 2, "num_heads": 4, "topk": 10, "accuracy": [[0.6, 0.1], [0.5, 0.1], [0.5, 0.1], [0.4, 0.1]],
 "path_positions": 1000, "path_counts": [[[0], 600], [[1], 100], [[0, 0], 550], [[0, 0, 0], 500], [[0, 0, 0, 0], 450], [[1, 0], 20]]}
JSON
common=(--model "$pycode" --heads random:4 --calibration "$d/calibration.json" --cost-cache "$d/cache" --max-new-tokens "$(capped 48)"
        --prompt 'def main():' --json)

out=$("$run" "${common[@]}" --mode both --step-cost-out "$d/curve.json" 2>"$d/err1") || { cat "$d/err1"; fail "first run"; }
med=$(printf '%s\n' "$out" | grep '"mode":"medusa"')
van=$(printf '%s\n' "$out" | grep '"mode":"vanilla"')
echo "$med" | python3 -c '
import json, sys
m = json.loads(sys.stdin.read()); t = m["tree"]
assert t["spec"] == "auto" and t["calibration_kind"] == "path-conditional", t
assert t["step_cost"]["source"] == "measured", t
assert t["predicted_speedup"] > 0 and t["nodes"] == len(t["paths"]) + 1, t
assert [0] in t["paths"], t
print("auto tree:", t["paths"], "predicted", round(t["predicted_speedup"], 2))' || fail "tree report"
# Peak RSS on every line, in bytes (the packed f32 weights alone are ~57 MB), never falling.
python3 -c '
import json, sys
v, m = json.loads(sys.argv[1]), json.loads(sys.argv[2])
assert 16 << 20 < v["peak_rss_bytes"] <= m["peak_rss_bytes"], (v["peak_rss_bytes"], m["peak_rss_bytes"])' "$van" "$med" || fail "peak_rss_bytes"
[ "$(echo "$med" | python3 -c 'import json,sys; print(json.loads(sys.stdin.read())["tokens"])')" = \
  "$(echo "$van" | python3 -c 'import json,sys; print(json.loads(sys.stdin.read())["tokens"])')" ] || fail "greedy tokens differ"
grep -q 'tree auto:' "$d/err1" || fail "no 'tree auto:' line on stderr"
ls "$d"/cache/step-cost-*.json >/dev/null 2>&1 || fail "no cache file"

out2=$("$run" "${common[@]}" 2>/dev/null) || fail "second run"
echo "$out2" | python3 -c '
import json, sys
t = json.loads(sys.stdin.read())["tree"]
assert t["step_cost"]["source"] == "cached", t
print("second run: cached")' || fail "cache not used"

opt=$("$tree" optimize --calibration "$d/calibration.json" --cost "$d/curve.json" --max-nodes 64 --max-depth 4 --format json) || fail "optimize"
python3 - "$opt" "$med" <<'PY' || fail "optimize disagrees with medusa-run"
import json, sys
o, m = json.loads(sys.argv[1]), json.loads(sys.argv[2])["tree"]
assert o["paths"] == m["paths"], (o["paths"], m["paths"])
assert abs(o["predicted_speedup"] - m["predicted_speedup"]) < 1e-6
PY

chain=$("$run" --model "$pycode" --heads random:4 --max-new-tokens 8 --prompt x --json --cost-cache none 2>&1 >/dev/null | wc -l)
out3=$("$run" --model "$pycode" --heads random:4 --max-new-tokens 8 --prompt x --json --cost-cache none 2>/dev/null) || fail "random heads"
echo "$out3" | python3 -c '
import json, sys
t = json.loads(sys.stdin.read())["tree"]
assert t["paths"] == [[0], [0, 0], [0, 0, 0]] and "reason" in t, t' || fail "random heads: no small chain"
[ "$chain" -eq 0 ] || fail "random heads: unexpected stderr"

# Hybrid and dynamic drafts, one request and a batch: identical to plain decoding.
printf 'def main():\\n    x = 1\\n    x = 1\\n\nclass A:\\n    pass\\n\nimport os\\nimport os\\n\n' > "$d/prompts.txt"
for extra in "--lookup 6" "--lookup 6 --dynamic --lookup-ngram 1:3" "--dynamic"; do
  one=$("$run" --model "$pycode" --heads random:4 --tree '[[0],[0,0],[1]]' $extra --max-new-tokens "$(capped 64)" --prompt 'x = 1
x = 1
' --mode both --json 2>/dev/null) || fail "$extra: single run"
  python3 -c '
import json, sys
v, m = [json.loads(l) for l in sys.stdin.read().splitlines()[:2]]
assert v["tokens"] == m["tokens"], "tokens differ"
assert m["tree"]["drafts"]["lookup_tokens"] >= 0' <<< "$one" || fail "$extra: not lossless"
  sum=$("$run" --model "$pycode" --heads random:4 --tree '[[0],[0,0],[1]]' $extra --max-new-tokens "$(capped 48)" --prompts-file "$d/prompts.txt" \
        --batch 2 --mode both --json 2>/dev/null | tail -1) || fail "$extra: batch run"
  python3 -c 'import json, sys; s = json.loads(sys.stdin.read()); assert s["identical"], s' <<< "$sum" || fail "$extra: batch not lossless"
  echo "drafts $extra: lossless"
done
# Calibration from real decoding, usable by the tree search.
"$run" --model "$pycode" --heads random:4 --mode vanilla --prompts-file "$d/prompts.txt" --max-new-tokens "$(capped 48)" \
  --calibrate-out "$d/counted.json" >/dev/null 2>&1 || fail "--calibrate-out"
"$tree" optimize --calibration "$d/counted.json" --cost "$d/curve.json" --format json >/dev/null || fail "counted calibration unusable"

expect_error() {  # status pattern command...
  local want=$1 pat=$2; shift 2
  local err; err=$("$@" 2>&1 >/dev/null); local rc=$?
  echo "exit $rc: $err"
  [ "$rc" -eq "$want" ] || fail "expected exit $want"
  [ "$(printf '%s\n' "$err" | wc -l)" -eq 1 ] || fail "expected one line on stderr"
  printf '%s' "$err" | grep -Eq -- "$pat" || fail "stderr does not match /$pat/"
}
printf '{"format": "medusa-calibration", "version": 2, "num_heads": 2, "topk": 10, "path_positions": 10, "path_counts": [[[0, 0], 3]]}' > "$d/bad-cal.json"
printf '{"format": "medusa-step-cost", "version": 1, "rows": [2], "seconds": [1], "head_seconds": 0, "overhead_seconds": 0}' > "$d/bad-cost.json"
expect_error 2 'prefix \[0\] is not' "$run" --model "$pycode" --heads random:4 --calibration "$d/bad-cal.json" --prompt x
expect_error 2 'must be 1' "$run" --model "$pycode" --heads random:4 --calibration "$d/calibration.json" --step-cost "$d/bad-cost.json" --prompt x
expect_error 2 'none.json: cannot open' "$run" --model "$pycode" --heads random:4 --calibration "$d/none.json" --prompt x
expect_error 2 'max-nodes' "$run" --model "$pycode" --heads random:4 --max-nodes 1 --prompt x
expect_error 2 'prefix \[0\] is not' "$tree" optimize --calibration "$d/bad-cal.json" --cost "$d/curve.json"
expect_error 2 'none.json: cannot open' "$tree" optimize --calibration "$d/calibration.json" --cost "$d/none.json"
expect_error 2 'not a tree' "$tree" --preset mc_sim_7b_63 optimize --calibration "$d/calibration.json" --cost "$d/curve.json"
expect_error 2 '--lookup must be' "$run" --model "$pycode" --heads random:4 --lookup 65 --prompt x
expect_error 2 'takes no --lookup' "$run" --model "$pycode" --heads random:4 --lookup 4 --policy sampled --prompt x
expect_error 2 'calibrate-out needs' "$run" --model "$pycode" --heads random:4 --policy typical --calibrate-out "$d/x.json" --prompt x
expect_error 2 'lookup-ngram' "$run" --model "$pycode" --heads random:4 --lookup 4 --lookup-ngram 3:1 --prompt x
echo "ok"
