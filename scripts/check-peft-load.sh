#!/usr/bin/env bash
# Do the adapters kiln writes load in Hugging Face PEFT unchanged? For each tiny fixture base
# (Llama: nn.Linear; GPT-2: Conv1D, fan_in_fan_out), fine-tune a few steps with kiln, then load
# kiln's adapter directory with PeftModel.from_pretrained onto the base and compare its logits
# with those of kiln's merged model (--merge-into) loaded in transformers, and PEFT's
# merge_and_unload() weights with kiln's merged weights. Needs a Python with torch,
# transformers and peft (not needed by kiln or its tests):
#
#     PYTHON=/path/to/venv/bin/python bash scripts/check-peft-load.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
KILN=${KILN:-target/release/kiln}
[ -x "$KILN" ] || cargo build --release -p kiln-cli
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for base in tiny-llama tiny-gpt2; do
  dir=models/hf/tests/fixtures/$base
  targets=$([ "$base" = tiny-gpt2 ] && echo all-linear || echo q_proj,v_proj,down_proj)
  "$KILN" finetune --base "$dir" --targets "$targets" --lora-r 4 --steps 20 --set train.lr=1e-2 \
    --set train.seq_len=16 --set train.batch_size=4 --set train.sample_chars=0 \
    --set data.synthetic_chars=20000 --out "$out/$base" --merge-into "$out/$base-merged" \
    --overwrite >"$out/$base.log" 2>&1 || { cat "$out/$base.log" >&2; exit 1; }
  "$PYTHON" - "$dir" "$out/$base/adapter" "$out/$base-merged" <<'PY'
import sys, torch
from transformers import AutoModelForCausalLM
from peft import PeftModel
base_dir, adapter_dir, merged_dir = sys.argv[1:]
torch.manual_seed(0)
base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
peft = PeftModel.from_pretrained(base, adapter_dir)
merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
ids = torch.randint(0, merged.config.vocab_size, (2, 16))
with torch.no_grad():
    a, b = peft(ids).logits, merged(ids).logits
    plain = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)(ids).logits
rel = lambda x, y: ((x - y).abs().max() / y.abs().max()).item()
trained = rel(a, plain)
logits = rel(a, b)
n = sum(1 for m in peft.modules() if hasattr(m, "lora_A") and len(m.lora_A))
unloaded = peft.merge_and_unload().state_dict()
weights = max(rel(unloaded[k], v) for k, v in merged.state_dict().items() if k in unloaded)
print(f"{base_dir}: PEFT loaded {n} adapted modules; logits PEFT vs kiln merged {logits:.2e} "
      f"(the adapters move them {trained:.2e} from the base); merge_and_unload vs kiln's merged "
      f"weights {weights:.2e}")
assert n > 0 and trained > 1e-3 and logits < 1e-5 and weights < 1e-5, "mismatch"
PY
done
