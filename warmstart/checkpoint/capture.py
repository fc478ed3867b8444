"""Capture: turn a quiesced worker (it signalled `ready-for-snapshot`) into a signed snapshot in the store.

Phases, each timed into the manifest: wait for the worker, CUDA lock + checkpoint (only when the process
uses CUDA), copy of the sandbox files the engine holds open (its stdio logs; a restore recreates them so
CRIU finds the same files, and CRIU insists on the same size: the sizes are checked again after the dump),
CRIU dump of the engine subtree (always `--leave-running`: CRIU runs inside the engine's namespace and must
not end it by killing the engine), publish. Then the source either exits
(`snapshot-complete`) or, after its GPU state is restored in place, keeps serving (`restore-complete`).

Any failure or interruption (timeout, Ctrl-C, an exception) discards the staging directory, so no snapshot
becomes visible, and the source is resumed (CUDA restore + unlock, `restore-complete`) so it keeps serving.
If the capturing process itself is killed, its staging directory stays invisible until store GC removes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from warmstart.checkpoint import cuda
from warmstart.checkpoint.criu import Criu
from warmstart.checkpoint.layout import CRIU_DIR, LOGS_DIR, SANDBOX_FILES_DIR, timed
from warmstart.checkpoint.sandbox import RESERVED_PIDS, Sandbox
from warmstart.identity import SnapshotIdentity
from warmstart.protocol import READY_FOR_SNAPSHOT, RESTORE_COMPLETE, SNAPSHOT_COMPLETE, ControlDir
from warmstart.snapshot.signing import Signer
from warmstart.snapshot.store import Snapshot, SnapshotStore

log = logging.getLogger(__name__)

_CORE_IMAGE = re.compile(r"core-(\d+)\.img")


class CaptureError(RuntimeError):
    """The capture did not produce a snapshot; the message says which phase failed and why."""


@dataclass
class CaptureResult:
    snapshot: Snapshot
    timings: dict[str, float]


@dataclass
class CaptureOptions:
    keep_serving: bool = True  # source resumes after the dump (restore in place) instead of exiting
    resume_payload: dict[str, Any] = field(default_factory=dict)  # e.g. {"port": 8000} for the source
    ready_timeout: float = 600.0
    cuda_lock_timeout_ms: int = cuda.DEFAULT_LOCK_TIMEOUT_MS
    meta: dict[str, Any] = field(default_factory=dict)
    # Identity fields the capturing side measures itself and records instead of the worker's own word
    # (on a cluster: the image digest the container runtime reports).
    measured_identity: dict[str, Any] = field(default_factory=dict)


class _Timer:
    def __init__(self, on_phase: Callable[[str], None] | None) -> None:
        self.timings: dict[str, float] = {}
        self.current = "start"
        self._on_phase = on_phase

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.current = name
        if self._on_phase:
            self._on_phase(name)
        with timed(self.timings, name):
            yield


def wait_ready(
    control: ControlDir, sandbox: Sandbox, timeout: float, cancelled: Callable[[], bool] = lambda: False
) -> dict[str, Any]:
    """The `ready-for-snapshot` payload; fails early when the sandbox dies first or `cancelled()`."""
    deadline = time.monotonic() + timeout
    while True:
        signal = control.read(READY_FOR_SNAPSHOT)
        if signal is not None:
            return signal.payload
        if not sandbox.alive():
            raise CaptureError(
                f"the worker exited before ready-for-snapshot (see {sandbox.host_dir} and its logs/)"
            )
        if time.monotonic() >= deadline:
            raise CaptureError(f"no ready-for-snapshot in {control.path} within {timeout:.0f}s")
        if cancelled():
            raise CaptureError(f"stopped waiting for ready-for-snapshot in {control.path}")
        time.sleep(0.02)


def identity_from_payload(payload: dict[str, Any]) -> SnapshotIdentity:
    try:
        identity = SnapshotIdentity.from_dict(payload["identity"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CaptureError(f"ready-for-snapshot payload has no valid 'identity': {exc}") from exc
    claimed = payload.get("identity_hash")
    if claimed and claimed != identity.digest():
        raise CaptureError(f"ready-for-snapshot identity_hash {claimed} does not match its identity")
    return identity


def engine_pids(payload: dict[str, Any], sandbox: Sandbox) -> tuple[int, int]:
    """The engine's PID inside the sandbox (as the payload reports it) and on the host."""
    namespace_pid = payload.get("pid")
    if namespace_pid is None:
        raise CaptureError("ready-for-snapshot payload has no 'pid': the worker must report its own PID")
    if not isinstance(namespace_pid, int) or isinstance(namespace_pid, bool) or namespace_pid <= 0:
        raise CaptureError(f"ready-for-snapshot 'pid' must be a positive integer, got {namespace_pid!r}")
    host_pid = sandbox.host_pid(namespace_pid)
    if host_pid is None:
        raise CaptureError(f"the worker's pid {namespace_pid} is not running in the sandbox")
    return namespace_pid, host_pid


def open_sandbox_files(host_pid: int, sandbox: Sandbox) -> list[Path]:
    """Regular files under the sandbox mountpoint that `host_pid` holds open (paths inside the sandbox)."""
    found: set[Path] = set()
    for fd in os.listdir(f"/proc/{host_pid}/fd"):
        with contextlib.suppress(OSError):
            target = Path(os.readlink(f"/proc/{host_pid}/fd/{fd}"))
            if target.is_relative_to(sandbox.mountpoint) and sandbox.on_host(target).is_file():
                found.add(target)
    return sorted(found)


def _copy_sandbox_files(files: list[Path], sandbox: Sandbox, destination: Path) -> dict[Path, int]:
    """Copy the files; returns the sizes copied (CRIU refuses to restore a file of another size)."""
    sizes = {}
    for inside in files:
        target = destination / inside.relative_to(sandbox.mountpoint)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(sandbox.on_host(inside), target)
        sizes[inside] = target.stat().st_size
    return sizes


def _check_unchanged(files: list[Path], sandbox: Sandbox, sizes: dict[Path, int]) -> None:
    """The copies must match what CRIU saw: the quiesced engine must not write while it is captured."""
    for inside in files:
        now = sandbox.on_host(inside).stat().st_size
        if now != sizes[inside]:
            raise CaptureError(
                f"the worker wrote to {inside} during the capture ({sizes[inside]} -> {now} bytes); "
                "it must stay quiet after ready-for-snapshot"
            )


def capture(
    *,
    store: SnapshotStore,
    signer: Signer,
    sandbox: Sandbox,
    control: ControlDir,
    criu: Criu,
    options: CaptureOptions | None = None,
    on_phase: Callable[[str], None] | None = None,
) -> CaptureResult:
    """Snapshot the worker in `sandbox` whose control directory (host path) is `control`."""
    options = options or CaptureOptions()
    timer = _Timer(on_phase)
    with timer.phase("wait_ready"):
        payload = wait_ready(control, sandbox, options.ready_timeout)
    try:
        identity = dataclasses.replace(identity_from_payload(payload), **options.measured_identity)
        namespace_pid, host_pid = engine_pids(payload, sandbox)
    except CaptureError:  # nothing was suspended: the worker only waits for word to serve
        _tell_source_to_serve(control, options.resume_payload)
        raise
    use = cuda.process_uses_cuda(host_pid)
    log.info("capturing pid %d (host %d): %s", namespace_pid, host_pid, use.reason)
    suspended = False
    try:
        if use.uses_cuda:
            with timer.phase("cuda_checkpoint"):
                cuda.suspend(host_pid, options.cuda_lock_timeout_ms)
            suspended = True
        published = _dump_and_publish(
            store, signer, sandbox, criu, identity, namespace_pid, host_pid, payload, use, options, timer
        )
    except BaseException as exc:
        try:
            _resume_source(control, host_pid, suspended, options.resume_payload, timer)
        except Exception as resume_error:  # report the capture failure, not this one
            log.error("could not resume the source after a failed capture: %s", resume_error)
        if isinstance(exc, Exception) and not isinstance(exc, CaptureError):
            raise CaptureError(f"capture failed during {timer.current}: {exc}") from exc
        raise
    if options.keep_serving:
        _resume_source(control, host_pid, suspended, options.resume_payload, timer)
    else:
        control.send(SNAPSHOT_COMPLETE, {"snapshot": published.id})
    return CaptureResult(published, timer.timings)


def _dump_and_publish(
    store: SnapshotStore,
    signer: Signer,
    sandbox: Sandbox,
    criu: Criu,
    identity: SnapshotIdentity,
    namespace_pid: int,
    host_pid: int,
    payload: dict[str, Any],
    use: cuda.CudaUse,
    options: CaptureOptions,
    timer: _Timer,
) -> Snapshot:
    meta = {
        **options.meta,
        "engine_pid": namespace_pid,
        "uses_cuda": use.uses_cuda,
        "cuda_reason": use.reason,
        "worker": {k: v for k, v in payload.items() if k not in ("identity", "pid")},
    }
    node = {"hostname": socket.gethostname()}
    with store.stage(identity, node=node, meta=meta) as staging:
        with timer.phase("copy_sandbox_files"):
            files = open_sandbox_files(host_pid, sandbox)
            sizes = _copy_sandbox_files(files, sandbox, staging.dir / SANDBOX_FILES_DIR)
        with timer.phase("criu_dump"):
            criu.in_namespaces_of(sandbox.init_pid).dump(
                namespace_pid,
                staging.dir / CRIU_DIR,
                logs_dir=staging.dir / LOGS_DIR,
                leave_running=True,
            )
        _check_unchanged(files, sandbox, sizes)
        check_ids_restorable(staging.dir / CRIU_DIR)
        staging.meta["sandbox_files"] = [str(path) for path in files]
        staging.meta["sandbox_mountpoint"] = str(sandbox.mountpoint)
        staging.timings.update(timer.timings)
        with timer.phase("publish"):
            snapshot = staging.publish(signer)
    snapshot.timings.update(timer.timings)
    return snapshot


def check_ids_restorable(images: Path) -> None:
    """Refuse an image whose process or thread ids pass `RESERVED_PIDS`: a restore sandbox keeps only the
    ids up to that free, so CRIU could not recreate such a task there (CRIU writes one core-<id>.img per
    thread)."""
    ids = [int(found.group(1)) for path in images.iterdir() if (found := _CORE_IMAGE.fullmatch(path.name))]
    highest = max(ids, default=0)
    if highest > RESERVED_PIDS:  # the sandbox's own processes start at RESERVED_PIDS + 1
        raise CaptureError(
            f"the worker used process/thread id {highest}; restores keep only ids up to {RESERVED_PIDS} "
            "free, so this snapshot could never be restored (start fewer processes or threads before it)"
        )


def _resume_source(
    control: ControlDir, host_pid: int, suspended: bool, payload: dict[str, Any], timer: _Timer
) -> None:
    """Let the source carry on serving: GPU state back (when it was checkpointed), then `restore-complete`."""
    if suspended:
        with timer.phase("cuda_restore"):
            cuda.resume(host_pid)
    _tell_source_to_serve(control, payload)


def _tell_source_to_serve(control: ControlDir, payload: dict[str, Any]) -> None:
    control.send(RESTORE_COMPLETE, {**payload, "restored_in_place": True})
