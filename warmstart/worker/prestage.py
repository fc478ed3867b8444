"""`warmstart prestage-weights`: keep an endpoint's model files in this node's page cache.

It runs in the pods of the DaemonSet the operator makes for an endpoint with `snapshot.prestage: PageCache`:
the worker's image, volumes, environment and scheduling, no GPU, no privileges. It resolves the model
directory the way the worker's engine does (without loading the engine) and, every `--interval` seconds,
reads into the page cache whatever of the directory's files is not resident. The node agent pre-stages the
snapshot itself; the weights only a pod of the endpoint may read (the privileged agent never follows a path
the tenant controls). A replica restored on the node then reads both from memory, not from disk.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

from warmstart.api.worker_options import WorkerOptions, add_worker_arguments
from warmstart.snapshot import residency

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_SECONDS = 30.0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "prestage-weights",
        help="keep an endpoint's model files in this node's page cache (the operator's DaemonSet runs it)",
        description="Resolve the model directory from the worker's flags and read its files into the page "
        "cache every --interval seconds, so a replica started on this node reads them from memory.",
    )
    add_worker_arguments(parser)
    parser.add_argument(
        "--interval", type=float, default=DEFAULT_INTERVAL_SECONDS,
        help=f"seconds between passes (default {DEFAULT_INTERVAL_SECONDS:.0f})",
    )  # fmt: skip
    parser.add_argument("--once", action="store_true", help="one pass, then exit")
    parser.set_defaults(func=run)


def model_dir(args: argparse.Namespace) -> Path | None:
    """The directory the worker's engine reads its model from (it may not exist yet); None for a model that
    is not local files (a Hugging Face id the engine downloads)."""
    from warmstart.engines import create_engine

    engine = create_engine(args.engine, **WorkerOptions.of(args).engine_options())
    found = str(engine.model_dir or "")
    return Path(found) if found else None


def model_files(directory: Path) -> list[Path]:
    """Every regular file under `directory`, the largest (the weights) first."""
    files = [path for path in directory.rglob("*") if path.is_file() and not path.is_symlink()]
    return sorted(files, key=lambda path: path.stat().st_size, reverse=True)


def run(args: argparse.Namespace) -> int:
    stopping = threading.Event()

    def stop(_signum: int, _frame: FrameType | None) -> None:
        stopping.set()

    signal.signal(signal.SIGTERM, stop)
    directory = model_dir(args)  # once: the engine is built to name it, never loaded
    announced = False
    while not stopping.is_set():
        if directory is None or not directory.is_dir():
            if not announced:
                log.info("model %s has no local directory (yet): nothing to stage", args.model)
                announced = True
        else:
            started = time.monotonic()
            files = model_files(directory)
            total = sum(path.stat().st_size for path in files)
            read = residency.stage(files, total)  # what is not resident
            seconds = time.monotonic() - started
            log.info("staged %s: read %d of %d bytes in %.2f s", directory, read, total, seconds)
        if args.once:
            return 0
        stopping.wait(max(1.0, args.interval))
    return 0
