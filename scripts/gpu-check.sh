#!/usr/bin/env bash
# kiln on GPUs: build with CUDA and NCCL, check correctness against the CPU, print throughput.
# Needs an NVIDIA driver, the CUDA toolkit's NVRTC and headers (CUDA_PATH or /usr/local/cuda;
# Burn's CUDA backend compiles kernels at run time) and NCCL (libnccl.so.2 is linked to the
# name cudarc loads by `kiln launch`, and by this script for the steps it runs directly).
#
# Every step runs even after a failure; a summary lists each step's result at the end, and the
# exit status is non-zero if any failed (or if the build failed: then nothing else can run).
#
#     bash scripts/gpu-check.sh              # all GPUs of this machine
#     GPU_CHECK_QUICK=1 bash scripts/gpu-check.sh   # skip the GPT-2 124M-shape throughput run
#     GPU_CHECK_ONLY=shard-check bash scripts/gpu-check.sh   # only the steps whose names match
#     KILN_PREBUILT=DIR bash scripts/gpu-check.sh   # a GPU machine without Rust: binaries built
#         elsewhere by `bash scripts/gpu-check.sh --prebuild DIR` (kiln, comm-bench and the
#         device-collectives test), same CPU architecture and an equal or newer glibc there
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

# --prebuild DIR: build the binaries the checks run (no GPU needed) and copy them, stripped, to DIR.
if [ "${1:-}" = "--prebuild" ]; then
  dir=${2:?usage: gpu-check.sh --prebuild DIR}
  set -e
  cargo build --release -p kiln-cli --features cuda,nccl --bins
  test_bin=$(cargo test --release -p kiln-shard --features cuda --lib --no-run \
    --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "kiln_shard":
        print(m["executable"])')
  target=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
  mkdir -p "$dir"
  cp "$target/release/kiln" "$target/release/comm-bench" "$dir/"
  cp "$test_bin" "$dir/kiln-shard-device-test"
  strip "$dir"/*
  ls -l "$dir"
  exit 0
fi

ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ "$ngpu" -lt 1 ]; then
  echo "gpu-check: no NVIDIA GPU visible (nvidia-smi -L lists none)" >&2
  exit 1
fi
echo "== $ngpu GPU(s): $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"

results=()
failed=0
# step NAME COMMAND...: runs the command, records pass/fail, never stops the script.
step() {
  local name=$1
  shift
  # GPU_CHECK_ONLY=REGEX: only the steps whose names match (a rerun of some checks).
  if [ -n "${GPU_CHECK_ONLY:-}" ] && ! grep -Eq -- "$GPU_CHECK_ONLY" <<<"$name"; then
    return 0
  fi
  echo
  echo "== $name"
  local start=$SECONDS
  if "$@"; then
    results+=("PASS  $name ($((SECONDS - start))s)")
  else
    results+=("FAIL  $name ($((SECONDS - start))s)")
    failed=1
  fi
  echo "-> ${results[-1]}"
}
# expect_failure PATTERN COMMAND...: the command must fail, printing PATTERN (a clear error).
expect_failure() {
  local pattern=$1
  shift
  local out
  out=$("$@" 2>&1)
  local rc=$?
  echo "$out" | tail -5
  if [ $rc -eq 0 ]; then
    echo "expected a failure, got success"
    return 1
  fi
  if ! grep -q -- "$pattern" <<<"$out"; then
    echo "the error does not say: $pattern"
    return 1
  fi
}
summary() {
  echo
  echo "== summary"
  printf '%s\n' "${results[@]}"
  if [ $failed -ne 0 ]; then
    echo "gpu-check: some steps FAILED"
  else
    echo "gpu-check: all steps passed"
  fi
  exit $failed
}

# NCCL packages install libnccl.so.2; cudarc dlopens libnccl.so. `kiln launch` links it for
# its ranks; the steps run without the launcher get the same link here.
ncclso=$(ldconfig -p 2>/dev/null | awk '/libnccl\.so\.2 /{print $NF; exit}')
if [ -z "$ncclso" ]; then
  ncclso=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(nvidia.nccl.__path__[0], "lib", "libnccl.so.2"))' 2>/dev/null || true)
fi
if [ -n "$ncclso" ] && [ -e "$ncclso" ]; then
  linkdir=$(mktemp -d)
  ln -s "$ncclso" "$linkdir/libnccl.so"
  nccldir=$(dirname "$ncclso")
  export LD_LIBRARY_PATH="$linkdir:$nccldir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

if [ -n "${KILN_PREBUILT:-}" ]; then
  bin=$(cd "$KILN_PREBUILT" && pwd)
  echo "== prebuilt binaries from $bin"
else
  step "build (release, --features cuda,nccl)" cargo build --release -p kiln-cli --features cuda,nccl
  if [ $failed -ne 0 ]; then summary; fi
  bin=target/release
fi
kiln=$bin/kiln
launch() { "$kiln" launch --nproc-per-node "$1" --master-port 0 -- "${@:2}"; }

# --- kiln-comm's NCCL group -------------------------------------------------------------------
# The conformance check: every collective, reduce op and dtype (f32, f16, bf16, i64), lengths
# 0 (zero-length collectives are no-ops, still validated), 1, N-1, N, N+1, ... 70001; the
# send_recv ring inside one NCCL group (a deadlock before); Avg within the dtype's tolerance.
step "comm-check over NCCL, 1 rank (send to self is a local copy)" launch 1 "$kiln" comm-check --backend nccl
if [ "$ngpu" -gt 1 ]; then
  step "comm-check over NCCL, $ngpu ranks (ring send_recv, zero lengths, bf16, Avg)" \
    launch "$ngpu" "$kiln" comm-check --backend nccl
fi
# A rank that never joins: node 1 of a 2-node job is never started, so rank 0's
# ncclCommInitRankConfig must give up at the timeout (non-blocking init, abort), not hang.
port=$((20000 + RANDOM % 20000))
step "NCCL init times out when a rank never joins (KILN_COMM_TIMEOUT=15)" expect_failure \
  "not every rank joined" env KILN_COMM_TIMEOUT=15 timeout 120 "$kiln" launch --nnodes 2 \
  --node-rank 0 --nproc-per-node 1 --master-port "$port" -- "$kiln" comm-check --backend nccl
# More NCCL ranks than GPUs: a clear error naming the fit, not NCCL's duplicate-GPU failure.
step "$((ngpu + 1)) NCCL ranks on $ngpu GPU(s) is a clear error" expect_failure \
  "NCCL needs one GPU per rank" timeout 300 env -u CUDA_VISIBLE_DEVICES "$kiln" launch \
  --nproc-per-node $((ngpu + 1)) --master-port 0 -- "$kiln" comm-check --backend nccl

# --- device-memory collectives (kiln-shard's `device` module) ---------------------------------
device_test() {
  if [ -n "${KILN_PREBUILT:-}" ]; then
    "$bin/kiln-shard-device-test" --ignored device::
  else
    cargo test --release -p kiln-shard --features cuda --lib -- --ignored device::
  fi
}
step "device collectives on burn-cuda tensors (no host copies), 1 GPU" device_test

# --- the decorator: every strategy ------------------------------------------------------------
strategies="ddp zero1 zero2 zero3 hybrid:1"
for strategy in $strategies; do
  step "shard-check $strategy: 1 GPU vs CPU" \
    "$kiln" shard-check --device cuda --ranks 1 --strategy "$strategy"
done
# One rank over NCCL: the decorator's collectives take the device path (kiln-shard's `device`
# module on burn-cuda's buffers) even at world size 1.
for strategy in ddp zero3; do
  step "shard-check $strategy over NCCL, 1 rank (device-memory collectives)" \
    launch 1 "$kiln" shard-check --device cuda --backend nccl --strategy "$strategy"
done
if [ "$ngpu" -gt 1 ]; then
  half=1
  if [ $((ngpu % 2)) -eq 0 ]; then half=$((ngpu / 2)); fi
  for strategy in ddp zero1 zero2 zero3 "hybrid:$half"; do
    step "shard-check $strategy over NCCL on $ngpu GPUs" \
      launch "$ngpu" "$kiln" shard-check --device cuda --backend nccl --strategy "$strategy"
  done
fi
# Mixed precision: N thread ranks against one device in bf16 (bf16 partial sums round in
# another order, hence the looser bound), and over NCCL at one rank (gathers in bf16 on the
# device path).
step "precision: shard-check zero3 bf16, 2 thread ranks sharing the GPU" \
  "$kiln" shard-check --device cuda --ranks 2 --strategy zero3 --precision bf16 --tolerance 1e-2
step "precision: shard-check zero3 bf16 over NCCL, 1 rank" \
  launch 1 "$kiln" shard-check --device cuda --backend nccl --strategy zero3 --precision bf16 \
  --tolerance 1e-2

# --- training: the GPU against the CPU --------------------------------------------------------
tmp=$(mktemp -d)
# compare_losses A B TOL WHAT: the runs in $tmp/A and $tmp/B logged the same number of losses,
# each within TOL (relative) of the other's; prints the largest difference.
compare_losses() {
  python3 - "$tmp/$1" "$tmp/$2" "$3" "$4" <<'PY'
import json, sys
def losses(d):
    return [json.loads(l)["loss"] for l in open(f"{d}/metrics.jsonl") if '"loss"' in l]
a, b, tol, what = losses(sys.argv[1]), losses(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
worst = max((abs(x - y) / abs(x) for x, y in zip(a, b)), default=float("inf"))
print(f"{what}: largest relative loss difference over {len(a)} steps: {worst:.2e}")
sys.exit(0 if worst < tol and len(a) == len(b) > 0 else 1)
PY
}
train_parity() {
  for dev in cpu cuda; do
    "$kiln" train --device "$dev" --steps 50 --set train.sample_chars=0 --out "$tmp/$dev" \
      --overwrite | tail -4 || return 1
  done
  compare_losses cpu cuda 1e-3 "train: cuda vs cpu"
}
step "kiln train: 50 steps of the default recipe, cuda vs cpu losses" train_parity
# bf16 on both: the GPU's bf16 matmuls against Flex's, within bf16's rounding.
bf16_parity() {
  if [ ! -e "$tmp/cuda/metrics.jsonl" ]; then
    "$kiln" train --device cuda --steps 50 --set train.sample_chars=0 --out "$tmp/cuda" \
      --overwrite | tail -1 || return 1
  fi
  for dev in cpu cuda; do
    "$kiln" train --device "$dev" --precision bf16 --steps 50 --set train.sample_chars=0 \
      --out "$tmp/bf16-$dev" --overwrite | tail -2 || return 1
  done
  python3 - "$tmp" <<'PY'
import json, sys
def losses(d):
    return [json.loads(l)["loss"] for l in open(f"{sys.argv[1]}/{d}/metrics.jsonl") if '"loss"' in l]
cpu, gpu, f32 = losses("bf16-cpu"), losses("bf16-cuda"), losses("cuda")
worst = max(abs(a - b) / abs(a) for a, b in zip(cpu, gpu))
moved = max(abs(a - b) / abs(a) for a, b in zip(f32, gpu))
print(f"precision: bf16 losses cuda vs cpu {worst:.2e}; bf16 vs f32 on cuda {moved:.2e}")
sys.exit(0 if worst < 2e-2 and moved > 0 else 1)
PY
}
step "precision: kiln train --precision bf16, 50 steps, cuda vs cpu losses" bf16_parity
# `--ranks 2 --device cuda` on fewer GPUs than ranks: threads share (it asked for GPU 1 before).
step "kiln train --ranks 2 --device cuda (ranks share GPUs round-robin)" \
  "$kiln" train --device cuda --ranks 2 --strategy zero3 --steps 5 --set train.sample_chars=0 \
  --set output.snapshot_every=0 --out "$tmp/threads" --overwrite
# Pipelines over NCCL: each stage's sends are queued (an Outbox, a two-rank communicator per
# direction), since NCCL's own sends wait for the receiver and a 1F1B step would deadlock.
# The same pipeline over TCP on the CPU gives the reference losses.
pipe_parity() {
  local common=(--pp 2 --microbatches 4 --schedule 1f1b --steps 20 --set train.sample_chars=0
    --set output.snapshot_every=0 --overwrite)
  launch 2 "$kiln" train --device cpu "${common[@]}" --out "$tmp/pp-cpu" | tail -2 || return 1
  launch 2 "$kiln" train --device cuda --set 'parallel.backend="nccl"' "${common[@]}" \
    --out "$tmp/pp-nccl" | tail -2 || return 1
  compare_losses pp-cpu pp-nccl 1e-3 "pipeline: pp 2, 1f1b over NCCL vs TCP on the CPU"
}
if [ "$ngpu" -gt 1 ]; then
  step "kiln train --pp 2 --schedule 1f1b over NCCL on 2 GPUs, against TCP on the CPU" pipe_parity
  for strategy in ddp zero3; do
    step "kiln train $strategy over NCCL on $ngpu GPUs (20 steps)" \
      launch "$ngpu" "$kiln" train --device cuda --strategy "$strategy" --steps 20 \
      --set 'parallel.backend="nccl"' --set train.sample_chars=0 --set output.snapshot_every=0 \
      --out "$tmp/nccl-$strategy" --overwrite
  done
fi

# --- throughput: the default recipe at GPT-2 124M's shape -------------------------------------
# 12 layers, 12 heads, d=768, context 1024 (kiln's byte vocabulary of 256 instead of 50257, so
# 85M parameters rather than 124M); 8 x 1024 tokens per step, 30 steps, no sample or evaluation
# beyond one batch. tokens/s is the run's average after its first step.
gpt2_124m=(--set model.layers=12 --set model.heads=12 --set model.dim=768
  --set model.context=1024 --set train.seq_len=1024 --set train.batch_size=8
  --set train.warmup_steps=3 --set train.eval_every=0 --set train.eval_batches=1
  --set train.sample_chars=0 --set output.snapshot_every=0 --set output.keep=1)
throughput() {
  local name=$1
  shift
  "$@" --steps 30 "${gpt2_124m[@]}" --out "$tmp/$name" --overwrite | tail -3 || return 1
  python3 - "$tmp/$name/metrics.jsonl" "$name" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"tokens_per_s"' in l]
print(f"THROUGHPUT {sys.argv[2]}: {rows[-1]['tokens_per_s']:.0f} tokens/s (GPT-2 124M shape, step {rows[-1]['step']})")
PY
}
# PyTorch eager (f32, no torch.compile) on the same GPU, the same shape and optimizer.
torch_throughput() {
  python3 bench/torch/train_gpt.py --device cuda --layers 12 --heads 12 --dim 768 --context 1024 \
    --seq-len 1024 --batch-size 8 --steps 20 --warmup 5 | tail -2
}
torch_autocast_throughput() {
  python3 bench/torch/train_gpt.py --device cuda --autocast bf16 --layers 12 --heads 12 \
    --dim 768 --context 1024 --seq-len 1024 --batch-size 8 --steps 20 --warmup 5 | tail -2
}
if [ -z "${GPU_CHECK_QUICK:-}" ]; then
  step "throughput: GPT-2 124M shape, 1 GPU, ddp" throughput gpu1-ddp \
    "$kiln" train --device cuda --strategy ddp
  for precision in bf16 f16; do
    step "throughput (precision $precision): GPT-2 124M shape, 1 GPU, ddp" throughput \
      "gpu1-ddp-$precision" "$kiln" train --device cuda --strategy ddp --precision "$precision"
  done
  step "throughput: GPT-2 124M shape, 1 GPU, zero3 over NCCL (1 rank)" throughput gpu1-nccl-zero3 \
    launch 1 "$kiln" train --device cuda --strategy zero3 --set 'parallel.backend="nccl"'
  if python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
    step "throughput: PyTorch eager, same shape, 1 GPU" torch_throughput
    step "throughput (precision bf16): PyTorch eager under autocast, same shape, 1 GPU" \
      torch_autocast_throughput
  fi
  if [ "$ngpu" -gt 1 ]; then
    for strategy in ddp zero3; do
      step "throughput: GPT-2 124M shape, $ngpu GPUs over NCCL, $strategy" throughput \
        "gpu$ngpu-$strategy" launch "$ngpu" "$kiln" train --device cuda --strategy "$strategy" \
        --set 'parallel.backend="nccl"'
    done
  fi
fi

# --- several ranks sharing the GPU(s) (last: the slowest part of the check) ----------------
# Ranks as threads share GPUs round-robin (host-memory group): several ranks on one GPU.
# At 3 ranks each rank's third of the batch runs through other CUDA kernel shapes than the
# whole batch: on an H200 DDP, ZeRO-1 and ZeRO-3 all differ from one device by the same 1.3e-4
# (3.4e-5 after one step), as one device differs from the CPU (1.4e-4), while 2 and 4 ranks
# agree to 5e-8 and the CPU at 3 ranks to 1e-7. So 3 ranks are held to the device-vs-CPU bound.
for spec in ddp:2:1e-5 zero1:2:1e-5 zero2:3:1e-3 zero3:3:1e-3 hybrid:2:4:1e-5; do
  tol=${spec##*:} spec=${spec%:*}
  strategy=${spec%:*} ranks=${spec##*:}
  step "shard-check $strategy: $ranks thread ranks sharing the GPU(s), local group" \
    "$kiln" shard-check --device cuda --ranks "$ranks" --strategy "$strategy" --tolerance "$tol"
done

step "comm-bench: all-reduce over NCCL (host-staged) on $ngpu GPU(s)" \
  launch "$ngpu" "$bin/comm-bench" --backend nccl --max-size 64M

summary
