"""The CUDA driver checkpoint API, driven from the agent with the worker's PID (driver >= 570).

Capture: lock -> checkpoint (device memory copied to host, GPU resources released) -> CRIU dump.
Restore: CRIU restore -> restore -> unlock. A worker whose engine runs one process per GPU (tensor
parallelism) has several CUDA processes in its tree: `cuda_processes` finds them, `suspend_all` locks every
one before checkpointing any (no rank keeps computing, or waiting in a collective, beside a checkpointed
one) and undoes what it did when one fails; `resume_all` brings them all back or says which did not.
`cuda.bindings.driver` is imported lazily; a machine without libcuda is "no CUDA here" (`CudaUnavailable`),
never a crash, and CPU workers are skipped (`process_uses_cuda`).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import time
from typing import Any

from warmstart.host import cuda_driver, procinfo
from warmstart.host.cuda_driver import CudaError, CudaUnavailable

log = logging.getLogger(__name__)

DEFAULT_LOCK_TIMEOUT_MS = 20_000
_CHECKPOINT_CALLS = ("cuCheckpointProcessLock", "cuCheckpointProcessGetState")


class CudaCheckpointError(CudaError):
    """A checkpoint API call failed; the message names the call, the PID and the driver's error."""


class CheckpointState(enum.Enum):
    RUNNING = "running"
    LOCKED = "locked"
    CHECKPOINTED = "checkpointed"
    FAILED = "failed"
    CHECKPOINTING = "checkpointing"
    RESTORING = "restoring"


def process_uses_cuda(pid: int) -> bool:
    """Whether the process maps libcuda or holds a descriptor on /dev/nvidia* (False when it is gone)."""
    with contextlib.suppress(FileNotFoundError):
        with open(f"/proc/{pid}/maps") as maps:
            if any("libcuda.so" in line for line in maps):
                return True
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/dev/nvidia"):
                    return True
    return False


def driver() -> Any:
    """`cuda.bindings.driver`, initialised and with the checkpoint API; else `CudaUnavailable` saying why."""
    cu = cuda_driver.driver()
    for name in _CHECKPOINT_CALLS:
        if not hasattr(cu, name):
            raise CudaUnavailable(f"cuda-python lacks {name}: needs cuda-python >= 12.8 and driver >= 570")
    return cu


def _check(result: Any, call: str, pid: int) -> Any:
    return cuda_driver.check(result, f"{call}(pid {pid})", error_type=CudaCheckpointError)


def lock(pid: int, timeout_ms: int = DEFAULT_LOCK_TIMEOUT_MS) -> None:
    """Block new CUDA calls in `pid` and wait (up to `timeout_ms`) for running work to finish."""
    cu = driver()
    args = cu.CUcheckpointLockArgs()
    args.timeoutMs = timeout_ms
    _check(cu.cuCheckpointProcessLock(pid, args), "cuCheckpointProcessLock", pid)


def checkpoint(pid: int) -> None:
    """Copy `pid`'s device memory to host memory and release its GPU resources (needs LOCKED)."""
    cu = driver()
    _check(
        cu.cuCheckpointProcessCheckpoint(pid, cu.CUcheckpointCheckpointArgs()),
        "cuCheckpointProcessCheckpoint",
        pid,
    )


def restore(pid: int) -> None:
    """Re-acquire the GPU and copy device memory back (needs CHECKPOINTED); the process stays LOCKED."""
    cu = driver()
    _check(
        cu.cuCheckpointProcessRestore(pid, cu.CUcheckpointRestoreArgs()),
        "cuCheckpointProcessRestore",
        pid,
    )


def unlock(pid: int) -> None:
    """Let `pid` make CUDA calls again (needs LOCKED)."""
    cu = driver()
    _check(cu.cuCheckpointProcessUnlock(pid, cu.CUcheckpointUnlockArgs()), "cuCheckpointProcessUnlock", pid)


def state(pid: int) -> CheckpointState:
    cu = driver()
    raw = _check(cu.cuCheckpointProcessGetState(pid), "cuCheckpointProcessGetState", pid)
    name = getattr(raw, "name", str(raw)).removeprefix("CU_PROCESS_STATE_").lower()
    try:
        return CheckpointState(name)
    except ValueError as exc:
        raise CudaCheckpointError(f"unknown CUDA process state {raw!r} for pid {pid}") from exc


def process_tree(root: int) -> list[int]:
    """`root` and every process descended from it, parents before children (empty when `root` is gone)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            stat = procinfo.read_stat(entry.name)
            if stat is not None:
                children.setdefault(stat.ppid, []).append(stat.pid)
    if not os.path.exists(f"/proc/{root}"):
        return []
    tree = [root]
    for pid in tree:  # the list grows while it is walked: breadth first
        tree.extend(sorted(children.get(pid, [])))
    return tree


def cuda_processes(root: int) -> list[int]:
    """The processes of `root`'s tree that hold CUDA state, parents first.

    `root` counts when it maps libcuda or opens the GPU (its checkpoint then says whether it can be
    captured). A descendant also needs the driver to report a CUDA state for it: a child forked from a CUDA
    process, or a compile worker that only loaded the driver, inherits its mappings without a context of
    its own, and locking it would fail a capture that needs nothing of it."""
    found = []
    for pid in process_tree(root):
        try:
            uses = process_uses_cuda(pid)
        except OSError:  # gone, or not ours to read, since the tree was listed
            continue
        if uses and (pid == root or _has_cuda_state(pid)):
            found.append(pid)
    return found


def _has_cuda_state(pid: int) -> bool:
    try:
        state(pid)
    except CudaCheckpointError as exc:
        log.info("pid %d maps the CUDA driver but has no CUDA state to checkpoint: %s", pid, exc)
        return False
    return True


def suspend_all(pids: list[int], timeout_ms: int = DEFAULT_LOCK_TIMEOUT_MS) -> None:
    """Lock every process, then checkpoint every one: all or none. On a failure, what was checkpointed is
    restored and what was locked unlocked, so every process runs as before, and the error is raised."""
    locked: list[int] = []
    try:
        for pid in pids:
            lock(pid, timeout_ms)
            locked.append(pid)
        for pid in pids:
            checkpoint(pid)
    except BaseException:  # back to running, each from whatever state it reached (even a part-way checkpoint)
        for pid in locked:
            try:
                resume(pid)
            except CudaError as exc:  # the original failure is the one to report
                log.error("undoing a failed checkpoint: %s", exc)
        raise


def resume_all(pids: list[int]) -> None:
    """Resume every process (`resume`); when any fails, the others are still resumed and one error names
    every failure."""
    failures = []
    for pid in pids:
        try:
            resume(pid)
        except CudaCheckpointError as exc:
            failures.append(str(exc))
    if failures:
        raise CudaCheckpointError(f"{len(failures)} of {len(pids)} CUDA processes did not resume: "
                                  + "; ".join(failures))  # fmt: skip


def suspend(pid: int, timeout_ms: int = DEFAULT_LOCK_TIMEOUT_MS) -> None:
    """Lock then checkpoint; on a checkpoint failure the process is unlocked again and keeps running."""
    lock(pid, timeout_ms)
    try:
        checkpoint(pid)
    except CudaCheckpointError:
        unlock(pid)
        raise


def resume(pid: int) -> None:
    """Restore then unlock whatever state the process is in (CHECKPOINTED or only LOCKED)."""
    current = state(pid)
    started = time.perf_counter()
    if current is CheckpointState.CHECKPOINTED:
        restore(pid)
        current = state(pid)
    restored = time.perf_counter()
    if current is CheckpointState.LOCKED:
        unlock(pid)
    log.info("pid %d: CUDA restore %.3f s, unlock %.3f s", pid, restored - started,
             time.perf_counter() - restored)  # fmt: skip
