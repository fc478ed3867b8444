"""Command-line options shared by `warmstart worker` (the supervisor) and the engine process it spawns."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any, NoReturn

from warmstart.config import cache_dir, env_float
from warmstart.protocol import CONTROL_DIR_ENV

MODES = ("cold", "capture", "restore")
DEFAULT_RESTORE_TIMEOUT = 600.0


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    engine = parser.add_argument_group("engine")
    engine.add_argument("--engine", default="builtin", help="engine kind (default builtin)")
    engine.add_argument("--model", default="tiny", help="preset (tiny, qwen3-0.6b, qwen3-8b) or a model dir")
    engine.add_argument(
        "--model-dir", help="model directory (default: $WARMSTART_CACHE/models/<preset>-<seed>)"
    )
    engine.add_argument("--served-model-name", help="the model name clients ask for (default: the preset)")
    engine.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    engine.add_argument("--seed", type=int, default=0, help="seed of generated weights (default 0)")
    engine.add_argument(
        "--dtype", choices=("auto", "float32", "bfloat16", "float16"), help="weights dtype (auto: as stored)"
    )
    engine.add_argument("--revision", help="model revision of a Hugging Face model id (vllm engine)")
    engine.add_argument("--max-model-len", type=int, help="context length (default min(model's, 4096))")
    engine.add_argument("--max-num-seqs", type=int, help="sequences batched together (default 8 CPU, 16 GPU)")
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
    vllm = parser.add_argument_group("vllm engine (--engine vllm)")
    vllm.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs per model (default 1)")
    vllm.add_argument(
        "--gpu-memory-utilization", type=float, default=0.9, help="share of GPU memory to take (default 0.9)"
    )
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
    worker = parser.add_argument_group("worker")
    worker.add_argument(
        "--mode", choices=MODES, default="cold", help="cold, capture or restore (default cold)"
    )
    worker.add_argument("--host", default="127.0.0.1", help="HTTP listen address (default 127.0.0.1)")
    worker.add_argument("--port", type=port_number, default=8000, help="HTTP port (default 8000)")
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
        type=float,
        default=None,
        help=f"restore mode: seconds to wait for the agent before a cold start "
        f"(default $WARMSTART_RESTORE_TIMEOUT or {DEFAULT_RESTORE_TIMEOUT:g})",
    )


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword options for `create_engine(args.engine, ...)`."""
    options: dict[str, Any] = {"model": args.model, "device": args.device}
    optional = {
        "model_dir": args.model_dir,
        "served_model_name": args.served_model_name,
        "dtype": None if args.dtype == "auto" else args.dtype,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "cuda_graph_sizes": args.cuda_graph_sizes,
    }
    options.update({key: value for key, value in optional.items() if value is not None})
    if args.engine == "builtin":
        options.update(
            seed=args.seed, compile=args.compile, release_weights=args.release_weights, arena=args.arena
        )
    elif args.engine == "vllm":
        options.update(
            seed=args.seed,
            tensor_parallel_size=args.tensor_parallel_size,
            gpu_memory_utilization=args.gpu_memory_utilization,
            enforce_eager=args.enforce_eager,
            sleep_level=args.sleep_level,
            engine_args=dict(args.engine_arg or []) | ({"revision": args.revision} if args.revision else {}),
        )
    return options


def engine_argv(args: argparse.Namespace, mode: str) -> list[str]:
    """The engine process's arguments: the same options, with `mode` (cold or capture)."""
    argv = ["--engine", args.engine, "--model", args.model, "--device", args.device, "--seed", str(args.seed),
            "--mode", mode, "--host", args.host, "--port", str(args.port), "--arena", args.arena]  # fmt: skip
    for flag, value in (
        ("--model-dir", args.model_dir),
        ("--served-model-name", args.served_model_name),
        ("--dtype", args.dtype),
        ("--revision", args.revision),
        ("--max-model-len", args.max_model_len),
        ("--max-num-seqs", args.max_num_seqs),
        ("--control-dir", args.control_dir),
    ):
        if value is not None:
            argv += [flag, str(value)]
    if args.cuda_graph_sizes:
        argv += ["--cuda-graph-sizes", ",".join(map(str, args.cuda_graph_sizes))]
    argv += ["--compile"] if args.compile else []
    if args.release_weights is not None:
        argv += ["--release-weights" if args.release_weights else "--no-release-weights"]
    if args.engine == "vllm":
        argv += ["--tensor-parallel-size", str(args.tensor_parallel_size),
                 "--gpu-memory-utilization", str(args.gpu_memory_utilization),
                 "--sleep-level", str(args.sleep_level)]  # fmt: skip
        argv += ["--enforce-eager"] if args.enforce_eager else []
        for key, value in args.engine_arg or []:
            argv += ["--engine-arg", f"{key}={json.dumps(value)}"]
    return argv


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


def check_worker_args(args: argparse.Namespace) -> str | None:
    """An error message naming what to fix, or None."""
    if args.mode in ("capture", "restore") and not args.control_dir:
        return f"--mode {args.mode} needs --control-dir (or {CONTROL_DIR_ENV})"
    if args.revision and args.engine != "vllm":
        return "--revision names a Hugging Face model revision: it needs --engine vllm"
    if args.model_dir is None and args.engine == "builtin":
        from warmstart.engines.builtin.config import PRESETS

        if args.model not in PRESETS and not Path(args.model).is_dir():
            return f"--model {args.model!r} is neither a preset ({', '.join(PRESETS)}) nor a directory"
    return None


def log_dir(args: argparse.Namespace) -> Path:
    if args.log_dir:
        return Path(args.log_dir)
    if args.control_dir:
        return Path(args.control_dir) / "logs"
    return Path(os.environ.get("WARMSTART_LOG_DIR", cache_dir() / "logs"))


def restore_timeout(args: argparse.Namespace) -> float:
    if args.restore_timeout is not None:
        return args.restore_timeout
    return env_float("WARMSTART_RESTORE_TIMEOUT", DEFAULT_RESTORE_TIMEOUT)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _engine_arg(text: str) -> tuple[str, object]:
    from warmstart.engines.vllm import parse_engine_arg

    try:
        return parse_engine_arg(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0 to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"port must be an integer, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be between 0 and 65535, got {value}")
    return value
