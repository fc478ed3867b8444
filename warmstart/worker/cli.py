"""`warmstart worker ...`: start an inference worker (cold, capture or restore)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from warmstart.api.worker_options import add_worker_arguments
from warmstart.worker.options import check_worker_args


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "worker",
        help="run an inference worker (engine + OpenAI-compatible HTTP server)",
        description="Run an inference worker: a supervisor that starts the engine process (cold), starts it "
        "and hands it to the snapshot agent (capture), or waits for the agent to restore one (restore).",
    )
    add_worker_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    problem = check_worker_args(args)
    if problem:
        print(f"warmstart worker: {problem}", file=sys.stderr)
        return 2
    from warmstart.worker.supervisor import Supervisor

    return Supervisor(args).run()
