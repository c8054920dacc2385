#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Plain decoding against llama.cpp, like with like, in one session: the same pycode-15m GGUF files
# (converted and quantized by llama.cpp's own tools), the same thread count, the runs of both
# engines interleaved so that a noisy neighbour slows both alike.
#
#   bench/peer/decode.sh [--llama DIR] [--build DIR] [--threads N] [--runs R] [--tokens N]
#                        [--formats F32,Q8_0,Q4_0] [--cpu-target NAME]
#
#   --llama DIR       a folder made by ../shared/tools/build-llama-cpp (its build/bin tools and the
#                     pycode-15m-*.gguf files); default build/peer/llama.cpp
#   --build DIR       our build (bench/bench_llama, examples/medusa-run); default build/release
#   --cpu-target NAME limit our kernels to an instruction set (MEDUSA_CPU_TARGET, e.g. AVX2), to
#                     compare with a llama.cpp built for it (GGML_NATIVE=OFF gives an AVX2 build)
#
# Per format and run: `llama-bench -p 0 -n TOKENS -t N` (its tokens per second), our
# `bench_llama BM_decode` (steady decoding at a context of 128, the same weights packed from
# pycode-15m's model.bin in that format) and `medusa-run --mode vanilla` on the GGUF file itself
# (TOKENS new tokens after a short prompt, prefill included). Prints the median of each and the
# ratios ours ÷ llama.cpp, with the CPU and both engines' instruction sets.
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
llama=$here/build/peer/llama.cpp
build=$here/build/release
threads=2
runs=5
tokens=128
formats=F32,Q8_0,Q4_0
cpu_target=
while [[ $# -gt 0 ]]; do
  case $1 in
    --llama) llama=$2; shift 2 ;;
    --build) build=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --runs) runs=$2; shift 2 ;;
    --tokens) tokens=$2; shift 2 ;;
    --formats) formats=$2; shift 2 ;;
    --cpu-target) cpu_target=$2; shift 2 ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    *) echo "decode.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
bench=$build/bench/bench_llama
run=$build/examples/medusa-run
lbench=$llama/build/bin/llama-bench
for f in "$bench" "$run" "$lbench"; do
  [[ -x $f ]] || { echo "decode.sh: $f not found (build it, or pass --build / --llama)" >&2; exit 1; }
done
[[ -n $cpu_target ]] && export MEDUSA_CPU_TARGET=$cpu_target

median() { sort -g | awk '{a[NR]=$1} END {if (NR == 0) print "nan"; else if (NR % 2) print a[(NR+1)/2]; else print (a[NR/2] + a[NR/2+1]) / 2}'; }

declare -A weights=([F32]=0 [BF16]=1 [Q8_0]=3 [Q4_0]=4)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
prompt=$'def parse_args(argv):\n    """Parse the command line."""\n'
for r in $(seq 1 "$runs"); do
  for F in ${formats//,/ }; do
    gguf=$llama/pycode-15m-$F.gguf
    [[ -f $gguf ]] || { echo "decode.sh: $gguf not found" >&2; exit 1; }
    "$lbench" -m "$gguf" -p 0 -n "$tokens" -t "$threads" -r 1 -o json 2>/dev/null |
      python3 -c 'import json,sys; print(json.load(sys.stdin)[0]["avg_ts"])' >>"$tmp/llama-$F"
    "$bench" --benchmark_filter="^BM_decode/threads:$threads/weights:${weights[$F]}/real_time\$" \
      --benchmark_min_time=1 --benchmark_format=json 2>/dev/null |
      python3 -c 'import json,sys; b=json.load(sys.stdin)["benchmarks"][0]; print(b["tok_per_s"]); open(sys.argv[1],"w").write(b.get("label",""))' \
        "$tmp/target" >>"$tmp/bench-$F"
    "$run" --model "$gguf" --prompt "$prompt" --max-new-tokens "$tokens" --mode vanilla --threads "$threads" --json 2>/dev/null |
      python3 -c 'import json,sys; print([json.loads(l) for l in sys.stdin if l.startswith("{")][0]["tokens_per_second"])' >>"$tmp/run-$F"
  done
done

echo "CPU: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; AVX-512: $(grep -q avx512f /proc/cpuinfo && echo yes || echo no)"
echo "llama.cpp: $lbench ($(grep -o 'GGML_NATIVE:BOOL=[A-Z]*' "$llama/build/CMakeCache.txt" 2>/dev/null || echo '?'))"
echo "ours: $build, kernels $(cat "$tmp/target")${cpu_target:+ (MEDUSA_CPU_TARGET=$cpu_target)}"
echo "threads $threads, $tokens tokens, medians of $runs interleaved runs (tokens per second)"
echo
echo "| format | llama-bench -p 0 -n $tokens | bench_llama BM_decode | medusa-run --mode vanilla | BM_decode ÷ llama.cpp | medusa-run ÷ llama.cpp |"
echo "|---|---:|---:|---:|---:|---:|"
for F in ${formats//,/ }; do
  l=$(median <"$tmp/llama-$F"); b=$(median <"$tmp/bench-$F"); m=$(median <"$tmp/run-$F")
  awk -v F="$F" -v l="$l" -v b="$b" -v m="$m" 'BEGIN { printf "| %s | %.0f | %.0f | %.0f | %.2f | %.2f |\n", F, l, b, m, b / l, m / l }'
done
