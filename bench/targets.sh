#!/usr/bin/env bash
# Every serving target on one GPU, in about 10 minutes, into bench/results/<GPU>/targets.json:
#
#     bench/targets.sh [STEP...]        # STEPs: tower step image load arrivals (default: all)
#
# Steps, each under its own `timeout` and all within TARGETS_BUDGET_S seconds:
#   checkpoint  seeded random moondream2-size checkpoint for the served steps (vlm
#               make-checkpoint), written in the background while `tower` and `step` run
#               (they time GPU work); reused when present
#   tower       python -m bench.tower_probe --tower-only --tower-crops 9: the vision tower, bf16
#               and with FP8 GEMMs
#   step        python -m bench.step_bench --streams 1 32: the pipelined decode period
#   image       python -m bench.image_bench: host CPU and SM time of an 800x600 and a 12 MP
#               JPEG, one thread
#   load        python -m bench.load_gen --spawn: query3 on unique pictures at c=1 and c=64,
#               reason64 (a grounded-reasoning query) on unique pictures at c=1, query3 on
#               one repeated picture at c=64, caption128 on unique pictures at c=32
#   arrivals    python -m bench.arrival_itl --spawn: the server's step gaps with 16 captions
#               streaming, then with 20 new pictures a second as well
#   lora        (only when named) python -m bench.lora_bench: the decode period of 32 captions
#               over 8 rank-32 finetune adapters against none, and step gaps while adapters load
#   cap24       (only when named) query3 on unique pictures at c=64 with the server's GPU memory
#               capped at 24 GiB (rows suffixed _24gb)
#
# TARGETS_FAMILY=md3 measures Moondream 3 instead (rows md3.*; default steps: step load): a
# seeded random moondream3-preview checkpoint in the author's layout with FP8 experts, its
# decode period, query3 (c=1, c=64) and segment (c=1, c=16) on unique pictures.
# After each step its rows are merged into targets.json (python -m bench.targets collect), so a
# partial or interrupted run updates only the rows it measured. A table of the file comes last.
#
# Each step's raw output and console log go to RAW/<step>/ (emptied first). Everything is
# generated locally: no network is needed. This checkout is put first on PYTHONPATH.
#
# Environment:
#   PYTHON               interpreter (default: python3)
#   VLM_BENCH_CKPT       checkpoint folder (default: ${TMPDIR:-/tmp}/vlm-bench-moondream2)
#   TARGETS_FAMILY       md2 (default) or md3
#   TARGETS_FLAGS        server flags of `load` and `arrivals`, after --model (default below:
#                        md2 the server's defaults with --max-batch-size 64; md3 the same
#                        and FP8 vision, its one flag of record left: FP8 expert activations
#                        and the 96-SM partition are the defaults now)
#   TARGETS_IMAGE_FLAGS  extra image_bench flags (default: the JPEG engines; "" for the host path)
#   TARGETS_COMMIT       the tree measured (default: git's HEAD, "+dirty" with local changes)
#   TARGETS_FILE         the file to update (default: bench/results/<GPU>/targets.json)
#   TARGETS_RAW          raw outputs and logs (default: bench/results/<GPU>/targets-raw)
#   TARGETS_BUDGET_S     total seconds for all steps (default 600)
#   TARGETS_SMOKE=1      a few seconds per step on the CPU with the tiny preset: checks this
#                        script itself, not the hardware (bench/results/cpu-smoke, rows tiny.*)

set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
SMOKE=${TARGETS_SMOKE:-0}
BUDGET=${TARGETS_BUDGET_S:-600}
START=$(date +%s)
DEADLINE=$((START + BUDGET))

FAMILY=${TARGETS_FAMILY:-md2}
case $FAMILY in
    md2) ALL_STEPS=(tower step image load arrivals) ;;
    md3) ALL_STEPS=(step load) ;;
    *) echo "targets: TARGETS_FAMILY is md2 or md3, not $FAMILY" >&2; exit 2 ;;
esac
OPTIONAL_STEPS=(lora cap24)  # run only when named
STEPS=("$@")
((${#STEPS[@]})) || STEPS=("${ALL_STEPS[@]}")
for s in "${STEPS[@]}"; do
    [[ " ${ALL_STEPS[*]} ${OPTIONAL_STEPS[*]} " == *" $s "* ]] || { echo "targets: unknown step $s (choose from: ${ALL_STEPS[*]} ${OPTIONAL_STEPS[*]})" >&2; exit 2; }
done
wanted() { [[ " ${STEPS[*]} " == *" $1 "* ]]; }

if [[ $SMOKE == 1 ]]; then
    GPU=cpu-smoke
    PREFIX=tiny
else
    if ! DEVICE=$($PY -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"
print(torch.cuda.get_device_name())'); then
        echo "targets: needs a CUDA device visible to torch (TARGETS_SMOKE=1 checks the script" \
             "on the CPU)" >&2
        exit 1
    fi
    GPU=$($PY -m bench.targets gpu-folder "$DEVICE")
    PREFIX=$FAMILY
fi
TARGETS=${TARGETS_FILE:-bench/results/$GPU/targets.json}
RAW=${TARGETS_RAW:-bench/results/$GPU/targets-raw}
if [[ -z ${TARGETS_COMMIT:-} ]]; then
    TARGETS_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
    if [[ $TARGETS_COMMIT != unknown ]] \
        && [[ -n $(git status --porcelain --untracked-files=no -- . ':!bench/results' 2>/dev/null) ]]; then
        TARGETS_COMMIT="$TARGETS_COMMIT+dirty"
    fi
fi
if [[ $SMOKE == 1 ]]; then
    CKPT=${VLM_BENCH_CKPT:-${TMPDIR:-/tmp}/vlm-bench-tiny}
    SERVER=(--device cpu --dtype fp32)
    read -r -a EXTRA <<< "${TARGETS_FLAGS:-}"
else
    if [[ $FAMILY == md3 ]]; then
        CKPT=${VLM_BENCH_CKPT:-${TMPDIR:-/tmp}/vlm-bench-moondream3}
    else
        CKPT=${VLM_BENCH_CKPT:-${TMPDIR:-/tmp}/vlm-bench-moondream2}
    fi
    # The server's defaults for both families (an FP8-expert Moondream 3 build takes the FP8
    # tower and FP8 expert activations by default: --vision-fp8 and
    # --experts-fp8-activations auto).
    DEFAULT_FLAGS="--device cuda --dtype bf16 --max-batch-size 64"
    read -r -a EXTRA <<< "${TARGETS_FLAGS:-$DEFAULT_FLAGS}"
    SERVER=()
fi
SERVER=(--model "$CKPT" "${SERVER[@]}" "${EXTRA[@]}")
read -r -a IMAGE_FLAGS <<< "${TARGETS_IMAGE_FLAGS---gpu-decode-min-pixels 1 --gpu-decoder nvimgcodec}"
mkdir -p "$RAW"
: > "$RAW/steps.tsv"
echo "targets: ${STEPS[*]} on ${DEVICE:-the CPU (smoke)}; tree $TARGETS_COMMIT; into $TARGETS;" \
     "raw output in $RAW; budget ${BUDGET}s"

# Seconds a step may take: its own limit, less what the steps after it are kept (RESERVE).
step_limit() {  # OWN RESERVE
    local left=$((DEADLINE - $(date +%s) - $2))
    echo $(($1 < left ? $1 : left))
}

# Run one step under `timeout` (which signals the step's process group, so a spawned server
# is drained too) with its output in RAW/NAME/, then merge its rows into the targets file.
STEP_PID=
run_step() {  # NAME LIMIT CMD...
    local name=$1 limit=$2 start rc status
    shift 2
    local dir=$RAW/$name
    rm -rf "$dir" && mkdir -p "$dir"
    if ((limit < 20)); then
        printf '%s\t%s\t%s\n' "$name" "skipped (no time left)" 0 >> "$RAW/steps.tsv"
        echo "=== $name: skipped, no time left in the budget"
        return
    fi
    echo "=== $name (at most ${limit}s, $(($(date +%s) - START))s in): $*"
    start=$(date +%s)
    timeout --kill-after=20 "$limit" "$@" > >(tee "$dir/console.log") 2>&1 &
    STEP_PID=$!
    wait "$STEP_PID"
    rc=$?
    STEP_PID=
    case $rc in
        0) status=ok ;;
        124 | 137) status="timeout after ${limit}s" ;;
        *) status="failed (exit $rc)" ;;
    esac
    printf '%s\t%s\t%s\n' "$name" "$status" "$(($(date +%s) - start))" >> "$RAW/steps.tsv"
    echo "=== $name: $status in $(($(date +%s) - start))s"
    # What the step measured counts even when it stopped early (load_gen writes each level).
    $PY -m bench.targets collect "$dir" --targets "$TARGETS" --commit "$TARGETS_COMMIT" \
        --prefix "$PREFIX" --suffix "${COLLECT_SUFFIX:-}" || echo "=== $name: no rows"
}

CKPT_PID=
cleanup() {
    local pid
    for pid in $STEP_PID $CKPT_PID; do
        kill -0 "$pid" 2>/dev/null && kill -TERM "$pid" 2>/dev/null
    done
    wait 2>/dev/null
}
trap cleanup EXIT
trap 'echo "targets: interrupted" >&2; exit 130' INT TERM

# ---- checkpoint, in the background ----------------------------------------------------------
CKPT_OK=1
if wanted load || wanted arrivals || wanted cap24 || { [[ $FAMILY == md3 ]] && wanted step; }; then
    if [[ -f $CKPT/tokenizer.json && -f $CKPT/config.json ]]; then
        echo "=== checkpoint: reusing $CKPT"
        CKPT_OK=0
    else
        rm -rf "$CKPT.partial"
        if [[ $SMOKE == 1 ]]; then
            PRESET=(--preset tiny)
        elif [[ $FAMILY == md3 ]]; then
            PRESET=(--preset moondream3-preview --layout legacy)  # FP8 experts, as published
        else
            PRESET=(--preset moondream2)
        fi
        echo "=== checkpoint: writing a random ${PRESET[*]} checkpoint to $CKPT in the background"
        mkdir -p "$RAW/checkpoint"
        timeout 300 $PY -m vlm_server.cli make-checkpoint "$CKPT.partial" "${PRESET[@]}" \
            > "$RAW/checkpoint/console.log" 2>&1 &
        CKPT_PID=$!
    fi
fi
wait_checkpoint() {
    [[ -n $CKPT_PID ]] || return "$CKPT_OK"
    local rc
    wait "$CKPT_PID"
    rc=$?
    CKPT_PID=
    if ((rc == 0)) && mv "$CKPT.partial" "$CKPT"; then
        echo "=== checkpoint: written in $(($(date +%s) - START))s"
        CKPT_OK=0
    else
        echo "=== checkpoint: failed (exit $rc), see $RAW/checkpoint/console.log"
    fi
    return "$CKPT_OK"
}

# ---- steps ---------------------------------------------------------------------------------
if wanted tower; then
    if [[ $SMOKE == 1 ]]; then
        printf '%s\t%s\t%s\n' tower "skipped (needs CUDA)" 0 >> "$RAW/steps.tsv"
        echo "=== tower: skipped (needs CUDA)"
    else
        run_step tower "$(step_limit 90 420)" \
            $PY -m bench.tower_probe --tower-only --tower-crops 9 --json "$RAW/tower/tower.json"
    fi
fi

if wanted step; then
    if [[ $FAMILY == md3 ]]; then
        if wait_checkpoint; then
            run_step step "$(step_limit 150 300)" $PY -m bench.step_bench --model "$CKPT" \
                --streams 1 32 --tokens 64 --depths 2 --out "$RAW/step"
        else
            printf '%s\t%s\t%s\n' step "skipped (no checkpoint)" 0 >> "$RAW/steps.tsv"
        fi
    elif [[ $SMOKE == 1 ]]; then
        run_step step "$(step_limit 120 60)" $PY -m bench.step_bench --preset tiny --streams 1 2 \
            --tokens 8 --depths 2 --dtype fp32 --no-graphs --kv-gib 0 --out "$RAW/step"
    else
        run_step step "$(step_limit 120 330)" $PY -m bench.step_bench --preset moondream2 \
            --streams 1 32 --tokens 64 --depths 2 --out "$RAW/step"
    fi
fi

# The image step times host CPU: it runs once the checkpoint is no longer being written.
if wanted load || wanted arrivals || wanted cap24; then wait_checkpoint; fi

if wanted image; then
    if [[ $SMOKE == 1 ]]; then
        run_step image "$(step_limit 60 60)" $PY -m bench.image_bench --sizes 800x600 \
            --formats jpeg --threads 1 --images 2 --min-seconds 0.2 --out "$RAW/image"
    else
        run_step image "$(step_limit 90 240)" $PY -m bench.image_bench --device cuda \
            --sizes 800x600 4000x3000 --formats jpeg --resize vips --threads 1 \
            --normalize-device cuda "${IMAGE_FLAGS[@]}" --out "$RAW/image"
    fi
fi

if wanted load; then
    if ((CKPT_OK != 0)); then
        printf '%s\t%s\t%s\n' load "skipped (no checkpoint)" 0 >> "$RAW/steps.tsv"
    elif [[ $FAMILY == md3 ]]; then
        run_step load "$(step_limit 240 60)" $PY -m bench.load_gen --spawn \
            --scenario query3:800x600:unique:c1,c64 --scenario segment:800x600:unique:c1,c16 \
            --requests 400 --duration 8 --warmup 6 --time-budget 150 --quiet --out "$RAW/load" \
            -- "${SERVER[@]}"
    elif [[ $SMOKE == 1 ]]; then
        run_step load "$(step_limit 120 60)" $PY -m bench.load_gen --spawn \
            --scenario query3:800x600:unique:c1 --scenario reason64:800x600:unique:c1 \
            --scenario caption128:800x600:unique:c1 --requests 3 --duration 3 --warmup 1 --quiet --out "$RAW/load" -- "${SERVER[@]}"
    else
        # Most important first: a level past the time budget is skipped.
        run_step load "$(step_limit 220 120)" $PY -m bench.load_gen --spawn \
            --scenario query3:800x600:unique:c1,c64 --scenario reason64:800x600:unique:c1 \
            --scenario query3:800x600:repeated:c64 \
            --scenario caption128:800x600:unique:c32 --requests 600 --duration 8 --warmup 8 \
            --time-budget 120 --quiet --out "$RAW/load" -- "${SERVER[@]}"
    fi
fi

if wanted arrivals; then
    if ((CKPT_OK != 0)); then
        printf '%s\t%s\t%s\n' arrivals "skipped (no checkpoint)" 0 >> "$RAW/steps.tsv"
    elif [[ $SMOKE == 1 ]]; then
        run_step arrivals "$(step_limit 120 0)" $PY -m bench.arrival_itl --spawn --streams 16 \
            --rate 20 --duration 2 --warmup 1 --caption-tokens 8 --quiet --out "$RAW/arrivals" \
            -- "${SERVER[@]}"
    else
        run_step arrivals "$(step_limit 150 0)" $PY -m bench.arrival_itl --spawn --streams 16 \
            --rate 20 --duration 10 --client-processes 4 --quiet --out "$RAW/arrivals" \
            -- "${SERVER[@]}"
    fi
fi

if wanted lora; then
    if [[ $SMOKE == 1 ]]; then
        run_step lora "$(step_limit 120 0)" $PY -m bench.lora_bench --preset tiny --dtype fp32 \
            --streams 4 --tokens 12 --adapters 3 --load-streams 2 --load-tokens 200 --loads 2 \
            --warmup 0.3 --kv-gib 0.05 --out "$RAW/lora"
    else
        run_step lora "$(step_limit 300 0)" $PY -m bench.lora_bench --preset moondream2 \
            --streams 32 --adapters 8 --rank 32 --out "$RAW/lora"
    fi
fi

if wanted cap24; then
    if ((CKPT_OK != 0)); then
        printf '%s\t%s\t%s\n' cap24 "skipped (no checkpoint)" 0 >> "$RAW/steps.tsv"
    else
        COLLECT_SUFFIX=_24gb run_step cap24 "$(step_limit 150 0)" $PY -m bench.load_gen --spawn \
            --scenario query3:800x600:unique:c64 --requests 400 --duration 8 --warmup 6 \
            --time-budget 90 --quiet --out "$RAW/cap24" -- "${SERVER[@]}" --gpu-memory-bytes 24GiB
    fi
fi

echo
echo "targets: finished in $(($(date +%s) - START))s"
column -t -s $'\t' "$RAW/steps.tsv" 2>/dev/null || cat "$RAW/steps.tsv"
echo
$PY -m bench.targets show "$TARGETS"
