#!/usr/bin/env bash
# Run the GPU measurements on a GPU machine, in one go, from the repository root.
#
#   hack/device-gpu-bench.sh smoke   GPU tests (arena, scratch pool, CUDA checkpoint API, CRIU + CUDA round
#                                    trip, serve on CUDA), what a bare CUDA context costs in a checkpoint,
#                                    and a short Qwen3-0.6B run of the restore benchmark
#   hack/device-gpu-bench.sh full    the restore benchmark for Qwen3-0.6B and Qwen3-8B (3 repetitions)
#   hack/device-gpu-bench.sh check   the GPU tests (as smoke) and the product path at Qwen3-0.6B shapes, once
#                                    (`benchmarks/restore_bench.py`: cold, capture, restores, outputs compared);
#                                    needs the wheels in .whl as product does
#   hack/device-gpu-bench.sh product the product path, `benchmarks/restore_bench.py` (verification included), at
#                                    Qwen3-8B shapes. PRODUCT_STEPS (comma-separated, default model,main):
#                                    model (write the weight files), main (cold / hot / dropped with the
#                                    floor; REPEAT, COLD_DROPPED=1, PRESTAGE=1 for restores after the agent's
#                                    pre-staging, NO_DROP=1 for hot only, THP=always|madvise|never for the
#                                    node's transparent huge pages during the run), thp (hot restores with
#                                    THP_OTHER, default always, their own capture), verify (the store's verification
#                                    against SHA-256 and read baselines, 1.6 GiB), fill (CRIU's restorer
#                                    filling 1.77 GiB of memory against plain reads; again after TOUCH_GIB,
#                                    default 96, of memory is touched, and again beside CONTEND_READERS,
#                                    default 8, threads copying from the page cache; FILL_READERS, e.g. "1 8",
#                                    the restorer's readers to try, FILL_THP, default "always madvise"),
#                                    stagecopy (the weight stager's copy paths, 16 GiB, against the PCIe floor
#                                    and beside a CRIU-like reader; STAGE_VARIANTS, e.g. "buffered
#                                    mapped:256 mapped::16"), lazy
#                                    (restores with CRIU lazy pages), probe (what a bare CUDA context costs in
#                                    a checkpoint), kvfit (the KV cache sized to the GPU at 256 x 4096), levers
#                                    (each of LEVERS in turn, NAME set to 0 or NAME=VALUE, restores only), tests
#                                    (the engine's GPU tests), criu-sid (CRIU 4.2.1 from .dev/criu-sid)
#
# Needs root, an NVIDIA GPU with driver >= 570, python3 with torch, safetensors and cuda-bindings, and CRIU 4:
# WARMSTART_CRIU, or the portable folder made by hack/criu-setup copied to .dev/criu (and, for the product
# mode's CRIU 4.2.1 step, the one made with WARMSTART_CRIU_SUITE=sid in .dev/criu-sid). The product mode
# also needs what the machine's python lacks of warmstart's dependencies, as wheels in .whl (where only
# PyTorch's stack is installed: fastapi, starlette, uvicorn, pydantic, pydantic-settings and their needs,
# blake3, cryptography).
# Results go to $OUT (default benchmarks/results/local); scratch files to $BENCH_WORK (default
# /var/tmp/warmstart-gpu-bench).
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
    timeout 240 python3 -m pytest -q -p no:cacheprovider -p no:kube_plugin -p no:node_plugin -o addopts="" -rA \
        tests/test_serve.py::test_cuda_worker_restores_byte_identically 2>&1 | tee "$OUT/pytest-serve-cuda.txt" \
        | tail -5
}

# The product path at Qwen3-8B shapes: `benchmarks/restore_bench.py` with the engine flags of BENCHMARKS.md.
bench_restore() {  # NAME CRIU-COMMAND ARGS...: one bench run, its table and JSON in $OUT
    local name=$1 criu=$2
    shift 2
    echo "== bench restore: $name"
    rm -rf "$WORK/store"
    timeout "${STEP_TIMEOUT:-400}" python3 benchmarks/restore_bench.py --store "$WORK/store" --device cuda \
        --model qwen3-8b --worker-arg=--compile --worker-arg=--max-num-seqs=256 --worker-arg=--max-model-len=1024 \
        --criu "$criu" --markdown "$OUT/$name.md" --json "$OUT/$name.json" "$@" 2>&1 | tee "$OUT/$name.log" \
        | grep -v ' INFO ' | tail -22
}

product_deps() {  # what the machine's python lacks of warmstart's dependencies, from .whl
    if [[ -d .whl ]]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/ws-site .whl/*.whl || exit 4
        export PYTHONPATH=$PYTHONPATH:/tmp/ws-site
    fi
    export WARMSTART_CACHE=${WARMSTART_CACHE:-/tmp/wscache}
}

product() {  # STEPS (comma-separated): model main lazy probe kvfit levers tests criu-sid
    local steps=",$1,"
    product_deps
    for feature in uffd uffd-noncoop; do
        echo "criu check --feature $feature: $($WARMSTART_CRIU check --feature $feature 2>&1 | tail -1)"
    done
    if [[ "$steps" == *,fill,* ]]; then  # first: before the other steps' page cache takes the memory
        echo "== CRIU's restorer filling a process's memory, against plain reads"
        timeout 240 python3 benchmarks/criu_fill.py --size-gib 1.77 --dir "$WORK/fill" --criu "$WARMSTART_CRIU" \
            --touch-gib "${TOUCH_GIB:-96}" --contend-readers "${CONTEND_READERS:-8}" --readers ${FILL_READERS:-1} \
            --thp ${FILL_THP:-always madvise} 2>&1 | tee "$OUT/criu_fill.txt" \
            | tail -44
    fi
    if [[ "$steps" == *,stagecopy,* ]]; then
        echo "== the weight stager's copy paths"
        timeout 240 python3 benchmarks/stager_copy.py --size-gib 16 --dir "$WORK/stagecopy" \
            --variants ${STAGE_VARIANTS:-buffered mapped} ${THP:+--transparent-hugepages "$THP"} \
            $([[ -z "${NO_DROP:-}" ]] && echo --dropped) 2>&1 | tee "$OUT/stager_copy.txt" | tail -16
    fi
    if [[ "$steps" == *,model,* ]]; then  # the weight files exist before the first start, as on a real node
        echo "== Qwen3-8B shapes: weight files"
        python3 -c 'from warmstart.engines.builtin.model_dir import default_model_dir as d, ensure_model as e
e(d("qwen3-8b", 0, {}), "qwen3-8b", 0, {}, device="cuda")' || exit 5
    fi
    if [[ "$steps" == *,main,* ]]; then
        bench_restore main "$WARMSTART_CRIU" --repeat "${REPEAT:-1}" --lazy-pages "${LAZY_PAGES:-off}" \
            --logs "$OUT/logs" ${COLD_DROPPED:+--cold-dropped} ${PRESTAGE:+--prestage} \
            ${NO_DROP:+--no-drop-caches} ${THP:+--transparent-hugepages "$THP"}
    fi
    if [[ "$steps" == *,thp,* ]]; then
        bench_restore "thp-${THP_OTHER:-always}" "$WARMSTART_CRIU" --repeat "${REPEAT:-2}" --no-cold \
            --no-drop-caches --transparent-hugepages "${THP_OTHER:-always}" --logs "$OUT/thp-logs"
    fi
    if [[ "$steps" == *,verify,* ]]; then
        echo "== the store's verification, 1.6 GiB (a Qwen3-8B image) in 8 files"
        mkdir -p "$WORK/verify"
        timeout 200 python3 benchmarks/store_throughput.py --size-gib 1.6 --dir "$WORK/verify" 2>&1 \
            | tee "$OUT/store_throughput.txt" | tail -14
        rm -rf "$WORK/verify"
    fi
    if [[ "$steps" == *,lazy,* ]]; then  # its own capture: a hang under lazy pages cannot take main's table
        STEP_TIMEOUT=${LAZY_TIMEOUT:-150} bench_restore lazy-pages "$WARMSTART_CRIU" --repeat "${REPEAT:-1}" \
            --no-cold --lazy-pages on --logs "$OUT/lazy-logs"
    fi
    if [[ "$steps" == *,probe,* ]]; then
        echo "== what a CUDA checkpoint copies from a process holding no tensors"
        timeout 150 python3 benchmarks/cuda_context_probe.py 2>&1 | tee "$OUT/cuda_context_probe.md" | tail -7
    fi
    if [[ "$steps" == *,kvfit,* ]]; then
        echo "== KV cache sized to the GPU: 256 sequences x 4096 tokens asked for"
        timeout 150 python3 benchmarks/kv_fit.py 2>&1 | tee "$OUT/kv_fit.txt" | grep -v ' INFO ' | tail -6
    fi
    if [[ "$steps" == *,levers,* ]]; then
        for lever in ${LEVERS:-WARMSTART_SHRINK_LOCAL_MEMORY}; do
            [[ "$lever" == *=* ]] || lever="$lever=0"
            (export "$lever"; bench_restore "lever-${lever//=/-}" "$WARMSTART_CRIU" --repeat 2 --no-cold \
                --no-drop-caches ${THP:+--transparent-hugepages "$THP"})
        done
    fi
    if [[ "$steps" == *,tests,* ]]; then
        echo "== GPU tests of the builtin engine (release, reacquire, weight stager)"
        timeout "${TESTS_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider --confcutdir=tests/gpu -o addopts="" \
            -rA tests/engines/test_engine_gpu.py tests/gpu/test_cuda_arena.py 2>&1 | tee "$OUT/pytest-gpu.txt" | tail -8
    fi
    if [[ "$steps" == *,criu-sid,* && -x .dev/criu-sid/criu ]]; then
        local sid=$PWD/.dev/criu-sid
        bench_restore criu-4.2.1 "$sid/ld-linux-x86-64.so.2 --library-path $sid $sid/criu" --repeat 2 --no-cold \
            --no-drop-caches
    fi
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
product)
    product "${PRODUCT_STEPS:-model,main}"
    ;;
check)
    product_deps
    echo "== GPU tests"
    gpu_tests
    echo "== the product path at Qwen3-0.6B shapes: cold, capture, restores (outputs compared)"
    timeout "${STEP_TIMEOUT:-300}" python3 benchmarks/restore_bench.py --store "$WORK/store" --device cuda \
        --model qwen3-0.6b --repeat 1 --criu "$WARMSTART_CRIU" --markdown "$OUT/check.md" --json "$OUT/check.json" \
        2>&1 | tee "$OUT/check.log" | grep -v ' INFO ' | tail -22
    ;;
*)
    echo "usage: $0 smoke|full|product|check" >&2
    exit 2
    ;;
esac
