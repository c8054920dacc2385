#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# medusa-run with a draft model: the target's first layers (--self-draft-layers) alone, beside the
# heads' tree and with a prompt lookup, its trees (--draft-nodes), and the target itself as
# --draft-model (every chain accepted, or a tree's greedy path when the tree holds the whole
# expansion: 4 tokens a step), one request and three prompts two at a time (--prompts-file --batch);
# every request's Medusa tokens equal plain greedy decoding, and the draft ran. Then --policy
# speculative (chains, or trees with --draft-nodes, sampled from the draft's distribution): at T = 0
# it is greedy decoding, at T = 0.8 it samples every token asked for, with the target itself as
# draft accepting its first draws.
# MEDUSA_TOOL_TEST_NEW_TOKENS caps the new tokens per request (defaults 48, 40 and 32 by section;
# the sanitizer runs use fewer).
# Usage: medusa_run_draft.sh TOOL SHARED_DIR SCRATCH_DIR
set -u
capped() { local cap=${MEDUSA_TOOL_TEST_NEW_TOKENS:-$1}; if [ "$cap" -lt "$1" ]; then echo "$cap"; else echo "$1"; fi; }
n_one=$(capped 48) n_sampled=$(capped 40) n_batch=$(capped 32)
tool=$1 shared=$2 scratch=$3
pycode="$shared/models/pycode-15m/model.bin"
if [ ! -f "$pycode" ]; then echo "shared models not found: skipped"; exit 77; fi
status=0
for extra in "--self-draft-layers 4 --draft-alone" "--self-draft-layers 4 --tree mc_sim_7b_63" \
             "--self-draft-layers 4 --draft-alone --lookup 6" "--draft-model $pycode --draft-alone" \
             "--self-draft-layers 4 --draft-alone --draft-nodes 10 --lookup 6" "--draft-model $pycode --draft-alone --draft-nodes 14 --draft-topk 2"; do
  min_per_step=1
  case $extra in --draft-model*) min_per_step=3.5 ;; esac
  # shellcheck disable=SC2086  # $extra holds several words
  out=$("$tool" --model "$pycode" --heads random:4 --draft-tokens 3 $extra --mode both \
        --prompt $'import os\nimport sys\n\n\ndef main():\n' --max-new-tokens "$n_one" --threads 1 --json 2>/dev/null)
  rc=$?
  verdict=$(printf '%s\n' "$out" | MIN_PER_STEP=$min_per_step NEW=$n_one python3 -c '
import json, os, sys
rows = [json.loads(l) for l in sys.stdin if l.startswith("{")]
plain = [r for r in rows if r["mode"] == "vanilla"]
med = [r for r in rows if r["mode"] == "medusa"]
if len(plain) != 1 or len(med) != 1: print("missing runs"); sys.exit(1)
d = med[0]["tree"]["drafts"]
ok = (med[0]["tokens"] == plain[0]["tokens"] and len(plain[0]["tokens"]) == int(os.environ["NEW"]) and d["draft_tokens_run"] > 0
      and med[0]["mean_accepted"] >= float(os.environ["MIN_PER_STEP"]))
print("%s: %d tokens, %.2f per step, the draft ran %d tokens" % ("ok" if ok else "FAIL (tokens differ, too few, or too few per step)", len(med[0]["tokens"]), med[0]["mean_accepted"], d["draft_tokens_run"]))
sys.exit(0 if ok else 1)')
  vrc=$?
  echo "[$extra] exit $rc: $verdict"
  if [ "$rc" -ne 0 ] || [ "$vrc" -ne 0 ]; then status=1; fi
done

# Speculative sampling with the draft's own distribution: chains, and trees of sampled tokens
# (every node's first draw is accepted when the target is its own draft; the lookup's nodes too).
for sampled in "" "--draft-nodes 6 --draft-topk 2 --lookup 4"; do
for temp in 0 0.8; do
  min_per_step=3.5
  [ -n "$sampled" ] && min_per_step=2
  # shellcheck disable=SC2086  # $sampled holds several words
  out=$("$tool" --model "$pycode" --heads random:4 --draft-model "$pycode" --draft-alone --draft-tokens 3 --policy speculative \
        $sampled --temperature $temp --mode both --prompt $'import os\n' --max-new-tokens "$n_sampled" --threads 1 --json 2>/dev/null)
  rc=$?
  verdict=$(printf '%s\n' "$out" | TEMP=$temp MIN_PER_STEP=$min_per_step NEW=$n_sampled python3 -c '
import json, os, sys
rows = [json.loads(l) for l in sys.stdin if l.startswith("{")]
plain = [r for r in rows if r["mode"] == "vanilla"]
med = [r for r in rows if r["mode"] == "medusa"]
if len(plain) != 1 or len(med) != 1: print("missing runs"); sys.exit(1)
d = med[0]["tree"]["drafts"]
greedy = float(os.environ["TEMP"]) == 0
ok = (len(med[0]["tokens"]) == int(os.environ["NEW"]) and d.get("sampled") is True and d["draft_tokens_run"] > 0
      and (med[0]["tokens"] == plain[0]["tokens"] if greedy else True)
      and med[0]["mean_accepted"] >= float(os.environ["MIN_PER_STEP"]))
print("%s: %d tokens, %.2f per step" % ("ok" if ok else "FAIL", len(med[0]["tokens"]), med[0]["mean_accepted"]))
sys.exit(0 if ok else 1)')
  vrc=$?
  echo "[--policy speculative $sampled --temperature $temp, the target as draft] exit $rc: $verdict"
  if [ "$rc" -ne 0 ] || [ "$vrc" -ne 0 ]; then status=1; fi
done
done

# The serving engine: each request its own draft cache, requests joining as others finish.
mkdir -p "$scratch"
printf '%s\n' 'import os\nimport sys\n' 'class Stack:\n    def __init__(self):\n' 'def parse_args(argv):\n' \
  > "$scratch/draft_prompts.txt"
for extra in "--self-draft-layers 4 --draft-alone" "--draft-model $pycode --draft-alone" \
             "--draft-model $pycode --draft-alone --draft-nodes 8 --draft-topk 2"; do
  # shellcheck disable=SC2086  # $extra holds several words
  summary=$("$tool" --model "$pycode" --heads random:4 --draft-tokens 3 $extra --prompts-file "$scratch/draft_prompts.txt" \
            --batch 2 --mode both --max-new-tokens "$n_batch" --threads 1 --json 2>/dev/null | tail -n 1)
  rc=$?
  echo "[batch $extra] exit $rc: $summary"
  if ! printf '%s' "$summary" | python3 -c '
import json, sys
s = json.load(sys.stdin)
assert s["requests"] == 3 and s["identical"] is True, s
assert s["vanilla"]["tokens"] == s["medusa"]["tokens"] > 0, s
assert s["tree"]["drafts"]["draft_tokens_run"] > 0, s
'; then status=1; fi
done
# Sampled chains and trees on the serving engine: every request gets all its tokens.
for sampled in "" "--draft-nodes 6 --draft-topk 2"; do
  # shellcheck disable=SC2086  # $sampled holds several words
  summary=$("$tool" --model "$pycode" --heads random:4 --draft-model "$pycode" --draft-alone --draft-tokens 3 --policy speculative \
            $sampled --temperature 0.8 --prompts-file "$scratch/draft_prompts.txt" --batch 2 --mode both --max-new-tokens "$n_batch" \
            --threads 1 --json 2>/dev/null | tail -n 1)
  echo "[batch --policy speculative $sampled] $summary"
  if ! printf '%s' "$summary" | NEW=$n_batch python3 -c '
import json, os, sys
s = json.load(sys.stdin)
assert s["requests"] == 3 and s["vanilla"]["tokens"] == s["medusa"]["tokens"] == 3 * int(os.environ["NEW"]), s
assert s["tree"]["drafts"]["draft_tokens_run"] > 0, s
'; then status=1; fi
done
exit $status
