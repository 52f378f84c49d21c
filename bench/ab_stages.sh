#!/usr/bin/env bash
# Before/after measurements of the serving targets in one command, on one GPU:
#
#     bench/ab_stages.sh [-o DIR] [-b BASE_TREE] STAGE...
#
# With -b, every comparing stage runs twice, first in BASE_TREE (a checkout or an extracted
# `git archive` of the baseline commit; results tagged `base`) and then in this checkout
# (tagged `new`), on the same machine, back to back: the ratios are what to quote. Without -b
# only this checkout runs. Stages (each under its own timeout, results under DIR, default
# bench/results/<GPU name>/ab):
#   tests    the GPU tests (engine == reference, kernels against PyTorch, image crops)
#   load     load_gen: query3 on a repeated 800x600 picture at c=64, unique ones at c=1 and 64
#   itl      arrival_itl: 16 caption streams, then the same with 20 req/s of new images
#   mixed    mixed_steps: mixed-step time vs tokens, image path per tiling, prefix forward
#   step     step_bench: decode period at 1 / 8 / 32 streams, blocking vs pipelined
#   vision   profile_decode --vision: the tower per crop count, kernels, SDPA backends
#   prefix   profile_decode --prefix: the BOS + image forward's kernels (this checkout only)
#   image    image_bench: host CPU and GPU time per 800x600 and 12 MP JPEG, split as with an
#            engine process, and decoded by the JPEG engines where nvImageCodec is installed
#            (this checkout)
#   timeline request_timeline: where a c=1 request's time goes (this checkout)
#   sweep    itl and unique-image load (c=1, c=64) once per server flag set in SWEEP,
#            "name|flags;name|flags" (this checkout; results tagged itl_NAME, load_NAME),
#            e.g. SWEEP="fp8|--vision-fp8 true;fp8_g96|--vision-fp8 true --prefill-sms 96"
#
# Environment: PYTHON (default python3); VLM_BENCH_CKPT, the checkpoint folder (a random
# moondream2-size one is written there when missing); SERVER_FLAGS, the flags of `vlm serve`
# after --model (default: --device cuda --dtype bf16 --max-batch-size 64); ITL_CLIENT_PROCESSES,
# how many client processes read the caption streams of the itl and sweep stages (default 1:
# one client loop, whose own lag lands in the gaps it measures); AB_SMOKE=1 runs
# the load, itl and sweep stages on the CPU with the tiny preset: a check of this script, not of
# the hardware.

set -uo pipefail
export PYTHONUNBUFFERED=1
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
OUT= BASE=
while getopts "o:b:" opt; do
    case $opt in
        o) OUT=$OPTARG ;;
        b) BASE=$(cd "$OPTARG" && pwd) || exit 1 ;;
        *) sed -n '2,33p' "$0"; exit 2 ;;
    esac
done
shift $((OPTIND - 1))
(($#)) || { sed -n '2,33p' "$0"; exit 2; }
PRESET=moondream2 FLAGS="--device cuda --dtype bf16 --max-batch-size 64"
if [[ ${AB_SMOKE:-0} == 1 ]]; then
    GPU=cpu-smoke PRESET=tiny FLAGS="--device cpu --dtype fp32 --max-batch-size 8"
else
    GPU=$(PYTHONPATH=$REPO $PY -c 'import torch
print(torch.cuda.get_device_name().replace(" ", "_"))' 2>/dev/null) \
        || { echo "ab_stages: needs a CUDA device (AB_SMOKE=1 checks the script on the CPU)" >&2
             exit 1; }
fi
OUT=${OUT:-$REPO/bench/results/$GPU/ab}
mkdir -p "$OUT"
CKPT=${VLM_BENCH_CKPT:-${TMPDIR:-/tmp}/vlm-bench-$PRESET}
if [[ ! -f $CKPT/model.safetensors ]]; then
    echo "=== writing a random $PRESET checkpoint to $CKPT"
    PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} $PY -m vlm_server.cli make-checkpoint "$CKPT" --preset "$PRESET" \
        > "$OUT/checkpoint.log" 2>&1 || { tail "$OUT/checkpoint.log"; exit 1; }
fi
read -r -a SRV <<< "--model $CKPT ${SERVER_FLAGS:-$FLAGS}"
# A smoke run keeps every level short.
LOAD_ARGS=(--requests 600 --duration 8 --warmup 8)
ITL_ARGS=(--duration 10 --client-processes "${ITL_CLIENT_PROCESSES:-1}")
if [[ ${AB_SMOKE:-0} == 1 ]]; then
    LOAD_ARGS=(--requests 6 --duration 2 --warmup 0)
    ITL_ARGS=(--duration 2 --warmup 1 --client-processes "${ITL_CLIENT_PROCESSES:-1}")
fi

trees() {  # the trees a comparing stage runs in, baseline first
    [[ -n $BASE ]] && echo "base:$BASE"
    echo "new:$REPO"
}

in_tree() {  # TREE LIMIT CMD...: run CMD in TREE, with TREE first on PYTHONPATH
    local tree=$1 limit=$2
    shift 2
    (cd "$tree" && PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" timeout "$limit" "$@")
}

for stage in "$@"; do
    echo "=== $stage"
    case $stage in
        tests)
            in_tree "$REPO" 300 $PY -m pytest -q -m gpu tests/test_engine_gpu.py \
                tests/test_decoding_sampling.py tests/test_image_normalize.py \
                tests/test_image_resample.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -3 ;;
        load)
            for t in $(trees); do
                in_tree "${t#*:}" 240 $PY -m bench.load_gen --spawn \
                    --scenario query3:800x600:repeated:c64 --scenario query3:800x600:unique:c1,c64 \
                    "${LOAD_ARGS[@]}" --quiet --out "$OUT" \
                    --tag "load_${t%%:*}" -- "${SRV[@]}" 2>&1 | grep -A5 "^scenario"
            done ;;
        itl)
            for t in $(trees); do
                in_tree "${t#*:}" 180 $PY -m bench.arrival_itl --spawn --streams 16 --rate 20 \
                    "${ITL_ARGS[@]}" --quiet --out "$OUT" --tag "itl_${t%%:*}" -- "${SRV[@]}" \
                    2>&1 | tail -10
            done ;;
        mixed)
            for t in $(trees); do
                mkdir -p "$OUT/mixed_${t%%:*}"
                in_tree "${t#*:}" 240 $PY -m bench.mixed_steps --out "$OUT/mixed_${t%%:*}" \
                    2>&1 | grep -v "it/s\]" | tail -40
            done ;;
        step)
            for t in $(trees); do
                mkdir -p "$OUT/step_${t%%:*}"
                in_tree "${t#*:}" 180 $PY -m bench.step_bench --preset moondream2 \
                    --streams 1 8 32 --tokens 128 --out "$OUT/step_${t%%:*}" 2>&1 | tail -8
            done ;;
        vision)
            for t in $(trees); do
                echo "--- ${t%%:*}"
                in_tree "${t#*:}" 120 $PY -m bench.profile_decode --vision 2>&1 \
                    | tee "$OUT/vision_${t%%:*}.log" | grep -A5 "^crops"
            done ;;
        prefix)
            in_tree "$REPO" 120 $PY -m bench.profile_decode --prefix --top 18 2>&1 \
                | tee "$OUT/prefix_profile.log" | grep -A24 "=== BOS" ;;
        image)
            in_tree "$REPO" 240 $PY -m bench.image_bench --device cuda \
                --sizes 800x600 4000x3000 --formats jpeg --resize vips --threads 1 8 \
                --normalize-device cuda --out "$OUT/image" 2>&1 | tail -8
            in_tree "$REPO" 240 $PY -m bench.image_bench --device cuda \
                --sizes 800x600 4000x3000 --formats jpeg --threads 1 --split \
                --out "$OUT/image_split" 2>&1 | tail -6
            # The JPEG engines, where nvImageCodec is installed (src ms: their decode).
            if PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} $PY -c "import nvidia.nvimgcodec" \
                2>/dev/null; then
                in_tree "$REPO" 240 $PY -m bench.image_bench --device cuda \
                    --sizes 800x600 1920x1080 4000x3000 --formats jpeg --resize vips \
                    --threads 1 8 --normalize-device cuda --gpu-decode-min-pixels 1 \
                    --gpu-decoder nvimgcodec --out "$OUT/image_engines" 2>&1 | tail -9
            fi ;;
        timeline)
            in_tree "$REPO" 300 $PY -m bench.request_timeline --out "$OUT/timeline" 2>&1 \
                | grep -v "it/s\]" | tail -40 ;;
        sweep)
            IFS=';' read -r -a SETS <<< "${SWEEP:?the sweep stage needs SWEEP=\"name|flags;...\"}"
            for set in "${SETS[@]}"; do
                name=${set%%|*} EXTRA=()
                read -r -a EXTRA <<< "${set#*|}"
                echo "--- $name: ${EXTRA[*]}"
                in_tree "$REPO" 180 $PY -m bench.arrival_itl --spawn --streams 16 --rate 20 \
                    "${ITL_ARGS[@]}" --quiet --out "$OUT" --tag "itl_$name" \
                    -- "${SRV[@]}" "${EXTRA[@]}" 2>&1 | grep -E "^arrivals:|^server side"
                in_tree "$REPO" 240 $PY -m bench.load_gen --spawn \
                    --scenario query3:800x600:unique:c1,c64 "${LOAD_ARGS[@]}" --quiet \
                    --out "$OUT" --tag "load_$name" -- "${SRV[@]}" "${EXTRA[@]}" 2>&1 \
                    | grep -A3 "^scenario"
            done ;;
        *) echo "ab_stages: unknown stage $stage" >&2; exit 2 ;;
    esac
done
echo "results in $OUT"
