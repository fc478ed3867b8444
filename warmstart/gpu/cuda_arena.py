"""A weight arena in CUDA virtual memory whose physical backing can be dropped and re-mapped in place.

The arena reserves one virtual address range once (`cuMemAddressReserve`) and backs it with physical device
memory (`cuMemCreate` + `cuMemMap` + `cuMemSetAccess`). Torch tensors are views of that range, built through
`__cuda_array_interface__`, so kernels and CUDA graphs captured over them hold plain device addresses.

`release()` unmaps and frees the physical memory but keeps the virtual range: the process then holds no weight
bytes on the GPU, so a CUDA checkpoint copies almost nothing and the CRIU image stays small. `reacquire()`
maps fresh physical memory at the *same* addresses; once the owner refills the bytes (for weights:
`warmstart.gpu.weights_io.refill` into `arena.tensor`), the old views and graphs are valid again.

cuda-python is imported lazily (`warmstart.host.cuda_driver`): importing this module needs neither a GPU
nor the CUDA driver.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

from warmstart.gpu.arena import ArenaReleasedError, round_up
from warmstart.host.cuda_driver import CudaError, CudaUnavailable, check, driver


class _PrimaryContext:
    """The device's primary context (the one torch uses), made current on whichever thread asks."""

    def __init__(self, device_index: int) -> None:
        cu = driver()
        count = int(check(cu.cuDeviceGetCount(), "cuDeviceGetCount"))
        if not 0 <= device_index < count:
            raise CudaUnavailable(f"CUDA device {device_index} does not exist ({count} device(s) visible)")
        self.device = check(cu.cuDeviceGet(device_index), "cuDeviceGet")
        self.context = check(cu.cuDevicePrimaryCtxRetain(self.device), "cuDevicePrimaryCtxRetain")

    def make_current(self) -> None:
        check(driver().cuCtxSetCurrent(self.context), "cuCtxSetCurrent")


@functools.cache
def primary_context(device_index: int) -> _PrimaryContext:
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


class VmmRange:
    """One reserved device virtual range whose physical backing can be unmapped and mapped again in place.

    No torch here: the scratch pool calls this from inside torch's allocator. The caller makes the device's
    primary context current first.
    """

    def __init__(self, device_index: int, nbytes: int, backed: bool = True) -> None:
        """Reserve `nbytes` rounded up to the allocation granularity; backed: with fresh memory mapped."""
        if nbytes <= 0:
            raise ValueError(f"a device range must be positive, got {nbytes} bytes")
        self.device_index = device_index
        cu = driver()
        granularity = allocation_granularity(device_index)
        self.size = round_up(nbytes, granularity)
        self.address = int(check(cu.cuMemAddressReserve(self.size, granularity, 0, 0), "cuMemAddressReserve"))
        self._handle: Any = None
        try:
            if backed:
                self.map()
        except CudaError:
            cu.cuMemAddressFree(self.address, self.size)
            raise

    @property
    def mapped(self) -> bool:
        return self._handle is not None

    def map(self) -> None:
        """Back the range with fresh physical memory (contents undefined); nothing to do when mapped."""
        if self._handle is not None:
            return
        prop = _device_memory_prop(self.device_index)
        self._map_handle(check(driver().cuMemCreate(self.size, prop, 0), "cuMemCreate"))

    def map_shared(self, fd: int) -> None:
        """Back the range with memory another process exported as a POSIX file descriptor (same size)."""
        if self._handle is not None:
            raise CudaError("the range is mapped already; unmap it before mapping shared memory")
        cu = driver()
        kind = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        self._map_handle(check(cu.cuMemImportFromShareableHandle(fd, kind), "cuMemImportFromShareableHandle"))

    def _map_handle(self, handle: Any) -> None:
        """Map `handle` (ours from now on: released on failure or at unmap) over the whole range."""
        cu = driver()
        try:
            check(cu.cuMemMap(self.address, self.size, 0, handle, 0), "cuMemMap")
        except CudaError:
            cu.cuMemRelease(handle)
            raise
        access = read_write_access(self.device_index)
        try:
            check(cu.cuMemSetAccess(self.address, self.size, [access], 1), "cuMemSetAccess")
        except CudaError:  # leave the range unmapped, so a later map() can try again
            cu.cuMemUnmap(self.address, self.size)
            cu.cuMemRelease(handle)
            raise
        self._handle = handle

    def unmap(self) -> None:
        """Free the physical memory and keep the virtual range; a kernel touching it now faults."""
        if self._handle is None:
            return
        cu = driver()
        check(cu.cuMemUnmap(self.address, self.size), "cuMemUnmap")
        handle, self._handle = self._handle, None  # unmapped now, whatever the release says
        check(cu.cuMemRelease(handle), "cuMemRelease")

    def free(self) -> None:
        """Unmap and give the virtual range back for good."""
        self.unmap()
        if self.size:
            check(driver().cuMemAddressFree(self.address, self.size), "cuMemAddressFree")
            self.size = 0


def _device_memory_prop(device_index: int) -> Any:
    cu = driver()
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device_index
    return prop


def read_write_access(device_index: int) -> Any:
    """The access descriptor that lets the device with `device_index` read and write a mapping."""
    cu = driver()
    access = cu.CUmemAccessDesc()
    access.location = _device_memory_prop(device_index).location
    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return access


def allocation_granularity(device_index: int) -> int:
    """The size every device allocation of this GPU is rounded up to (2 MiB on the GPUs measured)."""
    cu = driver()
    flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    prop = _device_memory_prop(device_index)
    return int(check(cu.cuMemGetAllocationGranularity(prop, flag), "cuMemGetAllocationGranularity"))


class ImportedBlock:
    """Allocations another process exported (one descriptor each), mapped end to end at a fresh address of
    this process: `tensor` is the whole as a flat uint8 torch tensor. The imported handles are released with
    the block unless `take_handles()` took them over."""

    def __init__(self, device_index: int, fds: list[int], sizes: tuple[int, ...]) -> None:
        if len(fds) != len(sizes):
            raise CudaError(f"{len(fds)} descriptors for {len(sizes)} allocations")
        cu = driver()
        kind = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        self.device_index, self.sizes = device_index, sizes
        self.span = VmmRange(device_index, sum(sizes), backed=False)
        self.handles: list[Any] = []
        self._mapped: list[tuple[int, int]] = []  # address, size
        try:
            for fd in fds:
                self.handles.append(check(cu.cuMemImportFromShareableHandle(fd, kind), "cuMemImport"))
            at = self.span.address
            for handle, size in zip(self.handles, sizes, strict=True):
                check(cu.cuMemMap(at, size, 0, handle, 0), "cuMemMap")
                self._mapped.append((at, size))
                at += size
            access = read_write_access(device_index)
            check(cu.cuMemSetAccess(self.span.address, self.span.size, [access], 1), "cuMemSetAccess")
        except BaseException:
            self.close()
            raise

    @property
    def tensor(self) -> Any:
        import torch

        nbytes = sum(self.sizes)
        return torch.as_tensor(_CudaArrayView(self.span.address, nbytes), device=f"cuda:{self.device_index}")

    def take_handles(self) -> list[Any]:
        """The imported handles, the caller's to map elsewhere and release from now on."""
        handles, self.handles = self.handles, []
        return handles

    def close(self) -> None:
        cu = driver()
        for at, size in self._mapped:
            cu.cuMemUnmap(at, size)
        self._mapped = []
        for handle in self.handles:
            cu.cuMemRelease(handle)
        self.handles = []
        self.span.free()


@contextlib.contextmanager
def imported_block(device_index: int, fds: list[int], sizes: tuple[int, ...]) -> Iterator[ImportedBlock]:
    """An `ImportedBlock` for as long as the block runs; the block's kernels are waited for before it is
    unmapped and its range given back."""
    import torch

    primary_context(device_index).make_current()
    block = ImportedBlock(device_index, fds, sizes)
    try:
        yield block
    finally:
        with contextlib.suppress(Exception):  # a faulted context cannot synchronize; free what can be
            torch.cuda.synchronize(device_index)
        block.close()


class CudaVmmArena:
    """One contiguous range of device memory whose physical backing can be released and re-mapped in place.

    Implements `warmstart.gpu.arena.Arena`. Usage: `allocate(nbytes)` once; carve tensor views out of the
    returned flat tensor; `release()` before a checkpoint; `reacquire()` and refill after a restore. Views
    must not be touched while the arena is released (the addresses are unmapped: a kernel reading them
    faults).
    """

    keeps_address = True

    def __init__(self, device: Any = "cuda") -> None:
        self.device_index = cuda_ordinal(device)
        self._context: _PrimaryContext | None = None
        self._range: VmmRange | None = None
        self._nbytes = 0
        self._tensor: Any = None

    @property
    def nbytes(self) -> int:
        """Bytes asked for in `allocate` (the mapped size is rounded up to the allocation granularity)."""
        return self._nbytes

    @property
    def address(self) -> int:
        """The arena's device virtual address; the same before `release()` and after `reacquire()`."""
        return self._range.address if self._range else 0

    @property
    def released(self) -> bool:
        return self._range is None or not self._range.mapped

    @property
    def tensor(self) -> Any:
        """The whole arena as a flat uint8 torch tensor on the GPU."""
        if self._tensor is None:
            raise RuntimeError("the CUDA arena has no memory yet: call allocate(nbytes) first")
        if self.released:
            raise ArenaReleasedError("the CUDA arena is released; call reacquire() first")
        return self._tensor

    def allocate(self, nbytes: int) -> Any:
        """Reserve the virtual range, back it with device memory, and return the flat uint8 view."""
        if nbytes <= 0:
            raise ValueError(f"arena size must be positive, got {nbytes} bytes")
        if self._range is not None:
            raise RuntimeError(f"the CUDA arena is already allocated ({self._nbytes} bytes); allocate once")
        import torch

        torch.cuda.init()
        torch.cuda.set_device(self.device_index)
        self._context = primary_context(self.device_index)
        self._context.make_current()
        self._range = VmmRange(self.device_index, nbytes)
        self._nbytes = nbytes
        view = _CudaArrayView(self._range.address, nbytes)
        self._tensor = torch.as_tensor(view, device=f"cuda:{self.device_index}")
        if self._tensor.data_ptr() != self._range.address:  # torch must view the range, never copy it
            raise CudaError("torch copied the arena instead of viewing it (__cuda_array_interface__)")
        return self._tensor

    def release(self) -> None:
        """Free the physical memory, keep the virtual range (views stay, pointing at unmapped addresses)."""
        if self.released:
            return
        self._require_context()
        import torch

        torch.cuda.synchronize(self.device_index)  # no kernel may still read the weights
        self._range.unmap()

    def reacquire(self) -> Any:
        """Map fresh physical memory at the same address; contents are undefined until refilled."""
        if self._range is None:
            raise RuntimeError("the CUDA arena was never allocated: call allocate(nbytes) first")
        self._require_context()
        self._range.map()
        return self._tensor

    def reacquire_shared(self, fd: int) -> Any:
        """Map memory another process filled and exported (`weight_stager`) at the same address."""
        if self._range is None:
            raise RuntimeError("the CUDA arena was never allocated: call allocate(nbytes) first")
        self._require_context()
        self._range.map_shared(fd)
        return self._tensor

    @property
    def range_bytes(self) -> int:
        """The mapped size: `nbytes` rounded up to the allocation granularity (0 before `allocate`)."""
        return self._range.size if self._range else 0

    def close(self) -> None:
        """Release the memory and give the virtual range back; the arena's views become invalid for good."""
        if self._range is not None:
            self._require_context()
            import torch

            torch.cuda.synchronize(self.device_index)  # no kernel may still use the range
            self._range.free()
        self._range = None
        self._tensor = None

    def _require_context(self) -> None:
        if self._context is None:
            raise RuntimeError("the CUDA arena was never allocated: call allocate(nbytes) first")
        self._context.make_current()


def cuda_ordinal(device: Any) -> int:
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
