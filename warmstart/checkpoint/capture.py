"""Capture: turn a quiesced worker (it signalled `ready-for-snapshot`) into a signed snapshot in the store.

Phases, each timed into the manifest: wait for the worker, CUDA lock + checkpoint (only when the process
uses CUDA), copy of the sandbox files the engine holds open (its stdio logs; a restore recreates them so
CRIU finds the same files, and CRIU insists on the same size: the sizes are checked again after the dump;
they are read through the engine's own descriptors, never by a path the tenant could point elsewhere),
CRIU dump of the engine subtree (always `--leave-running`: CRIU runs inside the engine's namespace and must
not end it by killing the engine), publish. Then the source either exits once the caller sends
`snapshot-complete` or, after its GPU state is restored in place, keeps serving (`restore-complete`).

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
import socket
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from warmstart.api.capture_record import CaptureRecord, WorkerRecord
from warmstart.api.control_dir import (
    READY_FOR_SNAPSHOT,
    RESTORE_COMPLETE,
    ControlDir,
    SignalError,
)
from warmstart.api.identity import SnapshotIdentity
from warmstart.checkpoint import cuda
from warmstart.checkpoint.criu import Criu, unescape_mountinfo
from warmstart.checkpoint.layout import CRIU_DIR, LOGS_DIR, SANDBOX_FILES_DIR, timed
from warmstart.checkpoint.sandbox import RESERVED_PIDS, Sandbox, namespace_pids
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
    # The source resumes after the dump (restore in place). Without it the source waits for
    # `snapshot-complete`, its word to exit, which the caller sends once the snapshot is recorded (the node
    # agent: pushed and Ready), not merely published.
    keep_serving: bool = True
    resume_payload: dict[str, Any] = field(default_factory=dict)  # e.g. {"port": 8000} for the source
    ready_timeout: float = 600.0
    record: CaptureRecord = field(default_factory=CaptureRecord)  # who asked: completed by the capture
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
        try:
            signal = control.read(READY_FOR_SNAPSHOT)
        except SignalError as exc:
            raise CaptureError(f"unusable ready-for-snapshot: {exc}") from exc
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


@dataclass(frozen=True)
class SandboxFile:
    """A file the engine holds open on the sandbox mount, held open here too (the open file itself)."""

    inside: Path  # its path inside the sandbox: names it in the snapshot, is never opened
    fd: int  # read-only descriptor of the very file the engine has open


@contextlib.contextmanager
def open_sandbox_files(host_pid: int, sandbox: Sandbox) -> Iterator[list[SandboxFile]]:
    """Regular files on the sandbox mount that `host_pid` holds open or has mapped (a JIT compiler's shared
    object, loaded and its descriptor closed), held open while the block runs.

    Each is opened through `/proc/<pid>/fd/N` or `/proc/<pid>/map_files/RANGE`, which lead to the engine's
    file itself: its path is never resolved again, so nothing the tenant put at that path (a link to a file
    only root may read, a FIFO) is ever opened. Descriptors of links (O_PATH), devices, FIFOs, deleted files
    and files on any other mount are left out.
    """
    mount_id = _mount_id_at(host_pid, sandbox.mountpoint)
    found: dict[Path, SandboxFile] = {}
    with contextlib.ExitStack() as held:
        for magic in _engine_files(host_pid):
            opened = _open_engine_file(magic, sandbox.mountpoint, mount_id)
            if opened is None:
                continue
            if opened.inside in found:  # reached again (a library mapped in several ranges): one will do
                os.close(opened.fd)
            else:
                found[opened.inside] = opened
                held.callback(os.close, opened.fd)
        yield sorted(found.values(), key=lambda opened: opened.inside)


def _engine_files(host_pid: int) -> Iterator[str]:
    """The magic links to every file `host_pid` holds open, then to every file it has mapped."""
    for folder in (f"/proc/{host_pid}/fd", f"/proc/{host_pid}/map_files"):
        try:
            names = os.listdir(folder)
        except OSError:  # map_files: absent on old kernels
            continue
        yield from (f"{folder}/{name}" for name in names)


def _open_engine_file(magic: str, mountpoint: Path, mount_id: int) -> SandboxFile | None:
    try:
        inside = Path(os.readlink(magic))  # only a name for the snapshot, never opened
        if inside == mountpoint or not inside.is_relative_to(mountpoint):
            return None
        handle = os.open(magic, os.O_PATH | os.O_CLOEXEC)  # a magic link: the open file, no path lookup
    except OSError:  # closed meanwhile
        return None
    try:
        info = os.fstat(handle)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink == 0 or _mount_id_of(handle) != mount_id:
            return None
        readable = os.open(f"/proc/self/fd/{handle}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    finally:
        os.close(handle)
    return SandboxFile(inside, readable)


def _mount_id_at(host_pid: int, mountpoint: Path) -> int:
    """The id of the mount at `mountpoint` in the mount namespace of `host_pid` (the topmost one)."""
    found = None
    with open(f"/proc/{host_pid}/mountinfo", encoding="utf-8", errors="surrogateescape") as mounts:
        for line in mounts:
            fields = line.split()
            if unescape_mountinfo(fields[4]) == str(mountpoint):
                found = int(fields[0])
    if found is None:
        raise CaptureError(f"nothing is mounted at {mountpoint} in the worker's mount namespace")
    return found


def _mount_id_of(fd: int) -> int | None:
    with open(f"/proc/self/fdinfo/{fd}", encoding="ascii") as info:
        for line in info:
            if line.startswith("mnt_id:"):
                return int(line.split()[1])
    return None


def _copy_sandbox_files(files: list[SandboxFile], sandbox: Sandbox, destination: Path) -> dict[Path, int]:
    """Copy the open files' contents, each from offset 0 (its own open file: the engine's offset stays);
    returns the sizes copied (CRIU refuses a file of another size)."""
    sizes = {}
    for opened in files:
        target = destination / opened.inside.relative_to(sandbox.mountpoint)
        target.parent.mkdir(parents=True, exist_ok=True)
        copied = 0
        with open(target, "xb") as copy:
            while chunk := os.pread(opened.fd, 1 << 20, copied):
                copied += copy.write(chunk)
        sizes[opened.inside] = copied
    return sizes


def _check_unchanged(files: list[SandboxFile], sizes: dict[Path, int]) -> None:
    """The copies must match what CRIU saw: the quiesced engine must not write while it is captured."""
    for opened in files:
        now = os.fstat(opened.fd).st_size
        if now != sizes[opened.inside]:
            raise CaptureError(
                f"the worker wrote to {opened.inside} during the capture ({sizes[opened.inside]} -> {now} "
                "bytes); it must stay quiet after ready-for-snapshot"
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
        worker = worker_record(payload)
    except CaptureError:  # nothing was suspended: the worker only waits for word to serve
        _tell_source_to_serve(control, options.resume_payload)
        raise
    suspended: list[int] = []
    try:
        gpu_pids = cuda.cuda_processes(host_pid)
        cuda_reason = (
            f"{len(gpu_pids)} CUDA process(es) in the tree: host pids {gpu_pids}"
            if gpu_pids
            else f"no process of pid {host_pid}'s tree maps libcuda or opens /dev/nvidia*"
        )
        log.info("capturing pid %d (host %d): %s", namespace_pid, host_pid, cuda_reason)
        if gpu_pids:
            with timer.phase("cuda_checkpoint"):
                cuda.suspend_all(gpu_pids)
            suspended = gpu_pids
        record = dataclasses.replace(
            options.record,
            engine_pid=namespace_pid,
            uses_cuda=bool(gpu_pids),
            cuda_reason=cuda_reason,
            # Their PIDs inside the sandbox (CRIU restores them): each is CUDA-restored, or the restore fails.
            cuda_pids=_sandbox_pids(host_pid, gpu_pids),
            worker=worker,
        )
        with (
            store.stage(identity, node={"hostname": socket.gethostname()}) as staging,
            open_sandbox_files(host_pid, sandbox) as files,
        ):
            with timer.phase("copy_sandbox_files"):
                sizes = _copy_sandbox_files(files, sandbox, staging.dir / SANDBOX_FILES_DIR)
            images = staging.dir / CRIU_DIR
            with timer.phase("criu_dump"):
                sandbox.criu(criu).dump(
                    namespace_pid, images, logs_dir=staging.dir / LOGS_DIR, leave_running=True
                )
            _check_unchanged(files, sizes)
            check_ids_restorable(images)
            staging.meta = dataclasses.replace(
                record,
                sandbox_files=[str(opened.inside) for opened in files],
                sandbox_mountpoint=str(sandbox.mountpoint),
            ).to_meta()
            staging.timings.update(timer.timings)
            with timer.phase("publish"):
                published = staging.publish(signer)
        published.timings.update(timer.timings)
    except BaseException as exc:
        try:
            _resume_source(control, suspended, options.resume_payload, timer)
        except Exception as resume_error:  # report the capture failure, not this one
            log.error("could not resume the source after a failed capture: %s", resume_error)
        if isinstance(exc, Exception) and not isinstance(exc, CaptureError):
            raise CaptureError(f"capture failed during {timer.current}: {exc}") from exc
        raise
    if options.keep_serving:
        _resume_source(control, suspended, options.resume_payload, timer)
    return CaptureResult(published, timer.timings)


def worker_record(payload: dict[str, Any]) -> WorkerRecord:
    """The worker's snapshot request as the capture records it; CaptureError naming each field of the wrong
    type (the worker runs the tenant's code: what it sends is checked before it is signed)."""
    try:
        return WorkerRecord.of({k: v for k, v in payload.items() if k not in ("identity", "pid")})
    except ValueError as exc:
        raise CaptureError(f"the worker's request for its snapshot is refused: {exc}") from exc


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


def _resume_source(control: ControlDir, suspended: list[int], payload: dict[str, Any], timer: _Timer) -> None:
    """Let the source carry on serving: GPU state back where it was checkpointed, then `restore-complete`
    (also when a process did not resume: the worker then fails where it stands instead of waiting)."""
    try:
        if suspended:
            with timer.phase("cuda_restore"):
                cuda.resume_all(suspended)
    finally:
        _tell_source_to_serve(control, payload)


def _sandbox_pids(engine_host_pid: int, host_pids: list[int]) -> list[int]:
    """The PIDs of `host_pids` in the engine's PID namespace (the sandbox's), even for a process that made
    a namespace of its own below it."""
    level = len(namespace_pids(engine_host_pid)) - 1
    return [namespace_pids(pid)[level] for pid in host_pids]


def _tell_source_to_serve(control: ControlDir, payload: dict[str, Any]) -> None:
    control.send(RESTORE_COMPLETE, {**payload, "restored_in_place": True})
