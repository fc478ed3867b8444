"""The restore facts this worker shows (`warmstart.api.restore_facts`): measured from its flags and its model
files, without an engine, by a restore pod's worker as it starts and by a capturing engine beside its
snapshot."""

from __future__ import annotations

import argparse

from warmstart.api.restore_facts import RestoreFacts
from warmstart.api.worker_options import WorkerOptions
from warmstart.engines.base import EngineError
from warmstart.engines.digest import sampled_digests
from warmstart.engines.model_files import engine_version, model_files

# They differ between a capture pod and its restore pods.
ROLE_OPTIONS = ("mode", "control_dir")


def measure_restore_facts(args: argparse.Namespace) -> RestoreFacts:
    """This worker's facts; a model that cannot be found or read is reported in `error`, not raised."""
    options = WorkerOptions.of(args)
    directory, files, error = "", {}, ""
    try:
        found, paths = model_files(
            options.engine, options.model, options.model_dir, options.seed, options.dtype, options.revision
        )
        directory, files = str(found), sampled_digests(paths)
    except (EngineError, OSError) as exc:
        error = str(exc)
    return RestoreFacts(
        engine=options.engine,
        engine_version=engine_version(options.engine),
        worker_args=tuple(options.argv(leave_out=ROLE_OPTIONS)),
        model_dir=directory,
        model_files=files,
        error=error,
    )
