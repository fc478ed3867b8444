"""Durable, race-free file writes: the one way warmstart writes a file another process may read.

A file is written under a fresh random name in its target's directory (created with O_EXCL | O_NOFOLLOW,
so a planted symbolic link or file is never followed or reused), fsync'd, then renamed over the target:
a reader sees the old content or the new, never a part. Directories may be given as descriptors, so a
privileged writer never resolves a path a tenant can change between the check and the write.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def write_new_file(path: Path, content: bytes, mode: int = 0o644) -> None:
    """Create `path` (never overwrite, never through a symbolic link) with `content`, fsync'd."""
    fd = os.open(path, NEW_FILE_FLAGS, mode)
    try:
        _write_all(fd, content)
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(target: Path, mode: int = 0o644, *, dir_fd: int | None = None) -> Iterator[BinaryIO]:
    """A binary handle whose content replaces `target` once the block ends without an exception.

    With `dir_fd`, `target` is a bare name inside that directory (no path is resolved at all).
    """
    if dir_fd is not None and Path(target).name != str(target):
        raise ValueError(f"with dir_fd the target must be a bare name, got {str(target)!r}")
    name = Path(target).name
    temporary = f".{name}.{secrets.token_hex(8)}.tmp"
    temporary_path = temporary if dir_fd is not None else str(Path(target).parent / temporary)
    fd = os.open(temporary_path, NEW_FILE_FLAGS, mode, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb", closefd=True) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        final = name if dir_fd is not None else str(target)
        os.rename(temporary_path, final, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary_path, dir_fd=dir_fd)
        raise


def write_atomic(target: Path, content: bytes, mode: int = 0o644, *, dir_fd: int | None = None) -> None:
    """Replace `target` with `content` in one rename (see `atomic_file`)."""
    with atomic_file(target, mode, dir_fd=dir_fd) as handle:
        handle.write(content)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, content: bytes) -> None:
    view = memoryview(content)
    while view:
        view = view[os.write(fd, view) :]
