"""Blob files: ingesting a hashed file as the blob of its digest, and placing a blob at a target path."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import stat
import uuid
from pathlib import Path

from warmstart.snapshot.layout import StoreLayout
from warmstart.snapshot.manifest import FileEntry, SnapshotInvalid

log = logging.getLogger(__name__)


def touch(path: Path) -> None:
    """Refresh a blob's mtime (the GC grace clock); a blob owned by another user keeps its old one."""
    with contextlib.suppress(PermissionError):
        os.utime(path)


def copy_file(source: Path, target: Path, mode: int) -> None:
    """Copy through a temporary name, fsync, then rename into place: `target` is never half-written."""
    temporary = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        shutil.copyfile(source, temporary)
        os.chmod(temporary, mode)
        with open(temporary, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)


def ingest(layout: StoreLayout, source: Path, digest: str, size: int, mode: int) -> None:
    """Make `source` (already hashed, on disk) the blob for `digest`; drop it when the blob exists."""
    target = layout.blob_path(digest)
    try:
        existing = target.stat()
    except FileNotFoundError:
        existing = None
    if existing is not None and existing.st_size == size:
        touch(target)
        return
    os.chmod(source, mode & 0o555)
    if existing is not None:  # wrong size: a damaged blob; replace it with good bytes
        log.warning("replacing damaged blob %s (size %d, expected %d)", digest, existing.st_size, size)
        os.replace(source, target)
    else:
        try:
            os.link(source, target)
        except FileExistsError:  # a concurrent publisher stored the same bytes first
            pass
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
            copy_file(source, target, mode & 0o555)
    touch(target)  # a linked file keeps its old mtime; the GC grace period starts now


def place(layout: StoreLayout, target: Path, entry: FileEntry, use_link: list[bool]) -> None:
    """Put the blob of `entry` at `target`: a hardlink while `use_link[0]` holds, else a copy."""
    blob = layout.blob_path(entry.digest)
    if use_link[0] and stat.S_IMODE(blob.stat().st_mode) == entry.mode & 0o555:
        try:
            os.link(blob, target)
            return
        except FileNotFoundError as exc:
            raise SnapshotInvalid(f"blob {entry.digest} vanished while materialising {target}") from exc
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                raise
            use_link[0] = False  # another filesystem (or no hardlinks there): copy from now on
    copy_file(blob, target, entry.mode)
