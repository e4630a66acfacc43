#!/usr/bin/env bash
# The GPU runs behind a record, in one call on a device machine (GPU time comes in few, full
# calls): from the repository root there,
#
#   DGEMMA_BENCH_COMMIT=<sha> bash tools/record_run.sh [STAGE...]
#
# with .vllm_kernels/ copied beside the tree (tools/fetch_vllm_kernels.sh makes it; without it
# the stages time no vLLM path). Stages, in the order given (default: all four):
#
#   tests    the GPU suite, 4 workers (python -m pytest -m gpu -n 4; ~3 minutes on an H100)
#   runner   bench_runner.py --peaked --no-secondary: the step from hidden states against the
#            two-GEMM floor and vLLM 0.34's own path, all rows peaked (~2 minutes)
#   profile  tools/profile_step.py --hidden-states at 1, 4, 16, 32 requests: device time per
#            part of the step (head, statistics, operand, soft embedding, canvas update, rest)
#   step1    bench_step.py at 1 request from fp32 logits beside vLLM 0.33's kernel path
#
# Each stage runs through tools/on_device.sh (a log headed with card, versions, date, commit
# and command) under a time limit of its own (LIMIT_<STAGE> seconds), so a hang costs that
# stage and not the call. After every stage the logs and the results of record the benchmarks
# wrote (bench/results/) are packed into $OUT/record.tgz, so a call cut short still brings back
# what ran. The exit status is the number of stages that failed.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${OUT:-/tmp/record}
logs=$(mktemp -d)
vllm_kernels="$root/.vllm_kernels/diffusion_gemma_sampler.py"
with_vllm=()
if [ -f "$vllm_kernels" ]; then
    with_vllm=(--vllm-kernels "$vllm_kernels")
else
    echo "record_run: no $vllm_kernels: vLLM's own paths are not timed" >&2
fi
tag=$(cd "$root" && python -c "import sys; sys.path.insert(0, 'bench'); import record
print(record.card_tag(record.card_name()))")

stage() {
    local name=$1 limit=$2
    shift 2
    OUT=$logs LIMIT=$limit bash "$root/tools/on_device.sh" "$name" "$@"
}

failed=0
for s in "${@:-tests runner profile step1}"; do
    for name in $s; do
        case $name in
            tests) stage gpu-tests "${LIMIT_TESTS:-400}" \
                       python -m pytest -q -m gpu -n 4 -p no:cacheprovider ../tests ;;
            runner) stage runner "${LIMIT_RUNNER:-300}" \
                        python bench_runner.py --peaked --no-secondary "${with_vllm[@]}" ;;
            profile) stage profile "${LIMIT_PROFILE:-240}" \
                         python ../tools/profile_step.py --hidden-states --requests 1,4,16,32 \
                         --out "$logs/profile-$tag.json" ;;
            step1) stage step1 "${LIMIT_STEP1:-180}" \
                       python bench_step.py --requests 1 --no-compile "${with_vllm[@]}" \
                       --out "results/step-vllm033-1req-$tag.json" ;;
            *) echo "record_run: unknown stage $name (tests, runner, profile, step1)" >&2
               exit 2 ;;
        esac
        rc=$?
        [ "$rc" -eq 0 ] || { echo "record_run: stage $name exited $rc" >&2; failed=$((failed + 1)); }
        mkdir -p "$out"
        tar -czf "$out/record.tgz" -C "$logs" . -C "$root" bench/results
    done
done
exit "$failed"
