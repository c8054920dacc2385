#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Draft-model speculative decoding against llama.cpp's llama-speculative, like with like.

The same target and draft GGUF files, the same prompts, greedy, the same thread count, the two
engines run one after the other on each prompt (so a noisy neighbour slows both alike):

  bench/peer/speculative.py --llama build/peer/llama.cpp --target pycode-15m-F32.gguf \\
      --draft d2/draft/draft-F32.gguf --prompts-file d2/heldout-prompts.txt --draft-tokens 4

Per prompt: `llama-speculative -m TARGET -md DRAFT --temp 0 --draft-max K` (its decode speed, as it
prints it), and `medusa-run --model TARGET --draft-model DRAFT --draft-alone --draft-tokens K
--mode both` (plain and speculative tokens per second, prefill included, and whether the tokens
equal plain greedy decoding). Prints medians over the prompts and of the per-prompt ratios. Make
the draft's GGUF with llama.cpp's own converter:

  llama-convert-llama2c-to-ggml --copy-vocab-from-model tokenizer.bin \\
      --llama2c-model d2/draft/model.bin --llama2c-output-model d2/draft/draft-F32.gguf

That converter records a context of 128; give both files their trained context first
(bench/peer/gguf_set_context.py IN OUT 512), or this engine stops where the file says.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from speedup import read_prompts  # noqa: E402  (bench/speedup.py: the prompt-file format)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama", default="build/peer/llama.cpp", help="a folder made by ../shared/tools/build-llama-cpp")
    ap.add_argument("--build", default="build/release", help="our build")
    ap.add_argument("--target", required=True, help="target GGUF (a name inside --llama, or a path)")
    ap.add_argument("--draft", required=True, help="draft GGUF")
    ap.add_argument("--prompts-file", required=True, help="prompts, one per line (\\n, \\t, \\\\ escapes)")
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--limit", type=int, default=0, help="the first N prompts only (0 = all)")
    a = ap.parse_args()
    target = a.target if os.path.exists(a.target) else os.path.join(a.llama, a.target)
    spec = os.path.join(a.llama, "build", "bin", "llama-speculative")
    run = os.path.join(a.build, "examples", "medusa-run")
    prompts = read_prompts(a.prompts_file)
    if a.limit:
        prompts = prompts[: a.limit]
    peer, plain, ours, ratio, ratio_plain, per_step, peer_accept = [], [], [], [], [], [], []
    identical = 0
    for p in prompts:
        out = subprocess.run([spec, "-m", target, "-md", a.draft, "-p", p, "-n", str(a.tokens), "--draft-max", str(a.draft_tokens),
                              "-t", str(a.threads), "--temp", "0", "-c", "512"], capture_output=True, text=True, errors="replace")
        m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s", out.stderr + out.stdout)
        acc = re.search(r"accept\s+=\s+([\d.]+)%", out.stderr + out.stdout)
        if out.returncode != 0 or not m:
            print(out.stderr[-2000:], file=sys.stderr)
            return 1
        out2 = subprocess.run([run, "--model", target, "--heads", "random:4", "--draft-model", a.draft, "--draft-alone",
                               "--draft-tokens", str(a.draft_tokens), "--mode", "both", "--prompt", p, "--max-new-tokens",
                               str(a.tokens), "--threads", str(a.threads), "--json"], capture_output=True, text=True, errors="replace")
        if out2.returncode != 0:
            print(out2.stderr[-2000:], file=sys.stderr)
            return 1
        rows = [json.loads(l) for l in out2.stdout.splitlines() if l.startswith("{")]
        v = next(r for r in rows if r["mode"] == "vanilla")
        s = next(r for r in rows if r["mode"] == "medusa")
        if len(v["tokens"]) != a.tokens or int(m.group(1)) < a.tokens:
            print(f"a run stopped early: ours {len(v['tokens'])} ({v['stop_reason']}), llama-speculative {m.group(1)} of "
                  f"{a.tokens} tokens (the file's context? see gguf_set_context.py)", file=sys.stderr)
            return 1
        identical += s["tokens"] == v["tokens"]
        peer.append(float(m.group(3)))
        peer_accept.append(float(acc.group(1)) if acc else float("nan"))
        plain.append(v["tokens_per_second"])
        ours.append(s["tokens_per_second"])
        per_step.append(s["mean_accepted"])
        ratio.append(ours[-1] / peer[-1])
        ratio_plain.append(ours[-1] / plain[-1])
    md = statistics.median
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    avx512 = "avx512f" in open("/proc/cpuinfo").read()
    print(f"CPU: {cpu}, AVX-512: {'yes' if avx512 else 'no'}; {a.threads} threads; {len(prompts)} prompts x {a.tokens} tokens; "
          f"draft {a.draft_tokens} tokens; greedy")
    print("| llama-speculative tok/s | its acceptance | ours plain tok/s | ours draft tok/s | tokens/step | ours ÷ plain | "
          "ours ÷ llama-speculative | identical to plain |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| {md(peer):.0f} | {md(peer_accept):.1f} % | {md(plain):.0f} | {md(ours):.0f} | {md(per_step):.2f} | {md(ratio_plain):.2f}× | "
          f"{md(ratio):.2f}× | {identical}/{len(prompts)} |")
    return 0 if identical == len(prompts) else 1


if __name__ == "__main__":
    sys.exit(main())
