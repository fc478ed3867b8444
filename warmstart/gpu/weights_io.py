"""Weights on disk (safetensors) <-> a flat arena in memory.

A *layout* maps each tensor name to where it lives in the arena (offset, shape, dtype). `refill()` copies
the tensors' bytes from safetensors files into the arena at those offsets with parallel `preadv` calls:
straight into the arena on CPU, through per-thread pinned buffers and non-blocking copies on per-thread
streams on CUDA. `direct_io=True` reads with O_DIRECT instead, bypassing the page cache (a cold disk),
through aligned staging buffers on either device. The safetensors format is simple enough to read and write
here without loading whole files.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import struct
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from warmstart.gpu.arena import round_up
from warmstart.host.fileio import atomic_file
from warmstart.host.parallel import share_among_threads

if TYPE_CHECKING:
    import torch

ARENA_ALIGNMENT = 256  # bytes; enough for every dtype and for CUDA's vectorised loads
HEADER_ALIGNMENT = 4096  # data of files we write starts page-aligned (friendly to O_DIRECT readers)
DEFAULT_CHUNK_BYTES = 16 << 20  # measured on an H200: 16 MiB beat 32 and 64 MiB at 4-16 threads
DIRECT_IO_ALIGNMENT = 4096  # O_DIRECT file offsets, lengths and buffer addresses are multiples of this

DTYPE_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
}  # fmt: skip


def torch_dtype(code: str) -> torch.dtype:
    import torch

    table = {
        "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
        "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
        "BOOL": torch.bool,
    }  # fmt: skip
    try:
        return table[code]
    except KeyError:
        raise ValueError(f"safetensors dtype {code!r} is not supported; use one of {sorted(table)}") from None


def dtype_code(dtype: torch.dtype) -> str:
    for code in DTYPE_SIZES:
        if torch_dtype(code) == dtype:
            return code
    raise ValueError(f"torch dtype {dtype} has no safetensors code")


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor lives in the arena."""

    name: str
    offset: int
    shape: tuple[int, ...]
    dtype: str  # safetensors code, e.g. "BF16"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]


Layout = dict[str, TensorSlot]


@dataclass(frozen=True)
class FileEntry:
    """One tensor inside a safetensors file: absolute byte range in the file."""

    path: Path
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def read_header(path: str | os.PathLike[str]) -> list[FileEntry]:
    """Parse a safetensors file's header; entries in data order."""
    path = Path(path)
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > 100 << 20:
            raise ValueError(f"{path}: safetensors header of {header_len} bytes is implausible")
        header = json.loads(handle.read(header_len))
    data_start = 8 + header_len
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        dtype = info["dtype"]
        if dtype not in DTYPE_SIZES:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {dtype}")
        shape = tuple(info["shape"])
        entries.append(FileEntry(path, name, dtype, shape, data_start + begin, data_start + end))
    return sorted(entries, key=lambda entry: entry.start)


def index_files(files: Sequence[str | os.PathLike[str]]) -> dict[str, FileEntry]:
    """Tensor name -> where it is, over several files; a name in two files is an error."""
    index: dict[str, FileEntry] = {}
    for path in files:
        for entry in read_header(path):
            if entry.name in index:
                raise ValueError(f"tensor {entry.name} appears in both {index[entry.name].path} and {path}")
            index[entry.name] = entry
    return index


def plan_layout(
    files: Sequence[str | os.PathLike[str]], alignment: int = ARENA_ALIGNMENT
) -> tuple[Layout, int]:
    """A layout holding every tensor of `files` in file order; returns it with the arena size."""
    layout: Layout = {}
    offset = 0
    for path in files:
        for entry in read_header(path):
            offset = round_up(offset, alignment)
            layout[entry.name] = TensorSlot(entry.name, offset, entry.shape, entry.dtype)
            offset += layout[entry.name].nbytes
    return layout, round_up(offset, alignment)


def views(arena: torch.Tensor, layout: Layout) -> dict[str, torch.Tensor]:
    """Typed tensors over the arena's bytes, one per slot (no copies)."""
    return {slot.name: _view(arena, slot) for slot in layout.values()}


def _view(arena: torch.Tensor, slot: TensorSlot) -> torch.Tensor:
    return arena[slot.offset : slot.offset + slot.nbytes].view(torch_dtype(slot.dtype)).view(slot.shape)


@dataclass(frozen=True)
class Chunk:
    path: Path
    file_offset: int
    arena_offset: int
    nbytes: int


@dataclass(frozen=True)
class RefillStats:
    nbytes: int
    seconds: float
    threads: int

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def plan_chunks(layout: Layout, files: Sequence[str | os.PathLike[str]], chunk_bytes: int) -> list[Chunk]:
    """Byte ranges to copy, each at most `chunk_bytes`; checks every slot against the files."""
    index = index_files(files)
    chunks = []
    for slot in layout.values():
        entry = index.get(slot.name)
        if entry is None:
            names = ", ".join(map(str, files))
            raise ValueError(f"tensor {slot.name} is in the layout but in none of: {names}")
        if entry.dtype != slot.dtype or entry.shape != slot.shape:
            raise ValueError(
                f"tensor {slot.name}: file {entry.path} has {entry.dtype}{list(entry.shape)}, "
                f"layout expects {slot.dtype}{list(slot.shape)}"
            )
        for start in range(0, slot.nbytes, chunk_bytes):
            size = min(chunk_bytes, slot.nbytes - start)
            chunks.append(Chunk(entry.path, entry.start + start, slot.offset + start, size))
    return chunks


def refill(
    arena: torch.Tensor,
    layout: Layout,
    files: Sequence[str | os.PathLike[str]],
    threads: int = 8,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    direct_io: bool = False,
) -> RefillStats:
    """Read every slot of `layout` from `files` into `arena` (a flat uint8 tensor) with parallel reads.

    `direct_io=True` opens the files with O_DIRECT, so the bytes come from the disk and do not stay in the
    page cache (for a cold disk; the files' filesystem must support O_DIRECT).
    """
    if threads < 1 or chunk_bytes < 1:
        raise ValueError(f"threads and chunk_bytes must be >= 1, got {threads} and {chunk_bytes}")
    chunks = plan_chunks(layout, files, chunk_bytes)
    total = sum(chunk.nbytes for chunk in chunks)
    threads = max(1, min(threads, len(chunks)))
    started = time.perf_counter()
    with _open_files({chunk.path for chunk in chunks}, direct_io) as fds:
        buffer_bytes = min(chunk_bytes, max(chunk.nbytes for chunk in chunks))
        if arena.device.type == "cpu":
            worker = _cpu_worker(arena, fds, buffer_bytes, direct_io)
        else:
            import torch

            torch.cuda.synchronize(arena.device)  # no earlier kernel may still be using the destination
            worker = _cuda_worker(arena, fds, buffer_bytes, direct_io)
        share_among_threads(worker, iter(chunks), threads, name="refill")
    return RefillStats(total, time.perf_counter() - started, threads)


def _cpu_worker(
    arena: torch.Tensor, fds: dict[Path, int], buffer_bytes: int, direct_io: bool
) -> Callable[[Iterator[Chunk]], None]:
    # On CPU the arena is ordinary memory: read straight into it, no staging buffer. O_DIRECT needs aligned
    # offsets, lengths and addresses, which arena offsets are not: with it, stage each chunk.
    target = memoryview(arena.numpy())

    def work(chunks: Iterator[Chunk]) -> None:
        buffer = _direct_staging_buffer(buffer_bytes, pinned=False) if direct_io else None
        staging = None if buffer is None else memoryview(buffer.numpy())
        for chunk in chunks:
            window = target[chunk.arena_offset : chunk.arena_offset + chunk.nbytes]
            if staging is None:
                pread_exact(fds[chunk.path], window, chunk.file_offset)
            else:
                begin, end = _pread_direct(fds[chunk.path], staging, chunk.file_offset, chunk.nbytes)
                window[:] = staging[begin:end]

    return work


def _cuda_worker(
    arena: torch.Tensor, fds: dict[Path, int], buffer_bytes: int, direct_io: bool
) -> Callable[[Iterator[Chunk]], None]:
    import torch

    def work(chunks: Iterator[Chunk]) -> None:
        stream = torch.cuda.Stream(device=arena.device)
        # Two pinned buffers: read the next chunk while the previous one is still being copied.
        if direct_io:
            buffers = [_direct_staging_buffer(buffer_bytes, pinned=True) for _ in range(2)]
        else:
            buffers = [torch.empty(buffer_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        events: list[torch.cuda.Event | None] = [None, None]
        try:
            for number, chunk in enumerate(chunks):
                slot = number % 2
                if events[slot] is not None:
                    events[slot].synchronize()
                if direct_io:
                    view = memoryview(buffers[slot].numpy())
                    begin, end = _pread_direct(fds[chunk.path], view, chunk.file_offset, chunk.nbytes)
                    staging = buffers[slot][begin:end]
                else:
                    staging = buffers[slot][: chunk.nbytes]
                    pread_exact(fds[chunk.path], memoryview(staging.numpy()), chunk.file_offset)
                target = arena[chunk.arena_offset : chunk.arena_offset + chunk.nbytes]
                with torch.cuda.stream(stream):
                    target.copy_(staging, non_blocking=True)
                    events[slot] = torch.cuda.Event()
                    events[slot].record(stream)
            stream.synchronize()
        finally:
            del buffers

    return work


def release_pinned_cache() -> None:
    """Return torch's cached pinned host blocks to the OS (they would otherwise sit in a checkpoint)."""
    import torch

    if hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()


@contextlib.contextmanager
def _open_files(paths: Iterable[Path], direct_io: bool) -> Iterator[dict[Path, int]]:
    """Open each file once for all threads (pread is position-free) and close them all afterwards."""
    flags = os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if direct_io else 0)
    fds: dict[Path, int] = {}
    try:
        for path in sorted(paths):
            fds[path] = _open(path, flags)
        yield fds
    finally:
        for fd in fds.values():
            os.close(fd)


def pread_exact(fd: int, target: memoryview, offset: int) -> None:
    """Fill `target` from `fd` at `offset` (short reads continued; the end of the file is an error)."""
    done = 0
    while done < len(target):
        count = os.preadv(fd, [target[done:]], offset + done)
        if count == 0:
            raise ValueError(f"unexpected end of file at offset {offset + done} (file truncated?)")
        done += count


def _open(path: Path, flags: int) -> int:
    try:
        return os.open(path, flags)
    except OSError as exc:
        if flags & os.O_DIRECT and exc.errno == errno.EINVAL:
            raise OSError(
                exc.errno, f"{path}: its filesystem does not support O_DIRECT reads; refill without direct_io"
            ) from exc
        raise


def _direct_staging_buffer(nbytes: int, pinned: bool) -> torch.Tensor:
    """A uint8 host buffer for O_DIRECT reads of chunks up to `nbytes`, its first byte aligned."""
    import torch

    # A read starts on the aligned offset before the chunk and ends on the aligned offset after it.
    capacity = nbytes + 2 * DIRECT_IO_ALIGNMENT
    raw = torch.empty(capacity + DIRECT_IO_ALIGNMENT, dtype=torch.uint8, pin_memory=pinned)
    lead = -raw.data_ptr() % DIRECT_IO_ALIGNMENT
    return raw[lead : lead + capacity]


def _pread_direct(fd: int, buffer: memoryview, offset: int, nbytes: int) -> tuple[int, int]:
    """Read bytes [offset, offset + nbytes) of an O_DIRECT `fd` through the aligned `buffer`.

    Reads whole aligned blocks around the range; returns where the range's bytes are inside `buffer`.
    """
    start = offset - offset % DIRECT_IO_ALIGNMENT
    skip = offset - start
    window = buffer[: round_up(skip + nbytes, DIRECT_IO_ALIGNMENT)]
    done = 0
    while done < skip + nbytes:
        count = os.preadv(fd, [window[done:]], start + done)
        if count == 0 or (count % DIRECT_IO_ALIGNMENT and done + count < skip + nbytes):
            # A short read that is not a whole number of blocks is the end of the file.
            raise ValueError(f"unexpected end of file at offset {start + done + count} (file truncated?)")
        done += count
    return skip, skip + nbytes


TensorSource = tuple[str, str, tuple[int, ...], Callable[[], "torch.Tensor"]]  # name, dtype, shape, produce


def write_safetensors(
    path: str | os.PathLike[str],
    tensors: Sequence[TensorSource],
    metadata: dict[str, str] | None = None,
    on_bytes: Callable[[bytes | memoryview], None] | None = None,
) -> None:
    """Stream tensors into a safetensors file, producing one tensor at a time (bounded memory).

    `on_bytes` sees every byte written (to hash the file while writing it).
    """
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, dtype, shape, _ in tensors:
        nbytes = TensorSlot(name, 0, shape, dtype).nbytes
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded = encoded.ljust(round_up(8 + len(encoded), HEADER_ALIGNMENT) - 8)  # padded with spaces
    import torch

    emit = on_bytes or (lambda _data: None)
    with atomic_file(Path(path)) as handle:
        for piece in (struct.pack("<Q", len(encoded)), encoded):
            handle.write(piece)
            emit(piece)
        for name, dtype, shape, produce in tensors:
            tensor = produce().contiguous().cpu()
            if tuple(tensor.shape) != shape or dtype_code(tensor.dtype) != dtype:
                produced = f"{tensor.dtype}{list(tensor.shape)}"
                raise ValueError(f"tensor {name}: produced {produced}, declared {dtype}{list(shape)}")
            data = memoryview(tensor.view(-1).view(torch.uint8).numpy())
            handle.write(data)
            emit(data)
