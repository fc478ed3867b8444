#!/usr/bin/env bash
# The real-node testbed `make test` uses, on a GPU machine that reaches no package index: control plane,
# kubelet, containerd, runc, CNI, kube-proxy, CoreDNS, NVIDIA's device plugin and the chart's image, then the
# GPU end-to-end tests (tests/kube/test_gpu_e2e.py). From the repository root:
#
#   hack/device-kube-gpu.sh prepare [all|base|image|keda]
#                                          here: .dev/kube-gpu/ holds what the GPU machine lacks, compressed
#                                          and split into chunks below the transfer limit (PART_BYTES): the
#                                          base once (binaries, node packages, wheels), the chart's image
#                                          after every code change; KEDA and its HTTP add-on (optional:
#                                          their test skips without them) once, when built
#   hack/device-kube-gpu.sh stage FILE...  there: keep carried chunks outside the tree (calls back to back)
#   hack/device-kube-gpu.sh run [ARGS]     there: unpack once (and vLLM, when hack/device-vllm-prepare.sh's
#                                          chunks were staged too), then pytest ARGS (default: the GPU e2e
#                                          tests); results in $OUT (default benchmarks/results/local)
#   hack/device-kube-gpu.sh start [ARGS]   there: `run ARGS` in a session of its own, which outlives the call
#                                          (a whole round takes longer than one call may): returns at once
#   hack/device-kube-gpu.sh wait           there: follow the started round for up to WAIT_SECONDS (560); its
#                                          results in $OUT once it ended (exit: its status), 75 while it runs
#
# The round's last lines are one table: every start of both engines (scale -> first token), each step's
# wall time, and the machine time since the first chunk was staged (the GPU time the round cost, but the
# machine's own start). WARMSTART_GPU_E2E_SHAPE=qwen3-0.6b on `start` runs the quick round.
#
# `prepare` needs `hack/control-plane build --gpu` and `hack/control-plane images` done (`hack/control-plane
# addons` too for the keda payload), Debian's apt (the node's runtime packages are downloaded and unpacked
# into a folder, with wrappers that give them their libraries) and pip (the Python packages the GPU
# machine's python lacks, as wheels for it).
set -euo pipefail
cd "$(dirname "$0")/.."
PACK=.dev/kube-gpu
STAGE=${KUBE_GPU_STAGE:-/root/warmstart-kube-gpu-stage}
ROOT=${KUBE_GPU_ROOT:-/root/warmstart-kube-gpu}
VLLM_STAGE=${VLLM_STAGE:-/root/warmstart-vllm-stage}  # where hack/device-vllm-bench.sh stage puts its chunks
ROUND=${KUBE_GPU_ROUND:-/root/warmstart-kube-gpu-round}  # a started round: its log, status and results
FIRST_STAGED=$STAGE/.first-staged  # when this machine got its first chunk (seconds since the epoch)
PART_BYTES=${PART_BYTES:-50M}
# A rehearsal on a machine with its own environment (this script's run, on CPU): PYTHON=.venv/bin/python
# WHEELS_FOR_PYTHON=0 (the wheels are the GPU machine's python's).
PYTHON=${PYTHON:-python3}
WHEELS_FOR_PYTHON=${WHEELS_FOR_PYTHON:-1}
# What a started node runs, from Debian 12 (containerd 1.6, runc 1.1, the CNI plugins, nft, conntrack, ip).
NODE_PACKAGES=(containerd runc containernetworking-plugins nftables conntrack iproute2)
NODE_COMMANDS=(containerd containerd-shim-runc-v2 ctr runc nft conntrack ip)
# Warmstart's dependencies the GPU machine's python (3.12, torch, PyTorch's stack) lacks, in versions vLLM
# 0.26.0 takes too (hack/device-vllm-prepare.sh), since both end up in one folder there.
REQUIREMENTS=('fastapi>=0.133,<0.137' 'starlette>=1.0.1,<1.10' 'uvicorn>=0.55,<0.56' blake3 cryptography pydantic-settings)
WHEELS=(fastapi starlette pydantic pydantic-core annotated-types typing-inspection pydantic-settings
        python-dotenv uvicorn blake3 cryptography
        cffi pycparser)
K8S_BINARIES=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kwok helm kubelet kube-proxy
              coredns nvidia-device-plugin)

chart_image() {
    echo "ghcr.io/warmstart/warmstart:$(awk '/^appVersion:/{gsub(/"/, "", $2); print $2}' charts/warmstart/Chart.yaml)"
}

# Payloads: `base` (what rarely changes: the binaries, the node's packages, wheels), `image` (the chart's
# image, rebuilt by every code change) and `keda` (KEDA's and the add-on's images and manifests, optional),
# each one xz stream cut into chunks with its own SHA256.
prepare() {
    local which=${1:-all} cache=${WARMSTART_CACHE:-$HOME/.cache/warmstart}
    tmp=$(mktemp -d)  # global: the EXIT trap removes it
    trap 'rm -rf "$tmp"' EXIT
    mkdir -p "$PACK"
    if [[ $which == base || ( $which == all && ! -f $PACK/SHA256.base ) ]]; then
        prepare_base "$tmp/base"
        pack "$tmp/base" base
    fi
    if [[ $which == image || $which == all ]]; then
        prepare_image "$tmp/image"
        pack "$tmp/image" image
    fi
    if [[ $which == keda || ( $which == all && ! -f $PACK/SHA256.keda && -f $cache/k8s/addons/stamp.json ) ]]; then
        prepare_keda "$tmp/keda"
        pack "$tmp/keda" keda
    fi
    du -sh "$PACK"/kube-gpu-*.part_*
}

prepare_base() {
    local payload=$1 cache=${WARMSTART_CACHE:-$HOME/.cache/warmstart}
    mkdir -p "$payload/cache/k8s/bin" "$payload/cache/k8s/node" "$payload/tools/root" "$payload/tools/bin" \
             "$payload/wheels"
    for name in "${K8S_BINARIES[@]}"; do
        cp "$cache/k8s/bin/$name" "$payload/cache/k8s/bin/" || { echo "build first: $name missing" >&2; exit 2; }
    done
    cp "$cache"/k8s/{stamp.json,node-stamp.json,gpu-stamp.json} "$payload/cache/k8s/"
    cp -r "$cache/k8s/crds" "$cache/k8s/kwok-stages" "$payload/cache/k8s/"
    cp "$cache/k8s/node/pause.tar" "$payload/cache/k8s/node/"
    # The node's runtime packages and the libraries they need beyond a base system, unpacked.
    (cd "$tmp" && mkdir -p debs && cd debs && apt-get download -q \
        $(apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts --no-breaks --no-replaces \
            --no-enhances "${NODE_PACKAGES[@]}" | grep '^[a-z0-9]' \
            | grep -v -E '^(libc6|libgcc-s1|libstdc\+\+6|debconf|dpkg|perl-base|libcrypt1|init-system-helpers|adduser|passwd|libpam.*|libaudit.*|login|util-linux|mount|libsystemd0|libudev1|libselinux1|libpcre2-8-0|zlib1g|libzstd1|liblzma5|libbz2-1.0|libgpg-error0|libgcrypt20|liblz4-1)$' \
            | sort -u) >/dev/null)
    for deb in "$tmp"/debs/*.deb; do dpkg -x "$deb" "$payload/tools/root"; done
    # What a node never runs: documentation, and the CNI plugins its network does not name.
    rm -rf "$payload/tools/root/usr/share/"{doc,man,info,locale,lintian}
    find "$payload/tools/root/usr/lib/cni" -type f ! -name bridge ! -name host-local ! -name loopback -delete
    for command in "${NODE_COMMANDS[@]}"; do
        local path
        path=$(cd "$payload/tools/root" && { ls usr/bin/"$command" usr/sbin/"$command" sbin/"$command" \
               bin/"$command" 2>/dev/null || true; } | head -1)
        [[ -n "$path" ]] || { echo "no $command in ${NODE_PACKAGES[*]}" >&2; exit 2; }
        printf '#!/bin/sh\nroot=$(dirname "$(readlink -f "$0")")/../root\nLD_LIBRARY_PATH="$root/usr/lib/x86_64-linux-gnu:$root/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$root/%s" "$@"\n' \
            "$path" > "$payload/tools/bin/$command"
        chmod 755 "$payload/tools/bin/$command"
    done
    local platforms=()
    for p in manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_34_x86_64; do
        platforms+=(--platform "$p")
    done
    python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
        -d "$tmp/all-wheels" "${REQUIREMENTS[@]}"
    for name in "${WHEELS[@]}"; do
        cp "$tmp"/all-wheels/"${name//-/_}"-*.whl "$payload/wheels/"
    done
}

# The chart's image, and its index entry naming the archive by file name (unpack makes it a path there).
prepare_image() {
    local payload=$1 cache=${WARMSTART_CACHE:-$HOME/.cache/warmstart}
    mkdir -p "$payload/cache/images/archives"
    python3 - "$cache/images/built.json" "$payload/cache/images" "$(chart_image)" <<'PY'
import json, pathlib, shutil, sys
entry = json.loads(pathlib.Path(sys.argv[1]).read_text())[sys.argv[3]]
archive = pathlib.Path(entry["archive"])
shutil.copy(archive, pathlib.Path(sys.argv[2]) / "archives" / archive.name)
index = {sys.argv[3]: {**entry, "archive": archive.name}}
(pathlib.Path(sys.argv[2]) / "built.json").write_text(json.dumps(index, indent=2) + "\n")
PY
}

prepare_keda() {
    local payload=$1 cache=${WARMSTART_CACHE:-$HOME/.cache/warmstart}
    [[ -f $cache/k8s/addons/stamp.json ]] || { echo "build first: hack/control-plane addons" >&2; exit 2; }
    mkdir -p "$payload/cache/k8s/addons"
    cp -r "$cache"/k8s/addons/{stamp.json,manifests.yaml,images} "$payload/cache/k8s/addons/"
}

pack() {  # DIR NAME: one xz stream with a large window (the Kubernetes binaries share most of their code)
    rm -f "$PACK"/kube-gpu-"$2".part_* "$PACK/SHA256.$2"
    tar -C "$1" -cf - . | xz -T1 --lzma2=preset=2,dict=256MiB > "$PACK/$2.tar.xz"
    (cd "$PACK" && sha256sum "$2.tar.xz" | cut -d' ' -f1 > "SHA256.$2" \
        && split -b "$PART_BYTES" "$2.tar.xz" "kube-gpu-$2.part_" && rm "$2.tar.xz")
}

unpack() {
    [[ -f "$ROOT/.unpacked" ]] && return 0
    rm -rf "$ROOT" && mkdir -p "$ROOT"
    for name in base image; do
        [[ -f $PACK/SHA256.$name ]] || { echo "carry $PACK/SHA256.$name" >&2; exit 2; }
        cat "$STAGE"/kube-gpu-"$name".part_* > "$STAGE/$name.tar.xz"
        [[ $(sha256sum "$STAGE/$name.tar.xz" | cut -d' ' -f1) == $(cat "$PACK/SHA256.$name") ]] \
            || { echo "$name chunks damaged or missing: $(ls "$STAGE")" >&2; exit 3; }
        xz -d -T0 < "$STAGE/$name.tar.xz" | tar -C "$ROOT" -xf -
        rm "$STAGE/$name.tar.xz"
    done
    unpack_keda
    mkdir -p "$ROOT/site"
    if [[ $WHEELS_FOR_PYTHON == 1 ]]; then
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$ROOT/site" "$ROOT"/wheels/*.whl
    fi
    unpack_vllm
    # The image index names archives by absolute path: this machine's.
    python3 - "$ROOT/cache/images" <<'PY'
import json, pathlib, sys
images = pathlib.Path(sys.argv[1])
index = json.loads((images / "built.json").read_text())
for entry in index.values():
    entry["archive"] = str(images / "archives" / entry["archive"])
(images / "built.json").write_text(json.dumps(index, indent=2) + "\n")
PY
    touch "$ROOT/.unpacked"
}

# KEDA and its HTTP add-on, when their chunks were staged too (carry $PACK/SHA256.keda).
unpack_keda() {
    ls "$STAGE"/kube-gpu-keda.part_* >/dev/null 2>&1 || { echo "no KEDA staged: its test will skip"; return 0; }
    cat "$STAGE"/kube-gpu-keda.part_* > "$STAGE/keda.tar.xz"
    [[ -f $PACK/SHA256.keda && $(sha256sum "$STAGE/keda.tar.xz" | cut -d' ' -f1) == $(cat "$PACK/SHA256.keda") ]] \
        || { echo "KEDA chunks damaged or missing, or $PACK/SHA256.keda not carried" >&2; exit 3; }
    xz -d -T0 < "$STAGE/keda.tar.xz" | tar -C "$ROOT" -xf -
    rm "$STAGE/keda.tar.xz"
}

# vLLM, when its chunks were staged too (hack/device-vllm-prepare.sh; carry .dev/vllm/SHA256 and small/).
unpack_vllm() {
    ls "$VLLM_STAGE"/part_* >/dev/null 2>&1 || { echo "no vLLM staged: its tests will skip"; return 0; }
    cat "$VLLM_STAGE"/part_* > "$VLLM_STAGE/vllm.tar.xz"
    [[ $(sha256sum "$VLLM_STAGE/vllm.tar.xz" | cut -d' ' -f1) == $(cat .dev/vllm/SHA256) ]] \
        || { echo "vLLM chunks damaged or missing" >&2; exit 3; }
    xz -d -T0 < "$VLLM_STAGE/vllm.tar.xz" | tar -C "$ROOT/site" -xf -
    rm "$VLLM_STAGE/vllm.tar.xz"
    # Its small wheels; those already there (ours, in versions vLLM takes) are kept.
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$ROOT/site" .dev/vllm/small/*.whl 2>&1 \
        | grep -v "already exists" || true
}

run() {
    unpack
    # Bytecode for the workers' packages and this tree, as an installed package has it (pip compiles at
    # install; the wheels and the tree came without): otherwise each worker pod compiles every module it
    # imports, its read-only mounts keeping nothing. Up-to-date files are skipped.
    "$PYTHON" -m compileall -q -j 0 "$ROOT/site" warmstart >/dev/null 2>&1 || true
    OUT=${OUT:-benchmarks/results/local}
    mkdir -p "$OUT"
    export WARMSTART_CACHE=$ROOT/cache WARMSTART_NODE_TOOLS=$ROOT/tools/root WARMSTART_KUBE_NODES=0
    export PATH=$ROOT/tools/bin:$PATH PYTHONPATH=$PWD:$PWD/tests:$ROOT/site${PYTHONPATH:+:$PYTHONPATH}
    export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 WARMSTART_GPU_RESULTS=$OUT
    # The chart's pods run this tree's package over the image's: a fix needs no new image carried here.
    export WARMSTART_CHART_SOURCE_OVERLAY=1
    echo "== machine"
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader || echo "no GPU"
    echo "cpus $(nproc), $(free -g | awk '/Mem:/{print $2}') GiB RAM, kernel $(uname -r), $(df -h / | tail -1)"
    local status=0
    "$PYTHON" -m pytest -p no:cacheprovider -o addopts="" -o tmp_path_retention_policy=all -rA --timeout=1800 \
        "${@:-tests/kube/test_gpu_e2e.py}" 2>&1 | tee "$OUT/pytest-kube-gpu.txt" || status=$?
    # The control plane's and the node's logs of the last session (a failed test's are kept).
    local last
    last=$(ls -td /tmp/pytest-of-*/pytest-* 2>/dev/null | head -1)
    [[ -n "$last" ]] && (cd "$last" && tar -czf "$OUT/logs.tgz" --ignore-failed-read kube*/logs node*/logs) \
        2>/dev/null || true
    summary "$OUT"
    return "$status"
}

# The round's table, each step's wall time, and the machine time since the first chunk was staged.
summary() {
    echo "== the round"
    [[ -f $1/kube-gpu.md ]] && cat "$1/kube-gpu.md"
    if [[ -f $FIRST_STAGED ]]; then
        echo "machine time since the first chunk was staged: $(( $(date +%s) - $(cat "$FIRST_STAGED") )) s"
    fi
}

start() {
    rm -rf "$ROUND" && mkdir -p "$ROUND/results"
    ROUND=$ROUND OUT=$ROUND/results setsid bash -c '"$0" run "$@"; echo $? > "$ROUND/status"' "$0" "$@" \
        > "$ROUND/log" 2>&1 < /dev/null &
    echo "round started, pid $!; follow it with: $0 wait"
}

wait_round() {
    [[ -f $ROUND/log ]] || { echo "no round started here (the machine was given back?)" >&2; exit 2; }
    local deadline=$((SECONDS + ${WAIT_SECONDS:-560})) shown=0 lines
    while :; do
        lines=$(wc -l < "$ROUND/log")
        (( lines > shown )) && sed -n "$((shown + 1)),${lines}p" "$ROUND/log"
        shown=$lines
        [[ -f $ROUND/status ]] && break
        (( SECONDS < deadline )) || { echo "== still running"; exit 75; }
        sleep 5
    done
    sed -n "$((shown + 1)),\$p" "$ROUND/log"
    OUT=${OUT:-benchmarks/results/local}
    mkdir -p "$OUT" && cp "$ROUND"/results/* "$OUT"/ 2>/dev/null || true
    exit "$(cat "$ROUND/status")"
}

case "${1:-}" in
prepare) prepare "${2:-all}" ;;
stage)
    shift
    mkdir -p "$STAGE" && { [[ -f $FIRST_STAGED ]] || date +%s > "$FIRST_STAGED"; }
    cp "$@" "$STAGE/" && ls -la "$STAGE"
    ;;
run)
    shift
    run "$@"
    ;;
start)
    shift
    start "$@"
    ;;
wait) wait_round ;;
*)
    echo "usage: $0 prepare [all|base|image|keda] | stage FILE... | run|start [PYTEST ARGS] | wait" >&2
    exit 2
    ;;
esac
