"""The flags of `warmstart worker`: the contract between the worker and whoever starts it.

The worker parses its command line with this parser; the operator checks an endpoint's `engine.args`
against it and builds worker pods' arguments from it, without importing the worker or the engines.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import Any, NoReturn

from warmstart.api.control_dir import CONTROL_DIR_ENV
from warmstart.host.env import checked_seconds

MODES = ("cold", "capture", "restore")
DEFAULT_RESTORE_TIMEOUT = 600.0
RESTORE_TIMEOUT_ENV = "WARMSTART_RESTORE_TIMEOUT"
# The supervisor's probe endpoints on --probe-port (`warmstart.worker.probe`): `GET /ready?wait=S` answers
# 200 once the engine's /ready does, held up to S seconds (at most PROBE_WAIT_MAX_SECONDS); `GET /live`.
PROBE_READY_PATH = "/ready"
PROBE_LIVE_PATH = "/live"
PROBE_WAIT_MAX_SECONDS = 5.0
DEFAULT_START_TIMEOUT = 1800.0  # cold starts of large models take minutes; restores are much shorter


def probe_port(engine_port: int) -> int:
    """The port the operator gives the supervisor's probe endpoints: the one after the engine's."""
    return engine_port + 1 if engine_port < 65535 else engine_port - 1


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    engine = parser.add_argument_group("engine")
    engine.add_argument("--engine", default="builtin", help="engine kind (default builtin)")
    engine.add_argument(
        "--model", default="tiny", help="preset (tiny, demo, qwen3-0.6b, qwen3-8b) or a model dir"
    )
    engine.add_argument(
        "--model-dir", help="model directory (default: $WARMSTART_CACHE/models/<preset>-<seed>)"
    )
    engine.add_argument("--served-model-name", help="the model name clients ask for (default: the preset)")
    engine.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    engine.add_argument(
        "--seed", type=integer(0, (1 << 32) - 1), default=0,
        help="seed of generated or trained weights (default 0)",
    )  # fmt: skip
    engine.add_argument(
        "--dtype", choices=("auto", "float32", "bfloat16", "float16"), help="weights dtype (auto: as stored)"
    )
    engine.add_argument("--revision", help="model revision of a Hugging Face model id (vllm engine)")
    engine.add_argument(
        "--max-model-len", type=integer(1, 1 << 24), help="context length (default min(model's, 4096))"
    )
    engine.add_argument(
        "--max-num-seqs", type=integer(1, 1 << 16), help="sequences batched together (default 8 CPU, 16 GPU)"
    )
    engine.add_argument(
        "--cuda-graph-sizes", type=_int_list, help="decode batch sizes to capture, e.g. 1,2,4,8"
    )
    engine.add_argument("--compile", action="store_true", help="torch.compile the decode step (CUDA)")
    engine.add_argument(
        "--release-weights",
        action=argparse.BooleanOptionalAction,
        help="drop the weights before a checkpoint and reload them after resume (default: on CUDA with the "
        "cuda-vmm arena, where they come back at the same addresses; off elsewhere)",
    )
    engine.add_argument(
        "--arena",
        default="auto",
        choices=("auto", "torch", "cuda-vmm"),
        help="weight/KV memory backend (auto: cuda-vmm on CUDA, which keeps addresses; torch on CPU)",
    )
    engine.add_argument(
        "--tensor-parallel-size", type=integer(1, 1024), default=1,
        help="processes (one per GPU) the model is split over (default 1; the builtin engine: gloo on CPU, "
        "NCCL on CUDA)",
    )  # fmt: skip
    vllm = parser.add_argument_group("vllm engine (--engine vllm)")
    vllm.add_argument(
        "--gpu-memory-utilization", type=share, default=0.9,
        help="share of GPU memory to take, more than 0 and at most 1 (default 0.9)",
    )  # fmt: skip
    vllm.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    vllm.add_argument(
        "--sleep-level", type=int, choices=(1, 2), default=2,
        help="before a checkpoint: 2 drops the weights and reloads them from the model files after resume, "
        "1 keeps them in CPU memory, inside the snapshot (default 2)",
    )  # fmt: skip
    vllm.add_argument(
        "--engine-arg", action="append", type=_engine_arg, metavar="KEY=VALUE",
        help="any other vLLM engine argument (repeatable; VALUE is JSON where it parses)",
    )  # fmt: skip
    vllm.add_argument(
        "--api", choices=("vllm", "warmstart"), default="vllm",
        help="the HTTP server after resume: vllm (vLLM's own OpenAI-compatible server and its vllm:* "
        "metrics, in the worker's process) or warmstart (the worker's; default vllm)",
    )  # fmt: skip
    vllm.add_argument(
        "--vllm-server-arg", action="append", default=[], metavar="ARG",
        help="one argument for vLLM's server, as `vllm serve` takes it (repeatable, in the = form: "
        "--vllm-server-arg=--enable-auto-tool-choice --vllm-server-arg=--tool-call-parser=hermes)",
    )  # fmt: skip
    worker = parser.add_argument_group("worker")
    worker.add_argument(
        "--mode", choices=MODES, default="cold", help="cold, capture or restore (default cold)"
    )
    worker.add_argument("--host", default="127.0.0.1", help="HTTP listen address (default 127.0.0.1)")
    worker.add_argument("--port", type=port_number, default=8000, help="HTTP port (default 8000)")
    worker.add_argument(
        "--probe-port", type=port_number,
        help="serve the kubelet's probes on this port from the start: /ready?wait=S (held until the engine's "
        "/ready is 200) and /live (default: not served)",
    )  # fmt: skip
    worker.add_argument(
        "--start-timeout", type=seconds, default=DEFAULT_START_TIMEOUT,
        help="seconds the engine may take to be ready before /live fails and the kubelet restarts it "
        f"(default {DEFAULT_START_TIMEOUT:g})",
    )  # fmt: skip
    http = parser.add_argument_group("HTTP limits (what one client may hold)")
    http.add_argument("--http-keep-alive-seconds", type=seconds, default=5.0,
                      help="idle connections, request heads not in and bodies stalled are cut off after "
                      "this (default 5)")  # fmt: skip
    http.add_argument("--http-max-connections", type=integer(1, 1 << 20), default=1024,
                      help="open connections; past it the one waiting longest for its client goes "
                      "(default 1024)")  # fmt: skip
    http.add_argument("--http-max-connections-per-client", type=integer(1, 1 << 20), default=256,
                      help="open connections from one address; past it that address's longest waiting "
                      "goes, else a 503 (default 256)")  # fmt: skip
    http.add_argument("--http-body-timeout-seconds", type=seconds, default=30.0,
                      help="a request body must arrive whole within this, else 408 (default 30)")  # fmt: skip
    http.add_argument("--max-request-bytes", type=integer(1, 1 << 40), default=4 << 20,
                      help="largest request body, else 413 (default 4 MiB)")  # fmt: skip
    http.add_argument("--max-n", type=integer(1, 4096), default=16,
                      help="largest `n` of one request (default 16)")  # fmt: skip
    http.add_argument("--max-output-tokens", type=integer(1, 1 << 24), default=None,
                      help="largest max_tokens (default: what the context leaves)")  # fmt: skip
    worker.add_argument(
        "--control-dir",
        default=os.environ.get(CONTROL_DIR_ENV),
        help=f"control directory shared with the agent (default ${CONTROL_DIR_ENV})",
    )
    worker.add_argument(
        "--log-dir",
        help="where the engine's stdout/stderr go (default <control-dir>/logs, else $WARMSTART_CACHE/logs)",
    )
    worker.add_argument(
        "--restore-timeout",
        type=_restore_seconds,
        default=None,
        help=f"restore mode: seconds to wait for the agent before a cold start "
        f"(default ${RESTORE_TIMEOUT_ENV} or {DEFAULT_RESTORE_TIMEOUT:g})",
    )


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


def worker_flags_problem(argv: list[str]) -> str | None:
    """Why `warmstart worker` would reject these flags (argparse's own words), or None."""
    parser = _RaisingParser(prog="warmstart worker", add_help=False, allow_abbrev=False)
    add_worker_arguments(parser)
    try:
        _, unknown = parser.parse_known_args(argv)
    except ValueError as exc:
        return str(exc)
    return f"unrecognized arguments: {' '.join(unknown)}" if unknown else None


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse_engine_arg(text: str) -> tuple[str, Any]:
    """`KEY=VALUE` -> (key, value); VALUE is JSON where it parses (numbers, booleans, objects), else text."""
    key, sep, raw = text.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or not key.isidentifier():
        raise ValueError(f"expected KEY=VALUE with KEY an engine argument name, got {text!r}")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


def _engine_arg(text: str) -> tuple[str, object]:
    try:
        return parse_engine_arg(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def seconds(text: str) -> float:
    """An argparse type: a duration (`host.env.checked_seconds`: finite, more than 0, at most ten years)."""
    try:
        return checked_seconds(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc}, got {text!r}") from None


def _restore_seconds(text: str) -> float:
    try:
        return seconds(text)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (--restore-timeout / {RESTORE_TIMEOUT_ENV})") from None


def share(text: str) -> float:
    """An argparse type: a share of a whole, more than 0 and at most 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not 0 < value <= 1:  # also false for nan
        raise argparse.ArgumentTypeError(f"must be more than 0 and at most 1, got {text!r}")
    return value


def integer(minimum: int, maximum: int) -> Callable[[str], int]:
    """An argparse type: an integer from `minimum` to `maximum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(f"must be from {minimum} to {maximum}, got {text!r}")
        return value

    parse.__name__ = "integer"  # argparse names the type in its messages
    return parse


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0 to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"port must be an integer, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be between 0 and 65535, got {value}")
    return value
