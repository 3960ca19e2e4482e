#!/usr/bin/env bash
# LoRA and QLoRA fine-tuning against full fine-tuning of the same base, one rank, one sitting: a
# Llama of LAYERS blocks x DIM (the base dominates), pretrained for a few steps here so the runs
# start from a real checkpoint, then fine-tuned STEPS steps on the same data three ways. Prints
# trainable parameters, optimizer bytes, peak memory per step, seconds per step, the validation
# loss each reaches, and QLoRA's base bytes against the f32 base.
#
#     bash scripts/bench-lora.sh                       # 8 layers x 256, r=8 on q,k,v,o
#     R=16 TARGETS=all-linear bash scripts/bench-lora.sh
#     DROPOUT=0.05 bash scripts/bench-lora.sh             # the dropout of the fourth run
set -euo pipefail
cd "$(dirname "$0")/.."

LAYERS=${LAYERS:-8}
DIM=${DIM:-256}
HEADS=${HEADS:-8}
SEQ=${SEQ:-128}
STEPS=${STEPS:-12}
R=${R:-8}
TARGETS=${TARGETS:-q_proj,k_proj,v_proj,o_proj}
DROPOUT=${DROPOUT:-0.1}
DATA=${DATA:-synthetic}
KILN=${KILN:-target/release/kiln}
[ -x "$KILN" ] || cargo build --release -p kiln-cli
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

common=(--set train.seq_len="$SEQ" --set train.batch_size=8 --set train.eval_every=0
  --set train.eval_batches=2 --set train.sample_chars=0 --set output.snapshot_every=0
  --set train.warmup_steps=2 --data "$DATA")

echo "== Llama $LAYERS layers x d=$DIM, $SEQ tokens x 8 sequences per step, $STEPS steps, 1 rank; load: $(cut -d' ' -f1-3 /proc/loadavg)"
# The base: a few steps of pretraining, exported as a Hugging Face directory.
"$KILN" train --set model.kind=llama --set model.layers="$LAYERS" --set model.dim="$DIM" \
  --set model.heads="$HEADS" --set model.context="$SEQ" "${common[@]}" --steps 3 \
  --out "$out/pre" --overwrite >"$out/log" 2>&1 || { cat "$out/log" >&2; exit 1; }
"$KILN" export "$out/pre" --out "$out/base" >/dev/null

summarise() { # run dir, safetensors of what trains -> "trainable optimizer_bytes peak_bytes s_per_step val_loss"
  python3 - "$1/metrics.jsonl" "$2" <<'PY'
import json, struct, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
steps = [r for r in rows if "loss" in r and "step" in r]
# Seconds per step after the first (which pays one-time costs).
per_step = (steps[-1]["elapsed_s"] - steps[0]["elapsed_s"]) / max(len(steps) - 1, 1)
mem = next((r["memory"][0] for r in rows if "memory" in r), None)
val = [r["val_loss"] for r in rows if "val_loss" in r][-1]
with open(sys.argv[2], "rb") as f:
    header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
trainable = 0
for k, v in header.items():
    if k != "__metadata__":
        n = 1
        for d in v["shape"]:
            n *= d
        trainable += n
print(trainable, mem["optimizer"] if mem else 0, mem["peak"] if mem else 0, per_step, val)
PY
}

"$KILN" train --set model.from="$out/base" "${common[@]}" --steps "$STEPS" --set train.lr=1e-3 \
  --out "$out/full" --overwrite >"$out/full.log" 2>&1 || { cat "$out/full.log" >&2; exit 1; }
read -r f_params f_opt f_peak f_t f_val < <(summarise "$out/full" "$out/base/model.safetensors")
"$KILN" finetune --base "$out/base" "${common[@]}" --steps "$STEPS" --set train.lr=3e-3 \
  --lora-r "$R" --targets "$TARGETS" --out "$out/lora" --overwrite >"$out/lora.log" 2>&1 ||
  { cat "$out/lora.log" >&2; exit 1; }
read -r l_params l_opt l_peak l_t l_val < <(summarise "$out/lora" "$out/lora/adapter/adapter_model.safetensors")
"$KILN" finetune --base "$out/base" "${common[@]}" --steps "$STEPS" --set train.lr=3e-3 \
  --lora-r "$R" --targets "$TARGETS" --qlora --out "$out/qlora" --overwrite >"$out/qlora.log" 2>&1 ||
  { cat "$out/qlora.log" >&2; exit 1; }
read -r q_params q_opt q_peak q_t q_val < <(summarise "$out/qlora" "$out/qlora/adapter/adapter_model.safetensors")
"$KILN" finetune --base "$out/base" "${common[@]}" --steps "$STEPS" --set train.lr=3e-3 \
  --lora-r "$R" --targets "$TARGETS" --lora-dropout "$DROPOUT" --out "$out/drop" --overwrite >"$out/drop.log" 2>&1 ||
  { cat "$out/drop.log" >&2; exit 1; }
read -r d_params d_opt d_peak d_t d_val < <(summarise "$out/drop" "$out/drop/adapter/adapter_model.safetensors")
base_val=$(python3 -c "import json;print([json.loads(l)['val_loss'] for l in open('$out/lora/metrics.jsonl') if '\"val_loss\"' in l][0])")

printf '%-22s %14s %16s %14s %10s %10s\n' run "trainable" "optimizer MiB" "peak MiB" "s/step" "val loss"
printf '%-22s %14d %16.2f %14.1f %10.3f %10.4f\n' "full fine-tuning" "$f_params" \
  "$(echo "$f_opt/1048576" | bc -l)" "$(echo "$f_peak/1048576" | bc -l)" "$f_t" "$f_val"
printf '%-22s %14d %16.2f %14.1f %10.3f %10.4f\n' "LoRA r=$R" "$l_params" \
  "$(echo "$l_opt/1048576" | bc -l)" "$(echo "$l_peak/1048576" | bc -l)" "$l_t" "$l_val"
printf '%-22s %14d %16.2f %14.1f %10.3f %10.4f\n' "QLoRA r=$R" "$q_params" \
  "$(echo "$q_opt/1048576" | bc -l)" "$(echo "$q_peak/1048576" | bc -l)" "$q_t" "$q_val"
printf '%-22s %14d %16.2f %14.1f %10.3f %10.4f\n' "LoRA r=$R dropout $DROPOUT" "$d_params" \
  "$(echo "$d_opt/1048576" | bc -l)" "$(echo "$d_peak/1048576" | bc -l)" "$d_t" "$d_val"
printf 'LoRA / full: trainable %.4f, optimizer %.4f, peak %.2f, step time %.2f; validation loss of the base %.4f\n' \
  "$(echo "$l_params/$f_params" | bc -l)" "$(echo "$l_opt/$f_opt" | bc -l)" \
  "$(echo "$l_peak/$f_peak" | bc -l)" "$(echo "$l_t/$f_t" | bc -l)" "$base_val"
printf 'QLoRA / full: peak %.2f, step time %.2f; QLoRA - LoRA validation loss %+.4f\n' \
  "$(echo "$q_peak/$f_peak" | bc -l)" "$(echo "$q_t/$f_t" | bc -l)" "$(echo "$q_val-$l_val" | bc -l)"
printf 'LoRA with dropout / full: peak %.2f, step time %.2f\n' \
  "$(echo "$d_peak/$f_peak" | bc -l)" "$(echo "$d_t/$f_t" | bc -l)"
grep -o 'QLoRA: .*' "$out/qlora.log"
