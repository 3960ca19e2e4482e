#!/usr/bin/env bash
# kiln inside burn-train, the longer demonstrations (docs/learner.md):
#  1. Burn's text-classification example under `kiln launch`: ZeRO-3 on 2 processes vs 1 rank;
#  2. a run killed with SIGKILL in its third epoch, resumed through the Learner's checkpoint
#     option (`SupervisedTraining::checkpoint(2)`) on 2 ranks and on 1: its epoch-3 losses
#     against the uninterrupted run's;
#  3. each rank's parameter and optimizer bytes at upstream's model size, 1 rank vs ZeRO-3 x2.
# Release builds; about a few minutes on 2 cores after the build.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p kiln-cli -p burn-text-classification
BIN=target/release/burn-text-classification
OUT=${OUT:-/tmp/kiln-learner-demo}
rm -rf "$OUT" && mkdir -p "$OUT"
SMALL="d_model=32 layers=2 heads=4 seq=32 dropout=0 train=400 test=64 batch=16 full_precision=true"

echo "== 1 rank (threads) and ZeRO-3 x2 under kiln launch"
$BIN kiln 1 ddp $SMALL epochs=2 dir="$OUT/one" >/dev/null
target/release/kiln launch --nproc-per-node 2 --master-port 0 -- \
  $BIN kiln 2 zero3 $SMALL epochs=2 dir="$OUT/launch" >/dev/null
python3 - "$OUT" <<'PY'
import sys, pathlib
out = pathlib.Path(sys.argv[1])
def losses(run, split, epoch):
    f = out / run / split / f"epoch-{epoch}" / "Loss.log"
    return [float(l.split(",")[0]) for l in f.read_text().split()]
for e in (1, 2):
    for s in ("train", "valid"):
        a, b = losses("launch", s, e), losses("one", s, e)
        assert len(a) == len(b), (s, e, len(a), len(b))
        print(f"ZeRO-3 x2 (kiln launch) vs 1 rank, {s} epoch {e}: {len(a)} batches, "
              f"largest difference {max(abs(x - y) for x, y in zip(a, b)):.2e}")
PY

echo "== SIGKILL in epoch 3, resume from epoch 2's checkpoint"
$BIN kiln 2 zero3 $SMALL epochs=3 dir="$OUT/whole" >/dev/null
$BIN kiln 2 zero3 $SMALL epochs=3 dir="$OUT/killed" >/dev/null &
PID=$!
until [ -d "$OUT/killed/train/epoch-3" ]; do sleep 0.2; done
kill -9 $PID; wait $PID || true
echo "killed pid $PID in epoch 3; checkpoints: $(ls "$OUT/killed/checkpoint" | tr '\n' ' ')"
for ranks in 2 1; do
  mkdir -p "$OUT/resumed-$ranks" && cp -r "$OUT/killed/checkpoint" "$OUT/resumed-$ranks/"
  $BIN kiln $ranks zero3 $SMALL epochs=3 resume=2 dir="$OUT/resumed-$ranks" >/dev/null
done
python3 - "$OUT" <<'PY'
import sys, pathlib
out = pathlib.Path(sys.argv[1])
def losses(run):
    # burn-train's loggers number a resumed run's first epoch 1 (plain burn-train's too).
    epoch = 3 if run == "whole" else 1
    f = out / run / "train" / f"epoch-{epoch}" / "Loss.log"
    return [float(l.split(",")[0]) for l in f.read_text().split()]
for run in ("resumed-2", "resumed-1"):
    a, b = losses(run), losses("whole")
    print(f"{run} vs uninterrupted, epoch 3: {len(a)} batches, "
          f"largest difference {max(abs(x - y) for x, y in zip(a, b)):.2e}")
PY

echo "== per-rank bytes: upstream's model size (d_model 256, 4 layers, 8 heads), 1 rank vs ZeRO-3 x2"
for r in "1 ddp" "2 zero3"; do
  $BIN kiln $r d_model=256 layers=4 heads=8 seq=64 train=32 test=16 batch=16 epochs=1 \
    dir="$OUT/bytes-${r// /-}" 2>&1 | grep '^kiln:'
done
