"""Restore: a verified snapshot back into a running worker inside a sandbox.

Order matters for trust: signature, identity (against this machine) and every digest are checked BEFORE
CRIU sees a byte (`store.materialize` verifies, then hardlinks the image files). Then the restore takes the
pod's restore claim (`protocol.RESTORE_CLAIM`; a pod whose worker claimed it for a cold start is left
alone), the sandbox gets the files the engine held open at dump time (copies: the engine writes to them,
blobs are immutable; written through directory descriptors, never through a link in the tenant's
directory), CRIU restores the engine into the sandbox's namespaces, the CUDA state comes back when the
snapshot holds some, and `restore-complete` carries the resume payload (e.g. the port). A snapshot whose
engine left its weights out gets a weight stager (`weight_staging`), started before anything is verified and
given its plan once the manifest's signature and identity check out, working while the blobs are hashed and
CRIU runs; a blob that fails its digest stops it before CRIU sees a byte.
On any failure the half-restored tasks are killed, `restore-failed` carries the reason (the worker then
cold-starts) and the failure is counted so the caller can mark a snapshot that keeps failing Invalid.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from warmstart.api.control_dir import (
    CLAIM_COLD,
    CLAIM_RESTORE,
    RESTORE_CLAIM,
    RESTORE_COMPLETE,
    RESTORE_FAILED,
    ControlDir,
    SignalError,
)
from warmstart.api.identity import SnapshotIdentity
from warmstart.api.snapshot import MAX_RESTORE_FAILURES
from warmstart.checkpoint import cuda
from warmstart.checkpoint.criu import Criu, CriuError, kill_group, taken_pid
from warmstart.checkpoint.layout import CRIU_DIR, SANDBOX_FILES_DIR, timed
from warmstart.checkpoint.sandbox import Sandbox
from warmstart.checkpoint.weight_staging import StagerProcess, give_plan, spawn_stager_early
from warmstart.host import cuda_driver, procinfo
from warmstart.host.fileio import (
    DIRECTORY_FLAGS,
    UnsafeInput,
    atomic_file,
    directory_beneath,
    directory_fd,
    read_json_file,
    write_atomic,
)
from warmstart.snapshot.manifest import SnapshotError
from warmstart.snapshot.signing import Verifier
from warmstart.snapshot.store import Snapshot, SnapshotStore

log = logging.getLogger(__name__)

FAILURES_DIR = "restore-failures"
RESTORE_LOGS_DIR = "restore-logs"  # in the restorer's work directory, and a copy in the sandbox's
RESTORE_LOG = "restore.log"  # as CRIU names it
# "1": CRIU restores private memory lazily (userfaultfd, `criu lazy-pages`): the engine resumes before its
# pages are all back, each filled when first touched, the rest in the background. Off unless set.
LAZY_PAGES_ENV = "WARMSTART_LAZY_PAGES"
LAZY_PAGES_DEADLINE_SECONDS = 300.0


class RestoreRefused(RuntimeError):
    """The snapshot failed verification (signature, digest, identity); CRIU was not run."""


class RestoreClaimed(RestoreRefused):
    """The pod's worker claimed it for a cold start first (or another restore did): nothing was done in the
    pod and nothing was sent; the pod is a cold start and the snapshot is not at fault."""


class PodUnfit(RuntimeError):
    """The pod cannot take this snapshot (its image, its worker's facts, as `before_claim` found them):
    nothing was claimed or sent, and the snapshot is not at fault."""


class NotCounted(Exception):
    """A restore that failed for a reason not the snapshot's: the pod was answered `restore-failed` and
    cold-starts, and nothing is counted against the snapshot."""


class SnapshotVanished(RestoreRefused, NotCounted):
    """The snapshot was unpublished (deleted) while it was being restored."""


class RestoreFailed(RuntimeError):
    """CRIU or the CUDA restore failed; what was restored has been killed."""


class PidTaken(RestoreFailed, NotCounted):
    """A PID the snapshot's processes had is held by a process of the pod: the pod's doing. What was
    restored has been killed."""


@dataclass
class RestoreResult:
    snapshot: Snapshot
    namespace_pid: int
    host_pid: int
    timings: dict[str, float] = field(default_factory=dict)


class FailureCounter:
    """Restore failures per snapshot, one small JSON file each under `<store>/restore-failures/`.

    The directory is opened without following a symbolic link and every file in it is read and written
    through that descriptor, so a link planted in the store never makes root read or write elsewhere.
    """

    MAX_RECORD_BYTES = 64 << 10

    def __init__(self, store_root: Path, max_failures: int = MAX_RESTORE_FAILURES) -> None:
        self.store_root = Path(store_root)
        self.max_failures = max_failures

    @staticmethod
    def _name(snapshot_id: str) -> str:
        if "/" in snapshot_id or snapshot_id.startswith(".") or "\x00" in snapshot_id:
            raise ValueError(f"{snapshot_id!r} is not a snapshot id")
        return f"{snapshot_id}.json"

    def _record(self, snapshot_id: str) -> dict[str, Any]:
        """The stored record, or {} when there is none or it cannot be trusted as one."""
        with contextlib.suppress(OSError, UnsafeInput), directory_fd(self.store_root, FAILURES_DIR) as fd:
            return self._read(fd, snapshot_id)
        return {}

    def _read(self, fd: int, snapshot_id: str) -> dict[str, Any]:
        try:
            record = read_json_file(self._name(snapshot_id), self.MAX_RECORD_BYTES, dir_fd=fd)
        except (OSError, UnsafeInput):
            return {}
        return record if isinstance(record, dict) else {}

    @staticmethod
    def _count_in(record: dict[str, Any]) -> int:
        count = record.get("count")
        return count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else 0

    def count(self, snapshot_id: str) -> int:
        return self._count_in(self._record(snapshot_id))

    def last_reason(self, snapshot_id: str) -> str:
        reason = self._record(snapshot_id).get("reason")
        return reason if isinstance(reason, str) else ""

    def record(self, snapshot_id: str, reason: str) -> int:
        """Count one more failure; concurrent restores (threads or processes) each count, none is lost."""
        name = Path(self._name(snapshot_id))
        with directory_fd(self.store_root, FAILURES_DIR, create=True) as fd:
            fcntl.flock(fd, fcntl.LOCK_EX)  # read-add-write under the directory's lock; closing releases it
            count = self._count_in(self._read(fd, snapshot_id)) + 1
            content = json.dumps({"count": count, "reason": reason, "time": time.time()}).encode()
            write_atomic(name, content, dir_fd=fd)
        return count

    def invalid(self, snapshot_id: str) -> bool:
        """True once the snapshot failed `max_failures` times: do not try it again."""
        return self.count(snapshot_id) >= self.max_failures

    def clear(self, snapshot_id: str) -> None:
        name = self._name(snapshot_id)
        # no record to clear, or nothing that could be one
        with contextlib.suppress(OSError, UnsafeInput), directory_fd(self.store_root, FAILURES_DIR) as fd:
            os.unlink(name, dir_fd=fd)


@contextlib.contextmanager
def _refused_unless_valid(snapshot_id: str, destination: Path) -> Iterator[None]:
    """A SnapshotError (signature, identity, a digest) as RestoreRefused, with `destination` removed."""
    try:
        yield
    except SnapshotError as exc:
        shutil.rmtree(destination, ignore_errors=True)
        raise RestoreRefused(f"snapshot {snapshot_id} refused: {exc}") from exc


def place_sandbox_files(snapshot: Snapshot, materialized: Path, sandbox: Sandbox) -> None:
    """Copy the engine's open files (as they were at dump time) to the same paths inside the sandbox.

    The sandbox's directory is the tenant's: it is walked one directory descriptor at a time, never
    through a symbolic link (one where a directory goes is refused), and each file is written under a
    fresh name and renamed into place, so a link planted where a file goes is replaced, never followed.
    """
    mountpoint = Path(snapshot.record.sandbox_mountpoint or sandbox.mountpoint)
    if mountpoint != sandbox.mountpoint:
        raise RestoreFailed(
            f"the snapshot expects its sandbox at {mountpoint}, this one is at {sandbox.mountpoint}"
        )
    source_root = materialized / SANDBOX_FILES_DIR
    if not source_root.is_dir():
        return
    with _sandbox_dir(sandbox.host_dir) as root_fd:
        for source in sorted(source_root.rglob("*")):
            if source.is_file():
                relative = source.relative_to(source_root)
                entry = snapshot.files.get(f"{SANDBOX_FILES_DIR}/{relative}")
                mode = entry.mode & 0o777 if entry is not None else 0o644
                _place_file(root_fd, relative, source, mode, sandbox.host_dir)


@contextlib.contextmanager
def _sandbox_dir(host_dir: Path) -> Iterator[int]:
    try:
        fd = os.open(host_dir, DIRECTORY_FLAGS)
    except OSError as exc:
        raise RestoreFailed(f"the sandbox directory {host_dir} is unusable ({exc.strerror})") from exc
    try:
        yield fd
    finally:
        os.close(fd)


def _place_file(root_fd: int, relative: Path, source: Path, mode: int, host_dir: Path) -> None:
    try:
        with (
            directory_beneath(root_fd, relative.parts[:-1]) as parent_fd,
            open(source, "rb") as content,
            atomic_file(Path(relative.name), mode, dir_fd=parent_fd) as out,
        ):
            shutil.copyfileobj(content, out)  # a copy: the blob behind `source` is immutable
    except OSError as exc:
        raise RestoreFailed(
            f"cannot place {relative} in the sandbox directory {host_dir}: {exc.strerror or exc} "
            "(a symbolic link or another file where the snapshot has a directory is never followed)"
        ) from exc


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
    before_claim: Callable[[], None] | None = None,
) -> RestoreResult:
    """Restore `snapshot_id` into `sandbox`; `control` is the sandbox's control directory (host path).

    `before_claim` checks what only the pod can show (it may wait for it) once the snapshot is verified;
    PodUnfit from it stops the restore with nothing claimed, sent or counted.
    The pod's restore claim is taken once the snapshot is verified, before anything in the pod is touched:
    when the pod's worker claimed it first (it cold-started), RestoreClaimed says so and nothing is done or
    sent. Otherwise raises RestoreRefused (nothing ran) or RestoreFailed (cleaned up), both after
    `restore-failed` was sent: a restore that holds the claim always answers.
    """
    failures = FailureCounter(store.root)
    timings: dict[str, float] = {}
    stager: StagerProcess | None = None
    claimed = False
    try:
        stager = spawn_stager_early(store, snapshot_id, sandbox.init_pid, control)  # no plan yet
        with timed(timings, "verify_materialize"), _refused_unless_valid(snapshot_id, work_dir):
            # The plan is the signed manifest's: the weights go to the GPU while the blobs are hashed
            # and CRIU restores the engine; a blob that fails its digest stops the stager below.
            signed = store.check_signature(snapshot_id, verifier, expected_identity)  # blobs not hashed yet
            if signed.record.uses_cuda:
                cuda_driver.warm_up()  # meanwhile: ready by the CUDA restore (`cuda_driver` times the rest)
            stager = give_plan(stager, signed, sandbox.init_pid)
            shutil.rmtree(work_dir, ignore_errors=True)
            snapshot = store.materialize(snapshot_id, work_dir, verifier, expected_identity=expected_identity)
        if before_claim is not None:
            with timed(timings, "pod_checks"):
                before_claim()
        claim_restore(control, snapshot_id)
        claimed = True
        with timed(timings, "place_sandbox_files"):
            place_sandbox_files(snapshot, work_dir, sandbox)
        namespace_pid, host_pid = _restore_process(snapshot, sandbox, criu, work_dir, timings)
    except (RestoreClaimed, PodUnfit):
        _stop(stager)
        raise  # nothing claimed: nothing to undo, nothing to say (the caller answers an unfit pod)
    except (RestoreRefused, RestoreFailed) as exc:
        _stop(stager)
        _vanished_or_counted(store, control, failures, snapshot_id, exc)
        raise
    except (CriuError, cuda.CudaCheckpointError, cuda.CudaUnavailable, OSError) as exc:
        failed = _failure(snapshot_id, exc, sandbox)
        _undo(stager, sandbox, claimed)
        _vanished_or_counted(store, control, failures, snapshot_id, failed)
        raise failed from exc
    except BaseException:  # interrupted: leave nothing half-restored behind
        _undo(stager, sandbox, claimed)
        count_failure(control, failures, snapshot_id, "restore interrupted")
        raise
    staged = stager.payload() if stager is not None else {}
    control.send(
        RESTORE_COMPLETE, {**(resume_payload or {}), **staged, "snapshot": snapshot_id, "pid": namespace_pid}
    )
    return RestoreResult(snapshot, namespace_pid, host_pid, timings)


def claim_restore(control: ControlDir, snapshot_id: str) -> None:
    """Take the pod's restore claim; RestoreClaimed when its worker (or another restore) holds it already."""
    try:
        claim = control.claim(CLAIM_RESTORE, snapshot=snapshot_id)
    except (SignalError, OSError) as exc:
        raise RestoreClaimed(
            f"restore of {snapshot_id} not started: no claim in {control.path}: {exc}"
        ) from exc
    if not claim.ours:
        who = "the worker (for a cold start)" if claim.holder == CLAIM_COLD else "another restore"
        raise RestoreClaimed(
            f"restore of {snapshot_id} not started: {who} holds {control.path / RESTORE_CLAIM} "
            f"(since {claim.payload.get('time', 'an unknown time')})"
        )


def _undo(stager: StagerProcess | None, sandbox: Sandbox, claimed: bool) -> None:
    """Stop the stager and kill what was restored; an unclaimed pod may run its worker's cold engine."""
    _stop(stager)
    if claimed:
        sandbox.kill_all_but_init()


def _stop(stager: StagerProcess | None) -> None:
    if stager is not None:
        stager.stop()


def _restore_process(
    snapshot: Snapshot, sandbox: Sandbox, criu: Criu, work_dir: Path, timings: dict[str, float]
) -> tuple[int, int]:
    runner = sandbox.criu(criu)
    lazy = _start_lazy_pages(runner, work_dir) if os.environ.get(LAZY_PAGES_ENV) == "1" else None
    try:
        with timed(timings, "criu_restore"):
            namespace_pid = runner.restore(
                work_dir / CRIU_DIR, logs_dir=work_dir / RESTORE_LOGS_DIR,
                extra=["--lazy-pages"] if lazy is not None else [],
            )  # fmt: skip
    except BaseException:
        _stop_lazy_pages(lazy)
        raise
    finally:
        _hand_over_restore_log(work_dir, sandbox)
    if lazy is not None:  # it fills the rest of the memory in the background, then exits
        threading.Thread(target=_reap_lazy_pages, args=(lazy,), name="lazy-pages-reaper", daemon=True).start()
    sandbox.set_main_pid(namespace_pid)
    host_pid = sandbox.host_pid(namespace_pid)
    if host_pid is None:  # a CRIU-side failure: the caller kills whatever half-restored tasks remain
        raise CriuError(f"CRIU reported pid {namespace_pid} but no such process runs in the sandbox")
    if snapshot.record.uses_cuda:
        gpu_pids = _restored_cuda_pids(snapshot, sandbox, namespace_pid)
        with timed(timings, "cuda_driver"):
            cuda.driver()
        before = procinfo.memory_counters(host_pid)
        with timed(timings, "cuda_restore"):
            cuda.resume_all(gpu_pids)  # any one failing fails the restore: the caller kills the whole tree
        # What the driver's restore touched in host memory (pages it faulted in, memory it pinned again).
        log.info("CUDA restore of pid %d in %.3f s: %s", host_pid, timings["cuda_restore"],
                 procinfo.counters_delta(before, procinfo.memory_counters(host_pid)))  # fmt: skip
    return namespace_pid, host_pid


def _restored_cuda_pids(snapshot: Snapshot, sandbox: Sandbox, namespace_pid: int) -> list[int]:
    """Host PIDs of the restored processes that were CUDA-checkpointed (older snapshots: the engine)."""
    wanted = snapshot.record.cuda_pids or [namespace_pid]
    found = {pid: sandbox.host_pid(pid) for pid in wanted}
    missing = [pid for pid, host in found.items() if host is None]
    if missing:
        raise CriuError(f"CRIU restored no process with pid {missing} of the CUDA processes {wanted}")
    return [host for host in found.values() if host is not None]


def _start_lazy_pages(runner: Criu, work_dir: Path) -> subprocess.Popen[str] | None:
    """CRIU's lazy-pages daemon for this restore (memory filled on demand); None, restoring eagerly, when
    it cannot start."""
    try:
        return runner.lazy_pages(work_dir / CRIU_DIR, logs_dir=work_dir / RESTORE_LOGS_DIR)
    except (CriuError, OSError) as exc:
        log.warning("restoring without lazy pages: %s", exc)
        return None


def _stop_lazy_pages(process: subprocess.Popen[str] | None) -> None:
    if process is not None and process.poll() is None:
        kill_group(process)


def _reap_lazy_pages(process: subprocess.Popen[str]) -> None:
    try:
        code = process.wait(timeout=LAZY_PAGES_DEADLINE_SECONDS)
    except subprocess.TimeoutExpired:
        log.warning("CRIU lazy-pages ran past %.0f s; killing it", LAZY_PAGES_DEADLINE_SECONDS)
        _stop_lazy_pages(process)
        return
    if code:
        log.warning("CRIU lazy-pages exited with %d", code)


def _hand_over_restore_log(work_dir: Path, sandbox: Sandbox) -> None:
    """A copy of CRIU's restore log for the pod (CRIU, as root, writes only into the restorer's own
    directory, never to a path in the tenant's)."""
    source = work_dir / RESTORE_LOGS_DIR / RESTORE_LOG
    if not source.is_file():
        return
    try:
        with _sandbox_dir(sandbox.host_dir) as root_fd:
            _place_file(root_fd, Path(RESTORE_LOGS_DIR, RESTORE_LOG), source, 0o644, sandbox.host_dir)
    except RestoreFailed as exc:
        log.warning("CRIU's restore log stays in %s: %s", source, exc)


def _failure(snapshot_id: str, exc: Exception, sandbox: Sandbox) -> RestoreFailed:
    """What a failed CRIU or CUDA restore is: PidTaken when CRIU found a PID it needed held in the pod (by
    what, while it still is)."""
    if isinstance(exc, CriuError) and (pid := taken_pid(exc)) is not None:
        holder = sandbox.task_holding(pid)
        return PidTaken(
            f"restore of {snapshot_id} failed: PID {pid}, which the snapshot's process had, is taken in "
            f"the pod{f' by {holder}' if holder else ''} (not counted against the snapshot)"
        )
    return RestoreFailed(f"restore of {snapshot_id} failed: {exc}")


def _vanished_or_counted(
    store: SnapshotStore, control: ControlDir, failures: FailureCounter, snapshot_id: str, exc: Exception
) -> None:
    """Answer `restore-failed`; count the failure against the snapshot unless it is NotCounted or the
    snapshot is no longer published (then SnapshotVanished, saying so, instead of a digest or an errno that
    reads like corruption)."""
    if store.is_published(snapshot_id):
        if isinstance(exc, NotCounted):
            _answer_failed(control, snapshot_id, str(exc), None)
        else:
            count_failure(control, failures, snapshot_id, str(exc))
        return
    vanished = SnapshotVanished(
        f"snapshot {snapshot_id} was deleted while it was being restored (not counted against it): {exc}"
    )
    with contextlib.suppress(ValueError):  # not even a snapshot's name: there is no record to clear
        failures.clear(snapshot_id)
    _answer_failed(control, snapshot_id, str(vanished), None)
    raise vanished from exc


def count_failure(control: ControlDir, failures: FailureCounter, snapshot_id: str, reason: str) -> None:
    """Count the failure and answer `restore-failed` (the answer goes out even when counting fails)."""
    count: int | None = None
    try:
        count = failures.record(snapshot_id, reason)
    except (OSError, ValueError) as exc:  # restore-failures is no directory (UnsafeInput), a full disk, no id
        log.error("could not count the failed restore of %s: %s", snapshot_id, exc)
    log.warning("restore of %s failed (%s time(s)): %s", snapshot_id, count, reason)
    _answer_failed(control, snapshot_id, reason, count)


def _answer_failed(control: ControlDir, snapshot_id: str, reason: str, count: int | None) -> None:
    """Send `restore-failed`; when even that cannot be written (a full disk), say so: the worker then
    cold-starts after its restore timeout."""
    try:
        control.send(RESTORE_FAILED, {"reason": reason, "snapshot": snapshot_id, "failures": count})
    except (OSError, UnsafeInput, SignalError) as exc:
        log.error("could not answer restore-failed to %s: %s", control.path, exc)
