"""Command-line options shared by `warmstart worker` (the supervisor) and the engine process it spawns."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from warmstart.api.control_dir import CONTROL_DIR_ENV
from warmstart.api.worker_options import DEFAULT_RESTORE_TIMEOUT, RESTORE_TIMEOUT_ENV
from warmstart.host.env import cache_dir, env_seconds

# Once a restore holds the claim, how long past --restore-timeout to wait for its answer (it always answers;
# this bounds a restorer that died): longer than a CRIU restore's own timeout and the verification before it.
RESTORE_ANSWER_TIMEOUT_ENV = "WARMSTART_RESTORE_ANSWER_TIMEOUT"
DEFAULT_RESTORE_ANSWER_TIMEOUT = 1800.0


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
            seed=args.seed,
            tensor_parallel_size=args.tensor_parallel_size,
            compile=args.compile,
            release_weights=args.release_weights,
            arena=args.arena,
            gpu_memory_utilization=args.gpu_memory_utilization,
        )
    elif args.engine == "vllm":
        options.update(
            seed=args.seed,
            tensor_parallel_size=args.tensor_parallel_size,
            gpu_memory_utilization=args.gpu_memory_utilization,
            enforce_eager=args.enforce_eager,
            sleep_level=args.sleep_level,
            api=args.api,
            server_args=list(args.vllm_server_arg),
            engine_args=dict(args.engine_arg or []) | ({"revision": args.revision} if args.revision else {}),
        )
    return options


def engine_argv(args: argparse.Namespace, mode: str) -> list[str]:
    """The engine process's arguments: the same options, with `mode` (cold or capture)."""
    argv = ["--engine", args.engine, "--model", args.model, "--device", args.device, "--seed", str(args.seed),
            "--mode", mode, "--host", args.host, "--port", str(args.port), "--arena", args.arena,
            "--gpu-memory-utilization", str(args.gpu_memory_utilization)]  # fmt: skip
    for flag, value in (
        ("--model-dir", args.model_dir),
        ("--served-model-name", args.served_model_name),
        ("--dtype", args.dtype),
        ("--revision", args.revision),
        ("--max-model-len", args.max_model_len),
        ("--max-num-seqs", args.max_num_seqs),
        ("--control-dir", args.control_dir),
        ("--http-keep-alive-seconds", args.http_keep_alive_seconds),
        ("--http-max-connections", args.http_max_connections),
        ("--http-max-connections-per-client", args.http_max_connections_per_client),
        ("--http-body-timeout-seconds", args.http_body_timeout_seconds),
        ("--max-request-bytes", args.max_request_bytes),
        ("--max-n", args.max_n),
        ("--max-output-tokens", args.max_output_tokens),
    ):
        if value is not None:
            argv += [flag, str(value)]
    if args.cuda_graph_sizes:
        argv += ["--cuda-graph-sizes", ",".join(map(str, args.cuda_graph_sizes))]
    argv += ["--compile"] if args.compile else []
    if args.release_weights is not None:
        argv += ["--release-weights" if args.release_weights else "--no-release-weights"]
    if args.engine == "builtin" and args.tensor_parallel_size != 1:
        argv += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    if args.engine == "vllm":
        argv += ["--tensor-parallel-size", str(args.tensor_parallel_size),
                 "--sleep-level", str(args.sleep_level)]  # fmt: skip
        argv += ["--enforce-eager"] if args.enforce_eager else []
        argv += ["--api", args.api] + [f"--vllm-server-arg={arg}" for arg in args.vllm_server_arg]
        for key, value in args.engine_arg or []:
            argv += ["--engine-arg", f"{key}={json.dumps(value)}"]
    return argv


def check_worker_args(args: argparse.Namespace) -> str | None:
    """An error message naming what to fix, or None. It resolves the settings the environment gives into
    `args` (`restore_timeout`, `restore_answer_timeout`), so that a bad one stops the worker here, before it
    does anything a restorer could take for a pod ready to be restored."""
    try:
        args.restore_timeout = restore_timeout(args)
        args.restore_answer_timeout = env_seconds(RESTORE_ANSWER_TIMEOUT_ENV, DEFAULT_RESTORE_ANSWER_TIMEOUT)
    except ValueError as exc:
        return str(exc)
    if args.mode in ("capture", "restore") and not args.control_dir:
        return f"--mode {args.mode} needs --control-dir (or {CONTROL_DIR_ENV})"
    if args.revision and args.engine != "vllm":
        return "--revision names a Hugging Face model revision: it needs --engine vllm"
    if args.model_dir is None and args.engine == "builtin":
        from warmstart.engines.builtin.shapes import PRESETS

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
    """--restore-timeout (checked as it was parsed), else $WARMSTART_RESTORE_TIMEOUT, else the default;
    ValueError naming both when the variable is no duration."""
    if args.restore_timeout is not None:
        return float(args.restore_timeout)
    return env_seconds(RESTORE_TIMEOUT_ENV, DEFAULT_RESTORE_TIMEOUT, "--restore-timeout")
