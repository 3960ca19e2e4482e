#!/usr/bin/env bash
# Activation memory and step time of rematerialisation on a deep, narrow GPT-2 (the default
# recipe's width, LAYERS blocks, sequences of SEQ tokens: activations dominate), one rank:
# off, Burn's balanced checkpointing, and kiln's budget at BUDGET_FRACTION of off's measured
# activation peak (and the measured peak beside each budget). Every run trains the same steps
# from the same seed; the losses must match (remat is exact).
#
#     bash scripts/bench-remat.sh                      # 12 layers, 256 tokens, 4 steps
#     LAYERS=24 STEPS=3 bash scripts/bench-remat.sh    # the issue's shape (slow)
set -euo pipefail
cd "$(dirname "$0")/.."

LAYERS=${LAYERS:-12}
SEQ=${SEQ:-256}
STEPS=${STEPS:-4}
FRACTIONS=${FRACTIONS:-"0.5 0.33"}
KILN=${KILN:-target/release/kiln}
[ -x "$KILN" ] || cargo build --release -p kiln-cli
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

run() { # remat -> "activation_bytes seconds_per_step last_loss recompute_s policy_s" (per step, after the first)
  "$KILN" train --remat "$1" --steps "$STEPS" --set model.layers="$LAYERS" \
    --set model.context="$SEQ" --set train.seq_len="$SEQ" --set train.eval_every=0 \
    --set train.eval_batches=1 --set train.sample_chars=0 --set output.snapshot_every=0 \
    --out "$out/run" --overwrite >"$out/log" 2>&1 || {
    cat "$out/log" >&2
    exit 1
  }
  python3 - "$out/run/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
steps = [r for r in rows if "loss" in r]
mem = max(r["mem_activation_bytes"] or 0 for r in steps)
later = steps[1:] or steps
per_step = (later[-1]["elapsed_s"] - steps[0]["elapsed_s"]) / max(len(later) - (1 if len(steps) > 1 else 0), 1)
n = max(len(later) - (1 if len(steps) > 1 else 0), 1)
timed = later[1:] if len(later) > 1 else later
recompute = sum(r.get("remat_recompute_s") or 0 for r in timed) / max(len(timed), 1)
policy = sum(r.get("remat_policy_s") or 0 for r in timed) / max(len(timed), 1)
print(mem, per_step, steps[-1]["loss"], recompute, policy)
PY
}

echo "== GPT-2 $LAYERS layers x d=64, $SEQ tokens x 16 sequences per step, $STEPS steps, 1 rank; load: $(cut -d' ' -f1-3 /proc/loadavg)"
printf '%-22s %16s %10s %12s %10s %12s %14s %12s\n' remat "activations MiB" "x off" "s/step" \
  "x off" "last loss" "recompute s" "policy s"
read -r off_mem off_t off_loss _ _ < <(run off)
line() { # name mem t loss recompute policy
  printf '%-22s %16.1f %10.2f %12.2f %10.2f %12.6f %14.2f %12.2f\n' "$1" \
    "$(echo "$2/1048576" | bc -l)" "$(echo "$2/$off_mem" | bc -l)" "$3" \
    "$(echo "$3/$off_t" | bc -l)" "$4" "$5" "$6"
}
line off "$off_mem" "$off_t" "$off_loss" 0 0
read -r m t l _ _ < <(run balanced)
line balanced "$m" "$t" "$l" 0 0
for f in $FRACTIONS; do
  budget=$(python3 -c "print(int($off_mem * $f))")
  read -r m t l rc po < <(run "budget=$budget")
  line "budget=$f x off" "$m" "$t" "$l" "$rc" "$po"
done
