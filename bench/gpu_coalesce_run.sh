#!/usr/bin/env bash
# The coalescing comparison on the GPU: every model, the threshold sweep and tests/gpu, each
# step's log and JSON under $OUT; a failing (or hanging: per-step timeout) step does not stop
# the next one. Run from the repository root once the GPU kit is installed (DEVELOPERS.md,
# "GPU tests on the H200"), e.g.
#     source .gpu/kit/install.sh && OUT=$OUT bash bench/gpu_coalesce_run.sh
#     OUT=$OUT bash bench/gpu_coalesce_run.sh moe mixed threshold     # a subset, in this order
# Steps: moe mixed dense large threshold tests (default: all, ~10-12 min on one H200), and
# moe-one-buffer / mixed-one-buffer (the model with each rank's sources and targets as views of
# one buffer: the m2n lane reshards the stacks in place). API_MARKS=1 adds each model step's
# public-API timeline (bench/api_marks.py) under $OUT/api-marks-<step>. A model step suffixed
# -thread or -process (dense-thread, moe-process) hosts the store on a thread of trainer rank 0
# or in a process of its own instead of rank 0's event loop (--store). ITERS=N times each
# model step's fast paths N times (--iters; the bench's default, 5, otherwise): the medians of
# more rounds narrow the ratios' run-to-run spread at a few seconds a step. SETTLE=F passes
# --settle F (how long a rank waits after each timed call, times that call; 0: not at all).
set -u
OUT=${OUT:-/tmp/m2n-gpu-out}
mkdir -p "$OUT"
PY=${PY:-python3}
STEP_TIMEOUT=${STEP_TIMEOUT:-480}
JSON="$OUT/bench-gpu.jsonl"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(moe mixed dense large threshold tests)

run_step() {  # name, command...
    local name=$1; shift
    local t0=$SECONDS
    echo "== $name: $*" | tee -a "$OUT/steps.log"
    timeout -k 20 "$STEP_TIMEOUT" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "   $name: rc=$rc, $((SECONDS - t0)) s" | tee -a "$OUT/steps.log"
    # the table and the GOAL lines are printed last
    sed -n '/^== model\|^== threshold/,$p' "$OUT/$name.log" | tee -a "$OUT/goals.log"
    [ $rc -ne 0 ] && tail -n 30 "$OUT/$name.log"
    return 0
}

{ nvidia-smi -L; "$PY" -c "import torch; print('torch', torch.__version__)"; \
  "$PY" -c "from m2n_async._data import _cuda; print('libnccl', _cuda.libnccl_version())"; \
  git log --oneline -1; } >"$OUT/env.log" 2>&1

for s in "${steps[@]}"; do
    extra=()
    [ -n "${API_MARKS:-}" ] && extra=(--api-marks "$OUT/api-marks-$s")
    [ -n "${ITERS:-}" ] && extra+=(--iters "$ITERS")
    [ -n "${SETTLE:-}" ] && extra+=(--settle "$SETTLE")
    case $s in
        moe|mixed|dense|large)
            run_step "$s" "$PY" bench/gpu_sync_bench.py --model "$s" --timeout 420 --out "$JSON" \
                ${extra[@]+"${extra[@]}"} ;;
        moe-thread|mixed-thread|dense-thread|large-thread|moe-process|mixed-process|dense-process|large-process)
            run_step "$s" "$PY" bench/gpu_sync_bench.py --model "${s%-*}" --store "${s##*-}" \
                --no-broadcast --timeout 420 --out "$JSON" ${extra[@]+"${extra[@]}"} ;;
        moe-one-buffer|mixed-one-buffer)  # each stack's members back to back in one buffer
            run_step "$s" "$PY" bench/gpu_sync_bench.py --model "${s%-one-buffer}" --one-buffer \
                --no-broadcast --timeout 420 --out "$JSON" ${extra[@]+"${extra[@]}"} ;;
        threshold)
            run_step threshold "$PY" bench/gpu_sync_bench.py --threshold-sweep --timeout 420 \
                --out "$JSON" ;;
        tests)
            STEP_TIMEOUT=${TESTS_TIMEOUT:-900} run_step tests env M2N_GPU_REPORT="$OUT/gpu-report.jsonl" "$PY" -m pytest tests/gpu \
                -q -rs -p no:cacheprovider ;;
        *) echo "unknown step $s (moe mixed dense large, each -thread or -process too;" \
               "moe-one-buffer mixed-one-buffer threshold tests)" | tee -a "$OUT/steps.log" ;;
    esac
done
echo "done: $OUT/steps.log, $OUT/goals.log, $JSON" | tee -a "$OUT/steps.log"
