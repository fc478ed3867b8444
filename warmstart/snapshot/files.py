"""Durable file writes shared by the store and its key tools."""

from __future__ import annotations

import os
from pathlib import Path


def write_new_file(path: Path, content: bytes, mode: int = 0o644) -> None:
    """Create `path` (never overwrite: O_EXCL) with `content`, fsync'd before returning."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.write(fd, content)
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
