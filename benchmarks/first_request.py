"""What the first request at a new prompt length costs, against the same request again, in one process.

    python benchmarks/first_request.py --model qwen3-8b --device cuda --max-model-len 1024 [--compile] \
        [--prefill-attention all]

The builtin engine is loaded and warmed up as a worker does before serving or a checkpoint, then one-token
greedy completions go through its scheduler at each of `--lengths` (prompt bytes) once, and then each again.
The second pass is the baseline: the model work is the same, so what the first pass costs more is set-up that
a new prompt length triggers (a kernel's plan, a library's heuristics). `--prefill-attention` picks the
backends prefill attention may use: `engine` (the engine's own choice, `PREFILL_ATTENTION`) or `all` (every
backend PyTorch has, cuDNN's included, in its own order).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.nn.attention import SDPBackend

from warmstart.engines.base import GenerationRequest, SamplingParams
from warmstart.engines.builtin import model as builtin_model
from warmstart.engines.builtin.engine import BuiltinEngine

DEFAULT_LENGTHS = (7, 4, 13, 100, 300, 700)
EVERY_BACKEND = [
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]


def one_token_seconds(engine: BuiltinEngine, prompt_bytes: int) -> float:
    request = GenerationRequest(
        prompt="w" * prompt_bytes, request_id=f"len-{prompt_bytes}", sampling=SamplingParams(max_tokens=1)
    )
    started = time.perf_counter()
    engine.generate([request])
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS))
    parser.add_argument("--prefill-attention", choices=("engine", "all"), default="engine")
    args = parser.parse_args()
    if args.prefill_attention == "all":
        builtin_model.PREFILL_ATTENTION = EVERY_BACKEND
    engine = BuiltinEngine(
        model=args.model, device=args.device, compile=args.compile, max_model_len=args.max_model_len
    )
    engine.load()
    engine.warm_up()  # its prompt, "warm up", is 7 bytes: the first default length repeats it
    first = [one_token_seconds(engine, length) for length in args.lengths]
    again = [one_token_seconds(engine, length) for length in args.lengths]
    backends = ", ".join(backend.name for backend in builtin_model.PREFILL_ATTENTION)
    print(f"{args.model} on {args.device}, torch {torch.__version__}, prefill attention: {backends}")
    print("| prompt bytes | first request | again (baseline) | first costs more |")
    print("|---|---|---|---|")
    for length, once, twice in zip(args.lengths, first, again, strict=True):
        extra_ms = (once - twice) * 1000
        print(f"| {length} | {once * 1000:.1f} ms | {twice * 1000:.1f} ms | {extra_ms:+.1f} ms |")
    extra = sum(first) - sum(again)
    print(f"total: first pass {sum(first):.3f} s, again {sum(again):.3f} s, {extra:+.3f} s")


if __name__ == "__main__":
    main()
