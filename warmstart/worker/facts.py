"""The restore facts this worker shows (`warmstart.api.restore_facts`): measured from its flags and its model
files, without an engine, by a restore pod's worker as it starts and by a capturing engine beside its
snapshot."""

from __future__ import annotations

import argparse

from warmstart.api.restore_facts import RestoreFacts
from warmstart.engines.base import EngineError
from warmstart.engines.digest import sampled_digests
from warmstart.engines.model_files import engine_version, model_files
from warmstart.worker.options import engine_argv

ROLE_FLAGS = ("--mode", "--control-dir")  # they differ between a capture pod and its restore pods


def worker_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """The engine's flags as the worker runs it, without those that differ by role."""
    argv = engine_argv(args, "restore")
    kept: list[str] = []
    skip = False
    for item in argv:
        if skip:
            skip = False
        elif item in ROLE_FLAGS:
            skip = True
        else:
            kept.append(item)
    return tuple(kept)


def measure_restore_facts(args: argparse.Namespace) -> RestoreFacts:
    """This worker's facts; a model that cannot be found or read is reported in `error`, not raised."""
    dtype = None if args.dtype in (None, "auto") else args.dtype
    directory, files, error = "", {}, ""
    try:
        found, paths = model_files(args.engine, args.model, args.model_dir, args.seed, dtype, args.revision)
        directory, files = str(found), sampled_digests(paths)
    except (EngineError, OSError) as exc:
        error = str(exc)
    return RestoreFacts(
        engine=args.engine,
        engine_version=engine_version(args.engine),
        worker_args=worker_flags(args),
        model_dir=directory,
        model_files=files,
        error=error,
    )
