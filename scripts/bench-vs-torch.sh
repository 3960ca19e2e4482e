#!/usr/bin/env bash
# kiln against PyTorch on this machine's CPU: the default recipe's GPT-2 (2 layers, d=64, 121k
# parameters, 16 x 64 = 1024 tokens per step over all ranks, AdamW, clipping at 1.0), the same
# steps on both sides, warm-up steps excluded, in the same run:
#
#   1 process        kiln train --ranks 1 --strategy ddp      torch: 1 process, threads = cores,
#                                                             and again with 1 thread
#   DDP x2           kiln train --ranks 2 --strategy ddp      torch: DDP, 2 processes over gloo
#                    (kiln's ranks are threads of one process)
#   ZeRO-3 x2        kiln train --ranks 2 --strategy zero3    torch: FSDP2 (fully_shard), 2 processes
#   DDP x2 procs     kiln launch --nproc-per-node 2 -- kiln train --strategy ddp    (like for like)
#   ZeRO-3 x2 procs  kiln launch --nproc-per-node 2 -- kiln train --strategy zero3
#
# kiln's figure comes from OUT/metrics.jsonl (rank 0's elapsed time at step WARMUP and at step
# WARMUP+STEPS), so step 1, validation, the final snapshot and the sample are not in it (its own
# summary line, printed too, counts from step 1). The torch side is bench/torch/train_gpt.py
# (eager, no torch.compile); it runs when `$PYTHON -c "import torch"` works.
#
#     bash scripts/bench-vs-torch.sh
#     PYTHON=/work/venv/bin/python STEPS=300 WARMUP=30 REPEAT=3 bash scripts/bench-vs-torch.sh
#
# Environment: PYTHON (python3), STEPS (200 timed steps), WARMUP (20 untimed steps first),
# REPEAT (1: runs per cell, the best kept; a failed run prints its log's tail and leaves "-"), KILN (target/release/kiln; built when missing),
# NPROC (2: ranks of the multi-rank rows). Nothing is left behind (output in a temporary directory).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
STEPS=${STEPS:-200}
WARMUP=${WARMUP:-20}
REPEAT=${REPEAT:-1}
NPROC=${NPROC:-2}
KILN=${KILN:-target/release/kiln}
TORCH_SCRIPT=bench/torch/train_gpt.py

if [ "$WARMUP" -lt 1 ]; then
  echo "bench-vs-torch: WARMUP must be at least 1 (kiln's timing starts at a step's end)" >&2
  exit 2
fi
if [ ! -x "$KILN" ]; then
  echo "== building $KILN"
  cargo build --release -p kiln-cli
fi

tmp=$(mktemp -d "${TMPDIR:-/tmp}/bench-vs-torch.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

# GNU time reports the CPU share of a whole run (children included); optional.
timer=()
if [ -x /usr/bin/time ] && /usr/bin/time -f %P -o /dev/null true 2>/dev/null; then
  timer=(/usr/bin/time -f %P -o "$tmp/cpu")
fi

commands=()
declare -A result cpu

quote() { printf '%q ' "$@"; }

# run KEY CMD... : runs the command, keeps its log, records its CPU share.
run() {
  local key=$1
  shift
  commands+=("$(quote "$@")")
  echo "\$ $(quote "$@")"
  rm -f "$tmp/cpu"
  if ! "${timer[@]}" "$@" >"$tmp/$key.log" 2>&1; then
    echo "bench-vs-torch: the command failed; its last lines:" >&2
    tail -20 "$tmp/$key.log" >&2
    return 1
  fi
  if [ -s "$tmp/cpu" ]; then
    cpu_last=$(tail -1 "$tmp/cpu")
  else
    cpu_last="-"
  fi
}

# best KEY VALUE CPU: keeps the larger tokens/s of repeated runs.
best() {
  local old=${result[$1]:-0}
  if awk -v a="$2" -v b="$old" 'BEGIN { exit !(a > b) }'; then
    result[$1]=$2
    cpu[$1]=$3
  fi
}

# Steady-state tokens/s from metrics.jsonl: elapsed time between step WARMUP and the last step.
kiln_tps() {
  awk -v w="$WARMUP" -v n="$((WARMUP + STEPS))" -v tok=1024 '
    /"step":/ && /"elapsed_s":/ {
      match($0, /"step":[0-9]+/); s = substr($0, RSTART + 7, RLENGTH - 7) + 0
      match($0, /"elapsed_s":[-+0-9.eE]+/); e = substr($0, RSTART + 12, RLENGTH - 12) + 0
      if (s == w) t0 = e
      if (s == n) t1 = e
    }
    END { if (t1 > t0 && t0 > 0) printf "%.1f", (n - w) * tok / (t1 - t0); else print "-" }
  ' "$1"
}

kiln_common=(--steps "$((WARMUP + STEPS))" --overwrite
  --set train.eval_every=0 --set output.snapshot_every=0 --set train.sample_chars=0
  --set output.progress_lines=4)

# kiln_row KEY LAUNCHER-ARGS... -- TRAIN-ARGS...
kiln_row() {
  local key=$1
  shift
  local launcher=()
  while [ "$1" != "--" ]; do
    launcher+=("$1")
    shift
  done
  shift
  local i out tps
  for ((i = 1; i <= REPEAT; i++)); do
    out="$tmp/out-$key"
    if [ ${#launcher[@]} -gt 0 ]; then
      run "kiln-$key" "$KILN" "${launcher[@]}" -- "$KILN" train --out "$out" "${kiln_common[@]}" "$@" || continue
    else
      run "kiln-$key" "$KILN" train --out "$out" "${kiln_common[@]}" "$@" || continue
    fi
    tps=$(kiln_tps "$out/metrics.jsonl")
    echo "   kiln: $tps tok/s over steps $((WARMUP + 1))..$((WARMUP + STEPS)); CPU $cpu_last;" \
      "its summary (from step 1): $(grep -m1 '^trained steps' "$tmp/kiln-$key.log" || true)"
    best "kiln-$key" "$tps" "$cpu_last"
    rm -rf "$out"
  done
}

torch_row() {
  local key=$1
  shift
  local i tps
  for ((i = 1; i <= REPEAT; i++)); do
    run "torch-$key" "$PYTHON" "$TORCH_SCRIPT" --steps "$STEPS" --warmup "$WARMUP" "$@" || continue
    tps=$(sed -n 's/^RESULT .*tokens_per_s=\([0-9.]*\).*/\1/p' "$tmp/torch-$key.log" | tail -1)
    impl=$(sed -n 's/^RESULT .*impl=\([^ ]*\).*/\1/p' "$tmp/torch-$key.log" | tail -1)
    grep -i "falling back" "$tmp/torch-$key.log" || true
    echo "   torch ($impl): ${tps:--} tok/s; CPU $cpu_last; $(grep -m1 '^torch ' "$tmp/torch-$key.log" || true)"
    best "torch-$key" "${tps:-0}" "$cpu_last"
    if [ -n "$impl" ]; then impls[$key]=$impl; fi
  done
}

have_torch=0
torch_version=""
if torch_version=$("$PYTHON" -c "import warnings; warnings.filterwarnings('ignore'); import torch; print(torch.__version__)" 2>/dev/null); then
  have_torch=1
fi
declare -A impls

cores=$(nproc 2>/dev/null || getconf _NPROCESSORS_ONLN)
echo "== kiln vs PyTorch: $cores core(s), $STEPS timed steps after $WARMUP, 1024 tokens per step, best of $REPEAT"
echo "== kiln: $KILN, built $(date -r "$KILN" '+%F %T' 2>/dev/null || echo '?'), checkout $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
echo "== load average before: $(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || uptime)"
if [ $have_torch = 1 ]; then
  echo "== torch $torch_version ($PYTHON)"
else
  echo "== torch not found: \`$PYTHON -c \"import torch\"\` failed (set PYTHON to an interpreter with torch); kiln only"
fi

echo "== 1 process"
kiln_row one -- --ranks 1 --strategy ddp
[ $have_torch = 1 ] && torch_row single --mode single
# kiln's rank is one thread (Flex runs each op on the calling thread at this size): torch too.
[ $have_torch = 1 ] && [ "$cores" -gt 1 ] && torch_row single1 --mode single --threads 1
echo "== DDP x$NPROC"
kiln_row ddp -- --ranks "$NPROC" --strategy ddp
kiln_row ddp-procs launch --nproc-per-node "$NPROC" --master-port 0 -- --strategy ddp
[ $have_torch = 1 ] && torch_row ddp --mode ddp --nproc "$NPROC"
echo "== ZeRO-3 / FSDP x$NPROC"
kiln_row zero3 -- --ranks "$NPROC" --strategy zero3
kiln_row zero3-procs launch --nproc-per-node "$NPROC" --master-port 0 -- --strategy zero3
[ $have_torch = 1 ] && torch_row fsdp --mode fsdp --nproc "$NPROC"
load_after=$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || uptime)

echo
echo "== commands run"
for c in "${commands[@]}"; do echo "  $c"; done
echo
echo "== tokens/s (steady state; CPU = share of the whole run, 100% = one core); load average after: $load_after"
row() { # LABEL KILN-KEY TORCH-KEY
  local k=${result[kiln-$2]:--} t=${result[torch-$3]:--} ratio="-"
  if [ $have_torch = 1 ] && [ "$k" != "-" ] && [ "$t" != "-" ] && [ "$t" != "0" ]; then
    ratio=$(awk -v a="$k" -v b="$t" 'BEGIN { printf "%.2f", a / b }')
  fi
  if [ $have_torch = 1 ]; then
    printf "| %-46s | %10s | %11s | %10s | %6s | %7s |\n" "$1" "$k" "$t" "$ratio" "${cpu[kiln-$2]:--}" "${cpu[torch-$3]:--}"
  else
    printf "| %-46s | %10s | %6s |\n" "$1" "$k" "${cpu[kiln-$2]:--}"
  fi
}
if [ $have_torch = 1 ]; then
  printf "| %-46s | %10s | %11s | %10s | %6s | %7s |\n" mode "kiln tok/s" "torch tok/s" "kiln/torch" "kiln %" "torch %"
  echo "|$(printf -- '-%.0s' {1..48})|------------|-------------|------------|--------|---------|"
else
  printf "| %-46s | %10s | %6s |\n" mode "kiln tok/s" "kiln %"
  echo "|$(printf -- '-%.0s' {1..48})|------------|--------|"
fi
fsdp=${impls[fsdp]:-FSDP2}
fsdp=${fsdp%%(*}
if [ $have_torch = 1 ]; then
  row "1 process (torch: $cores threads)" one single
  [ "$cores" -gt 1 ] && row "1 process (torch: 1 thread)" one single1
  row "DDP x$NPROC, kiln threads (torch: procs)" ddp ddp
  row "DDP x$NPROC, kiln processes" ddp-procs ddp
  row "ZeRO-3 x$NPROC, kiln threads (torch: $fsdp)" zero3 fsdp
  row "ZeRO-3 x$NPROC, kiln processes (torch: $fsdp)" zero3-procs fsdp
else
  row "1 process" one -
  row "DDP x$NPROC, ranks as threads" ddp -
  row "DDP x$NPROC, ranks as processes" ddp-procs -
  row "ZeRO-3 x$NPROC, ranks as threads" zero3 -
  row "ZeRO-3 x$NPROC, ranks as processes" zero3-procs -
fi
if [ $have_torch = 0 ]; then
  echo "torch was not found ($PYTHON): only kiln's column"
fi
