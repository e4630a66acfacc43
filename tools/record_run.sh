#!/usr/bin/env bash
# The GPU runs behind a record, in one call on a device machine (GPU time comes in few, full
# calls, each at most 10 minutes): from the repository root there,
#
#   DGEMMA_BENCH_COMMIT=<sha> bash tools/record_run.sh [STAGE...]
#
# with .vllm_kernels/ copied beside the tree (tools/fetch_vllm_kernels.sh makes it; without it
# vLLM's paths are not timed and step1 is skipped). Stages, in the order given (default: all):
#
#   tests    the GPU suite, 4 workers (python -m pytest -m gpu -n 4; ~3 minutes on an H100)
#   runner   bench_runner.py --peaked --no-secondary: the step from hidden states against the
#            two-GEMM floor and vLLM 0.34's own path, all rows peaked
#   profile  tools/profile_step.py --hidden-states at 1, 4, 16, 32 requests: device time per
#            part of the step (head, statistics, operand, soft embedding, canvas update, rest)
#   step1    bench_step.py at 1 request from fp32 logits beside vLLM 0.33's kernel path
#
# Each stage runs through tools/on_device.sh (a log headed with card, versions, date, commit
# and command) under a time limit: its own (LIMIT_<STAGE> seconds) or what is left of BUDGET
# (default 560 s, inside one call's 600), whichever is less; a stage with less than 30 s left
# is skipped. After every stage the logs and the results of record the benchmarks wrote
# (bench/results/) are packed into $OUT/record.tgz (written aside, then moved), so a call cut
# short still brings back what ran. Exit status: the number of stages that failed or were
# skipped for time; 64 for an unknown stage.
set -uo pipefail
set -f  # stage names are split on spaces, never globbed
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${OUT:-/tmp/record}
budget=${BUDGET:-560}
stages=${*:-tests runner profile step1}
for name in $stages; do
    case $name in
        tests|runner|profile|step1) ;;
        *) echo "record_run: unknown stage $name (tests, runner, profile, step1)" >&2; exit 64 ;;
    esac
done
[ -n "${DGEMMA_BENCH_COMMIT:-}" ] || \
    echo "record_run: DGEMMA_BENCH_COMMIT is not set: the logs will name no commit" >&2
logs=$(mktemp -d)
vllm_kernels="$root/.vllm_kernels/diffusion_gemma_sampler.py"
with_vllm=()
if [ -f "$vllm_kernels" ]; then
    with_vllm=(--vllm-kernels "$vllm_kernels")
else
    echo "record_run: no $vllm_kernels: vLLM's own paths are not timed" >&2
fi
tag=$(cd "$root" && python -c "import sys; sys.path.insert(0, 'bench'); import record
print(record.card_tag(record.card_name()))") || tag=unknown

# One stage's command through on_device.sh, under the stage's name and limit.
run() { OUT=$logs LIMIT=$limit bash "$root/tools/on_device.sh" "$name" "$@"; }

failed=0
for name in $stages; do
    case $name in
        tests) limit=${LIMIT_TESTS:-240} ;;
        runner) limit=${LIMIT_RUNNER:-180} ;;
        profile) limit=${LIMIT_PROFILE:-150} ;;
        step1) limit=${LIMIT_STEP1:-90} ;;
    esac
    left=$((budget - SECONDS))
    [ "$limit" -le "$left" ] || limit=$left
    if [ "$limit" -lt 30 ]; then
        echo "record_run: $name skipped, ${left} s of the budget left" >&2
        failed=$((failed + 1))
        continue
    fi
    case $name in
        tests) run python -m pytest -q -m gpu -n 4 -p no:cacheprovider ../tests ;;
        runner) run python bench_runner.py --peaked --no-secondary "${with_vllm[@]}" ;;
        profile) run python ../tools/profile_step.py --hidden-states --requests 1,4,16,32 \
                     --out "$logs/profile-$tag.json" ;;
        step1)
            if [ ${#with_vllm[@]} -eq 0 ]; then
                echo "record_run: step1 skipped: it compares with vLLM 0.33's kernel path" >&2
                false
            else
                run python bench_step.py --requests 1 --no-compile "${with_vllm[@]}" \
                    --out "results/step-vllm033-1req-$tag.json"
            fi ;;
    esac
    rc=$?
    [ "$rc" -eq 0 ] || { echo "record_run: stage $name exited $rc" >&2; failed=$((failed + 1)); }
    mkdir -p "$out"
    tar -czf "$out/record.tgz.part" -C "$logs" . -C "$root" bench/results \
        && mv -f "$out/record.tgz.part" "$out/record.tgz"
done
exit "$failed"
