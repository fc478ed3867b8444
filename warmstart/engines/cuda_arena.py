"""A weight arena in CUDA virtual memory whose physical backing can be dropped and re-mapped in place.

The arena reserves one virtual address range once (`cuMemAddressReserve`) and backs it with physical device
memory (`cuMemCreate` + `cuMemMap` + `cuMemSetAccess`). Torch tensors are views of that range, built through
`__cuda_array_interface__`, so kernels and CUDA graphs captured over them hold plain device addresses.

`release()` unmaps and frees the physical memory but keeps the virtual range: the process then holds no weight
bytes on the GPU, so a CUDA checkpoint copies almost nothing and the CRIU image stays small. `reacquire()`
maps fresh physical memory at the *same* addresses; after `refill()` the old views and graphs are valid again.

`refill()` moves bytes from files (page cache or disk) into the arena: N threads, each reading with `preadv`
into its own two pinned host buffers and copying them asynchronously on its own stream, so reading one chunk
overlaps the DMA of the previous one.

cuda-python is imported lazily: importing this module needs neither a GPU nor the CUDA driver.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import struct
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_REFILL_THREADS = 8
DEFAULT_CHUNK_BYTES = 64 << 20
_DIRECT_IO_ALIGNMENT = 4096


class CudaError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the driver's error."""


class CudaUnavailable(RuntimeError):
    """No usable CUDA driver or device in this process (no libcuda, no GPU, or cuda-python missing)."""


def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise CudaUnavailable("cuda-python is not installed: pip install 'warmstart[gpu]'") from exc
    return driver


def _check(result: Any, call: str) -> Any:
    """Unpack a cuda-python result tuple; raise CudaError naming `call` when the driver reports an error."""
    error = result[0] if isinstance(result, tuple) else result
    if int(error) != 0:
        raise CudaError(f"{call} failed: {error!r}")
    if isinstance(result, tuple):
        values = result[1:]
        return values[0] if len(values) == 1 else (values or None)
    return None


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def cuda_device_count() -> int:
    """GPUs the CUDA driver sees; 0 when there is no driver, no libcuda or no cuda-python."""
    try:
        driver = _driver()
        _check(driver.cuInit(0), "cuInit")
        return int(_check(driver.cuDeviceGetCount(), "cuDeviceGetCount"))
    except (CudaUnavailable, CudaError, OSError, RuntimeError):
        # cuda-python raises a loader error (an OSError/RuntimeError subclass) when libcuda is absent.
        return 0


class _PrimaryContext:
    """The device's primary context (the one torch uses), made current on whichever thread asks."""

    def __init__(self, device_index: int) -> None:
        driver = _driver()
        try:
            _check(driver.cuInit(0), "cuInit")
        except CudaError:
            raise
        except Exception as exc:  # the loader's error when libcuda is missing
            raise CudaUnavailable(f"the CUDA driver cannot be loaded: {exc}") from exc
        count = int(_check(driver.cuDeviceGetCount(), "cuDeviceGetCount"))
        if not 0 <= device_index < count:
            raise CudaUnavailable(f"CUDA device {device_index} does not exist ({count} device(s) visible)")
        self.device = _check(driver.cuDeviceGet(device_index), "cuDeviceGet")
        self.context = _check(driver.cuDevicePrimaryCtxRetain(self.device), "cuDevicePrimaryCtxRetain")

    def make_current(self) -> None:
        _check(_driver().cuCtxSetCurrent(self.context), "cuCtxSetCurrent")


@functools.cache
def _primary_context(device_index: int) -> _PrimaryContext:
    return _PrimaryContext(device_index)  # retained once per process and device, never dropped


class _CudaArrayView:
    """A bare `__cuda_array_interface__` over raw device bytes, for `torch.as_tensor`."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
        }


class CudaVmmArena:
    """One contiguous range of device memory whose physical backing can be released and re-mapped in place.

    Implements `warmstart.engines.arena.Arena`. Usage: `allocate(nbytes)` once; carve tensor views out of the
    returned flat tensor; `release()` before a checkpoint; `reacquire()` and refill after a restore. Views
    must not be touched while the arena is released (the addresses are unmapped: a kernel reading them
    faults).
    """

    keeps_address = True

    def __init__(self, device: Any = "cuda") -> None:
        self.device_index = _device_index(device)
        self._context: _PrimaryContext | None = None
        self._address = 0
        self._reserved = 0
        self._nbytes = 0
        self._handle: Any = None
        self._tensor: Any = None

    # -- state ---------------------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes asked for in `allocate` (the mapped size is rounded up to the allocation granularity)."""
        return self._nbytes

    @property
    def address(self) -> int:
        """The arena's device virtual address; the same before `release()` and after `reacquire()`."""
        return self._address

    @property
    def released(self) -> bool:
        return self._handle is None

    @property
    def tensor(self) -> Any:
        """The whole arena as a flat uint8 torch tensor on the GPU."""
        if self._tensor is None:
            raise RuntimeError("the CUDA arena has no memory yet: call allocate(nbytes) first")
        if self._handle is None:
            from warmstart.engines.arena import ArenaReleasedError

            raise ArenaReleasedError("the CUDA arena is released; call reacquire() first")
        return self._tensor

    # -- lifecycle -----------------------------------------------------------------------------------------
    def allocate(self, nbytes: int) -> Any:
        """Reserve the virtual range, back it with device memory, and return the flat uint8 view."""
        if nbytes <= 0:
            raise ValueError(f"arena size must be positive, got {nbytes} bytes")
        if self._reserved:
            raise RuntimeError(f"the CUDA arena is already allocated ({self._nbytes} bytes); allocate once")
        import torch

        torch.cuda.init()
        torch.cuda.set_device(self.device_index)
        self._context = _primary_context(self.device_index)
        self._context.make_current()
        driver = _driver()
        granularity = int(
            _check(
                driver.cuMemGetAllocationGranularity(
                    self._allocation_prop(),
                    driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
                ),
                "cuMemGetAllocationGranularity",
            )
        )
        self._reserved = _round_up(nbytes, granularity)
        self._nbytes = nbytes
        reserved = driver.cuMemAddressReserve(self._reserved, granularity, 0, 0)
        self._address = int(_check(reserved, "cuMemAddressReserve"))
        self._map()
        view = _CudaArrayView(self._address, nbytes)
        self._tensor = torch.as_tensor(view, device=f"cuda:{self.device_index}")
        if self._tensor.data_ptr() != self._address:  # torch must view the range, never copy it
            raise CudaError("torch copied the arena instead of viewing it (__cuda_array_interface__)")
        return self._tensor

    def release(self) -> None:
        """Free the physical memory, keep the virtual range (views stay, pointing at unmapped addresses)."""
        if self._handle is None:
            return
        self._require_context()
        import torch

        torch.cuda.synchronize(self.device_index)  # no kernel may still read the weights
        driver = _driver()
        _check(driver.cuMemUnmap(self._address, self._reserved), "cuMemUnmap")
        _check(driver.cuMemRelease(self._handle), "cuMemRelease")
        self._handle = None

    def reacquire(self) -> Any:
        """Map fresh physical memory at the same address; contents are undefined until refilled."""
        if not self._reserved:
            raise RuntimeError("the CUDA arena was never allocated: call allocate(nbytes) first")
        if self._handle is None:
            self._require_context()
            self._map()
        return self._tensor

    def close(self) -> None:
        """Release the memory and give the virtual range back; the arena's views become invalid for good."""
        self.release()
        if self._reserved:
            _check(_driver().cuMemAddressFree(self._address, self._reserved), "cuMemAddressFree")
        self._tensor = None
        self._reserved = 0
        self._address = 0

    # -- internals -----------------------------------------------------------------------------------------
    def _require_context(self) -> None:
        if self._context is None:
            raise RuntimeError("the CUDA arena was never allocated: call allocate(nbytes) first")
        self._context.make_current()

    def _allocation_prop(self) -> Any:
        driver = _driver()
        prop = driver.CUmemAllocationProp()
        prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.device_index
        return prop

    def _map(self) -> None:
        driver = _driver()
        prop = self._allocation_prop()
        handle = _check(driver.cuMemCreate(self._reserved, prop, 0), "cuMemCreate")
        try:
            _check(driver.cuMemMap(self._address, self._reserved, 0, handle, 0), "cuMemMap")
            access = driver.CUmemAccessDesc()
            access.location = prop.location
            access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            _check(driver.cuMemSetAccess(self._address, self._reserved, [access], 1), "cuMemSetAccess")
        except CudaError:
            driver.cuMemRelease(handle)
            raise
        self._handle = handle


def _device_index(device: Any) -> int:
    """The CUDA ordinal of `device` ("cuda", "cuda:1", a torch.device or an int)."""
    if isinstance(device, int):
        return device
    text = str(device)
    kind, _, index = text.partition(":")
    if kind != "cuda":
        raise ValueError(f"the CUDA arena needs a cuda device, got {text!r} (use the torch arena elsewhere)")
    if not index:
        return 0
    if not index.isdigit():
        raise ValueError(f"bad CUDA device {text!r}: expected cuda or cuda:N")
    return int(index)


# ---------------------------------------------------------------------------------------------------------
# Where the bytes come from: safetensors layout and copy plans
# ---------------------------------------------------------------------------------------------------------

_SAFETENSORS_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip


@dataclass(frozen=True)
class StoredTensor:
    """One tensor's place inside a safetensors file (offsets are absolute file offsets)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file_offset: int
    nbytes: int


@dataclass(frozen=True)
class Segment:
    """Copy `nbytes` from `path` at `file_offset` into the arena at `arena_offset`."""

    path: str
    file_offset: int
    arena_offset: int
    nbytes: int


def safetensors_layout(path: str | os.PathLike[str]) -> list[StoredTensor]:
    """Read a safetensors header and return its tensors in file order, with absolute byte offsets."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path} is not a safetensors file: shorter than its 8-byte header length")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > 100 << 20:
            raise ValueError(f"{path} is not a safetensors file: header length {header_len} is implausible")
        header = json.loads(f.read(header_len))
    data_start = 8 + header_len
    tensors = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        dtype = info["dtype"]
        if dtype not in _SAFETENSORS_DTYPE_BYTES:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {dtype}")
        tensors.append(StoredTensor(name, dtype, tuple(info["shape"]), data_start + begin, end - begin))
    tensors.sort(key=lambda t: t.file_offset)
    return tensors


def merge_segments(segments: Iterable[Segment]) -> list[Segment]:
    """Join segments that are contiguous both in the same file and in the arena, so reads are long."""
    merged: list[Segment] = []
    for seg in sorted(segments, key=lambda s: (s.path, s.file_offset)):
        if seg.nbytes == 0:
            continue
        last = merged[-1] if merged else None
        if (
            last is not None
            and last.path == seg.path
            and last.file_offset + last.nbytes == seg.file_offset
            and last.arena_offset + last.nbytes == seg.arena_offset
        ):
            merged[-1] = Segment(last.path, last.file_offset, last.arena_offset, last.nbytes + seg.nbytes)
        else:
            merged.append(seg)
    return merged


def segments_for(placement: dict[str, int], files: Sequence[str | os.PathLike[str]]) -> list[Segment]:
    """The copy plan for tensors placed in the arena (`placement`: tensor name -> arena byte offset).

    Every placed tensor must be found in exactly one of `files`.
    """
    found: dict[str, Segment] = {}
    for file in files:
        for t in safetensors_layout(file):
            if t.name in placement:
                if t.name in found:
                    raise ValueError(
                        f"tensor {t.name!r} is in more than one weights file ({found[t.name].path}, {file})"
                    )
                found[t.name] = Segment(str(file), t.file_offset, placement[t.name], t.nbytes)
    missing = sorted(set(placement) - set(found))
    if missing:
        raise ValueError(
            f"{len(missing)} placed tensor(s) are in none of the weights files: {', '.join(missing[:5])}"
        )
    return merge_segments(found.values())


def _chunks(segments: Sequence[Segment], chunk_bytes: int) -> Iterator[Segment]:
    for seg in segments:
        for start in range(0, seg.nbytes, chunk_bytes):
            n = min(chunk_bytes, seg.nbytes - start)
            yield Segment(seg.path, seg.file_offset + start, seg.arena_offset + start, n)


# ---------------------------------------------------------------------------------------------------------
# Refill: files -> pinned buffers -> arena
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RefillStats:
    nbytes: int
    seconds: float
    threads: int
    direct_io: bool

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


class _PinnedBuffer:
    """Page-locked host memory from the driver, readable by `preadv` as a Python buffer."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.address = int(_check(_driver().cuMemHostAlloc(nbytes, 0), "cuMemHostAlloc"))
        self.view = memoryview((ctypes.c_char * nbytes).from_address(self.address)).cast("B")

    def free(self) -> None:
        self.view.release()
        _check(_driver().cuMemFreeHost(self.address), "cuMemFreeHost")


class _RefillWorker:
    """One thread's two pinned buffers, one stream and two events: reads overlap the previous chunk's DMA."""

    def __init__(self, context: _PrimaryContext, chunk_bytes: int, direct_io: bool) -> None:
        self.context = context
        self.direct_io = direct_io
        # A direct read starts on an aligned offset before the chunk and may end after it.
        self.capacity = chunk_bytes + (2 * _DIRECT_IO_ALIGNMENT if direct_io else 0)
        self.buffers: list[_PinnedBuffer] = []
        self.events: list[Any] = []
        self.stream: Any = None
        self.fds: dict[str, int] = {}

    def setup(self) -> None:
        driver = _driver()
        self.context.make_current()
        self.stream = _check(
            driver.cuStreamCreate(driver.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate"
        )
        for _ in range(2):
            self.buffers.append(_PinnedBuffer(self.capacity))
            flags = driver.CUevent_flags.CU_EVENT_DISABLE_TIMING
            self.events.append(_check(driver.cuEventCreate(flags), "cuEventCreate"))

    def run(self, next_chunk: Any, arena_address: int) -> int:
        driver = _driver()
        copied = 0
        turn = 0
        while (chunk := next_chunk()) is not None:
            buffer, event = self.buffers[turn], self.events[turn]
            _check(driver.cuEventSynchronize(event), "cuEventSynchronize")  # its previous copy is done
            skip = self._read(chunk, buffer)
            _check(
                driver.cuMemcpyHtoDAsync(
                    arena_address + chunk.arena_offset, buffer.address + skip, chunk.nbytes, self.stream
                ),
                "cuMemcpyHtoDAsync",
            )
            _check(driver.cuEventRecord(event, self.stream), "cuEventRecord")
            copied += chunk.nbytes
            turn ^= 1
        _check(driver.cuStreamSynchronize(self.stream), "cuStreamSynchronize")
        return copied

    def _read(self, chunk: Segment, buffer: _PinnedBuffer) -> int:
        """Fill `buffer` with the chunk's bytes; return where they start inside the buffer."""
        fd = self._fd(chunk.path)
        if self.direct_io:
            start = chunk.file_offset // _DIRECT_IO_ALIGNMENT * _DIRECT_IO_ALIGNMENT
            skip = chunk.file_offset - start
            length = _round_up(skip + chunk.nbytes, _DIRECT_IO_ALIGNMENT)
        else:
            start, skip, length = chunk.file_offset, 0, chunk.nbytes
        done = 0
        while done < skip + chunk.nbytes:
            n = os.preadv(fd, [buffer.view[done:length]], start + done)
            if n <= 0:
                raise OSError(
                    f"{chunk.path}: unexpected end of file at byte {start + done} (weights file truncated?)"
                )
            done += n
        return skip

    def _fd(self, path: str) -> int:
        fd = self.fds.get(path)
        if fd is None:
            fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if self.direct_io else 0))
            self.fds[path] = fd
        return fd

    def teardown(self) -> None:
        driver = _driver()
        for fd in self.fds.values():
            os.close(fd)
        for buffer in self.buffers:
            buffer.free()
        for event in self.events:
            driver.cuEventDestroy(event)
        if self.stream is not None:
            driver.cuStreamDestroy(self.stream)


def refill(
    target: Any,
    segments: Sequence[Segment],
    threads: int = DEFAULT_REFILL_THREADS,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    direct_io: bool = False,
) -> RefillStats:
    """Copy every segment from its file into `target` with `threads` parallel readers; block until done.

    `target` is a `CudaVmmArena` or any contiguous CUDA torch tensor (segment offsets are byte offsets into
    it). `direct_io=True` reads with O_DIRECT (bypassing the page cache, for a cold disk); the default reads
    through the page cache.
    """
    address, nbytes, device_index = _destination(target)
    if threads < 1 or chunk_bytes < _DIRECT_IO_ALIGNMENT or chunk_bytes % _DIRECT_IO_ALIGNMENT:
        raise ValueError(
            f"refill needs threads >= 1 and a chunk size in multiples of 4096 (got {threads}, {chunk_bytes})"
        )
    for seg in segments:
        if seg.arena_offset < 0 or seg.arena_offset + seg.nbytes > nbytes:
            raise ValueError(f"segment {seg} does not fit in the destination ({nbytes} bytes)")
    context = _primary_context(device_index)
    chunks = _chunks(list(segments), chunk_bytes)
    lock = threading.Lock()

    def next_chunk() -> Segment | None:
        with lock:
            return next(chunks, None)

    started = time.perf_counter()
    copied, errors = _run_workers(context, threads, chunk_bytes, direct_io, next_chunk, address)
    seconds = time.perf_counter() - started
    if errors:
        raise errors[0]
    return RefillStats(copied, seconds, threads, direct_io)


def _destination(target: Any) -> tuple[int, int, int]:
    """(device address, size in bytes, device ordinal) of a refill target."""
    if isinstance(target, CudaVmmArena):
        if target.released:
            raise RuntimeError("the CUDA arena is released: call reacquire() before refill()")
        return target.address, target.nbytes, target.device_index
    device = getattr(target, "device", None)
    if getattr(device, "type", None) != "cuda" or not target.is_contiguous():
        raise ValueError("refill needs a CudaVmmArena or a contiguous CUDA tensor as its destination")
    import torch

    torch.cuda.synchronize(device)  # nothing may still be writing the destination
    return target.data_ptr(), target.numel() * target.element_size(), device.index or 0


def _run_workers(
    context: _PrimaryContext, threads: int, chunk_bytes: int, direct_io: bool, next_chunk: Any, address: int
) -> tuple[int, list[BaseException]]:
    totals: list[int] = []
    errors: list[BaseException] = []

    def body() -> None:
        worker = _RefillWorker(context, chunk_bytes, direct_io)
        try:
            worker.setup()
            totals.append(worker.run(next_chunk, address))
        except BaseException as exc:  # re-raised in the caller's thread
            errors.append(exc)
        finally:
            worker.teardown()

    pool = [threading.Thread(target=body, name=f"arena-refill-{i}", daemon=True) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return sum(totals), errors


def file_segments(path: str | os.PathLike[str], arena_offset: int = 0) -> list[Segment]:
    """A whole file copied into the arena starting at `arena_offset` (for raw weight blobs)."""
    size = Path(path).stat().st_size
    return [Segment(str(path), 0, arena_offset, size)]
