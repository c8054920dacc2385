#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# medusa-run --prompts-file --batch on the shared code model: 7 prompts of different lengths, 3 at
# a time (requests join as others finish), plain and Medusa decoding; every request's Medusa
# tokens must equal its plain tokens, with random and with a tree deeper than one step; the summary
# reports the peak resident memory.
# Usage: medusa_run_batch.sh TOOL SHARED_DIR SCRATCH_DIR
# MEDUSA_TOOL_TEST_NEW_TOKENS caps the new tokens per request (default 48; the sanitizer runs use
# fewer: the same code paths, in less time).
set -eu
tool=$1 shared=$2 scratch=$3
new_tokens=${MEDUSA_TOOL_TEST_NEW_TOKENS:-48}
pycode="$shared/models/pycode-15m/model.bin"
if [ ! -f "$pycode" ]; then echo "shared models not found: skipped"; exit 77; fi
mkdir -p "$scratch"
cat > "$scratch/batch_prompts.txt" <<'P'
import os\nimport sys\n\n\ndef main():\n
class Stack:\n    def __init__(self):\n
def parse_args(argv):\n    """Parse the command line."""\n
import re\n\n_pattern = re.compile(
    def __repr__(self):\n        return
x = 1
from collections import defaultdict\n\n\ndef count_words(text):\n    counts = defaultdict(int)\n
P
for tree in '[[0],[0,0],[1]]' mc_sim_7b_63; do
  out=$("$tool" --model "$pycode" --heads random:4 --tree "$tree" --prompts-file "$scratch/batch_prompts.txt" \
        --batch 3 --mode both --max-new-tokens "$new_tokens" --threads 2 --json)
  summary=$(printf '%s\n' "$out" | tail -n 1)
  echo "$tree: $summary"
  printf '%s' "$summary" | python3 -c '
import json, sys
s = json.load(sys.stdin)
assert s["requests"] == 7 and s["batch"] == 3, s
assert s["identical"] is True, s
assert s["vanilla"]["tokens"] == s["medusa"]["tokens"] > 0, s
assert s["peak_rss_bytes"] > 16 << 20, s  # bytes: the packed f32 weights alone are ~57 MB
lines = [json.loads(l) for l in sys.argv[1].splitlines()[:-1]]
assert sorted((l["mode"], l["request"]) for l in lines) == sorted((m, i) for m in ("vanilla", "medusa") for i in range(7))
' "$out"
done
