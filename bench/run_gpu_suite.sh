#!/usr/bin/env bash
# The whole GPU benchmark suite in one command, inside 10 minutes on one GPU:
#
#     bench/run_gpu_suite.sh [RESULTS_DIR]       # default: bench/results/<GPU name>
#
# Steps, each under its own `timeout` and all within SUITE_BUDGET_S seconds:
#   checkpoint   seeded random moondream2-size checkpoint for the server (vlm make-checkpoint),
#                written in the background while `sampling` and `hf_baseline` run (it takes
#                one or two CPU cores; those two steps time GPU work), reused when present
#   sampling     python -m bench.bench_sampling (mask + top-p sampling per step)
#   hf_baseline  transformers PhiForCausalLM of moondream2's text size: generate with the
#                dynamic and the static compiled cache at batch 1 and 8, generate_batch 32 x 64
#   step_bench   engine decode steps at 1/8/32 streams, blocking vs pipelined
#   load_gen     gRPC load generator against `vlm serve` on the checkpoint (spawned, bf16)
#   image_bench  image pipeline alone (decode + tile + normalize), CPU threads
# then a summary table against the targets (python -m bench.suite_summary RESULTS_DIR).
#
# Everything is generated locally: no network is needed. This checkout is put first on
# PYTHONPATH and any PYTHONPATH already set (e.g. extra packages) is kept after it. Each step
# logs to RESULTS_DIR/logs/<step>.log; results are JSON + PNG in RESULTS_DIR; a step that
# fails or times out is recorded in RESULTS_DIR/suite_steps.tsv and the suite goes on.
#
# Environment:
#   PYTHON          interpreter (default: python3)
#   VLM_BENCH_CKPT  checkpoint folder (default: ${TMPDIR:-/tmp}/vlm-bench-moondream2)
#   SUITE_BUDGET_S  total seconds for all steps (default 585)
#   SUITE_SLO_MS    end-to-end objective for the load generator's goodput (default 250)
#   SUITE_SMOKE=1   a few seconds per step on the CPU with the tiny preset: checks this
#                   script itself, not the hardware (default results: bench/results/cpu-smoke)

set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
SMOKE=${SUITE_SMOKE:-0}
BUDGET=${SUITE_BUDGET_S:-585}
SLO_MS=${SUITE_SLO_MS:-250}
SUITE_START=$(date +%s)
DEADLINE=$((SUITE_START + BUDGET))

if [[ $SMOKE == 1 ]]; then
    GPU=cpu-smoke
else
    if ! GPU=$($PY -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"
print(torch.cuda.get_device_name().replace(" ", "_"))'); then
        echo "run_gpu_suite: needs a CUDA device visible to torch (SUITE_SMOKE=1 checks the" \
             "script on the CPU)" >&2
        exit 1
    fi
fi
OUT=${1:-bench/results/$GPU}
LOGS=$OUT/logs
STEPS=$OUT/suite_steps.tsv
mkdir -p "$LOGS"
: > "$STEPS"
CKPT=${VLM_BENCH_CKPT:-${TMPDIR:-/tmp}/vlm-bench-moondream2}
[[ $SMOKE == 1 ]] && CKPT=${VLM_BENCH_CKPT:-${TMPDIR:-/tmp}/vlm-bench-tiny}
echo "benchmark suite: results in $OUT, checkpoint $CKPT, budget ${BUDGET}s"

# Seconds a step may take: its own limit, less what the steps after it are kept (RESERVE).
step_limit() {  # OWN RESERVE
    local left=$((DEADLINE - $(date +%s) - $2))
    echo $(($1 < left ? $1 : left))
}

# Run one step under `timeout` (which signals the step's whole process group, so a spawned
# server is drained too), log it, and record its status and duration.
run_step() {  # NAME LIMIT CMD...
    local name=$1 limit=$2 start rc status
    shift 2
    if ((limit < 20)); then
        printf '%s\t%s\t%s\n' "$name" "skipped (no time left)" 0 >> "$STEPS"
        echo "=== $name: skipped, no time left in the budget"
        return
    fi
    echo "=== $name (at most ${limit}s): $*"
    start=$(date +%s)
    # In the background and waited on, so that Ctrl-C or SIGTERM reaches the trap at once.
    timeout --kill-after=20 "$limit" "$@" > >(tee "$LOGS/$name.log") 2>&1 &
    STEP_PID=$!
    wait "$STEP_PID"
    rc=$?
    STEP_PID=
    case $rc in
        0) status=ok ;;
        124 | 137) status="timeout after ${limit}s" ;;
        *) status="failed (exit $rc)" ;;
    esac
    printf '%s\t%s\t%s\n' "$name" "$status" "$(($(date +%s) - start))" >> "$STEPS"
}

# ---- checkpoint, in the background -----------------------------------------------------------
CKPT_PID=
STEP_PID=
cleanup() {
    # `timeout` passes the signal on to its command's process group (a spawned server too).
    local pid
    for pid in $STEP_PID $CKPT_PID; do
        kill -0 "$pid" 2>/dev/null && kill -TERM "$pid" 2>/dev/null
    done
    wait 2>/dev/null
}
trap cleanup EXIT
trap 'echo "run_gpu_suite: interrupted" >&2; exit 130' INT TERM

CKPT_START=$(date +%s)
if [[ -f $CKPT/model.safetensors && -f $CKPT/tokenizer.json && -f $CKPT/config.json ]]; then
    printf '%s\t%s\t%s\n' checkpoint "reused $CKPT" 0 >> "$STEPS"
    echo "=== checkpoint: reusing $CKPT"
else
    # A private folder renamed into place: an interrupted write is never taken as complete.
    rm -rf "$CKPT.partial"
    if [[ $SMOKE == 1 ]]; then PRESET=tiny; else PRESET=moondream2; fi
    echo "=== checkpoint: writing a random $PRESET checkpoint in the background"
    timeout 300 $PY -m vlm_server.cli make-checkpoint "$CKPT.partial" --preset "$PRESET" \
        > "$LOGS/checkpoint.log" 2>&1 &
    CKPT_PID=$!
fi

wait_checkpoint() {
    if [[ -z $CKPT_PID ]]; then return 0; fi
    local rc
    wait "$CKPT_PID"
    rc=$?
    CKPT_PID=
    if ((rc == 0)) && mv "$CKPT.partial" "$CKPT"; then
        printf '%s\t%s\t%s\n' checkpoint "ok (background)" "$(($(date +%s) - CKPT_START))" \
            >> "$STEPS"
        return 0
    fi
    printf '%s\t%s\t%s\n' checkpoint "failed (exit $rc)" "$(($(date +%s) - CKPT_START))" \
        >> "$STEPS"
    return 1
}

# ---- steps -------------------------------------------------------------------------------------
if [[ $SMOKE == 1 ]]; then
    printf '%s\t%s\t%s\n' sampling "skipped (needs CUDA)" 0 >> "$STEPS"
    run_step hf_baseline "$(step_limit 120 60)" \
        $PY -m bench.hf_baseline --tiny --repeats 1 --cb-runs 1 --out "$OUT"
else
    run_step sampling "$(step_limit 60 420)" $PY -m bench.bench_sampling --out "$OUT"
    run_step hf_baseline "$(step_limit 170 240)" $PY -m bench.hf_baseline --out "$OUT"
fi

wait_checkpoint
CKPT_OK=$?

if [[ $SMOKE == 1 ]]; then
    run_step step_bench "$(step_limit 120 40)" \
        $PY -m bench.step_bench --preset tiny --streams 1 2 --tokens 8 --dtype fp32 \
        --no-graphs --kv-gib 0 --out "$OUT"
else
    run_step step_bench "$(step_limit 150 150)" \
        $PY -m bench.step_bench --preset moondream2 --streams 1 8 32 --tokens 128 --out "$OUT"
fi

if ((CKPT_OK != 0)); then
    printf '%s\t%s\t%s\n' load_gen "skipped (no checkpoint)" 0 >> "$STEPS"
else
    if [[ $SMOKE == 1 ]]; then
        LIMIT=$(step_limit 90 20)
        SCENARIOS=(--scenario query3:64x48:unique:c1,c2 --scenario caption64:64x48:unique:c1
                   --scenario detect5:64x48:unique:c1 --scenario query3:64x48:repeated:c1
                   --scenario query3:64x48:unique:r4)
        SERVER=(--model "$CKPT" --device cpu --dtype fp32)
        SIZING=(--requests 3 --duration 3 --warmup 1)
    else
        LIMIT=$(step_limit 240 30)
        # Most important first: later levels are skipped when the time budget runs out.
        SCENARIOS=(--scenario query3:800x600:unique:c1,c4,c16,c64
                   --scenario query30:800x600:unique:c1,c4,c16,c64
                   --scenario caption64:800x600:unique:c1,c16
                   --scenario detect5:800x600:unique:c1,c16
                   --scenario point5:800x600:unique:c1,c16
                   --scenario segment:800x600:unique:c1,c16
                   --scenario query3:800x600:repeated:c1,c64
                   --scenario query3:4000x3000:unique:c1,c16
                   --scenario query3:800x600:unique:r20,r50)
        SERVER=(--model "$CKPT" --device cuda --dtype bf16 --max-batch-size 64)
        SIZING=(--requests 128 --duration 6 --warmup 4)
    fi
    # Keep ~70 s of the step's limit for the server's start (load, graph capture) and stop.
    run_step load_gen "$LIMIT" \
        $PY -m bench.load_gen --spawn "${SCENARIOS[@]}" "${SIZING[@]}" --slo-ms "$SLO_MS" \
        --time-budget $((LIMIT > 100 ? LIMIT - 70 : LIMIT / 3)) --out "$OUT" -- "${SERVER[@]}"
fi

if [[ $SMOKE == 1 ]]; then
    run_step image_bench "$(step_limit 60 0)" \
        $PY -m bench.image_bench --sizes 64x48 --threads 1 2 --images 2 --min-seconds 0.1 \
        --out "$OUT"
else
    run_step image_bench "$(step_limit 75 0)" \
        $PY -m bench.image_bench --min-seconds 0.5 --out "$OUT"
fi

echo
echo "benchmark suite finished in $(($(date +%s) - SUITE_START))s; results in $OUT"
$PY -m bench.suite_summary "$OUT"
