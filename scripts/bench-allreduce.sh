#!/usr/bin/env bash
# kiln's TcpGroup all-reduce against PyTorch's gloo on this machine: ranks as processes over
# loopback, N = 2 and 4, float32 sums of 1 MiB to 256 MiB, both timed the same way (one
# warm-up, then clamp(64 MiB / size, 2, 200) all-reduces between barriers; the best of REPEAT
# runs per size). busbw = algbw x 2(N-1)/N. With ROUNDS > 1 the two sides take turns (kiln,
# gloo, kiln, gloo, ...) and each cell keeps its best round, so that load from other work on
# the machine falls on both alike.
#
#     bash scripts/bench-allreduce.sh
#     PYTHON=/work/venv/bin/python REPEAT=5 RANKS=2,4 MIN=1M MAX=256M bash scripts/bench-allreduce.sh
#
# kiln's side is `comm-bench --groups tcp-mp` (built when missing); gloo's is
# bench/torch/allreduce_gloo.py, run when `$PYTHON -c "import torch"` works (else the table has
# kiln's column only). Environment: PYTHON (python3), REPEAT (3), ROUNDS (1), RANKS (2,4),
# MIN (1M), MAX (256M), FACTOR (4: size step), COMM_BENCH (target/release/comm-bench).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
REPEAT=${REPEAT:-3}
ROUNDS=${ROUNDS:-1}
RANKS=${RANKS:-2,4}
MIN=${MIN:-1M}
MAX=${MAX:-256M}
FACTOR=${FACTOR:-4}
COMM_BENCH=${COMM_BENCH:-target/release/comm-bench}

if [[ ! -x $COMM_BENCH ]]; then
    cargo build --release -p kiln-cli --bin comm-bench
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

sweep=(--ranks "$RANKS" --min-size "$MIN" --max-size "$MAX" --factor "$FACTOR" --repeat "$REPEAT")
have_torch=0
"$PYTHON" -c "import torch" 2>/dev/null && have_torch=1
: >"$tmp/kiln.txt"
: >"$tmp/gloo.txt"
for round in $(seq "$ROUNDS"); do
    echo "== round $round of $ROUNDS"
    echo "kiln: $COMM_BENCH --groups tcp-mp ${sweep[*]}"
    "$COMM_BENCH" --groups tcp-mp "${sweep[@]}" | tee -a "$tmp/kiln.txt"
    if ((have_torch)); then
        echo
        echo "gloo: $PYTHON bench/torch/allreduce_gloo.py ${sweep[*]}"
        "$PYTHON" bench/torch/allreduce_gloo.py "${sweep[@]}" | tee -a "$tmp/gloo.txt"
    fi
done
((have_torch)) || echo "($PYTHON has no torch: gloo's column is left empty)"

# Rows are "<group> <N> <size> <alg> <time> <algbw> <busbw> <ratio>"; join on (N, size),
# keeping each side's best round.
echo
printf '%-3s %6s  %14s %14s %10s\n' N size "kiln busbw" "gloo busbw" kiln/gloo
awk '
    $1 == "tcp-mp" {
        key = $2 " " $3
        if (!(key in kiln)) order[++rows] = key
        if ($7 > kiln[key]) kiln[key] = $7
    }
    $1 == "gloo" && $7 > gloo[$2 " " $3] { gloo[$2 " " $3] = $7 }
    END {
        for (i = 1; i <= rows; i++) {
            key = order[i]; split(key, k, " ")
            g = (key in gloo) ? sprintf("%.3f GB/s", gloo[key]) : "-"
            ratio = (key in gloo && gloo[key] > 0) ? sprintf("%.2f", kiln[key] / gloo[key]) : "-"
            printf "%-3s %6s  %9.3f GB/s %14s %10s\n", k[1], k[2], kiln[key], g, ratio
        }
    }
' "$tmp/kiln.txt" "$tmp/gloo.txt"
