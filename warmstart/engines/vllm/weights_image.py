"""The loaded model's parameters, byte for byte, in one file beside the snapshot: a faster refill than
vLLM's `reload_weights` after a level-2 sleep.

vLLM's sleep-mode allocator (CuMemAllocator) keeps the virtual addresses of the weights it frees and maps
fresh memory at the same addresses on `wake_up(tags=["weights"])`, so the parameter tensors (and the CUDA
graphs captured over them) stay valid; only their bytes are gone. `reload_weights` refills them by running
the model loader again (safetensors iteration, per-parameter weight loaders, fusing q/k/v and gate/up,
post-processing). The parameters' final bytes are a plain copy away instead: `save` writes them, in
`named_parameters()` order, before the sleep; `refill` reads them back with parallel `pread`s into pinned
buffers and non-blocking copies on one CUDA stream per thread. A header (names, shapes, dtypes, sizes)
is checked first: if it does not match the live model, nothing is copied and the caller reloads instead.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from warmstart.gpu.weights_io import pread_exact

log = logging.getLogger(__name__)

MAGIC = b"WSVLLMW1"
ALIGN = 4096
DEFAULT_THREADS = 8


@dataclass(frozen=True)
class Entry:
    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int  # in the file, from its start
    nbytes: int


def layout(tensors: list[tuple[str, Any]], data_start: int) -> list[Entry]:
    """Where each tensor's bytes go in the file (aligned, in order)."""
    entries, offset = [], data_start
    for name, tensor in tensors:
        nbytes = int(tensor.numel() * tensor.element_size())
        entries.append(Entry(name, tuple(tensor.shape), str(tensor.dtype), offset, nbytes))
        offset = _aligned(offset + nbytes)
    return entries


def header_bytes(entries: list[Entry]) -> bytes:
    body = json.dumps([[e.name, list(e.shape), e.dtype, e.offset, e.nbytes] for e in entries]).encode()
    return MAGIC + struct.pack("<Q", len(body)) + body


def data_start(tensors: list[tuple[str, Any]]) -> int:
    """The first data offset: after a header sized for these tensors (offsets do not change its length
    by more than the slack kept here)."""
    provisional = header_bytes(layout(tensors, 0))
    return _aligned(len(provisional) + 32 * len(tensors) + ALIGN)


def read_entries(path: Path) -> list[Entry]:
    with open(path, "rb") as file:
        magic = file.read(len(MAGIC))
        if magic != MAGIC:
            raise ValueError(f"{path} is not a weights image")
        (size,) = struct.unpack("<Q", file.read(8))
        rows = json.loads(file.read(size))
    return [Entry(name, tuple(shape), dtype, offset, nbytes) for name, shape, dtype, offset, nbytes in rows]


def parameters(model: Any) -> list[tuple[str, Any]]:
    """The model's parameters a refill covers: contiguous ones, each once."""
    return [(name, p.data) for name, p in model.named_parameters() if p.data.is_contiguous()]


def save(model: Any, path: Path, threads: int = DEFAULT_THREADS) -> dict[str, float]:
    """Write the parameters' bytes to `path` (atomically); returns {'bytes', 'seconds'}."""
    import torch

    started = time.perf_counter()
    tensors = parameters(model)
    entries = layout(tensors, data_start(tensors))
    head = header_bytes(entries)
    if entries and len(head) > entries[0].offset:
        raise ValueError("weights image header outgrew its space")
    partial = path.with_name(path.name + ".partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.pwrite(fd, head, 0)

        def write(item: tuple[Entry, Any]) -> None:
            entry, tensor = item
            host = tensor.detach().reshape(-1).view(torch.uint8).cpu().numpy()
            _pwrite_all(fd, memoryview(host), entry.offset)

        with ThreadPoolExecutor(max(1, threads)) as pool:
            list(pool.map(write, zip(entries, (t for _, t in tensors), strict=True)))
    finally:
        os.close(fd)
    os.replace(partial, path)
    total = sum(e.nbytes for e in entries)
    return {"bytes": float(total), "seconds": time.perf_counter() - started}


def matches(entries: list[Entry], tensors: list[tuple[str, Any]]) -> str | None:
    """Why `entries` do not describe `tensors`, or None when they do."""
    if len(entries) != len(tensors):
        return f"{len(entries)} tensors in the image, {len(tensors)} in the model"
    for entry, (name, tensor) in zip(entries, tensors, strict=True):
        if (entry.name, entry.shape, entry.dtype) != (name, tuple(tensor.shape), str(tensor.dtype)):
            return f"{entry.name} {entry.shape} {entry.dtype} in the image, {name} {tuple(tensor.shape)} here"
    return None


def reusable(model: Any, path: Path) -> bool:
    """Whether `path` is a complete image of exactly these parameters' layout (its bytes are not read)."""
    try:
        entries = read_entries(path)
        size = path.stat().st_size
    except (OSError, ValueError, struct.error, json.JSONDecodeError):
        return False
    if matches(entries, parameters(model)) is not None:
        return False
    return not entries or size >= entries[-1].offset + entries[-1].nbytes


def refill(model: Any, path: Path, threads: int, chunk_bytes: int) -> dict[str, float]:
    """Copy the image's bytes back into the model's parameters; raises ValueError when it does not match."""
    import torch

    started = time.perf_counter()
    tensors = parameters(model)
    entries = read_entries(path)
    why = matches(entries, tensors)
    if why:
        raise ValueError(f"the weights image {path} does not match the model: {why}")
    chunks = list(_chunks(entries, chunk_bytes))
    targets = [t.reshape(-1).view(torch.uint8) for _, t in tensors]
    fd = os.open(path, os.O_RDONLY)
    try:
        copy_chunks(targets, [fd], chunks, threads, chunk_bytes)
    finally:
        os.close(fd)
    total = sum(e.nbytes for e in entries)
    seconds = time.perf_counter() - started
    return {"bytes": float(total), "seconds": seconds, "gb_per_s": total / seconds / 1e9 if seconds else 0.0}


@dataclass(frozen=True)
class Chunk:
    """One piece of a refill: `length` bytes of file `fd_index` at `file_offset` into tensor `target` at
    byte `start`."""

    target: int
    fd_index: int
    file_offset: int
    start: int
    length: int


def copy_chunks(
    targets: list[Any], fds: list[int], chunks: list[Chunk], threads: int, chunk_bytes: int
) -> None:
    """Read every chunk into its target (flat uint8 views): on a GPU with `threads` threads, each reading
    into two pinned buffers of `chunk_bytes` in turn and copying on its own stream; on the CPU straight in."""
    import torch

    if not chunks:
        return
    device = targets[chunks[0].target].device
    threads = max(1, min(threads, len(chunks)))
    shares = [chunks[i::threads] for i in range(threads)]

    def read_into(share: list[Chunk]) -> None:
        for chunk in share:
            view = targets[chunk.target][chunk.start : chunk.start + chunk.length]
            pread_exact(fds[chunk.fd_index], memoryview(view.numpy()), chunk.file_offset)

    def work(share: list[Chunk]) -> None:
        buffers = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        done: list[Any] = [None, None]
        stream = torch.cuda.Stream(device=device)
        for i, chunk in enumerate(share):
            slot = i % 2
            if done[slot] is not None:
                done[slot].synchronize()
            buffer = buffers[slot]
            pread_exact(fds[chunk.fd_index], memoryview(buffer.numpy())[: chunk.length], chunk.file_offset)
            with torch.cuda.stream(stream):
                target = targets[chunk.target][chunk.start : chunk.start + chunk.length]
                target.copy_(buffer[: chunk.length], non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            done[slot] = event
        stream.synchronize()

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(read_into if device.type == "cpu" else work, shares))
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _chunks(entries: list[Entry], chunk_bytes: int) -> Iterator[Chunk]:
    for index, entry in enumerate(entries):
        for start in range(0, entry.nbytes, chunk_bytes):
            yield Chunk(index, 0, entry.offset + start, start, min(chunk_bytes, entry.nbytes - start))


def _aligned(offset: int) -> int:
    return (offset + ALIGN - 1) // ALIGN * ALIGN


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    data = data.cast("B")
    while data:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written
