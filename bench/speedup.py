#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""End-to-end speedup of Medusa over plain decoding with medusa-run (greedy, identical tokens).

For each weight format and tree, runs `medusa-run --mode both --json` on each prompt REPEAT times
and reports medians: plain and Medusa tokens/s, the ratio measured within each run, tokens per
step, and whether the tokens were identical in every run.

  bench/speedup.py --bin build/release/examples --model ../shared/models/pycode-15m/model.bin \
      --heads build/heads/pycode-15m --trees mc_sim_7b_63,build/heads/pycode-15m/tree-8.json

A Medusa-2 model (a fine-tuned backbone) is compared with the model it came from as well:
--plain-model ORIGINAL runs plain decoding of ORIGINAL right after each `--mode both` run and
adds the speedup over it, and how many prompts the two models continue identically.
--prompts-file takes the prompts from a file (one per line, \\n escapes; medusa-train writes
held-out ones to OUT/heldout-prompts.txt). --extra passes more medusa-run options to the Medusa
side, for example a draft model:

  bench/speedup.py ... --extra "--draft-model d2/draft/model.bin --draft-alone --draft-tokens 4"
"""
import argparse
import json
import shlex
import statistics
import subprocess
import sys

DEFAULT_PROMPTS = [
    "import os\nimport sys\n\n\ndef main():\n",
    "class Stack:\n    def __init__(self):\n",
    "def parse_args(argv):\n    \"\"\"Parse the command line.\"\"\"\n",
    "import re\n\n_pattern = re.compile(",
    "    def __repr__(self):\n        return",
]


def unescape(line: str) -> str:
    """A prompt-file line with its \\n, \\t and \\\\ escapes undone."""
    out, i = [], 0
    while i < len(line):
        if line[i] == "\\" and i + 1 < len(line):
            out.append({"n": "\n", "t": "\t", "\\": "\\"}.get(line[i + 1], line[i + 1]))
            i += 2
        else:
            out.append(line[i])
            i += 1
    return "".join(out)


def read_prompts(path: str) -> list:
    """The prompts of a prompt file: one per non-blank line, escapes undone."""
    with open(path, encoding="utf-8") as f:
        return [unescape(l.rstrip("\n")) for l in f if l.strip()]


def tree_nodes(bin_dir: str, tree: str) -> int:
    """Node count of a preset, tree text or file, as medusa-tree reads it."""
    import pathlib
    if pathlib.Path(tree).is_file():
        args = ["--choices-file", tree]
    elif tree.lstrip().startswith("["):
        args = ["--choices", tree]
    else:
        args = ["--preset", tree]
    out = subprocess.run([f"{bin_dir}/medusa-tree", *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)["num_nodes"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", required=True, help="folder with medusa-run")
    ap.add_argument("--model", required=True)
    ap.add_argument("--heads", required=True)
    ap.add_argument("--trees", required=True, help="comma-separated presets, tree texts or files")
    ap.add_argument("--weights", default="f32,bf16")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--head-weights", default="", help="medusa-run --head-weights (default: its own)")
    ap.add_argument("--per-prompt", action="store_true", help="also print each prompt's medians")
    ap.add_argument("--prompts-file", default="", help="prompts, one per line (\\n, \\t, \\\\ escapes)")
    ap.add_argument("--extra", default="", help="more medusa-run options (a draft model, a lookup, ...)")
    ap.add_argument("--plain-model", default="", help="also time plain decoding of this model (the original of a Medusa-2 model)")
    a = ap.parse_args()
    prompts = read_prompts(a.prompts_file) if a.prompts_file else DEFAULT_PROMPTS

    print(f"{'weights':7} {'tree':28} {'nodes':>5} {'plain tok/s':>11} {'medusa tok/s':>12} "
          f"{'speedup':>7} {'tok/step':>8} identical"
          + (f" {'orig tok/s':>10} {'vs orig':>7} same-as-orig" if a.plain_model else ""))
    for weights in a.weights.split(","):
        for tree in a.trees.split(","):
            ratios, plain, medusa, per_step, same = [], [], [], [], True
            orig, orig_ratios, orig_same = [], [], 0
            by_prompt = {p: ([], []) for p in prompts}  # ratios, tokens per step
            for _ in range(a.repeat):
                for prompt in prompts:
                    out = subprocess.run(
                        [f"{a.bin}/medusa-run", "--model", a.model, "--heads", a.heads, "--tree", tree,
                         "--weights", weights, "--threads", str(a.threads), "--prompt", prompt,
                         "--max-new-tokens", str(a.tokens), "--mode", "both", "--json",
                         *(["--head-weights", a.head_weights] if a.head_weights else []), *shlex.split(a.extra)],
                        capture_output=True, text=True)
                    if out.returncode != 0:
                        print(out.stderr, file=sys.stderr)
                        return 1
                    v, m = (json.loads(line) for line in out.stdout.splitlines()[:2])
                    same &= v["tokens"] == m["tokens"]
                    plain.append(v["tokens_per_second"])
                    medusa.append(m["tokens_per_second"])
                    ratios.append(m["tokens_per_second"] / v["tokens_per_second"])
                    per_step.append(m["mean_accepted"])
                    by_prompt[prompt][0].append(ratios[-1])
                    by_prompt[prompt][1].append(per_step[-1])
                    if a.plain_model:
                        po = subprocess.run(
                            [f"{a.bin}/medusa-run", "--model", a.plain_model, "--weights", weights, "--threads", str(a.threads),
                             "--prompt", prompt, "--max-new-tokens", str(a.tokens), "--mode", "vanilla", "--json"],
                            capture_output=True, text=True)
                        if po.returncode != 0:
                            print(po.stderr, file=sys.stderr)
                            return 1
                        o = json.loads(po.stdout.splitlines()[0])
                        orig.append(o["tokens_per_second"])
                        orig_ratios.append(m["tokens_per_second"] / o["tokens_per_second"])
                        orig_same += o["tokens"] == v["tokens"]
            nodes = str(tree_nodes(a.bin, tree))
            name = tree if len(tree) <= 28 else "…" + tree[-27:]
            print(f"{weights:7} {name:28} {nodes:>5} {statistics.median(plain):11.1f} {statistics.median(medusa):12.1f} "
                  f"{statistics.median(ratios):6.2f}x {statistics.median(per_step):8.2f} {'yes' if same else 'NO':9}"
                  + (f" {statistics.median(orig):10.1f} {statistics.median(orig_ratios):6.2f}x {orig_same}/{len(orig)}"
                     if a.plain_model else ""),
                  flush=True)
            if a.per_prompt:
                for prompt, (r, t) in by_prompt.items():
                    print(f"    {repr(prompt)[:40]:40} speedup {statistics.median(r):5.2f}x  tok/step {statistics.median(t):5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
