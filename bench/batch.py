#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Aggregate throughput of plain and Medusa decoding at several batch sizes (continuous batching).

Builds a prompt file from the first LINES lines of NUM Python files of a directory (held out from
the heads' training data), then for each batch size and tree runs
`medusa-run --prompts-file F --batch B --mode both --json` REPEAT times and reports medians:
aggregate plain and Medusa tokens/s, their ratio measured within each run, tokens per step, and
whether every request's Medusa tokens equalled its plain tokens in every run.

  bench/batch.py --bin build/release/examples --model ../shared/models/pycode-15m/model.bin \\
      --heads build/heads/pycode-15m --trees build/heads/pycode-15m/tree-6.json --batches 1,2,4,8
"""
import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile


def escape(text: str) -> str:
    """One prompt per line: the escapes medusa-run's --prompts-file decodes."""
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t")


def prompts_from(directory: str, count: int, lines: int) -> list:
    out = []
    for path in sorted(pathlib.Path(directory).rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        head = text.splitlines()[:lines]
        if len(head) < lines or sum(len(x.strip()) > 0 for x in head) < lines // 2:
            continue  # too short, or mostly blank
        out.append("\n".join(head) + "\n")
        if len(out) == count:
            break
    if len(out) < count:
        sys.exit(f"only {len(out)} usable files under {directory}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", required=True, help="folder with medusa-run")
    ap.add_argument("--model", required=True)
    ap.add_argument("--heads", required=True)
    ap.add_argument("--trees", required=True, help="comma-separated presets, tree texts or files")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--prompt-dir", default="/usr/lib/python3/dist-packages")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--lines", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--weights", default="f32")
    a = ap.parse_args()

    prompts = prompts_from(a.prompt_dir, a.num_prompts, a.lines)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("".join(escape(p) + "\n" for p in prompts))
        prompt_file = f.name
    print(f"{len(prompts)} prompts (first {a.lines} lines of files under {a.prompt_dir}), "
          f"{a.tokens} new tokens each, weights {a.weights}")
    print(f"{'batch':>5} {'tree':34} {'plain tok/s':>11} {'medusa tok/s':>12} {'speedup':>7} "
          f"{'tok/step':>8} identical")
    for batch in [int(b) for b in a.batches.split(",")]:
        for tree in a.trees.split(","):
            plain, medusa, ratios, per_step, same = [], [], [], [], True
            for _ in range(a.repeat):
                cmd = [f"{a.bin}/medusa-run", "--model", a.model, "--heads", a.heads, "--tree", tree,
                       "--prompts-file", prompt_file, "--batch", str(batch), "--mode", "both", "--json",
                       "--max-new-tokens", str(a.tokens), "--threads", str(a.threads), "--weights", a.weights]
                out = subprocess.run(cmd, capture_output=True, text=True)
                if out.returncode != 0:
                    sys.exit(f"{' '.join(cmd)}\n{out.stderr}")
                summary = json.loads(out.stdout.strip().splitlines()[-1])
                plain.append(summary["vanilla"]["tokens_per_second"])
                medusa.append(summary["medusa"]["tokens_per_second"])
                ratios.append(summary["speedup"])
                per_step.append(summary["medusa"]["mean_accepted"])
                same = same and summary["identical"]
            name = tree if len(tree) <= 34 else "…" + tree[-33:]
            print(f"{batch:5d} {name:34} {statistics.median(plain):11.0f} {statistics.median(medusa):12.0f} "
                  f"{statistics.median(ratios):6.2f}x {statistics.median(per_step):8.2f} {'yes' if same else 'NO'}",
                  flush=True)
    pathlib.Path(prompt_file).unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
