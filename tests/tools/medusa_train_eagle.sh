#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# medusa-train --recipe eagle end to end on stories260K: it writes OUT/eagle/model.bin (a one-block
# llama2.c model with the target's embedding and classifier) and OUT/eagle/fc.bin (W_fc, 2d → d)
# beside the target's tokenizer, and a calibration whose chain figures are consistent.
# Usage: medusa_train_eagle.sh TRAIN_TOOL SHARED_DIR SCRATCH_DIR
set -u
train=$1 shared=$2 scratch=$3
stories="$shared/models/stories260K"
if [ ! -f "$stories/stories260K.bin" ]; then echo "shared models not found: skipped"; exit 77; fi
dir="$scratch/train-eagle"
rm -rf "$dir" && mkdir -p "$dir"
for i in $(seq 1 40); do echo "Once upon a time there was a little dog number $i. It liked to play"; done > "$dir/prompts.txt"
if ! "$train" --model "$stories/stories260K.bin" --tokenizer "$stories/tok512.bin" --prompts "$dir/prompts.txt" --tokens 3000 \
     --gen-len 48 --prompt-min 4 --prompt-max 12 --threads 1 --no-progress --recipe eagle --eagle-hidden-dim 96 --eagle-epochs 20 --eagle-lr 3e-3 \
     --out "$dir/out" > "$dir/train.log" 2>&1; then
  echo "FAIL: training"; cat "$dir/train.log"; exit 1
fi
tail -n 12 "$dir/train.log"
for f in model.bin fc.bin tok512.bin calibration.json; do
  [ -f "$dir/out/eagle/$f" ] || { echo "FAIL: no OUT/eagle/$f"; ls -la "$dir/out" "$dir/out/eagle"; exit 1; }
done
python3 - "$dir/out" "$stories/stories260K.bin" <<'PY' || exit 1
import json, os, struct, sys
out, target = sys.argv[1], sys.argv[2]
c = json.load(open(os.path.join(out, "calibration.json")))
assert c == json.load(open(os.path.join(out, "eagle", "calibration.json"))), "the two calibrations differ"
assert c["recipe"] == "eagle" and c["chain_estimate"] == "autoregressive", c
acc, chain = c["acceptance_by_depth"], c["chain_tokens_per_step"]
assert len(acc) == 8 and len(chain) == 8 and len(c["chain_tokens_per_step_teacher_forced"]) == 8, c
assert 0 <= c["agreement"] <= 1 and abs(acc[0] - c["agreement"]) < 1e-3 and c["positions"] > 0, c
p, t = 1.0, 1.0
for a, ct in zip(acc, chain):
    assert 0 <= a <= 1, acc
    p *= a; t += p
    assert abs(ct - t) < 1e-3, (ct, t)
# The target's header: dim, hidden, layers, heads, kv heads, vocab (< 0: separate classifier), seq_len.
th = struct.unpack("<7i", open(target, "rb").read(28))
d = th[0]
e = c["eagle"]
assert e["n_layers"] == 1 and e["dim"] == d and e["hidden_dim"] == 96 and e["fc"] == [d, 2 * d], e
mh = struct.unpack("<7i", open(os.path.join(out, "eagle", "model.bin"), "rb").read(28))
assert mh == (d, 96, 1, th[3], th[4], th[5], th[6]), (mh, th)
fc = open(os.path.join(out, "eagle", "fc.bin"), "rb").read()
assert fc[:8] == b"MEDUSAFC" and struct.unpack("<3i", fc[8:20]) == (1, 2 * d, d), fc[:20]
assert len(fc) == 20 + 4 * d * 2 * d, len(fc)
w = struct.unpack("<%df" % (d * 2 * d), fc[20:])
assert all(abs(x) < 1e3 for x in w) and any(x != 0 for x in w), "W_fc is not finite or all zero"
print("eagle ok: agreement %.3f, chains of 1..8: %s" % (c["agreement"], " ".join("%.2f" % x for x in chain)))
PY
