"""Restore: a verified snapshot back into a running worker inside a sandbox.

Order matters for trust: signature, identity (against this machine) and every digest are checked BEFORE
CRIU sees a byte (`store.materialize` verifies, then hardlinks the image files). Then the sandbox gets the
files the engine held open at dump time (copies: the engine writes to them, blobs are immutable), CRIU
restores the engine into the sandbox's namespaces, the CUDA state comes back when the snapshot holds some,
and `restore-complete` carries the resume payload (e.g. the port). A snapshot whose engine left its
weights out gets a weight stager (`weight_staging`) once verified, working while CRIU runs. On any failure
the half-restored tasks are killed, `restore-failed` carries the reason (the worker then cold-starts) and
the failure is counted so the caller can mark a snapshot that keeps failing Invalid.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from warmstart.checkpoint import cuda
from warmstart.checkpoint.criu import Criu, CriuError
from warmstart.checkpoint.layout import CRIU_DIR, SANDBOX_FILES_DIR, timed
from warmstart.checkpoint.sandbox import Sandbox
from warmstart.checkpoint.weight_staging import StagerProcess, start_stager
from warmstart.fileio import write_atomic
from warmstart.identity import SnapshotIdentity
from warmstart.protocol import RESTORE_COMPLETE, RESTORE_FAILED, ControlDir
from warmstart.snapshot.manifest import SnapshotError
from warmstart.snapshot.signing import Verifier
from warmstart.snapshot.store import Snapshot, SnapshotStore

log = logging.getLogger(__name__)

FAILURES_DIR = "restore-failures"
DEFAULT_MAX_FAILURES = 3


class RestoreRefused(RuntimeError):
    """The snapshot failed verification (signature, digest, identity); CRIU was not run."""


class RestoreFailed(RuntimeError):
    """CRIU or the CUDA restore failed; what was restored has been killed."""


@dataclass
class RestoreResult:
    snapshot: Snapshot
    namespace_pid: int
    host_pid: int
    timings: dict[str, float] = field(default_factory=dict)


class FailureCounter:
    """Restore failures per snapshot, one small JSON file each under `<store>/restore-failures/`."""

    def __init__(self, store_root: Path, max_failures: int = DEFAULT_MAX_FAILURES) -> None:
        self.directory = Path(store_root) / FAILURES_DIR
        self.max_failures = max_failures

    def _file(self, snapshot_id: str) -> Path:
        if "/" in snapshot_id or snapshot_id.startswith("."):
            raise ValueError(f"{snapshot_id!r} is not a snapshot id")
        return self.directory / f"{snapshot_id}.json"

    def count(self, snapshot_id: str) -> int:
        try:
            return int(json.loads(self._file(snapshot_id).read_text())["count"])
        except (OSError, ValueError, KeyError, TypeError):
            return 0

    def last_reason(self, snapshot_id: str) -> str:
        try:
            return str(json.loads(self._file(snapshot_id).read_text())["reason"])
        except (OSError, ValueError, KeyError, TypeError):
            return ""

    def record(self, snapshot_id: str, reason: str) -> int:
        count = self.count(snapshot_id) + 1
        self.directory.mkdir(parents=True, exist_ok=True)
        target = self._file(snapshot_id)
        write_atomic(target, json.dumps({"count": count, "reason": reason, "time": time.time()}).encode())
        return count

    def invalid(self, snapshot_id: str) -> bool:
        """True once the snapshot failed `max_failures` times: do not try it again."""
        return self.count(snapshot_id) >= self.max_failures

    def clear(self, snapshot_id: str) -> None:
        self._file(snapshot_id).unlink(missing_ok=True)


def verify_and_materialize(
    store: SnapshotStore,
    snapshot_id: str,
    verifier: Verifier,
    expected_identity: SnapshotIdentity,
    destination: Path,
) -> Snapshot:
    """Verify signature, identity and digests, then hardlink the snapshot's files under `destination`."""
    shutil.rmtree(destination, ignore_errors=True)
    try:
        return store.materialize(snapshot_id, destination, verifier, expected_identity=expected_identity)
    except SnapshotError as exc:
        shutil.rmtree(destination, ignore_errors=True)
        raise RestoreRefused(f"snapshot {snapshot_id} refused: {exc}") from exc


def place_sandbox_files(snapshot: Snapshot, materialized: Path, sandbox: Sandbox) -> None:
    """Copy the engine's open files (as they were at dump time) to the same paths inside the sandbox."""
    mountpoint = Path(snapshot.meta.get("sandbox_mountpoint", str(sandbox.mountpoint)))
    if mountpoint != sandbox.mountpoint:
        raise RestoreFailed(
            f"the snapshot expects its sandbox at {mountpoint}, this one is at {sandbox.mountpoint}"
        )
    source_root = materialized / SANDBOX_FILES_DIR
    if not source_root.is_dir():
        return
    for source in source_root.rglob("*"):
        if source.is_file():
            target = sandbox.host_dir / source.relative_to(source_root)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)  # a copy: the blob behind `source` is immutable


def restore(
    *,
    store: SnapshotStore,
    verifier: Verifier,
    snapshot_id: str,
    expected_identity: SnapshotIdentity,
    sandbox: Sandbox,
    control: ControlDir,
    criu: Criu,
    work_dir: Path,
    resume_payload: dict[str, Any] | None = None,
    failures: FailureCounter | None = None,
) -> RestoreResult:
    """Restore `snapshot_id` into `sandbox`; `control` is the sandbox's control directory (host path).

    Raises RestoreRefused (nothing ran) or RestoreFailed (cleaned up); both after `restore-failed` was sent.
    """
    failures = failures or FailureCounter(store.root)
    timings: dict[str, float] = {}
    stager: StagerProcess | None = None
    try:
        with timed(timings, "verify_materialize"):
            snapshot = verify_and_materialize(store, snapshot_id, verifier, expected_identity, work_dir)
        with timed(timings, "place_sandbox_files"):
            place_sandbox_files(snapshot, work_dir, sandbox)
        # Verified: the engine's weights may now go to the GPU while CRIU restores the engine.
        stager = start_stager(snapshot, sandbox.init_pid, control)
        namespace_pid, host_pid = _restore_process(snapshot, sandbox, criu, work_dir, timings)
    except (RestoreRefused, RestoreFailed) as exc:
        _stop(stager)
        _fail(control, failures, snapshot_id, str(exc))
        raise
    except (CriuError, cuda.CudaCheckpointError, cuda.CudaUnavailable, OSError) as exc:
        _stop(stager)
        sandbox.kill_all_but_init()
        _fail(control, failures, snapshot_id, str(exc))
        raise RestoreFailed(f"restore of {snapshot_id} failed: {exc}") from exc
    except BaseException:  # interrupted: leave nothing half-restored behind
        _stop(stager)
        sandbox.kill_all_but_init()
        _fail(control, failures, snapshot_id, "restore interrupted")
        raise
    staged = stager.payload() if stager is not None else {}
    control.send(
        RESTORE_COMPLETE, {**(resume_payload or {}), **staged, "snapshot": snapshot_id, "pid": namespace_pid}
    )
    return RestoreResult(snapshot, namespace_pid, host_pid, timings)


def _stop(stager: StagerProcess | None) -> None:
    if stager is not None:
        stager.stop()


def _restore_process(
    snapshot: Snapshot, sandbox: Sandbox, criu: Criu, work_dir: Path, timings: dict[str, float]
) -> tuple[int, int]:
    with timed(timings, "criu_restore"):
        namespace_pid = criu.in_namespaces_of(sandbox.init_pid).restore(
            work_dir / CRIU_DIR, logs_dir=sandbox.host_dir / "restore-logs"
        )
    sandbox.set_main_pid(namespace_pid)
    host_pid = sandbox.host_pid(namespace_pid)
    if host_pid is None:  # a CRIU-side failure: the caller kills whatever half-restored tasks remain
        raise CriuError(f"CRIU reported pid {namespace_pid} but no such process runs in the sandbox")
    if snapshot.meta.get("uses_cuda"):
        with timed(timings, "cuda_restore"):
            cuda.resume(host_pid)
    return namespace_pid, host_pid


def _fail(control: ControlDir, failures: FailureCounter, snapshot_id: str, reason: str) -> None:
    count = failures.record(snapshot_id, reason)
    log.warning("restore of %s failed (%d time(s)): %s", snapshot_id, count, reason)
    control.send(RESTORE_FAILED, {"reason": reason, "snapshot": snapshot_id, "failures": count})
