"""The CUDA driver API through cuda-python, for the engines' VMM arena and the agent's checkpoint calls.

`driver()` imports `cuda.bindings.driver` lazily and runs `cuInit` once: importing this module needs neither
a GPU nor libcuda, and a machine without them gets `CudaUnavailable` with the reason, never a crash.
`check()` unpacks cuda-python's `(error, value...)` result tuples and raises `CudaError` naming the call.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any


class CudaUnavailable(RuntimeError):
    """No usable CUDA driver here (cuda-python missing, no libcuda, no device, or a driver lacking an API)."""


class CudaError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the driver's error."""


_init_lock = threading.Lock()
_initialised: Any = None


def driver() -> Any:
    """`cuda.bindings.driver` with `cuInit` done; `CudaUnavailable` with the reason when it cannot be."""
    global _initialised
    with _init_lock:
        if _initialised is not None:
            return _initialised
        try:
            from cuda.bindings import driver as cu
        except ImportError as exc:
            raise CudaUnavailable(
                f"cuda-python is not installed ({exc}): pip install 'warmstart[gpu]'"
            ) from exc
        try:
            (error,) = cu.cuInit(0)
        except Exception as exc:  # the loader's error (DynamicLibNotFoundError and kin): no libcuda here
            raise CudaUnavailable(f"no CUDA driver here: {exc}") from exc
        if int(error) != 0:
            raise CudaUnavailable(f"cuInit failed: {error_name(cu, error)}")
        _initialised = cu
        return cu


def warm_up() -> None:
    """Import the bindings and run `cuInit` on a thread of their own, so that the first driver call of a
    process that only now needs the driver (a restore's) finds them done, both having overlapped what the
    caller waited for meanwhile (CRIU's restore, a child process). Without a usable driver it does nothing;
    the call that needs one says why."""
    if _initialised is None:
        threading.Thread(target=_initialise_quietly, name="cuda-driver-warm-up", daemon=True).start()


def _initialise_quietly() -> None:
    with contextlib.suppress(CudaUnavailable):
        driver()


def error_name(cu: Any, error: Any) -> str:
    """The driver's name for `error` with its number, e.g. `CUDA_ERROR_INVALID_VALUE (1)`."""
    try:
        result = cu.cuGetErrorName(error)
        name = result[1].decode() if isinstance(result[1], bytes) else str(result[1])
        return f"{name} ({int(error)})"
    except Exception:  # no driver module to ask, or a driver that does not know the code
        return repr(error)


def check(result: Any, call: str, error_type: type[Exception] = CudaError) -> Any:
    """Unpack a cuda-python result: the one value after the error code, a tuple of several, or None;
    `error_type` naming `call` when the driver reports an error."""
    error = result[0] if isinstance(result, tuple) else result
    if int(error) != 0:
        raise error_type(f"{call} failed: {error_name(_initialised, error)}")
    values = result[1:] if isinstance(result, tuple) else ()
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def device_count() -> int:
    """GPUs the CUDA driver sees; 0 when there is no driver, no libcuda, no device or no cuda-python."""
    try:
        return int(check(driver().cuDeviceGetCount(), "cuDeviceGetCount"))
    except (CudaUnavailable, CudaError):
        return 0


def device_uuid(device_index: int) -> str:
    """The GPU's UUID as nvidia-smi prints it (`GPU-xxxxxxxx-xxxx-...`): the same GPU in every process,
    whatever ordinal CUDA_VISIBLE_DEVICES gives it there."""
    cu = driver()
    device = check(cu.cuDeviceGet(device_index), "cuDeviceGet")
    raw = check(cu.cuDeviceGetUuid(device), "cuDeviceGetUuid").bytes
    digits = (raw.encode("latin-1") if isinstance(raw, str) else bytes(raw)).hex()
    return f"GPU-{digits[:8]}-{digits[8:12]}-{digits[12:16]}-{digits[16:20]}-{digits[20:32]}"


def device_with_uuid(uuid: str) -> int:
    """This process's ordinal of the GPU with `uuid`; CudaError when that GPU is not visible here."""
    for index in range(int(check(driver().cuDeviceGetCount(), "cuDeviceGetCount"))):
        if device_uuid(index) == uuid:
            return index
    raise CudaError(f"GPU {uuid} is not visible to this process")


@dataclass(frozen=True)
class GpuDevice:
    """One GPU as the driver names it: what a snapshot identity records of a GPU."""

    uuid: str
    name: str
    compute_capability: str


def gpu_devices() -> list[GpuDevice]:
    """Every GPU the driver sees (CudaUnavailable where there is no driver)."""
    cu = driver()
    devices = []
    for index in range(int(check(cu.cuDeviceGetCount(), "cuDeviceGetCount"))):
        device = check(cu.cuDeviceGet(index), "cuDeviceGet")
        raw_name = check(cu.cuDeviceGetName(256, device), "cuDeviceGetName")
        name = bytes(raw_name).split(b"\0", 1)[0].decode(errors="replace")
        attribute = cu.CUdevice_attribute
        major, minor = (
            check(cu.cuDeviceGetAttribute(which, device), "cuDeviceGetAttribute")
            for which in (
                attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
            )
        )
        devices.append(GpuDevice(device_uuid(index), name, f"{major}.{minor}"))
    return devices
