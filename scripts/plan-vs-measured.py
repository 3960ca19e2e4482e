#!/usr/bin/env python3
"""`kiln plan`'s predictions against real `kiln train` / `kiln finetune` runs on this machine.

    cargo build --release -p kiln-cli && python3 scripts/plan-vs-measured.py [--steps 5]

For each layout: the peak memory per rank `kiln plan` predicts (its simulated step on shapes)
beside the peak the real run measured (kiln's per-rank heap counters, the worst rank, its
most demanding step), and the step time predicted on the calibrated "cpu" profile beside the
real run's median step time (steps 2..N). One sitting, nothing else running: the calibration
and the runs share the machine. Each layout's plan calibrates this machine afresh (`kiln plan
--recalibrate`) right after its run: this VM's speed drifts by 20% and more over minutes, and a
calibration kept from the sitting's start priced all the layouts of 2 ranks of a later sitting
22-33% fast.
"""
import argparse, json, os, shutil, statistics, subprocess, sys, tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KILN = os.path.join(os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target")), "release", "kiln")

MODEL = ["--set", "model.dim=256", "--set", "model.layers=4", "--set", "model.heads=8",
         "--set", "model.context=256", "--set", "train.seq_len=256", "--batch-size", "8"]
QUIET = ["--set", "train.eval_every=0", "--set", "train.sample_chars=0",
         "--set", "output.snapshot_every=0"]

LAYOUTS = [
    ("1 rank", ["--ranks", "1"]),
    ("ddp x2", ["--ranks", "2", "--strategy", "ddp"]),
    ("zero1 x2", ["--ranks", "2", "--strategy", "zero1"]),
    ("zero2 x2", ["--ranks", "2", "--strategy", "zero2"]),
    ("zero3 x2", ["--ranks", "2", "--strategy", "zero3"]),
    ("hybrid:2 x4", ["--ranks", "4", "--strategy", "hybrid:2"]),
    ("pp 2 gpipe, 4 mb", ["--ranks", "2", "--pp", "2", "--schedule", "gpipe", "--microbatches", "4"]),
    ("pp 2 1f1b, 4 mb", ["--ranks", "2", "--pp", "2", "--schedule", "1f1b", "--microbatches", "4"]),
    ("tp 2", ["--ranks", "2", "--tp", "2"]),
    ("remat balanced", ["--ranks", "1", "--remat", "balanced"]),
    ("remat budget=64MiB", ["--ranks", "1", "--remat", "budget=64MiB"]),
    ("bf16", ["--ranks", "1", "--precision", "bf16"]),
    ("zero3 x2 bf16", ["--ranks", "2", "--strategy", "zero3", "--precision", "bf16"]),
]


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    return p.stdout


def measured(cmd, out):
    shutil.rmtree(out, ignore_errors=True)
    run(cmd + ["--out", out])
    rows = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
    steps = [r for r in rows if "step" in r and "elapsed_s" in r]
    times = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(steps, steps[1:])]
    memory = next(r["memory"] for r in rows if "memory" in r)
    return max(m["peak"] for m in memory), statistics.median(times)


def predicted(cmd):
    plan = json.loads(run(cmd + ["--json"]))["plan"]
    return plan["peak"], plan["step_s"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="kiln-plan-check-")
    base = os.path.join(tmp, "base")
    # A LoRA base of the same shape: one step of training, exported.
    run([KILN, "train", "--ranks", "1", "--steps", "1", *MODEL, *QUIET, "--out", os.path.join(tmp, "b")])
    run([KILN, "export", os.path.join(tmp, "b"), "--out", base])
    layouts = [(n, ["train", *a]) for n, a in LAYOUTS] + [
        ("LoRA r 8", ["finetune", "--base", base, "--ranks", "1"]),
        ("QLoRA r 8", ["finetune", "--base", base, "--ranks", "1", "--qlora"]),
    ]
    print(f"{'layout':<20} {'peak plan':>11} {'peak real':>11} {'err':>7}   {'step plan':>10} {'step real':>10} {'err':>7}")
    worst_m, worst_t = 0.0, 0.0
    for name, a in layouts:
        common = [*a, *MODEL]
        real_peak, real_step = measured([KILN, *common, *QUIET, "--steps", str(args.steps)], os.path.join(tmp, "run"))
        plan_cmd = [KILN, "plan", *common[1:]]
        if a[0] == "finetune":
            plan_cmd = [KILN, "plan", *common[1:]]
        plan_peak, plan_step = predicted(plan_cmd + ["--recalibrate"])
        em = plan_peak / real_peak - 1
        et = plan_step / real_step - 1
        worst_m, worst_t = max(worst_m, abs(em)), max(worst_t, abs(et))
        mib = lambda b: f"{b / 2**20:.1f} MiB"
        print(f"{name:<20} {mib(plan_peak):>11} {mib(real_peak):>11} {100*em:>+6.1f}%   "
              f"{plan_step:>9.3f}s {real_step:>9.3f}s {100*et:>+6.1f}%", flush=True)
    print(f"worst: memory {100*worst_m:.1f}%, step time {100*worst_t:.1f}%")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
