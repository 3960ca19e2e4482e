#!/usr/bin/env bash
# Exposed communication of a ZeRO-3 x2 step: the fraction of rank 0's step time spent blocked on
# collectives, with blocking collectives (parallel.overlap=false) and with communication on its
# own thread (gradient buckets reduced during backward, parameters prefetched), in one run.
# Ranks are processes over TCP (`kiln launch`), the default recipe's model otherwise.
#
#     bash scripts/bench-overlap.sh                       # 200 steps, best of 3 per setting
#     STEPS=100 REPEAT=1 STRATEGY=ddp bash scripts/bench-overlap.sh
set -euo pipefail
cd "$(dirname "$0")/.."

STEPS=${STEPS:-200}
REPEAT=${REPEAT:-3}
STRATEGY=${STRATEGY:-zero3}
RANKS=${RANKS:-2}
KILN=${KILN:-target/release/kiln}
[ -x "$KILN" ] || cargo build --release -p kiln-cli
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

run() { # overlap -> "tok/s wait%"
  "$KILN" launch --nproc-per-node "$RANKS" --master-port 0 -- "$KILN" train \
    --set parallel.strategy="$STRATEGY" --set parallel.overlap="$1" \
    --set train.steps="$STEPS" --set train.eval_every=0 --set train.sample_chars=0 \
    --set output.snapshot_every=0 --set output.dir="$out/run" --overwrite >"$out/log" 2>&1 || {
    cat "$out/log" >&2
    exit 1
  }
  local t w
  t=$(sed -n 's/^\[rank 0\] trained steps .*(\([0-9.]*k*\) tok\/s).*/\1/p' "$out/log")
  w=$(sed -n 's/^\[rank 0\] waiting on collectives: \([0-9.]*\)%.*/\1/p' "$out/log")
  echo "$t $w"
}

echo "== $STRATEGY x$RANKS (processes), $STEPS steps, best of $REPEAT per setting; load: $(cut -d' ' -f1-3 /proc/loadavg)"
printf '%-10s %12s %18s\n' overlap "tok/s" "waiting on colls"
declare -A best_t best_w
for _ in $(seq "$REPEAT"); do
  for ov in false true; do # alternate, so both settings see the same machine
    read -r t w < <(run "$ov")
    if [ -z "${best_w[$ov]:-}" ] || awk "BEGIN { exit !($w < ${best_w[$ov]}) }"; then
      best_w[$ov]=$w
      best_t[$ov]=$t
    fi
  done
done
for ov in false true; do
  printf '%-10s %12s %17s%%\n' "$ov" "${best_t[$ov]}" "${best_w[$ov]}"
done
awk -v a="${best_w[false]}" -v b="${best_w[true]}" \
  'BEGIN { if (a > 0) printf "exposed communication with overlap: %.2f of blocking\n", b / a }'
