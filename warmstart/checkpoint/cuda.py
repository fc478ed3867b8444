"""The CUDA driver checkpoint API, driven from the agent with the worker's PID (driver >= 570).

Capture: lock -> checkpoint (device memory copied to host, GPU resources released) -> CRIU dump.
Restore: CRIU restore -> restore -> unlock. `cuda.bindings.driver` is imported lazily; a machine without
libcuda is "no CUDA here" (`CudaUnavailable`), never a crash, and CPU workers are skipped with a reason by
`process_uses_cuda`.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import Any

from warmstart import cuda_driver
from warmstart.cuda_driver import CudaError, CudaUnavailable

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


@dataclass(frozen=True)
class CudaUse:
    """Whether a process holds CUDA state, and what showed it."""

    uses_cuda: bool
    reason: str


def process_uses_cuda(pid: int) -> CudaUse:
    """CUDA is in use when the process maps libcuda or holds a descriptor on /dev/nvidia*."""
    try:
        with open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                if "libcuda.so" in line:
                    return CudaUse(True, f"pid {pid} maps {line.split()[-1]}")
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("/dev/nvidia"):
                return CudaUse(True, f"pid {pid} has {target} open")
    except FileNotFoundError:
        return CudaUse(False, f"pid {pid} does not exist")
    return CudaUse(False, f"pid {pid} neither maps libcuda nor opens /dev/nvidia*: a CPU process")


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
    if current is CheckpointState.CHECKPOINTED:
        restore(pid)
        current = state(pid)
    if current is CheckpointState.LOCKED:
        unlock(pid)
