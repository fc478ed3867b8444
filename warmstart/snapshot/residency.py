"""Page-cache residency of store files: how much of a file the kernel holds in memory, and pre-staging.

A restore reading its snapshot from the page cache runs at memory speed; one reading it from disk runs at
the disk's. `stage` reads what is not resident yet, so the next restore on this node takes the hot path.

- `resident_bytes`: the bytes of a file in the page cache (`mincore` over a read-only mapping of it, which
  reads nothing);
- `stage`: files in priority order, the first `budget_bytes` of them made resident: WILLNEED first, then a
  sequential read of the pages still missing, one file per thread;
- `evict`: the opposite of `stage`, a file's pages written back and dropped (how benchmarks and tests make a
  cold read);
- `blob_paths`: the distinct blobs of snapshots, in the order given, which is how the node agent stages them;
- `cgroup_memory_limit`: the memory limit of the caller's cgroup, which its page cache is charged against.

Files are opened with O_NOFOLLOW (and, given a `root`, resolved beneath it with no symbolic link anywhere on
the way) and must be regular files: a privileged reader is never led elsewhere by a planted link or a FIFO.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import re
import stat
from collections.abc import Callable, Iterable
from pathlib import Path

from warmstart.host.fileio import (
    RESOLVE_BENEATH,
    RESOLVE_NO_MAGICLINKS,
    RESOLVE_NO_SYMLINKS,
    UnsafeInput,
    libc,
    mapped_readonly,
    openat2,
)
from warmstart.host.parallel import parallel_map
from warmstart.snapshot.catalog import Snapshot
from warmstart.snapshot.store import SnapshotStore

PAGE_SIZE = mmap.PAGESIZE
DEFAULT_STAGE_THREADS = 4
CHUNK_BYTES = 8 << 20
UNLIMITED = 1 << 60  # cgroup v1 reports "no limit" as a number near 2**63
OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

_RESIDENT_BIT = bytes(value & 1 for value in range(256))  # mincore's other bits are reserved
_MISSING_RUN = re.compile(rb"\x00+")


def page_map(fd: int, length: int) -> bytes:
    """One byte per page of the file's first `length` bytes: 1 where the page is in the page cache."""
    if length <= 0:
        return b""
    vector = ctypes.create_string_buffer((length + PAGE_SIZE - 1) // PAGE_SIZE)
    with mapped_readonly(fd, 0, length) as address:
        if libc().mincore(address, length, vector) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"mincore: {os.strerror(error)}")
    return vector.raw.translate(_RESIDENT_BIT)


def open_regular(path: str | os.PathLike[str], root: Path | None = None) -> int:
    """A read-only descriptor of the regular file `path` (never through a symbolic link); UnsafeInput if not.

    With `root`, `path` must lie beneath it and is resolved from a descriptor of `root` with no symbolic
    link, `..` escape or magic link on the way.
    """
    try:
        fd = os.open(path, OPEN_FLAGS) if root is None else _open_beneath(Path(path), root)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EXDEV, errno.ENOTDIR):
            raise UnsafeInput(f"{os.fspath(path)} is refused: a symbolic link or outside its root") from exc
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafeInput(f"{os.fspath(path)} is not a regular file")
    return fd


def _open_beneath(path: Path, root: Path) -> int:
    try:
        relative = path.relative_to(root) if path.is_absolute() else path
    except ValueError as exc:
        raise UnsafeInput(f"{path} is not inside {root}") from exc
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS
        return openat2(root_fd, os.fspath(relative), OPEN_FLAGS, resolve)
    finally:
        os.close(root_fd)


def resident_bytes(path: str | os.PathLike[str], *, root: Path | None = None) -> int:
    """Bytes of the file at `path` now in the page cache (0 for an empty file)."""
    fd = open_regular(path, root)
    try:
        size = os.fstat(fd).st_size
        pages = page_map(fd, size)
    finally:
        os.close(fd)
    resident = pages.count(1) * PAGE_SIZE
    if size % PAGE_SIZE and pages and pages[-1]:
        resident -= PAGE_SIZE - size % PAGE_SIZE  # the last page is only partly the file's
    return resident


def evict(path: str | os.PathLike[str]) -> None:
    """Write the file's dirty pages back, then drop all its pages from the page cache."""
    fd = open_regular(path)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _allot(
    paths: Iterable[str | os.PathLike[str]],
    budget_bytes: int,
    root: Path | None,
    opened: contextlib.ExitStack,
) -> list[tuple[int, int]]:
    """Open the files in order until the budget is spent (`opened` closes them); each gets what is left of
    it, up to its size: (descriptor, how much of the file's start the budget covers)."""
    allotted: list[tuple[int, int]] = []
    left = budget_bytes
    for path in paths:
        if left <= 0:
            break
        try:
            fd = open_regular(path, root)
        except FileNotFoundError:  # removed by GC since it was listed: nothing to stage
            continue
        opened.callback(os.close, fd)
        length = min(os.fstat(fd).st_size, left)
        allotted.append((fd, length))
        left -= length
    return allotted


def _read_range(fd: int, start: int, end: int, buffer: memoryview, should_stop: Callable[[], bool]) -> int:
    offset = start
    while offset < end and not should_stop():
        got = os.preadv(fd, [buffer[: min(len(buffer), end - offset)]], offset)
        if got == 0:  # the file is shorter than it was (blobs never shrink; be safe anyway)
            break
        offset += got
    return offset - start


def _stage_file(fd: int, length: int, should_stop: Callable[[], bool]) -> int:
    """Read the runs of pages of the file's first `length` bytes that are not in the page cache."""
    missing = [
        (run.start() * PAGE_SIZE, min(run.end() * PAGE_SIZE, length))
        for run in _MISSING_RUN.finditer(page_map(fd, length))
    ]
    if not missing:
        return 0
    for start, end in missing:
        os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_WILLNEED)
    buffer = memoryview(bytearray(CHUNK_BYTES))
    return sum(_read_range(fd, start, end, buffer, should_stop) for start, end in missing)


def stage(
    paths: Iterable[str | os.PathLike[str]],
    budget_bytes: int,
    *,
    root: Path | None = None,
    threads: int = DEFAULT_STAGE_THREADS,
    should_stop: Callable[[], bool] = lambda: False,
) -> int:
    """Bring the first `budget_bytes` of `paths` (in their order, by file size) into the page cache.

    Only pages not resident yet are read, sequentially within a file, `threads` files at a time. A missing
    file is skipped; a symbolic link, a path outside `root` or a file that is not regular raises UnsafeInput
    before anything is read. Returns the bytes read.
    """
    with contextlib.ExitStack() as opened:
        allotted = _allot(paths, budget_bytes, root, opened)
        read = parallel_map(lambda item: _stage_file(*item, should_stop), allotted, workers=threads)
    return sum(read)


def cgroup_memory_limit(
    proc: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")
) -> int | None:
    """The memory limit of this process's cgroup (v2's `memory.max`, else v1's), None where there is none.

    Pages a process reads into the page cache are charged to its cgroup: staging past this limit only
    evicts what was staged before.
    """
    try:
        entries = [line.split(":", 2) for line in proc.read_text().splitlines() if line.count(":") >= 2]
    except OSError:
        return None
    v1 = [root / "memory" / path.lstrip("/") / "memory.limit_in_bytes"
          for _, controllers, path in entries if "memory" in controllers.split(",")]  # fmt: skip
    v2 = [root / path.lstrip("/") / "memory.max" for _, controllers, path in entries if not controllers]
    for candidate in v1 + v2:
        try:
            limit = candidate.read_text().strip()
        except OSError:
            continue
        return int(limit) if limit.isdigit() and int(limit) < UNLIMITED else None
    return None


def blob_paths(store: SnapshotStore, snapshots: Iterable[Snapshot]) -> list[Path]:
    """The blobs of `snapshots`, each once, in the order of the snapshots and of their files."""
    seen: dict[str, Path] = {}
    for snapshot in snapshots:
        for _name, entry in sorted(snapshot.files.items()):
            seen.setdefault(entry.digest, store.blob_path(entry.digest))
    return list(seen.values())
