#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# medusa-run with a draft model: the target's first layers (--self-draft-layers) alone, beside the
# heads' tree and with a prompt lookup, and the target itself as --draft-model (every chain
# accepted: 4 tokens a step); every run's Medusa tokens equal plain greedy decoding, and the draft
# ran. Usage: medusa_run_draft.sh TOOL SHARED_DIR
set -u
tool=$1 shared=$2
pycode="$shared/models/pycode-15m/model.bin"
if [ ! -f "$pycode" ]; then echo "shared models not found: skipped"; exit 77; fi
status=0
for extra in "--self-draft-layers 4 --draft-alone" "--self-draft-layers 4 --tree mc_sim_7b_63" \
             "--self-draft-layers 4 --draft-alone --lookup 6" "--draft-model $pycode --draft-alone"; do
  min_per_step=1
  case $extra in --draft-model*) min_per_step=3.5 ;; esac
  # shellcheck disable=SC2086  # $extra holds several words
  out=$("$tool" --model "$pycode" --heads random:4 --draft-tokens 3 $extra --mode both \
        --prompt $'import os\nimport sys\n\n\ndef main():\n' --max-new-tokens 48 --threads 1 --json 2>/dev/null)
  rc=$?
  verdict=$(printf '%s\n' "$out" | MIN_PER_STEP=$min_per_step python3 -c '
import json, os, sys
rows = [json.loads(l) for l in sys.stdin if l.startswith("{")]
plain = [r for r in rows if r["mode"] == "vanilla"]
med = [r for r in rows if r["mode"] == "medusa"]
if len(plain) != 1 or len(med) != 1: print("missing runs"); sys.exit(1)
d = med[0]["tree"]["drafts"]
ok = (med[0]["tokens"] == plain[0]["tokens"] and len(plain[0]["tokens"]) == 48 and d["draft_tokens_run"] > 0
      and med[0]["mean_accepted"] >= float(os.environ["MIN_PER_STEP"]))
print("%s: %d tokens, %.2f per step, the draft ran %d tokens" % ("ok" if ok else "FAIL (tokens differ, too few, or too few per step)", len(med[0]["tokens"]), med[0]["mean_accepted"], d["draft_tokens_run"]))
sys.exit(0 if ok else 1)')
  vrc=$?
  echo "[$extra] exit $rc: $verdict"
  if [ "$rc" -ne 0 ] || [ "$vrc" -ne 0 ]; then status=1; fi
done
exit $status
