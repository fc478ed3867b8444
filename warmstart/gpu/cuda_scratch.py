"""CUDA-graph scratch memory that is dropped before a checkpoint and mapped again, in place, after a restore.

A captured CUDA graph keeps its intermediate tensors (activations, gathered KV rows, logits) at fixed
addresses in a private memory pool. Between replays that memory holds nothing worth keeping: every replay
writes it before reading it, and the outputs are read only after a replay. Yet a CUDA checkpoint copies it
to host memory and CRIU stores it in the image (about 1 GiB for an 8B model's decode graphs).

`CudaScratchPool` is a torch `MemPool` whose segments come from our own allocator: each segment is a
`VmmRange` (reserved virtual range + physical memory). `release()` unmaps and frees the physical memory of
every segment and keeps the virtual ranges, so the checkpoint carries none of it; `reacquire()` maps fresh
memory at the same addresses, and the graphs replay unchanged. Torch's bookkeeping never notices: it only
ever saw the addresses.

The allocator functions torch calls are ctypes callbacks; torch calls them only when the pool needs a new
segment (during graph capture) or gives one back.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from collections.abc import Iterator
from typing import Any

from warmstart.gpu.cuda_arena import VmmRange, cuda_ordinal, primary_context
from warmstart.host.cuda_driver import check, driver

log = logging.getLogger(__name__)

# torch's pluggable allocator: void* alloc(ssize_t size, int device, cudaStream_t stream) and
# void free(void* ptr, ssize_t size, int device, cudaStream_t stream).
_AllocFn = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)
_FreeFn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p)


class CudaScratchPool:
    """A torch memory pool for CUDA graphs whose device memory can be released and re-mapped in place.

    Usage: `torch.cuda.graph(graph, pool=scratch.id)` for every capture; `release()` once no replay runs
    (before a checkpoint); `reacquire()` before the next replay. Tensors in the pool must not be read while
    it is released.
    """

    @staticmethod
    def supported() -> bool:
        """Whether this torch can route a graph's pool through our allocator (torch.cuda.MemPool, 2.5+)."""
        import torch

        return hasattr(torch.cuda, "MemPool") and hasattr(torch._C, "_cuda_customAllocator")

    def __init__(self, device: Any = "cuda") -> None:
        import torch

        self.device_index = cuda_ordinal(device)
        torch.cuda.init()
        self._context = primary_context(self.device_index)
        self._lock = threading.Lock()
        self._segments: dict[int, VmmRange] = {}
        self._released = False
        self._alloc_fn = _AllocFn(self._alloc)
        self._free_fn = _FreeFn(self._free)
        self._allocator = torch._C._cuda_customAllocator(
            ctypes.cast(self._alloc_fn, ctypes.c_void_p).value,
            ctypes.cast(self._free_fn, ctypes.c_void_p).value,
        )
        self._pool = torch.cuda.MemPool(self._allocator)
        # torch may call the allocator until the very end of the process (its pools are torn down late at
        # exit): the callbacks, and through them this object, must never be freed.
        for callback in (self._alloc_fn, self._free_fn):
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(callback))

    @property
    def id(self) -> tuple[int, int]:
        """The pool id to pass as `pool=` to `torch.cuda.graph`."""
        return self._pool.id

    @property
    def nbytes(self) -> int:
        """Device memory the pool's segments span (mapped or not)."""
        with self._lock:
            return sum(segment.size for segment in self._segments.values())

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> int:
        """Free the physical memory of every segment; returns the bytes given back."""
        import torch

        torch.cuda.synchronize(self.device_index)  # no replay may still use the scratch memory
        self._context.make_current()
        with self._lock:
            freed = 0
            for segment in self._segments.values():
                if segment.mapped:
                    segment.unmap()
                    freed += segment.size
            self._released = True
        return freed

    def reacquire(self) -> None:
        """Map fresh memory at every segment's address, zeroed (a few GB per millisecond).

        The graphs rewrite their intermediates on every replay; zeroing makes what a restored process finds
        there independent of whatever memory the driver hands back.
        """
        self._context.make_current()
        cu = driver()
        with self._lock:
            for segment in self._segments.values():
                if not segment.mapped:
                    segment.map()
                    check(cu.cuMemsetD8(segment.address, 0, segment.size), "cuMemsetD8")
            self._released = False

    # -- the allocator torch calls -------------------------------------------------------------------------
    def _alloc(self, size: int, device: int, stream: int) -> int | None:
        try:
            self._context.make_current()
            with _relaxed_capture():  # torch asks for segments while a graph is being captured
                segment = VmmRange(device, size)
        except Exception:  # a NULL makes torch raise its out-of-memory error; say why here
            log.exception("scratch pool: could not map %d bytes on cuda:%d", size, device)
            return None
        with self._lock:
            self._segments[segment.address] = segment
        return segment.address

    def _free(self, pointer: int | None, size: int, device: int, stream: int) -> None:
        with self._lock:
            segment = self._segments.pop(pointer or 0, None)
        if segment is None:
            log.error("scratch pool: torch freed %#x, which the pool never gave out", pointer or 0)
            return
        try:
            self._context.make_current()
            with _relaxed_capture():
                segment.free()
        except Exception:
            log.exception("scratch pool: could not free the segment at %#x", segment.address)


@contextlib.contextmanager
def _relaxed_capture() -> Iterator[None]:
    """Allow memory-management calls on this thread while another stream is capturing a graph."""
    cu = driver()
    relaxed = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
    previous = check(cu.cuThreadExchangeStreamCaptureMode(relaxed), "cuThreadExchangeStreamCaptureMode")
    try:
        yield
    finally:
        cu.cuThreadExchangeStreamCaptureMode(previous)
