"""What the worker resolves of its options (`warmstart.api.worker_options`) beyond their parsing: the settings
the environment gives, the checks across options, where its logs go."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from warmstart.api.control_dir import CONTROL_DIR_ENV
from warmstart.api.worker_options import DEFAULT_RESTORE_TIMEOUT, RESTORE_TIMEOUT_ENV
from warmstart.host.env import cache_dir, env_seconds

# Once a restore holds the claim, how long past --restore-timeout to wait for its answer (it always answers;
# this bounds a restorer that died): longer than a CRIU restore's own timeout and the verification before it.
RESTORE_ANSWER_TIMEOUT_ENV = "WARMSTART_RESTORE_ANSWER_TIMEOUT"
DEFAULT_RESTORE_ANSWER_TIMEOUT = 1800.0


def check_worker_args(args: argparse.Namespace) -> str | None:
    """An error message naming what to fix, or None. It resolves the settings the environment gives into
    `args` (`restore_timeout`, `restore_answer_timeout`), so that a bad one stops the worker here, before it
    does anything a restorer could take for a pod ready to be restored."""
    try:
        if args.restore_timeout is None:  # the flag was checked as it was parsed; the variable is here
            args.restore_timeout = env_seconds(
                RESTORE_TIMEOUT_ENV, DEFAULT_RESTORE_TIMEOUT, "--restore-timeout"
            )
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
