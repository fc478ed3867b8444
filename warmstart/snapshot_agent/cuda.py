"""The CUDA driver checkpoint API, driven from the agent with the worker's PID (driver >= 570).

Capture: lock -> checkpoint (device memory copied to host, GPU resources released) -> CRIU dump.
Restore: CRIU restore -> restore -> unlock. `cuda.bindings.driver` is imported lazily; a machine without
libcuda is "no CUDA here" (`CudaUnavailable`), never a crash, and CPU workers are skipped with a reason by
`process_uses_cuda`.
"""

from __future__ import annotations

import enum
import os
import threading
from dataclasses import dataclass
from typing import Any

DEFAULT_LOCK_TIMEOUT_MS = 20_000


class CudaUnavailable(RuntimeError):
    """No usable CUDA driver on this machine (no libcuda, no device, or a driver without the API)."""


class CudaCheckpointError(RuntimeError):
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


_init_lock = threading.Lock()
_driver: Any = None


def driver() -> Any:
    """`cuda.bindings.driver`, initialised once; `CudaUnavailable` with the reason when it cannot be."""
    global _driver
    with _init_lock:
        if _driver is not None:
            return _driver
        try:
            from cuda.bindings import driver as cu
        except ImportError as exc:
            raise CudaUnavailable(
                f"cuda-python is not installed ({exc}): pip install 'warmstart[gpu]'"
            ) from exc
        try:
            (error,) = cu.cuInit(0)
        except Exception as exc:  # DynamicLibNotFoundError and kin: no libcuda here
            raise CudaUnavailable(f"no CUDA driver here: {exc}") from exc
        if int(error) != 0:
            raise CudaUnavailable(f"cuInit failed: {_error_name(cu, error)}")
        for name in ("cuCheckpointProcessLock", "cuCheckpointProcessGetState"):
            if not hasattr(cu, name):
                raise CudaUnavailable(
                    f"cuda-python lacks {name}: needs cuda-python >= 12.8 and driver >= 570"
                )
        _driver = cu
        return cu


def _error_name(cu: Any, error: Any) -> str:
    try:
        result = cu.cuGetErrorName(error)
        name = result[1].decode() if isinstance(result[1], bytes) else str(result[1])
        return f"{name} ({int(error)})"
    except Exception:
        return repr(error)


def _check(cu: Any, result: Any, call: str, pid: int) -> Any:
    error = result[0] if isinstance(result, tuple) else result
    if int(error) != 0:
        raise CudaCheckpointError(f"{call}(pid {pid}) failed: {_error_name(cu, error)}")
    return result[1] if isinstance(result, tuple) and len(result) > 1 else None


def lock(pid: int, timeout_ms: int = DEFAULT_LOCK_TIMEOUT_MS) -> None:
    """Block new CUDA calls in `pid` and wait (up to `timeout_ms`) for running work to finish."""
    cu = driver()
    args = cu.CUcheckpointLockArgs()
    args.timeoutMs = timeout_ms
    _check(cu, cu.cuCheckpointProcessLock(pid, args), "cuCheckpointProcessLock", pid)


def checkpoint(pid: int) -> None:
    """Copy `pid`'s device memory to host memory and release its GPU resources (needs LOCKED)."""
    cu = driver()
    _check(
        cu,
        cu.cuCheckpointProcessCheckpoint(pid, cu.CUcheckpointCheckpointArgs()),
        "cuCheckpointProcessCheckpoint",
        pid,
    )


def restore(pid: int) -> None:
    """Re-acquire the GPU and copy device memory back (needs CHECKPOINTED); the process stays LOCKED."""
    cu = driver()
    _check(
        cu,
        cu.cuCheckpointProcessRestore(pid, cu.CUcheckpointRestoreArgs()),
        "cuCheckpointProcessRestore",
        pid,
    )


def unlock(pid: int) -> None:
    """Let `pid` make CUDA calls again (needs LOCKED)."""
    cu = driver()
    _check(
        cu, cu.cuCheckpointProcessUnlock(pid, cu.CUcheckpointUnlockArgs()), "cuCheckpointProcessUnlock", pid
    )


def state(pid: int) -> CheckpointState:
    cu = driver()
    raw = _check(cu, cu.cuCheckpointProcessGetState(pid), "cuCheckpointProcessGetState", pid)
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
