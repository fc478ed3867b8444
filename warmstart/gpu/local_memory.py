"""The GPU's per-thread local-memory reserve, shrunk while a process is checkpointed and grown back after.

The driver keeps a local-memory reserve of stack bytes x every thread the GPU can hold (hundreds of MiB on
an H200), and a CUDA checkpoint copies it like any allocation: into the process's host memory, then into
the CRIU image, and back at every restore. Nothing in it outlives a kernel, so an engine about to be
checkpointed lowers the stack limit (the reserve all but goes) and raises it again after the restore,
before any kernel runs. Both engines do this unless `WARMSTART_SHRINK_LOCAL_MEMORY=0` (to measure).
"""

from __future__ import annotations

import logging

from warmstart.gpu.cuda_arena import primary_context
from warmstart.host.cuda_driver import CudaError, CudaUnavailable, check, driver
from warmstart.host.env import env_flag

log = logging.getLogger(__name__)

SHRINK_ENV = "WARMSTART_SHRINK_LOCAL_MEMORY"  # "0": keep the reserve in the checkpoint
CHECKPOINT_STACK_BYTES = 16  # per-thread stack limit while checkpointed


class LocalMemoryLimit:
    """The stack-size limit of one device's primary context (the one torch and vLLM use)."""

    def __init__(self, device_index: int) -> None:
        self._device_index = device_index
        self._saved: int | None = None

    @property
    def lowered(self) -> bool:
        return self._saved is not None

    def lower(self) -> bool:
        """Shrink the reserve (unless turned off); False, with a warning, when the driver would not."""
        if not env_flag(SHRINK_ENV) or self._saved is not None:
            return self._saved is not None
        try:
            cu = driver()
            primary_context(self._device_index).make_current()
            limit = cu.CUlimit.CU_LIMIT_STACK_SIZE
            saved = int(check(cu.cuCtxGetLimit(limit), "cuCtxGetLimit"))
            check(cu.cuCtxSetLimit(limit, CHECKPOINT_STACK_BYTES), "cuCtxSetLimit")
        except (CudaError, CudaUnavailable) as exc:
            log.warning("GPU local memory stays in the checkpoint: %s", exc)
            return False
        self._saved = saved
        return True

    def restore(self) -> None:
        """Put the limit back as it was (nothing when it was not lowered)."""
        if self._saved is None:
            return
        cu = driver()
        primary_context(self._device_index).make_current()
        check(cu.cuCtxSetLimit(cu.CUlimit.CU_LIMIT_STACK_SIZE, self._saved), "cuCtxSetLimit")
        self._saved = None
