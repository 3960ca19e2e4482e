#!/usr/bin/env bash
# Pipeline parallelism's bubble, measured: per stage, compute, time waiting for neighbours and
# the schedule's time per step; the idle share of the whole schedule beside (p-1)/(v m + p-1);
# peak activation bytes per stage under GPipe and 1F1B; the bubble these stages leave in theory
# (the schedule replayed with each pass's measured time), which tells the cut's imbalance from
# the pipeline's own overhead. Part 1: GPT-2 with real compute on 2
# stages (threads). Part 2: 4 and 8 stages as processes, each pass a fixed delay (the machine
# has 2 cores), so the schedule itself is measured.
#
#     bash scripts/bench-pipeline.sh
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p kiln-pipe --example pipeline_bench
echo "load: $(cut -d' ' -f1-3 /proc/loadavg)"
target/release/examples/pipeline_bench
