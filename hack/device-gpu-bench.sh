#!/usr/bin/env bash
# Run the GPU measurements on a GPU machine, in one go, from the repository root.
#
#   hack/device-gpu-bench.sh smoke   GPU tests (arena, scratch pool, CUDA checkpoint API, CRIU + CUDA round
#                                    trip, serve on CUDA), what a bare CUDA context costs in a checkpoint,
#                                    and a short Qwen3-0.6B run of the restore benchmark
#   hack/device-gpu-bench.sh full    the restore benchmark for Qwen3-0.6B and Qwen3-8B (3 repetitions)
#
# Needs root, an NVIDIA GPU with driver >= 570, python3 with torch, safetensors and cuda-bindings, and CRIU 4:
# WARMSTART_CRIU, or the portable folder made by hack/criu-setup copied to .dev/criu. Results go to $OUT
# (default benchmarks/results/local); scratch files to $BENCH_WORK (default /var/tmp/warmstart-gpu-bench).
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-smoke}
OUT=${OUT:-benchmarks/results/local}
WORK=${BENCH_WORK:-/var/tmp/warmstart-gpu-bench}
[[ "$WORK" == *warmstart* ]] && rm -rf "$WORK"  # our own scratch directory: start clean, the disk is small
mkdir -p "$OUT" "$WORK"
# tests/ too: the GPU tests run with --confcutdir=tests/gpu and share tests/support.py
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH} PYTHONDONTWRITEBYTECODE=1
if [[ -z "${WARMSTART_CRIU:-}" && -x .dev/criu/criu ]]; then
    C=$PWD/.dev/criu
    export WARMSTART_CRIU="$C/ld-linux-x86-64.so.2 --library-path $C $C/criu"
fi
: "${WARMSTART_CRIU:=criu}"

echo "== machine"
date -u
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
python3 -c 'import sys, torch, cuda.bindings, safetensors; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda-bindings", cuda.bindings.__version__, "safetensors", safetensors.__version__)'
echo "cpus $(nproc), $(free -g | awk '/Mem:/{print $2}') GiB RAM, kernel $(uname -r)"
df -h "$WORK" | tail -1
$WARMSTART_CRIU --version | head -1
$WARMSTART_CRIU check 2>&1 | tail -1

# The GPU tests alone: the suite's top-level conftest pulls in the control-plane plugin, not needed here.
gpu_tests() {
    timeout 300 python3 -m pytest -q -p no:cacheprovider --confcutdir=tests/gpu -o addopts="" -rA tests/gpu \
        tests/engines/test_engine_gpu.py 2>&1 | tee "$OUT/pytest-gpu.txt" | tail -25
    timeout 240 python3 -m pytest -q -p no:cacheprovider -p no:kube_plugin -o addopts="" -rA \
        tests/test_serve.py::test_cuda_worker_restores_byte_identically 2>&1 | tee "$OUT/pytest-serve-cuda.txt" \
        | tail -5
}

case "$MODE" in
smoke)
    echo "== GPU tests"
    gpu_tests

    echo "== what a CUDA checkpoint copies from a process holding no tensors"
    timeout 120 python3 benchmarks/cuda_context_probe.py 2>&1 | tee "$OUT/cuda_context_probe.md"

    echo "== floors + short Qwen3-0.6B restore run"
    python3 benchmarks/gpu_restore.py run --criu "$WARMSTART_CRIU" --work "$WORK" --out "$OUT" \
        --models qwen3-0.6b --reps 1 --cold-reps 1 --floors-gib "${FLOORS_GIB:-8}" \
        ${FLOORS_JSON:+--floors-json "$FLOORS_JSON"} --modes "${MODES:-optimised,naive}" \
        --compile-models "${COMPILE_MODELS:-}" --max-num-seqs "${MAX_NUM_SEQS:-16}" \
        --budget-s "${BUDGET_S:-330}" 2>&1 | tee "$OUT/gpu_restore.log"
    ;;
full)
    [[ -n "${WITH_TESTS:-}" ]] && { echo "== GPU tests"; gpu_tests; }
    python3 benchmarks/gpu_restore.py run --criu "$WARMSTART_CRIU" --work "$WORK" --out "$OUT" \
        --models "${MODELS:-qwen3-0.6b,qwen3-8b}" --reps "${REPS:-3}" --cold-reps "${COLD_REPS:-1}" \
        --floors-gib "${FLOORS_GIB:-0}" ${FLOORS_JSON:+--floors-json "$FLOORS_JSON"} \
        --naive-reps "${NAIVE_REPS:-0}" --modes "${MODES:-optimised,naive}" --compile-models "${COMPILE_MODELS:-}" \
        --max-num-seqs "${MAX_NUM_SEQS:-64}" --refill-threads "${REFILL_THREADS:-8}" \
        --stage-weights "${STAGE_WEIGHTS:-on}" \
        --caches "${CACHES:-hot,dropped}" --budget-s "${BUDGET_S:-540}" 2>&1 | tee "$OUT/gpu_restore.log"
    ;;
*)
    echo "usage: $0 smoke|full" >&2
    exit 2
    ;;
esac
