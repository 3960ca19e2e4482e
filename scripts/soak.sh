#!/usr/bin/env bash
# Soak test of recovery without a person (issue 33): induced failures over a 1-node 4-process job
# and a 2-node job (two network namespaces, 2 ranks each), each run to its last step by
# `kiln launch --max-restarts` alone, then compared with the same job run without failures.
#
#   scripts/soak.sh [FAILURES]          # default 100: half on each job
#
# Failures, drawn at random (seeded: SOAK_SEED), each at a random moment once the job trains
# again after the previous one:
#   kill      kill -9 of a random rank
#   snapshot  kill -9 of a random rank while a snapshot is being written (its .partial
#             directory exists; the script says how many it caught in the act)
#   stop      SIGSTOP of a random rank: a hang, which the launcher must name (--hang-timeout)
#   link      (2-node job) node 0's end of the link set down for longer than the collective
#             timeout, then up again
#
# It reports, per job: failures by kind; restarts and hangs the launcher counted; soak hangs
# (a recovery that did not happen within SOAK_RECOVERY_LIMIT seconds: must be 0); steps
# recomputed per failure (<= the snapshot interval, except for a failure while a snapshot is
# still being written asynchronously: then <= 2 intervals; the count of those is shown); time
# to recover (median, p95:
# from the failure's detection to the first step after it; a hang's detection takes
# --hang-timeout, a cut link's the collective timeout); the final validation loss against the
# uninterrupted run's (bitwise at the same world size). Exit status 0 only if every check holds.
#
# Needs a release build (cargo build --release -p kiln-cli), python3, and for the 2-node job
# root and iproute2's `ip` (without them that job is SKIPPED, saying why). Environment:
#   KILN=target/release/kiln  SOAK_DIR=/tmp/kiln-soak-PID  SOAK_SEED=1  SOAK_STEPS=5000
#   SOAK_EVERY=10 (snapshot interval)  SOAK_JOBS="one two"  SOAK_RECOVERY_LIMIT=120
#   SOAK_MEMORY_EVERY=0 (k > 0: also a snapshot in memory every k steps, --memory-snapshot-every;
#   the steps recomputed are then checked against k; in the 2-node job each node's memory is a
#   directory of its own, so a node's pieces come back from the copy on the other)
set -uo pipefail

FAILURES=${1:-100}
KILN=$(realpath "${KILN:-target/release/kiln}")
DIR=${SOAK_DIR:-/tmp/kiln-soak-$$}
SEED=${SOAK_SEED:-1}
STEPS=${SOAK_STEPS:-5000}
EVERY=${SOAK_EVERY:-10}
MEMORY_EVERY=${SOAK_MEMORY_EVERY:-0}
JOBS=${SOAK_JOBS:-one two}
LIMIT=${SOAK_RECOVERY_LIMIT:-120}
HANG=4          # --hang-timeout
COMM=5          # KILN_COMM_TIMEOUT
RANDOM=$SEED

[ -x "$KILN" ] || { echo "soak: no kiln binary at $KILN (cargo build --release -p kiln-cli)"; exit 2; }
command -v python3 >/dev/null || { echo "soak: needs python3"; exit 2; }
mkdir -p "$DIR"
echo "soak: $FAILURES failures, seed $SEED, $STEPS steps, a snapshot every $EVERY (in memory: every $MEMORY_EVERY); in $DIR"

# The default recipe's model (GPT-2, 2 layers, d=64) under ZeRO-3, validation every 100 steps.
train_args() { # OUT
    echo train --strategy zero3 --steps "$STEPS" --snapshot-every "$EVERY" \
        --memory-snapshot-every "$MEMORY_EVERY" \
        --set train.eval_every=100 --set train.sample_chars=0 --out "$1" --overwrite
}

rank_pids() { # LAUNCHER_PID...: the ranks (the launchers' children)
    for p in "$@"; do pgrep -P "$p"; done
}

recovered() { # LOG: how many restarts have trained again
    local n
    n=$(grep -ac "recovered: resumed" "$1" 2>/dev/null)
    [[ $n =~ ^[0-9]+$ ]] && echo "$n" || echo 0
}

# Waits until LOG shows N recoveries (or the launcher ended); 1 if it takes over $LIMIT s.
await_recovery() { # LOG N LAUNCHER_PID
    local start=$SECONDS
    while [ "$(recovered "$1")" -lt "$2" ]; do
        kill -0 "$3" 2>/dev/null || return 0
        if [ $((SECONDS - start)) -gt "$LIMIT" ]; then return 1; fi
        sleep 0.1
    done
}

# kill -9 of a random rank as soon as a snapshot is being written; prints "caught" if the
# .partial directory was there when the signal went.
kill_in_snapshot() { # SNAPSHOTS_DIR PID...
    python3 - "$@" <<'EOF'
import glob, os, random, sys, time
snaps, pids = sys.argv[1], [int(p) for p in sys.argv[2:]]
end = time.time() + 20
while time.time() < end:
    if glob.glob(os.path.join(snaps, ".step-*.partial")):
        try:
            os.kill(random.choice(pids), 9)
        except ProcessLookupError:
            continue
        print("caught" if glob.glob(os.path.join(snaps, ".step-*.partial")) else "missed")
        sys.exit(0)
    time.sleep(0.0005)
os.kill(random.choice(pids), 9)
print("missed")
EOF
}

# The figures of a run, from the launcher's --summary JSON and the metrics; prints a report and
# exits 1 if a check fails.
report() { # NAME SUMMARY RUN_DIR REFERENCE_DIR KINDS_FILE SOAK_HANGS CAUGHT
    # The interval a failure may cost: the memory snapshots' where they are kept.
    local interval=$EVERY
    [ "$MEMORY_EVERY" -gt 0 ] && interval=$MEMORY_EVERY
    python3 - "$@" "$interval" <<'EOF'
import json, statistics, sys
name, summary, run, ref, kinds, soak_hangs, caught, every = sys.argv[1:]
every = int(every)
s = json.load(open(summary))
def val(d):
    v = None
    for l in open(f"{d}/metrics.jsonl"):
        r = json.loads(l)
        if "val_loss" in r:
            v = r["val_loss"]
    return v
a, b = val(run), val(ref)
ks = open(kinds).read().split()
rs = s["restarts"]
rec = [r["recomputed"] for r in rs if r["recomputed"] is not None]
times = sorted(r["recover_s"] for r in rs if r["recover_s"] is not None)
def pct(p):
    import math
    return times[max(1, math.ceil(p / 100 * len(times))) - 1] if times else float("nan")
hangs = sum(1 for r in rs if r["hang"])
counts = {k: ks.count(k) for k in sorted(set(ks))}
ok = True
def check(cond, what):
    global ok
    print(f"  {'ok  ' if cond else 'FAIL'} {what}")
    ok &= cond
print(f"{name}: {len(ks)} induced failures {counts}; snapshot kills caught mid-write: {caught}")
print(f"  launcher: {len(rs)} restarts, {hangs} named hangs, exit {s['exit_code']}, {s['elapsed_s']:.0f}s; rounds' nodes: {sorted(set(map(tuple, s['rounds'])))}")
print(f"  steps recomputed per failure: max {max(rec) if rec else 'n/a'}, mean {statistics.mean(rec) if rec else float('nan'):.1f}, total {sum(rec)}")
print(f"  time to recover: median {pct(50):.2f}s, p95 {pct(95):.2f}s, max {times[-1] if times else float('nan'):.2f}s")
print(f"  final validation loss {a!r} vs uninterrupted {b!r}")
check(s["exit_code"] == 0, "the job ran to its last step with no person")
check(int(soak_hangs) == 0, f"0 hangs (recoveries that never came): {soak_hangs}")
check(len(rs) >= len(ks), f"every failure restarted the job ({len(rs)} restarts for {len(ks)} failures)")
check(hangs >= ks.count("stop"), f"every SIGSTOP named as a hang ({hangs} >= {ks.count('stop')})")
over = sum(1 for r in rec if r > every)
print(f"  failures that recomputed more than the snapshot interval ({every}): {over} (a failure while a snapshot was still being written: the one before is the latest)")
check(bool(rec) and max(rec) <= 2 * every, f"steps recomputed per failure <= 2 snapshot intervals ({2 * every}), <= 1 interval for {len(rec) - over} of {len(rec)}")
check(a is not None and a == b, "final validation loss bitwise equal to the uninterrupted run's")
sys.exit(0 if ok else 1)
EOF
}

# Runs the failure injection against a job; LAUNCHERS are the launcher pids, LOG node 0's log.
inject() { # N KINDS LOG SNAPSHOTS OUT_KINDS LAUNCHER_PID...
    local n=$1 kinds=$2 log=$3 snaps=$4 out=$5
    shift 5
    local launchers=("$@") i kind pids caught=0 hangs=0
    : >"$out"
    for ((i = 1; i <= n; i++)); do
        if ! await_recovery "$log" $((i - 1)) "${launchers[0]}"; then
            echo "  failure $i: the job did not recover within ${LIMIT}s"
            hangs=$((hangs + 1))
            break
        fi
        kill -0 "${launchers[0]}" 2>/dev/null || { echo "  the job ended after $((i - 1)) failures"; break; }
        # A random moment: 0.3 to 2.3 s after the job trains again.
        sleep "$(printf '0.%03d' $((RANDOM % 1000)))"
        sleep "$((RANDOM % 2)).$((RANDOM % 10))"
        read -ra k <<<"$kinds"
        kind=${k[$((RANDOM % ${#k[@]}))]}
        mapfile -t pids < <(rank_pids "${launchers[@]}")
        [ ${#pids[@]} -gt 0 ] || { i=$((i - 1)); continue; }
        local victim=${pids[$((RANDOM % ${#pids[@]}))]}
        case $kind in
            kill) kill -9 "$victim" 2>/dev/null ;;
            stop) kill -STOP "$victim" 2>/dev/null ;;
            snapshot) [ "$(kill_in_snapshot "$snaps" "${pids[@]}")" = caught ] && caught=$((caught + 1)) ;;
            link)
                ip -n "$NS0" link set ksoak0 down
                sleep $((COMM + 3))
                ip -n "$NS0" link set ksoak0 up
                ;;
        esac
        echo "$kind" >>"$out"
        printf '  failure %d: %s\n' "$i" "$kind"
    done
    echo "$hangs $caught"  # soak hangs, snapshot kills caught mid-write
}

status=0
HALF=$((FAILURES / 2))

if [[ " $JOBS " == *" one "* ]]; then
    echo "== one node, 4 processes =="
    ONE=$DIR/one
    mkdir -p "$ONE"
    echo "  the uninterrupted run..."
    KILN_COMM_TIMEOUT=$COMM "$KILN" launch --nproc-per-node 4 --master-port 0 -- \
        "$KILN" $(train_args "$ONE/reference") >"$ONE/reference.log" 2>&1 \
        || { echo "  the uninterrupted run failed: $ONE/reference.log"; exit 1; }
    KILN_COMM_TIMEOUT=$COMM "$KILN" launch --nproc-per-node 4 --master-port 0 \
        --max-restarts $((HALF + 20)) --hang-timeout $HANG --restart-backoff 0.2 \
        --summary "$ONE/summary.json" -- "$KILN" $(train_args "$ONE/run") >"$ONE/run.log" 2>&1 &
    LAUNCHER=$!
    read -r hangs caught < <(inject "$HALF" "kill snapshot stop" "$ONE/run.log" "$ONE/run/snapshots" "$ONE/kinds" "$LAUNCHER" | tee -a /dev/stderr | tail -1)
    wait "$LAUNCHER"
    report "one node, 4 processes" "$ONE/summary.json" "$ONE/run" "$ONE/reference" "$ONE/kinds" "$hangs" "$caught" || status=1
fi

if [[ " $JOBS " == *" two "* ]]; then
    echo "== two nodes (network namespaces), 2 processes each =="
    NS0=ksoak-$$-0
    NS1=ksoak-$$-1
    if [ "$(id -u)" != 0 ] || ! command -v ip >/dev/null; then
        echo "SKIPPED (two nodes): needs root and iproute2's ip for network namespaces"
    elif ! { ip netns add "$NS0" && ip netns add "$NS1" &&
        ip link add ksoak0 netns "$NS0" type veth peer name ksoak1 netns "$NS1" &&
        ip -n "$NS0" addr add 10.203.9.1/24 dev ksoak0 && ip -n "$NS1" addr add 10.203.9.2/24 dev ksoak1 &&
        ip -n "$NS0" link set ksoak0 up && ip -n "$NS1" link set ksoak1 up &&
        ip -n "$NS0" link set lo up && ip -n "$NS1" link set lo up; }; then
        echo "SKIPPED (two nodes): network namespaces cannot be made here"
    else
        trap 'ip netns del "$NS0" 2>/dev/null; ip netns del "$NS1" 2>/dev/null' EXIT
        TWO=$DIR/two
        mkdir -p "$TWO"
        node() { # NS NODE_RANK OUT LOG [restart flags...]
            local ns=$1 nr=$2 out=$3 log=$4
            shift 4
            # Each node's memory snapshots in a directory of its own, as machines' memories
            # are (the namespaces share one /dev/shm): the copies across nodes are exercised.
            KILN_MEMORY_SNAPSHOTS=$out.memory-$nr \
            KILN_JOB_TOKEN=soak-$$ KILN_COMM_TIMEOUT=$COMM ip netns exec "$ns" "$KILN" launch \
                --nnodes 2 --node-rank "$nr" --nproc-per-node 2 --master-addr 10.203.9.1 \
                --master-port 29650 "$@" -- "$KILN" $(train_args "$out") >"$log" 2>&1
        }
        echo "  the uninterrupted run..."
        node "$NS0" 0 "$TWO/reference" "$TWO/reference-0.log" & R0=$!
        node "$NS1" 1 "$TWO/reference" "$TWO/reference-1.log" & R1=$!
        wait $R0 && wait $R1 || { echo "  the uninterrupted run failed: $TWO/reference-*.log"; exit 1; }
        FLAGS=(--max-restarts $((FAILURES - HALF + 20)) --hang-timeout $HANG --restart-backoff 0.2
            --rdzv-timeout 60)
        node "$NS0" 0 "$TWO/run" "$TWO/run-0.log" "${FLAGS[@]}" --summary "$TWO/summary.json" & L0=$!
        node "$NS1" 1 "$TWO/run" "$TWO/run-1.log" "${FLAGS[@]}" & L1=$!
        # The launchers' own pids (under a subshell and `ip netns exec`).
        launcher_of() { pgrep -n -f -- "--node-rank $1 --nproc-per-node 2 --master-addr 10.203.9.1 --master-port 29650 --max-restarts"; }
        for _ in $(seq 100); do launcher_of 0 >/dev/null && launcher_of 1 >/dev/null && break; sleep 0.1; done
        read -r hangs caught < <(inject $((FAILURES - HALF)) "kill snapshot stop link" "$TWO/run-0.log" "$TWO/run/snapshots" "$TWO/kinds" "$(launcher_of 0)" "$(launcher_of 1)" | tee -a /dev/stderr | tail -1)
        wait $L0
        wait $L1
        report "two nodes" "$TWO/summary.json" "$TWO/run" "$TWO/reference" "$TWO/kinds" "$hangs" "$caught" || status=1
    fi
fi
exit $status
