"""Stage a restored engine's weights on the GPU while CRIU is still restoring the engine itself.

After a restore, an engine that released its weights before the checkpoint must copy them back (about 0.6 s
for 16 GB from a hot page cache), and it cannot start before CRIU and the CUDA restore are done (about
1.5 s). A *stager* is a small process, started by whoever starts the restore, that does the copy in that
window instead: it allocates device memory that can be shared between processes (`cuMemCreate` with a POSIX
file-descriptor handle), fills it from the safetensors files following the engine's `StagingPlan`, and
hands the memory's file descriptor to the engine over a Unix socket. The engine maps that memory at its
weight arena's own virtual addresses (`cuMemImportFromShareableHandle` + `cuMemMap`), so its tensors and
CUDA graphs see the weights with no copy at all on the engine's side. When anything fails the engine is told
why and refills the weights itself, as without a stager.

    python -m warmstart.engines.weight_stager --plan PLAN.json|- --socket PATH

The stager needs the CUDA driver and cuda-python, not torch: it must start fast.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

STAGING_CHUNK_BYTES = 16 << 20  # as the engine's own refill (measured best on an H200)
STAGING_THREADS = 8
ACK = b"mapped"


@dataclass(frozen=True)
class StagingPlan:
    """What to put where: `copies` are (file, file offset, offset in the weight range, bytes)."""

    device_index: int  # the engine's CUDA ordinal; `device_uuid`, when known, decides
    range_bytes: int  # the engine's weight range, rounded up to the allocation granularity
    copies: tuple[tuple[str, int, int, int], ...]
    device_uuid: str = ""  # the same GPU in the stager's process, whatever its ordinal there
    root: str = ""  # where the paths are resolved ("": this process's own root)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def under_root(self, root: str | os.PathLike[str]) -> StagingPlan:
        """The same plan with its files looked up inside `root` (e.g. `/proc/<pid>/root`, a sandbox's
        filesystem): neither `..` nor a symbolic link leads out of it."""
        return dataclasses.replace(self, root=str(root))

    @classmethod
    def from_json(cls, text: str) -> StagingPlan:
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StagingPlan:
        """A plan from its dict form; ValueError (or KeyError/TypeError) names what is wrong."""
        copies = tuple((str(p), int(f), int(a), int(n)) for p, f, a, n in data["copies"])
        uuid, root = str(data.get("device_uuid", "")), str(data.get("root", ""))
        plan = cls(int(data["device_index"]), int(data["range_bytes"]), copies, uuid, root)
        plan.check()
        return plan

    def check(self) -> None:
        for path, file_offset, offset, nbytes in self.copies:
            if file_offset < 0 or offset < 0 or nbytes <= 0 or offset + nbytes > self.range_bytes:
                raise ValueError(
                    f"staging plan: copy of {nbytes} bytes from {path} to {offset} is out of range"
                )


class StagedWeightsUnavailable(RuntimeError):
    """No staged weights to map: the stager failed, was not there, or hung up; the engine refills."""


# --- the engine's side -----------------------------------------------------------------------------------


def receive_staged_weights(socket_path: str | os.PathLike[str], timeout: float = 120.0) -> tuple[int, dict]:
    """Wait for the stager at `socket_path`; return the shared memory's file descriptor and its report.

    The caller maps the descriptor, closes it, then calls `acknowledge`. Raises `StagedWeightsUnavailable`
    with the reason when there is nothing to map.
    """
    deadline = time.monotonic() + timeout
    connection = _connect(Path(socket_path), deadline)
    try:
        connection.settimeout(max(0.1, deadline - time.monotonic()))
        message, fds, _flags, _address = socket.recv_fds(connection, 1 << 16, 1)
    except OSError as exc:
        connection.close()
        raise StagedWeightsUnavailable(f"no answer from the weight stager: {exc}") from exc
    report = json.loads(message or b'{"error": "the stager hung up"}')
    if not fds:
        connection.close()
        raise StagedWeightsUnavailable(
            f"the weight stager failed: {report.get('error', 'no descriptor sent')}"
        )
    report["_connection"] = connection
    return fds[0], report


def acknowledge(report: dict) -> None:
    """Tell the stager its memory is mapped here (it may exit now) and hang up."""
    connection = report.pop("_connection", None)
    if connection is not None:
        with contextlib.suppress(OSError):
            connection.sendall(ACK)
        connection.close()


def _connect(path: Path, deadline: float) -> socket.socket:
    while True:
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            connection.connect(str(path))
            return connection
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            connection.close()
            if time.monotonic() > deadline:
                raise StagedWeightsUnavailable(f"no weight stager at {path}: {exc}") from exc
            time.sleep(0.005)


# --- the stager's side -----------------------------------------------------------------------------------


def stage(
    plan_path: str | os.PathLike[str], socket_path: str | os.PathLike[str], threads: int = STAGING_THREADS
) -> None:
    """Fill shared device memory per the plan and hand it to the first engine that connects to `socket_path`.

    Whatever fails, the engine that connects is told why (and refills its weights itself).
    """
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(socket_path))  # bound first: the engine may already be waiting for it
    listener.listen(1)
    started = time.perf_counter()
    try:
        memory = None
        try:
            text = sys.stdin.read() if str(plan_path) == "-" else Path(plan_path).read_text()
            plan = StagingPlan.from_json(text)
            memory = _SharedDeviceMemory(_stager_device(plan), plan.range_bytes)
            _fill(memory, plan.copies, threads, plan.root)
            fd = memory.export()
        except Exception as exc:
            if memory is not None:
                memory.close()
            _answer(listener, {"error": f"{type(exc).__name__}: {exc}"}, None)
            raise
        report = {"bytes": sum(c[3] for c in plan.copies), "seconds": round(time.perf_counter() - started, 3)}
        try:
            _answer(listener, report, fd)
        finally:
            os.close(fd)
            memory.close()  # the engine's import keeps the memory alive
    finally:
        listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(socket_path)


def _stager_device(plan: StagingPlan) -> int:
    """The engine's GPU as this process numbers it (the agent may see every GPU of the node)."""
    if not plan.device_uuid:
        return plan.device_index
    from warmstart.cuda_driver import device_with_uuid

    return device_with_uuid(plan.device_uuid)


def _answer(listener: socket.socket, report: dict, fd: int | None, timeout: float = 120.0) -> None:
    listener.settimeout(timeout)
    connection, _ = listener.accept()
    with connection:
        connection.settimeout(timeout)
        socket.send_fds(connection, [json.dumps(report).encode()], [fd] if fd is not None else [])
        if fd is not None:
            connection.recv(len(ACK))  # wait until the engine has imported the memory (or hung up)


class _SharedDeviceMemory:
    """Device memory with an exportable POSIX file-descriptor handle, mapped here for the fill."""

    def __init__(self, device_index: int, nbytes: int) -> None:
        from warmstart.cuda_driver import check, driver

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
        self.size = nbytes
        self.handle = check(cu.cuMemCreate(nbytes, prop, 0), "cuMemCreate")
        self.address = int(check(cu.cuMemAddressReserve(nbytes, 0, 0, 0), "cuMemAddressReserve"))
        check(cu.cuMemMap(self.address, nbytes, 0, self.handle, 0), "cuMemMap")
        access = cu.CUmemAccessDesc()
        access.location = prop.location
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        check(cu.cuMemSetAccess(self.address, nbytes, [access], 1), "cuMemSetAccess")

    def export(self) -> int:
        cu = self._cu
        kind = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        return int(self._check(cu.cuMemExportToShareableHandle(self.handle, kind, 0), "cuMemExport"))

    def close(self) -> None:
        cu = self._cu
        cu.cuMemUnmap(self.address, self.size)
        cu.cuMemAddressFree(self.address, self.size)
        cu.cuMemRelease(self.handle)


def _fill(
    memory: _SharedDeviceMemory, copies: tuple[tuple[str, int, int, int], ...], threads: int, root: str = ""
) -> None:
    """Page cache -> per-thread pinned buffers -> device, on per-thread streams (like `weights_io.refill`)."""
    fds: dict[str, int] = {}
    try:
        for path in {c[0] for c in copies}:
            fds[path] = open_inside(root, path)
    except BaseException:
        for fd in fds.values():
            os.close(fd)
        raise
    queue = _Queue(iter(copies))
    errors: list[BaseException] = []

    def work() -> None:
        try:
            _copy_some(memory, fds, queue)
        except BaseException as exc:  # re-raised below
            errors.append(exc)
            queue.stop()

    try:
        pool = [threading.Thread(target=work, name=f"stage-{i}") for i in range(threads)]
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join()
    finally:
        for fd in fds.values():
            os.close(fd)
    if errors:
        raise errors[0]


def open_inside(root: str, path: str) -> int:
    """Open `path` for reading; with a `root`, as if `root` were `/` (openat2's RESOLVE_IN_ROOT).

    The plan comes from the engine, which runs with less trust than the stager: neither `..` nor a
    symbolic link in the engine's filesystem may make the stager read a file of the host.
    """
    if not root:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    directory = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        how = _OpenHow(os.O_RDONLY | os.O_CLOEXEC, 0, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.syscall(SYS_OPENAT2, directory, os.fsencode(path), ctypes.byref(how), ctypes.sizeof(how))
        if fd < 0:
            error = ctypes.get_errno()
            raise OSError(error, f"{os.strerror(error)}: {path} inside {root}")
        return fd
    finally:
        os.close(directory)


SYS_OPENAT2 = 437  # the same number on x86_64 and arm64
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_IN_ROOT = 0x10


class _OpenHow(ctypes.Structure):
    _fields_ = (("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64))


def _copy_some(memory: _SharedDeviceMemory, fds: dict[str, int], queue: _Queue) -> None:
    cu, check = memory._cu, memory._check
    check(cu.cuCtxSetCurrent(memory.context), "cuCtxSetCurrent")
    stream = check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
    buffers = [int(check(cu.cuMemHostAlloc(STAGING_CHUNK_BYTES, 0), "cuMemHostAlloc")) for _ in range(2)]
    events = [
        check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate") for _ in buffers
    ]
    in_flight = [False, False]
    try:
        for number, (path, file_offset, offset, nbytes) in enumerate(_chunks(queue)):
            slot = number % 2
            if in_flight[slot]:
                check(cu.cuEventSynchronize(events[slot]), "cuEventSynchronize")
            view = memoryview((ctypes.c_char * nbytes).from_address(buffers[slot])).cast("B")
            _pread_exact(fds[path], view, file_offset)
            check(
                cu.cuMemcpyHtoDAsync(memory.address + offset, buffers[slot], nbytes, stream), "cuMemcpyHtoD"
            )
            check(cu.cuEventRecord(events[slot], stream), "cuEventRecord")
            in_flight[slot] = True
        check(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")
    finally:
        cu.cuStreamSynchronize(stream)
        for event in events:
            cu.cuEventDestroy(event)
        for buffer in buffers:
            cu.cuMemFreeHost(buffer)
        cu.cuStreamDestroy(stream)


def _chunks(queue: _Queue) -> Iterator[tuple[str, int, int, int]]:
    """Each copy cut to the staging buffer's size."""
    for path, file_offset, offset, nbytes in queue:
        for start in range(0, nbytes, STAGING_CHUNK_BYTES):
            yield path, file_offset + start, offset + start, min(STAGING_CHUNK_BYTES, nbytes - start)


def _pread_exact(fd: int, target: memoryview, offset: int) -> None:
    done = 0
    while done < len(target):
        count = os.preadv(fd, [target[done:]], offset + done)
        if count == 0:
            raise ValueError(f"unexpected end of file at offset {offset + done} (file truncated?)")
        done += count


class _Queue:
    def __init__(self, items: Iterator[Any]) -> None:
        self._items = items
        self._lock = threading.Lock()
        self._stopped = False

    def __iter__(self) -> _Queue:
        return self

    def __next__(self) -> Any:
        with self._lock:
            if self._stopped:
                raise StopIteration
            return next(self._items)

    def stop(self) -> None:
        with self._lock:
            self._stopped = True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m warmstart.engines.weight_stager", description=__doc__)
    parser.add_argument("--plan", required=True, help="the engine's staging plan (a JSON file; -: stdin)")
    parser.add_argument("--socket", required=True, help="Unix socket the engine connects to")
    parser.add_argument("--threads", type=int, default=STAGING_THREADS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="weight-stager: %(message)s")
    try:
        stage(args.plan, args.socket, args.threads)
    except Exception as exc:  # the engine was told already; the exit status says it too
        log.error("%s: %s", type(exc).__name__, exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
