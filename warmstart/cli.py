"""`warmstart ...`: one entry point; each mode registers its own subcommands.

Modules are imported to register their parsers, so they keep heavy imports (torch, kopf, grpc) inside the
functions that run a command.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

# (module, purpose): every module exposes `register(subparsers)`; each parser sets `func(args) -> int`.
COMMAND_MODULES: tuple[str, ...] = (
    "warmstart.serve.cli",
    "warmstart.worker.cli",
    "warmstart.worker.prestage",
    "warmstart.snapshot.cli",
    "warmstart.agent.cli",
    "warmstart.operator.cli",
    "warmstart.bench",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="warmstart",
        description="Start inference workers in seconds by restoring them from checkpoints.",
    )
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default INFO)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # the mode is not part of this build
                continue
            raise
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
