#!/usr/bin/env bash
# Build the vLLM artifacts that hack/device-vllm-bench.sh carries to a GPU machine without a package index.
#
#   hack/device-vllm-prepare.sh [DIR]     (default .dev/vllm, git-ignored)
#
# The GPU machine has Python 3.12 and torch 2.11 but no vLLM; vLLM 0.26.0 is the release built against torch
# 2.11. Its wheel is too large to travel in one call, so it is unpacked, stripped of files an H200 serving a
# bf16 model never loads (FlashAttention 2, the Rust front-end binary, CUTLASS header trees of two JIT
# libraries), recompressed and split into 50 MiB chunks (with the repository, under the 64 MiB a call
# carries). The pure-Python and small binary wheels vLLM
# imports at start go to DIR/small. Idempotent: a finished DIR is left alone.
set -euo pipefail
DIR=$(realpath -m "${1:-.dev/vllm}")
VLLM_VERSION=0.26.0
[[ -f "$DIR/SHA256" && -d "$DIR/small" ]] && { echo "prepared: $DIR"; exit 0; }
mkdir -p "$DIR/small" "$DIR/dl"
plat=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64 manylinux_2_34_x86_64; do
    plat+=(--platform "$p")
done
fetch() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" "$@"; }
fetch -d "$DIR/dl" "vllm==$VLLM_VERSION"
# What vLLM's engine and its OpenAI server import at start, beyond the GPU machine's own packages.
small=(
  'fastapi>=0.133,<0.137' 'starlette>=1.0.1,<1.10' 'openai>=2,<3' jiter distro sniffio openai-harmony
  partial-json-parser pybase64 msgspec pyzmq cbor2 cachetools setproctitle blake3
  'prometheus-fastapi-instrumentator>=8' watchfiles python-json-logger ijson 'lark==1.2.2' jsonschema
  jsonschema-specifications referencing rpds-py 'depyf==0.20.0' astor dill 'compressed-tensors==0.17.0'
  'mistral_common>=1.11.5' pydantic-extra-types pycountry 'model-hosting-container-standards>=0.1.14,<1'
  anthropic docstring-parser mcp httpx-sse sse-starlette pydantic-settings python-dotenv python-multipart
  'outlines_core==0.2.14' 'lm-format-enforcer==0.11.3' interegular 'llguidance==1.6.1' 'xgrammar<1'
  'apache-tvm-ffi>=0.1.11,<0.2' 'nvtx==0.2.15' pydantic pydantic-core annotated-types typing-inspection
  annotated-doc uvicorn opentelemetry-api importlib-metadata prometheus-client jmespath
)
for req in "${small[@]}"; do fetch -d "$DIR/small" "$req"; done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && unzip -q "$DIR"/dl/vllm-"$VLLM_VERSION"-*.whl)
rm -f "$tmp/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so" "$tmp/vllm/vllm-rs"
rm -rf "$tmp/vllm/third_party/deep_gemm/include" "$tmp/vllm/third_party/fmha_sm100/cutlass"
tar -C "$tmp" -cf - . | xz -T0 -6 > "$DIR/vllm.tar.xz"
(cd "$DIR" && split -b 50M vllm.tar.xz part_ && sha256sum vllm.tar.xz | cut -d' ' -f1 > SHA256.partial \
   && rm vllm.tar.xz && mv SHA256.partial SHA256)
rm -rf "$DIR/dl"
du -sh "$DIR"/part_* "$DIR/small"
