#!/usr/bin/env bash
# vLLM capture/restore measurements on a GPU machine without a package index, from the repository root.
#
#   hack/device-vllm-prepare.sh                      here: build .dev/vllm (vLLM 0.26.0 in chunks + small wheels)
#   hack/device-vllm-bench.sh stage .dev/vllm/part_aa  there: keep one carried chunk outside the tree
#   hack/device-vllm-bench.sh run                     there: unpack vLLM (once), then benchmarks/vllm_bench.py
#
# CRIU >= 4.2 (4.1.1 cannot dump inet sockets on kernels 6.16+): WARMSTART_CRIU, or the portable folder made by
# `WARMSTART_CRIU_SUITE=sid hack/criu-setup` copied to .dev/criu-sid. Results go to $OUT (default
# benchmarks/results/local); scratch to $BENCH_WORK (default /var/tmp/warmstart-vllm), the model to $MODEL_DIR.
# $STEPS picks the benchmark's steps (its --help lists them); `cold` is a separate cold start of the same spec;
# $SHAPE a Qwen3 size for a model written anew (qwen3-0.6b, qwen3-8b, qwen3-14b; give it its own $MODEL_DIR).
# Every start's greedy token ids and logprobs are compared with the capture's and the first cold start's
# (results.json: vs_own_capture, vs_<capture step>, vs_cold; the log ends with one line per start).
set -uo pipefail
cd "$(dirname "$0")/.."
STAGE=${VLLM_STAGE:-/root/warmstart-vllm-stage}
SITE=${VLLM_SITE:-/root/warmstart-vllm-site}
case "${1:-}" in
stage)
    mkdir -p "$STAGE" && cp "$2" "$STAGE/" && ls -la "$STAGE"
    exit 0
    ;;
run) ;;
*)
    echo "usage: $0 stage FILE | run" >&2
    exit 2
    ;;
esac
OUT=${OUT:-benchmarks/results/local}
WORK=${BENCH_WORK:-/var/tmp/warmstart-vllm}
MODEL_DIR=${MODEL_DIR:-/var/tmp/qwen3-8b-shapes}
mkdir -p "$OUT"
if [[ ! -d "$SITE/vllm" ]]; then
    [[ -f .dev/vllm/SHA256 ]] || { echo "carry .dev/vllm/SHA256 and .dev/vllm/small" >&2; exit 2; }
    cat "$STAGE"/part_* > "$STAGE/vllm.tar.xz"
    [[ $(sha256sum "$STAGE/vllm.tar.xz" | cut -d' ' -f1) == $(cat .dev/vllm/SHA256) ]] || { echo "vLLM chunks damaged" >&2; exit 3; }
    mkdir -p "$SITE" && tar -C "$SITE" -xJf "$STAGE/vllm.tar.xz" && rm "$STAGE/vllm.tar.xz"
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .dev/vllm/small/*.whl || exit 4
fi
# Bytecode for vLLM's packages and this tree, as an installed package has it (pip compiles at install; the
# wheels and the tree came without): otherwise every start, `vllm serve`'s and `warmstart serve`'s alike,
# compiles each module it imports (benchmarks/serve_start.py measures what that costs). Up-to-date files are
# skipped.
python3 -m compileall -q -j 0 "$SITE" warmstart >/dev/null 2>&1 || true
if [[ -z "${WARMSTART_CRIU:-}" && -x .dev/criu-sid/criu ]]; then
    C=$PWD/.dev/criu-sid
    export WARMSTART_CRIU="$C/ld-linux-x86-64.so.2 --library-path $C $C/criu"
fi
: "${WARMSTART_CRIU:=criu}"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_USE_FLASHINFER_SAMPLER=0
[[ -n "${TCP_ESTABLISHED:-}" ]] && { printf 'tcp-established\n' > /tmp/warmstart-criu.conf; export CRIU_CONFIG_FILE=/tmp/warmstart-criu.conf; }
[[ "$WORK" == *warmstart* ]] && rm -rf "$WORK"
mkdir -p "$WORK"
echo "== machine"
date -u
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
python3 -c 'import sys, torch, vllm; print("python", sys.version.split()[0], "torch", torch.__version__, "vllm", vllm.__version__)' 2>&1 | tail -1
echo "cpus $(nproc), $(free -g | awk '/Mem:/{print $2}') GiB RAM, kernel $(uname -r), $(df -h /var/tmp | tail -1)"
$WARMSTART_CRIU --version | head -1
echo "transparent hugepages: $(cat /sys/kernel/mm/transparent_hugepage/enabled)"
# vLLM's server imports more than its engine: a missing module is found here, not after the model loads.
python3 -c 'import vllm.entrypoints.openai.api_server' 2>&1 | tail -3 || exit 5
python3 benchmarks/vllm_bench.py --criu "$WARMSTART_CRIU" --model "$MODEL_DIR" --work "$WORK" --out "$OUT" \
    ${STEPS:+--steps "$STEPS"} ${SHAPE:+--shape "$SHAPE"} 2>&1 | tee "$OUT/vllm_bench.log"
