"""Blob files: ingesting a hashed file as the blob of its digest, and placing a blob at a target path.

A name in `blobs/sha256/` that is not a regular file (a planted symbolic link, FIFO or device) is never
followed: publishing replaces it with the right bytes, placing refuses it. A regular file there is kept by
publishing only once its content was checked against the digest it is named by.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import stat
from pathlib import Path

from warmstart.host.fileio import READ_FLAGS, atomic_file
from warmstart.snapshot.layout import StoreLayout
from warmstart.snapshot.manifest import FileEntry, SnapshotError, SnapshotInvalid

log = logging.getLogger(__name__)


def touch(path: Path) -> None:
    """Refresh a blob's mtime (the GC grace clock); a blob owned by another user keeps its old one."""
    with contextlib.suppress(PermissionError):
        os.utime(path, follow_symlinks=False)


def copy_file(source: Path, target: Path, mode: int) -> None:
    """Copy a regular file (never through a symbolic link) to `target`, which is never half-written."""
    fd = os.open(source, READ_FLAGS | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as reader:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SnapshotInvalid(f"{source} is not a regular file")
        with atomic_file(target, mode) as writer:
            shutil.copyfileobj(reader, writer, 8 << 20)
            os.fchmod(writer.fileno(), mode)


def existing_blob_of_size(layout: StoreLayout, digest: str, size: int) -> bool:
    """Whether the blob of `digest` is a regular file of `size` bytes (its content still unchecked)."""
    try:
        info = layout.blob_path(digest).lstat()
    except FileNotFoundError:
        return False
    return _regular_of_size(info, size)


def _regular_of_size(info: os.stat_result | None, size: int) -> bool:
    return info is not None and stat.S_ISREG(info.st_mode) and info.st_size == size


def ingest(layout: StoreLayout, source: Path, entry: FileEntry, *, keep_existing: bool) -> bool:
    """Make `source` (already hashed, on disk) the blob of `entry`; True when this wrote the blob.

    An existing blob of the right size is kept when `keep_existing` (the caller checked its content);
    anything else at the blob's name (damaged bytes, a link, a FIFO) is replaced with `source`.
    """
    target = layout.blob_path(entry.digest)
    try:
        existing = target.lstat()
    except FileNotFoundError:
        existing = None
    if keep_existing and _regular_of_size(existing, entry.size):
        touch(target)
        return False
    os.chmod(source, entry.mode & 0o555)
    if existing is not None:  # damaged or not a file at all: replace it with good bytes
        if stat.S_ISDIR(existing.st_mode):
            raise SnapshotError(f"blob {entry.digest} in the store is a directory; remove {target}")
        log.warning(
            "replacing damaged blob %s (mode %o, %d bytes)", entry.digest, existing.st_mode, existing.st_size
        )
        os.replace(source, target)
    else:
        try:
            os.link(source, target, follow_symlinks=False)
        except FileExistsError:  # a concurrent publisher stored the same bytes first
            return False
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
            copy_file(source, target, entry.mode & 0o555)
    touch(target)  # a linked file keeps its old mtime; the GC grace period starts now
    return True


def place(layout: StoreLayout, target: Path, entry: FileEntry, use_link: list[bool]) -> None:
    """Put the blob of `entry` at `target`: a hardlink while `use_link[0]` holds, else a copy."""
    blob = layout.blob_path(entry.digest)
    if use_link[0] and stat.S_IMODE(blob.lstat().st_mode) == entry.mode & 0o555:
        try:
            os.link(blob, target, follow_symlinks=False)
            return
        except FileNotFoundError as exc:
            raise SnapshotInvalid(f"blob {entry.digest} vanished while materialising {target}") from exc
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                raise
            use_link[0] = False  # another filesystem (or no hardlinks there): copy from now on
    copy_file(blob, target, entry.mode)
