#!/usr/bin/env bash
# The GPU tests natively and as smaller chips would run them (--chip-profile, chip_features.py),
# on one CUDA machine:
#
#     tests/run_gpu_profiles.sh [PROFILE...]    # default: native rtx3090 rtx4090 a100
#
# Each profile runs `pytest -m gpu` with VLM_CHIP_PROFILE set (none for "native") under its own
# time limit, writing JUnit XML and a log to RESULTS/<profile>.{xml,log}; a table of passed,
# failed, errors and skipped per profile (every profile with results in RESULTS, this run's or
# an earlier call's) and the slowest tests comes last. Profiles can be split over several calls
# on the same RESULTS folder.
#
# Environment:
#   RESULTS              folder of the XML and logs (default: ${TMPDIR:-/tmp}/gpu-profiles)
#   GPU_PROFILE_BUDGET_S seconds per profile (default 420); a profile cut short is marked so
#   PYTEST_ARGS          extra pytest arguments (e.g. "-k engine" or a list of files)
#   PYTHON               interpreter (default python3)

set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
RESULTS=${RESULTS:-${TMPDIR:-/tmp}/gpu-profiles}
BUDGET=${GPU_PROFILE_BUDGET_S:-420}
mkdir -p "$RESULTS"
profiles=("$@")
[[ ${#profiles[@]} -eq 0 ]] && profiles=(native rtx3090 rtx4090 a100)

for p in "${profiles[@]}"; do
    echo "== $p (limit ${BUDGET}s)"
    env_profile=()
    [[ $p != native ]] && env_profile=(VLM_CHIP_PROFILE="$p")
    rm -f "$RESULTS/$p.cut"
    # shellcheck disable=SC2086  # PYTEST_ARGS is a list of arguments
    env "${env_profile[@]}" timeout "$BUDGET" "$PY" -m pytest -q -p no:cacheprovider -m gpu \
        --junitxml="$RESULTS/$p.xml" ${PYTEST_ARGS:-} > "$RESULTS/$p.log" 2>&1
    rc=$?
    [[ $rc -eq 124 || $rc -eq 137 ]] && touch "$RESULTS/$p.cut"
    tail -3 "$RESULTS/$p.log"
done
"$PY" -m tests.support.profile_results "$RESULTS"
