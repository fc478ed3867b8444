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

# Each command's module exposes `register(subparsers)` and its parser sets `func(args) -> int`. A command
# line naming one imports only its module: a worker pod's supervisor starts without the agent's or the
# operator's settings models.
COMMAND_MODULES: dict[str, str] = {
    "serve": "warmstart.serve.cli",
    "worker": "warmstart.worker.cli",
    "prestage-weights": "warmstart.worker.prestage",
    "snapshot": "warmstart.snapshot.cli",
    "agent": "warmstart.agent.cli",
    "operator": "warmstart.operator.cli",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of `command`, or of every command when it names none of them."""
    parser = argparse.ArgumentParser(
        prog="warmstart",
        description="Start inference workers in seconds by restoring them from checkpoints.",
    )
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default INFO)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules = [COMMAND_MODULES[command]] if command in COMMAND_MODULES else list(COMMAND_MODULES.values())
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # the mode is not part of this build
                continue
            raise
        module.register(subparsers)
    return parser


def named_command(argv: Sequence[str]) -> str | None:
    """The command word of a command line (the first word that is no option nor --log-level's value)."""
    words = iter(argv)
    for word in words:
        if word == "--log-level":
            next(words, None)
        elif not word.startswith("-"):
            return word
    return None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(named_command(argv))
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
