#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Tree report: plain decoding, every preset, the calibrated trees and `--tree auto`, predicted
against measured, on held-out prompts; JSON plus a PNG plot (gnuplot).

Builds a prompt file from the first LINES lines of NUM Python files of a directory held out from
the heads' training data, then for each weight format and tree runs
`medusa-run --prompts-file F --batch 1 --mode both --json` (plain and Medusa decoding of every
prompt in one process) and records per prompt the Medusa / plain tokens-per-second ratio and the
tokens per step (the table's first speedup and tokens per step are over all prompts together,
which is what the prediction models; the median is over prompts). The prediction of each tree comes from the heads' calibration.json and the step-cost
curve `--tree auto` measured in the same run (the model of docs/tree.md, "Choosing a tree").

  bench/tree_report.py --bin build/release/examples --model ../shared/models/pycode-15m/model.bin \\
      --heads build/heads/pycode-15m --out build/tree-report
"""
import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from batch import escape, prompts_from  # noqa: E402

PRESETS = ["mc_sim_7b_63", "vicuna_7b_stage2", "vicuna_7b_stage1_ablation", "vicuna_7b_stage1", "vicuna_13b_stage2",
           "vicuna_13b_stage1", "vicuna_33b_stage2", "vicuna_33b_stage1", "zephyr_stage2"]


def forward_seconds(curve: dict, n: int) -> float:
    """step_cost_curve::forward_seconds, in Python."""
    rows, secs = curve["rows"], curve["seconds"]
    if n in rows:
        return secs[rows.index(n)]
    if len(rows) == 1:
        return secs[0] * n
    j = next((i for i, r in enumerate(rows) if r > n), len(rows) - 1)
    j = max(j, 1)
    x0, x1, y0, y1 = rows[j - 1], rows[j], secs[j - 1], secs[j]
    return max(secs[0], y0 + (y1 - y0) * (n - x0) / (x1 - x0))


def probability(cal: dict, path: list) -> float:
    """path_calibration::probability: path counts (version 2) or the product of accuracies."""
    if cal.get("version") == 2:
        counts = {tuple(p): c for p, c in cal["path_counts"]}
        return counts.get(tuple(path), 0) / cal["path_positions"]
    p = 1.0
    for k, r in enumerate(path):
        acc = cal["accuracy"]
        p *= acc[k][r] if k < len(acc) and r < len(acc[k]) else 0.0
    return p


def replay(cal: dict, paths: list) -> float:
    """path_calibration::replay_tokens_per_step: greedy decoding replayed on the recorded paths."""
    held = {tuple(p) for p in paths}
    tokens = steps = 0
    for seq in cal["recorded_paths"]:
        t = 0
        while t < len(seq):
            p, a = seq[t], 0
            while a < len(p) and tuple(p[:a + 1]) in held:
                a += 1
            emitted = min(a + 1, len(seq) - t)
            tokens, steps, t = tokens + emitted, steps + 1, t + emitted
    return tokens / steps if steps else 0.0


def predict(cal: dict, curve: dict, paths: list) -> tuple:
    tokens = replay(cal, paths) if cal.get("recorded_paths") else 1.0 + sum(probability(cal, p) for p in paths)
    depth = max((len(p) for p in paths), default=0)
    cost = (forward_seconds(curve, len(paths) + 1) + depth * curve["head_seconds"] + curve["overhead_seconds"]) / curve["seconds"][0]
    return tokens, tokens / cost


def tree_paths(bin_dir: str, tree: str) -> list:
    path = pathlib.Path(tree)
    args = ["--choices-file", tree] if path.is_file() else ["--preset", tree]
    out = subprocess.run([f"{bin_dir}/medusa-tree", *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)["sorted_choices"]


def run(a, prompts_file: str, weights: str, tree: str, extra: list) -> dict:
    cmd = [f"{a.bin}/medusa-run", "--model", a.model, "--heads", a.heads, "--tree", tree, "--weights", weights,
           "--threads", str(a.threads), "--prompts-file", prompts_file, "--batch", "1", "--max-new-tokens", str(a.tokens),
           "--mode", "both", "--json", *extra]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)}\n{out.stderr}")
    lines = [json.loads(x) for x in out.stdout.splitlines()]
    summary = lines[-1]
    per = {}
    for x in lines[:-1]:
        per.setdefault(x["request"], {})[x["mode"]] = x
    ratios = [r["medusa"]["tokens_per_second"] / r["vanilla"]["tokens_per_second"] for r in per.values()]
    steps = [r["medusa"]["mean_accepted"] for r in per.values()]
    return {"tree": tree, "weights": weights, "identical": summary["identical"], "speedup_median": statistics.median(ratios),
            "speedup_min": min(ratios), "speedup_max": max(ratios), "tokens_per_step_median": statistics.median(steps),
            "speedup_aggregate": summary["speedup"], "plain_tokens_per_second": summary["vanilla"]["tokens_per_second"],
            "medusa_tokens_per_second": summary["medusa"]["tokens_per_second"],
            "tokens_per_step": summary["medusa"]["mean_accepted"], "tree_info": summary.get("tree", {}),
            "per_prompt_speedup": ratios, "per_prompt_tokens_per_step": steps}


def plot(out: pathlib.Path, rows: list) -> None:
    data = out / "tree_report.dat"
    with open(data, "w") as f:
        for kind in ("calibrated", "preset", "auto"):
            f.write(f"# {kind}\n")
            for r in sorted((r for r in rows if r["kind"] == kind and r["weights"] == "f32"), key=lambda r: r["nodes"]):
                f.write(f'{r["nodes"]} {r["tokens_per_step"]:.4f} {r["predicted_tokens_per_step"]:.4f} '
                        f'{r["speedup_aggregate"]:.4f} {r["predicted_speedup"]:.4f}\n')
            f.write("\n\n")
    script = f"""
set terminal pngcairo size 1000,440 font 'sans,10'
set output '{out / "tree_report.png"}'
set multiplot layout 1,2 title 'pycode-15m, held-out prompts, f32, 2 threads: measured (points) and predicted (lines)'
set logscale x 2
set xlabel 'tree nodes (root included)'
set key top left
set ylabel 'tokens per step'
plot '{data}' index 0 using 1:2 with points pt 7 title 'calibrated: measured', \\
     '' index 0 using 1:3 with lines lw 2 title 'calibrated: predicted', \\
     '' index 1 using 1:2 with points pt 5 title 'presets: measured', \\
     '' index 2 using 1:2 with points pt 9 ps 1.8 title 'auto: measured', \\
     '' index 2 using 1:3 with points pt 8 ps 1.8 title 'auto: predicted'
set ylabel 'speedup over plain decoding (all prompts)'
set key top right
plot '{data}' index 0 using 1:4 with points pt 7 title 'calibrated: measured', \\
     '' index 0 using 1:5 with lines lw 2 title 'calibrated: predicted', \\
     '' index 1 using 1:4 with points pt 5 title 'presets: measured', \\
     '' index 2 using 1:4 with points pt 9 ps 1.8 title 'auto: measured', \\
     '' index 2 using 1:5 with points pt 8 ps 1.8 title 'auto: predicted'
unset multiplot
"""
    subprocess.run(["gnuplot"], input=script, text=True, check=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", required=True, help="folder with medusa-run and medusa-tree")
    ap.add_argument("--model", required=True)
    ap.add_argument("--heads", required=True, help="heads directory with calibration.json and tree-N.json")
    ap.add_argument("--calibration", default="", help="calibration for auto and the predictions (default: the heads')")
    ap.add_argument("--variants", default="lookup:--lookup 8;dynamic:--dynamic;dynamic+lookup:--dynamic --lookup 8",
                    help="NAME:EXTRA-ARGS;... runs of auto with per-step drafts (measured only)")
    ap.add_argument("--skip-presets", action="store_true")
    ap.add_argument("--out", required=True, help="output directory (tree_report.json, .dat, .png)")
    ap.add_argument("--plot-only", action="store_true", help="only redraw the plot from OUT/tree_report.json")
    ap.add_argument("--weights", default="f32,bf16")
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--prompt-dir", default="/usr/lib/python3/dist-packages")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--lines", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()

    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.plot_only:
        plot(out, json.loads((out / "tree_report.json").read_text())["rows"])
        return 0
    cal_file = a.calibration or str(pathlib.Path(a.heads) / "calibration.json")
    cal = json.loads(pathlib.Path(cal_file).read_text())
    cal_args = ["--calibration", cal_file] if a.calibration else []
    prompts = prompts_from(a.prompt_dir, a.num_prompts, a.lines)
    tmp = tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False)
    tmp.write("".join(escape(p) + "\n" for p in prompts))
    tmp.close()

    rows = []
    print(f"{'weights':7} {'tree':24} {'nodes':>5} {'tok/step':>8} {'pred':>5} {'speedup':>7} {'pred':>5} {'median':>6} "
          f"{'min':>5} {'max':>5} {'plain tok/s':>11} identical")
    for weights in a.weights.split(","):
        curve_file = out / f"step-cost-{weights}.json"
        auto = run(a, tmp.name, weights, "auto", ["--step-cost-out", str(curve_file), "--cost-cache", "none", *cal_args])
        curve = json.loads(curve_file.read_text())
        trees = [("auto", "auto")]
        trees += [("calibrated", str(p)) for p in sorted(pathlib.Path(a.heads).glob("tree-*.json"),
                                                       key=lambda p: int(p.stem.split("-")[1]))]
        if not a.skip_presets:
            trees += [("preset", p) for p in a.presets.split(",") if p]
        variants = [v.split(":", 1) for v in a.variants.split(";") if v]
        trees += [("auto+" + name, "auto") for name, _ in variants]
        for kind, tree in trees:
            if kind.startswith("auto+"):
                extra = dict(variants)[kind[5:]].split()
                r = run(a, tmp.name, weights, "auto", ["--step-cost", str(curve_file), *cal_args, *extra])
            else:
                r = auto if tree == "auto" else run(a, tmp.name, weights, tree, [])
            paths = r["tree_info"]["paths"] if tree == "auto" else tree_paths(a.bin, tree)
            r["kind"] = kind
            r["nodes"] = len(paths) + 1
            r["predicted_tokens_per_step"], r["predicted_speedup"] = predict(cal, curve, paths)
            rows.append(r)
            name = kind if kind.startswith("auto+") else tree if len(tree) <= 24 else "…" + tree[-23:]
            print(f"{weights:7} {name:24} {r['nodes']:5} {r['tokens_per_step']:8.2f} {r['predicted_tokens_per_step']:5.2f} "
                  f"{r['speedup_aggregate']:6.2f}x {r['predicted_speedup']:5.2f} {r['speedup_median']:5.2f}x "
                  f"{r['speedup_min']:5.2f} {r['speedup_max']:5.2f} "
                  f"{r['plain_tokens_per_second']:11.1f} {'yes' if r['identical'] else 'NO'}", flush=True)
    (out / "tree_report.json").write_text(json.dumps({"prompts": len(prompts), "tokens": a.tokens, "rows": rows}, indent=1))
    try:
        plot(out, rows)
        print(f"wrote {out / 'tree_report.json'} and {out / 'tree_report.png'}")
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"wrote {out / 'tree_report.json'}; no plot ({e})")
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
