#!/usr/bin/env bash
# kiln on GPUs: build with CUDA and NCCL, check correctness against the CPU, print throughput.
# Needs an NVIDIA driver, the CUDA toolkit's NVRTC and headers (CUDA_PATH or /usr/local/cuda;
# Burn's CUDA backend compiles kernels at run time) and NCCL (libnccl.so.2 is linked to the
# name cudarc loads by `kiln launch`). Exits non-zero at the first failed check.
#
#     bash scripts/gpu-check.sh            # all GPUs of this machine
set -euo pipefail
cd "$(dirname "$0")/.."

ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ "$ngpu" -lt 1 ]; then
  echo "gpu-check: no NVIDIA GPU visible (nvidia-smi -L lists none)" >&2
  exit 1
fi
echo "== $ngpu GPU(s): $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"

echo "== build (--features cuda,nccl)"
cargo build --release -p kiln-cli --features cuda,nccl
kiln=target/release/kiln

echo "== the decorator on one GPU: MLP parity at world size 1 (and the GPU against the CPU)"
for strategy in ddp zero3; do
  "$kiln" shard-check --device cuda --ranks 1 --strategy "$strategy"
done

echo "== NCCL collectives, every dtype, on all GPUs"
"$kiln" launch --nproc-per-node "$ngpu" --master-port 0 -- "$kiln" comm-check --backend nccl

if [ "$ngpu" -gt 1 ]; then
  echo "== the decorator across GPUs: ZeRO-3 and DDP over NCCL equal one GPU"
  for strategy in zero3 ddp; do
    "$kiln" launch --nproc-per-node "$ngpu" --master-port 0 -- \
      "$kiln" shard-check --device cuda --backend nccl --strategy "$strategy"
  done
fi

echo "== kiln train: 50 steps of the default recipe on one GPU against the CPU (losses, throughput)"
tmp=$(mktemp -d)
for dev in cpu cuda; do
  "$kiln" train --device "$dev" --steps 50 --set train.sample_chars=0 --out "$tmp/$dev" --overwrite | tail -4
done
python3 - "$tmp" <<'PY'
import json, sys
def losses(d):
    return [json.loads(l)["loss"] for l in open(f"{sys.argv[1]}/{d}/metrics.jsonl") if '"loss"' in l]
cpu, gpu = losses("cpu"), losses("cuda")
worst = max(abs(a - b) / abs(a) for a, b in zip(cpu, gpu))
print(f"train: largest relative loss difference cuda vs cpu over {len(cpu)} steps: {worst:.2e}")
sys.exit(0 if worst < 1e-3 else 1)
PY

echo "== throughput: all-reduce over NCCL (host-staged) and TCP"
"$kiln" launch --nproc-per-node "$ngpu" --master-port 0 -- target/release/comm-bench --backend nccl --max-size 64M
echo "gpu-check: all checks passed"
