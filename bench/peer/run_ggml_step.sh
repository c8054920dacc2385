#!/usr/bin/env bash
# Run ggml_step RUNS times (default 3) and keep, per (format, N), the best median
# (and the best min). Extra arguments are passed to ggml_step (e.g. -s 1.0 -t 2).
#   GGML_BUILD  where build_ggml.sh put ggml_step (default /work/peer/ggml-build)
#   OUT_DIR     where per-run CSVs and the merged CSV go (default $GGML_BUILD/results)
set -euo pipefail
GGML_BUILD="${GGML_BUILD:-/work/peer/ggml-build}"
OUT_DIR="${OUT_DIR:-$GGML_BUILD/results}"
RUNS="${RUNS:-3}"
mkdir -p "$OUT_DIR"
echo "cpu:  $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')"
if [ -d "${GGML_MIRROR:-/work/.mirror/ggerganov+ggml/repo}" ]; then
    echo "ggml: $(git -C "${GGML_MIRROR:-/work/.mirror/ggerganov+ggml/repo}" log -1 --format=%H)"
fi
for r in $(seq 1 "$RUNS"); do
    echo "--- run $r/$RUNS"
    "$GGML_BUILD/ggml_step" -o "$OUT_DIR/run$r.csv" "$@" 2>/dev/null | sed -n '/^median/,/^$/p'
done
# merge: best (lowest) median and min per format,N over the runs
awk -F, 'FNR == 1 { next }
         { k = $1 "," $2
           if (!(k in med)) { order[++n] = k; mn[k] = $3; med[k] = $4 }
           if ($3 < mn[k]) mn[k] = $3
           if ($4 < med[k]) med[k] = $4 }
         END { print "format,N,min_us,median_us"
               for (i = 1; i <= n; i++) print order[i] "," mn[order[i]] "," med[order[i]] }' \
    "$OUT_DIR"/run*.csv > "$OUT_DIR/best.csv"
echo "--- best of $RUNS runs: median us per step (tok/s at N=1 = 1e6/median)"
awk -F, 'NR == 1 { next }
         { if (!($1 in seen)) { seen[$1] = 1; fmts[++nf] = $1 }
           if (!($2 in seenN)) { seenN[$2] = 1; Ns[++nn] = $2 }
           v[$1 "," $2] = $4 }
         END { printf "%-12s", "format"; for (j = 1; j <= nn; j++) printf " %8s", "N=" Ns[j]
               printf " %10s\n", "tok/s N=1"
               for (i = 1; i <= nf; i++) { f = fmts[i]; printf "%-12s", f
                   for (j = 1; j <= nn; j++) printf " %8.0f", v[f "," Ns[j]]
                   printf " %10.0f\n", ((f ",1") in v) ? 1e6 / v[f ",1"] : 0 } }' "$OUT_DIR/best.csv"
echo "--- CSV ($OUT_DIR/best.csv)"
cat "$OUT_DIR/best.csv"
