"""The stager's side: open the plan's files, fill shared device memory from them and hand it to the engine."""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from warmstart.gpu.weight_stager.channel import ACK
from warmstart.gpu.weight_stager.plan import Copy, StagingPlan
from warmstart.gpu.weights_io import pread_exact
from warmstart.host.fileio import RESOLVE_IN_ROOT, RESOLVE_NO_MAGICLINKS, mapped_readonly, openat2
from warmstart.host.parallel import share_among_threads

log = logging.getLogger(__name__)

STAGING_CHUNK_BYTES = 16 << 20  # as the engine's own refill (measured best on an H200)
MAPPED_PIECE_BYTES = 256 << 20  # pinned in the page cache at a time (measured best of 64 and 256 on an H200)
STAGING_THREADS = 8
MAX_STAGING_THREADS = 64
COPY_PATHS = ("buffered", "mapped")  # through pinned buffers / the page cache pinned and copied by DMA
ACCEPT_SECONDS = 60.0  # after the fill, a stager waits this long for its engine, then frees the memory


def stage(
    read_plan: Callable[[], str],
    listener: socket.socket,
    root_fd: int | None,
    threads: int = STAGING_THREADS,
    copy: str = COPY_PATHS[0],
) -> None:
    """Fill shared device memory per the plan and hand it to the first engine that connects to `listener`.

    Whatever fails, the engine that connects is told why (and refills its weights itself).
    """
    launched = time.perf_counter()
    cuda_started = _start_cuda()  # while the plan is awaited (a restore hands it over once verified)
    files: dict[str, int] = {}
    memory = None
    try:
        try:
            plan = StagingPlan.from_json(read_plan())
            started = time.perf_counter()
            files = _open_files(plan, root_fd)  # every file, before any device memory is taken
            opened = time.perf_counter()
            cuda_started()
            log.info(
                "the plan came %.3f s after the start; CUDA kept it waiting %.3f s more",
                started - launched, time.perf_counter() - opened,
            )  # fmt: skip
            memory = SharedDeviceMemory(_stager_device(plan), plan.allocations)
            paths = fill(memory, plan.copies, files, threads, copy)
            fds = memory.export()
        except Exception as exc:
            _answer(listener, {"error": f"{type(exc).__name__}: {exc}"}, [])
            raise
        report = {
            "bytes": plan.copied_bytes,
            "seconds": round(time.perf_counter() - started, 3),
            "copy": ",".join(sorted(set(paths))),
        }
        try:
            _answer(listener, report, fds)
        finally:
            for fd in fds:
                os.close(fd)
    finally:
        if memory is not None:
            memory.close()  # an engine that imported the memory keeps it alive
        for fd in files.values():
            os.close(fd)


def _start_cuda() -> Callable[[], None]:
    """Import cuda-python and initialise the driver in a thread; the callable returned waits for it and
    raises what it raised."""
    errors: list[Exception] = []

    def initialise() -> None:
        try:
            from warmstart.host.cuda_driver import driver

            driver()
        except Exception as exc:  # raised in the caller, after the plan's files were opened
            errors.append(exc)

    thread = threading.Thread(target=initialise, name="cuda-init", daemon=True)
    thread.start()

    def wait() -> None:
        thread.join()
        if errors:
            raise errors[0]

    return wait


def _open_files(plan: StagingPlan, root_fd: int | None) -> dict[str, int]:
    files: dict[str, int] = {}
    try:
        for path in dict.fromkeys(c[0] for c in plan.copies):
            files[path] = open_inside(root_fd, path)
    except BaseException:
        for fd in files.values():
            os.close(fd)
        raise
    return files


def open_inside(root_fd: int | None, path: str) -> int:
    """Open the regular file `path` for reading; with `root_fd`, as if that directory were `/`.

    openat2's RESOLVE_IN_ROOT keeps `..` and symbolic links (absolute ones too) inside the root, so an
    engine's plan cannot make the stager read a file of the host. Not blocking: a FIFO cannot hang it.
    """
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK
    if root_fd is None:
        fd = os.open(path, flags)
    else:
        try:
            fd = openat2(root_fd, path, flags, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)
        except OSError as exc:
            raise OSError(exc.errno, f"{exc.strerror}: {path} (inside the engine's root)") from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path} is not a regular file")
    return fd


def _stager_device(plan: StagingPlan) -> int:
    """The engine's GPU as this process numbers it (the agent may see every GPU of the node)."""
    if not plan.device_uuid:
        return plan.device_index
    from warmstart.host.cuda_driver import device_with_uuid

    return device_with_uuid(plan.device_uuid)


def _answer(listener: socket.socket, report: dict[str, Any], fds: list[int]) -> None:
    listener.settimeout(ACCEPT_SECONDS)
    connection, _ = listener.accept()
    with connection:
        connection.settimeout(ACCEPT_SECONDS)
        socket.send_fds(connection, [json.dumps(report).encode()], fds)
        if fds:
            connection.recv(len(ACK))  # wait until the engine has imported the memory (or hung up)


class SharedDeviceMemory:
    """Device allocations of the given sizes, each with an exportable POSIX file-descriptor handle, mapped
    here end to end at `address` for the fill."""

    def __init__(self, device_index: int, sizes: tuple[int, ...]) -> None:
        from warmstart.host.cuda_driver import check, driver

        cu = driver()
        self._cu, self._check = cu, check
        device = check(cu.cuDeviceGet(device_index), "cuDeviceGet")
        self.context = check(cu.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")
        check(cu.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device_index
        prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        self.size = sum(sizes)
        self.address = int(check(cu.cuMemAddressReserve(self.size, 0, 0, 0), "cuMemAddressReserve"))
        self.handles: list[tuple[Any, int, int]] = []  # handle, where it is mapped, its size
        try:
            for size in sizes:
                handle = check(cu.cuMemCreate(size, prop, 0), "cuMemCreate")
                at = self.address + sum(mapped for _, _, mapped in self.handles)
                self.handles.append((handle, at, size))
                check(cu.cuMemMap(at, size, 0, handle, 0), "cuMemMap")
            access = cu.CUmemAccessDesc()
            access.location = prop.location
            access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            check(cu.cuMemSetAccess(self.address, self.size, [access], 1), "cuMemSetAccess")
        except BaseException:
            self.close()
            raise

    def export(self) -> list[int]:
        """One descriptor per allocation, in order; the caller closes them."""
        cu = self._cu
        kind = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        fds: list[int] = []
        try:
            for handle, _, _ in self.handles:
                fds.append(int(self._check(cu.cuMemExportToShareableHandle(handle, kind, 0), "cuMemExport")))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return fds

    def close(self) -> None:
        cu = self._cu
        for handle, at, size in self.handles:
            cu.cuMemUnmap(at, size)  # an allocation that failed to map: an error, ignored
            cu.cuMemRelease(handle)
        self.handles = []
        cu.cuMemAddressFree(self.address, self.size)


def fill(
    memory: SharedDeviceMemory,
    copies: tuple[Copy, ...],
    files: dict[str, int],
    threads: int,
    copy: str,
    piece_bytes: int | None = None,
) -> list[str]:
    """Every copy onto the device, `threads` at a time, in pieces of `piece_bytes` (default: the copy
    path's); returns how each thread copied (see `COPY_PATHS`)."""
    paths: list[str] = []
    # shared by piece, so that one large tensor is not one thread's alone
    shared = _pieces(copies, max(piece_bytes or 0, MAPPED_PIECE_BYTES))

    def work(queue: Iterator[Copy]) -> None:
        paths.append(_copy_some(memory, files, queue, copy, piece_bytes))

    share_among_threads(work, shared, threads, name="stage")
    return paths


def _pieces(copies: tuple[Copy, ...], piece_bytes: int) -> Iterator[Copy]:
    for path, file_offset, offset, nbytes in copies:
        for start in range(0, nbytes, piece_bytes):
            yield path, file_offset + start, offset + start, min(piece_bytes, nbytes - start)


def _copy_some(
    memory: SharedDeviceMemory, fds: dict[str, int], queue: Iterator[Copy], copy: str, piece_bytes: int | None
) -> str:
    """This thread's share of the copies, on its own stream; returns the path it ended on."""
    cu, check = memory._cu, memory._check
    check(cu.cuCtxSetCurrent(memory.context), "cuCtxSetCurrent")
    stream = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
    kind = _MappedCopier if copy == "mapped" else _BufferedCopier
    copier: _Copier = kind(memory, stream, piece_bytes)
    try:
        for path, file_offset, offset, nbytes in queue:
            try:
                copier.copy(fds[path], file_offset, offset, nbytes)
            except _RegistrationRefused as exc:  # this driver or file system cannot pin the page cache
                log.warning("%s; copying through pinned buffers instead", exc)
                copier.close()
                copier = _BufferedCopier(memory, stream, None)
                copier.copy(fds[path], file_offset, offset, nbytes)
        copier.drain()
    finally:
        copier.close()
        cu.cuStreamDestroy(stream)
    return copier.name


class _RegistrationRefused(RuntimeError):
    """The driver would not pin a mapping of the page cache for DMA."""


class _Copier:
    """File -> device in pieces on one stream, two in flight: the next is prepared while the last one's DMA
    runs. A piece's source stays held (an `ExitStack`) until its copy is done."""

    name = ""
    piece_bytes = STAGING_CHUNK_BYTES

    def __init__(self, memory: SharedDeviceMemory, stream: Any, piece_bytes: int | None) -> None:
        self.piece_bytes = piece_bytes or self.piece_bytes
        self._cu, self._check, self._stream, self._base = memory._cu, memory._check, stream, memory.address
        flag = self._cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self._events = [self._check(self._cu.cuEventCreate(flag), "cuEventCreate") for _ in range(2)]
        self._held: list[contextlib.ExitStack | None] = [None, None]
        self._slot = 0

    def copy(self, fd: int, file_offset: int, offset: int, nbytes: int) -> None:
        for start in range(0, nbytes, self.piece_bytes):
            self._copy_piece(fd, file_offset + start, offset + start, min(self.piece_bytes, nbytes - start))

    def drain(self) -> None:
        for slot in range(2):
            self._wait(slot)

    def close(self) -> None:
        self._cu.cuStreamSynchronize(self._stream)
        for slot, held in enumerate(self._held):
            if held is not None:
                self._held[slot] = None
                held.close()
        for event in self._events:
            self._cu.cuEventDestroy(event)

    def _copy_piece(self, fd: int, file_offset: int, offset: int, nbytes: int) -> None:
        slot = self._slot
        self._wait(slot)
        with contextlib.ExitStack() as held:
            source = self._source(held, slot, fd, file_offset, nbytes)
            copy = self._cu.cuMemcpyHtoDAsync(self._base + offset, source, nbytes, self._stream)
            self._check(copy, "cuMemcpyHtoD")
            self._check(self._cu.cuEventRecord(self._events[slot], self._stream), "cuEventRecord")
            self._held[slot], self._slot = held.pop_all(), 1 - slot

    def _wait(self, slot: int) -> None:
        held = self._held[slot]
        if held is not None:
            self._check(self._cu.cuEventSynchronize(self._events[slot]), "cuEventSynchronize")
            self._held[slot] = None
            held.close()

    def _source(self, held: contextlib.ExitStack, slot: int, fd: int, file_offset: int, nbytes: int) -> int:
        """The host address to copy `nbytes` of `fd` at `file_offset` from, kept valid by `held`."""
        raise NotImplementedError


class _BufferedCopier(_Copier):
    """Page cache -> a pinned buffer (a CPU copy) -> device."""

    name = "buffered"

    def __init__(self, memory: SharedDeviceMemory, stream: Any, piece_bytes: int | None) -> None:
        super().__init__(memory, stream, piece_bytes)
        alloc = self._cu.cuMemHostAlloc
        self._buffers = [int(self._check(alloc(self.piece_bytes, 0), "cuMemHostAlloc")) for _ in range(2)]

    def _source(self, held: contextlib.ExitStack, slot: int, fd: int, file_offset: int, nbytes: int) -> int:
        buffer = self._buffers[slot]
        pread_exact(fd, memoryview((ctypes.c_char * nbytes).from_address(buffer)).cast("B"), file_offset)
        return buffer

    def close(self) -> None:
        super().close()
        for buffer in self._buffers:
            self._cu.cuMemFreeHost(buffer)


class _MappedCopier(_Copier):
    """The page cache itself, mapped and pinned while its piece is copied -> device: DMA only.

    Through a pinned buffer every byte crosses host memory three times (read, written to the buffer, read by
    the DMA); a CRIU restore running at the same time shares that memory bandwidth.
    """

    name = "mapped"
    piece_bytes = MAPPED_PIECE_BYTES

    def _source(self, held: contextlib.ExitStack, slot: int, fd: int, file_offset: int, nbytes: int) -> int:
        if file_offset + nbytes > os.fstat(fd).st_size:  # a mapping past the end would fault, not read short
            raise OSError(f"a copy of {nbytes} bytes at {file_offset} reaches past the end of its file")
        address = held.enter_context(mapped_readonly(fd, file_offset, nbytes))
        pin = self._cu.cuMemHostRegister(address, nbytes, self._cu.CU_MEMHOSTREGISTER_READ_ONLY)
        self._check(pin, "cuMemHostRegister of a file mapping", _RegistrationRefused)
        held.callback(self._cu.cuMemHostUnregister, address)
        return address
