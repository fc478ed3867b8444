"""Digests of many files at once, near disk speed: SHA-256 of each file, and of each chunk of a large one.

A digest of one stream is sequential, so parallelism comes from hashing several files and chunks in
threads: `readinto` and both hashes release the GIL on large buffers. Files are taken largest first so
one big file does not finish last alone. Chunks are hashed with BLAKE3 (SHA-256 in manifests written
before it): 3-4x SHA-256's speed per core, so verifying a restore's image is bounded by memory bandwidth
rather than by the cores' SHA units (BENCHMARKS.md).
"""

from __future__ import annotations

import errno
import functools
import hashlib
import os
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3

from warmstart.host.fileio import READ_FLAGS
from warmstart.host.parallel import run_heaviest_first

CHUNK_BYTES = 4 << 20
CHUNK_HASHES: dict[str, Callable[[], Any]] = {"sha256": hashlib.sha256, "blake3": blake3.blake3}
DEFAULT_CHUNK_HASH = "blake3"


def open_regular(path: Path) -> int:
    """A read descriptor of a regular file: a symbolic link, FIFO or device is refused (OSError)."""
    fd = os.open(path, READ_FLAGS | os.O_NOFOLLOW)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    return fd


def hash_file(path: Path, *, fsync: bool = False) -> tuple[str, int]:
    """(`sha256:<hex>`, size) of a file, read sequentially in large chunks; optionally fsync it too."""
    digest = hashlib.sha256()
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    size = 0
    with os.fdopen(open_regular(path), "rb", buffering=0) as handle:
        os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while count := handle.readinto(buffer):
            digest.update(view[:count])
            size += count
        if fsync:
            os.fsync(handle.fileno())
    return "sha256:" + digest.hexdigest(), size


def hash_range(path: Path, offset: int, length: int, algorithm: str = "sha256") -> str:
    """Hex digest (one of CHUNK_HASHES) of `length` bytes of `path` from `offset` (a short file gives a
    short read: no match)."""
    digest = CHUNK_HASHES[algorithm]()
    buffer = bytearray(min(CHUNK_BYTES, max(length, 1)))
    view = memoryview(buffer)
    fd = open_regular(path)
    try:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_SEQUENTIAL)
        position, end = offset, offset + length
        while position < end:
            count = os.preadv(fd, [view[: min(len(buffer), end - position)]], position)
            if count == 0:
                break
            digest.update(view[:count])
            position += count
    finally:
        os.close(fd)
    return digest.hexdigest()


def chunk_ranges(size: int, chunk_size: int) -> list[tuple[int, int]]:
    """(offset, length) of each `chunk_size` piece of a `size`-byte file."""
    return [(offset, min(chunk_size, size - offset)) for offset in range(0, size, chunk_size)]


@dataclass(frozen=True)
class FileHash:
    digest: str  # sha256:<hex> of the whole file
    size: int
    chunk_size: int = 0  # 0: not chunked
    chunks: tuple[str, ...] = ()  # hex digest of each chunk
    chunk_hash: str = DEFAULT_CHUNK_HASH


def hash_files(
    paths: Iterable[Path],
    *,
    workers: int | None = None,
    fsync: bool = False,
    chunk_size: int = 0,
    chunk_hash: str = DEFAULT_CHUNK_HASH,
) -> dict[Path, FileHash]:
    """Digest and size of every path, in parallel threads; files above `chunk_size` get chunk digests too
    (`chunk_hash`: one of CHUNK_HASHES).

    The whole-file digests of the largest files start first while the chunk digests fill the other threads.
    """
    sizes = {path: path.stat().st_size for path in paths}
    whole_jobs = [(size, functools.partial(hash_file, path, fsync=fsync)) for path, size in sizes.items()]
    chunk_owners: list[Path] = []
    chunk_jobs: list[tuple[int, Callable[[], str]]] = []
    for path, size in sizes.items():
        if chunk_size and size > chunk_size:
            for offset, length in chunk_ranges(size, chunk_size):
                chunk_owners.append(path)
                chunk_jobs.append((length, functools.partial(hash_range, path, offset, length, chunk_hash)))
    results: list[object] = run_heaviest_first([*whole_jobs, *chunk_jobs], workers=workers)
    chunks: dict[Path, list[str]] = {}
    for owner, chunk in zip(chunk_owners, results[len(whole_jobs) :], strict=True):
        chunks.setdefault(owner, []).append(str(chunk))
    hashes: dict[Path, FileHash] = {}
    for path, result in zip(sizes, results[: len(whole_jobs)], strict=True):
        digest, size = result  # type: ignore[misc]
        if size != sizes[path]:
            raise RuntimeError(f"{path} changed size while it was hashed ({sizes[path]} -> {size} bytes)")
        own = tuple(chunks.get(path, ()))
        hashes[path] = FileHash(digest, size, chunk_size if own else 0, own, chunk_hash)
    return hashes
