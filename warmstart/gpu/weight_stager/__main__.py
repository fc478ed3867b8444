"""The stager's command line, `python -m warmstart.gpu.weight_stager` (its help: the package's docstring)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import socket
import sys
from pathlib import Path

from warmstart.gpu import weight_stager
from warmstart.gpu.weight_stager.channel import listen, socket_address
from warmstart.gpu.weight_stager.stage import COPY_PATHS, STAGING_THREADS, stage

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m warmstart.gpu.weight_stager", description=weight_stager.__doc__
    )
    plan = parser.add_mutually_exclusive_group(required=True)
    plan.add_argument("--plan", help="the engine's staging plan (a JSON file)")
    plan.add_argument("--plan-fd", type=int, help="... or an inherited descriptor to read it from")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--socket", help="Unix socket to create for the engine to connect to")
    where.add_argument("--listen-fd", type=int, help="... or an inherited listening Unix socket")
    parser.add_argument("--root-fd", type=int, help="directory the plan's paths are resolved inside")
    parser.add_argument("--threads", type=int, default=STAGING_THREADS)
    parser.add_argument(
        "--copy", choices=COPY_PATHS, default=COPY_PATHS[0],
        help="buffered (the default): through pinned buffers; mapped: DMA straight from the page cache, "
        "pinned piece by piece (buffered where the driver refuses): a third of the CPU time and of the host "
        "memory traffic, but slower beside CRIU on the H200",
    )  # fmt: skip
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="weight-stager: %(message)s")
    # bound before anything else: the engine may be waiting for it
    listener = socket.socket(fileno=args.listen_fd) if args.listen_fd is not None else listen(args.socket)
    try:
        stage(lambda: _read_plan(args), listener, args.root_fd, args.threads, args.copy)
    except Exception as exc:  # the engine was told already; the exit status says it too
        log.error("%s: %s", type(exc).__name__, exc)
        return 1
    finally:
        listener.close()
        if args.socket:
            with contextlib.suppress(FileNotFoundError), socket_address(args.socket) as address:
                os.unlink(address)
    return 0


def _read_plan(args: argparse.Namespace) -> str:
    if args.plan_fd is not None:
        with os.fdopen(args.plan_fd, encoding="utf-8") as handle:
            return handle.read()
    return Path(args.plan).read_text()


if __name__ == "__main__":
    sys.exit(main())
