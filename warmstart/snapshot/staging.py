"""Staging: a snapshot being written, its owner record, and when an abandoned one is stale.

`<root>/staging/<uuid>/` holds `owner.json` (pid, its start time, host and boot), `files/` (the caller's)
and, while publishing, `snapshot/`. GC removes a staging directory once its owner process is gone, or, when
the owner runs elsewhere, once nothing in it changed for a while.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import stat
import uuid
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from warmstart import procinfo
from warmstart.fileio import UnsafeInput, read_json_file, write_new_file
from warmstart.identity import SnapshotIdentity
from warmstart.snapshot.catalog import Snapshot
from warmstart.snapshot.layout import DELETING_SUFFIX, MAX_OWNER_BYTES, OWNER_FILE, StoreLayout
from warmstart.snapshot.manifest import CREATED_FORMAT, SnapshotError, check_relative_path

if TYPE_CHECKING:
    from warmstart.snapshot.signing import Signer


def utc_now() -> datetime:
    return datetime.now(UTC)


def this_host() -> str:
    """Hostname plus boot id: a pid means something only on the same host since the same boot."""
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot_id = ""
    return f"{socket.gethostname()}/{boot_id}"


def create_staging_root(layout: StoreLayout) -> Path:
    """A staging directory and its owner record, made under the shared lock: GC never sees it bare."""
    owner = {
        "pid": os.getpid(),
        "pid_start": procinfo.start_ticks(os.getpid()),
        "host": this_host(),
        "created": utc_now().strftime(CREATED_FORMAT),
    }
    with layout.lock(exclusive=False):
        root = layout.staging_dir / uuid.uuid4().hex
        root.mkdir()
        write_new_file(root / OWNER_FILE, json.dumps(owner).encode())
        (root / "files").mkdir()
    return root


def newest_mtime(path: Path) -> float:
    """The latest mtime of `path` and everything under it (a capture writing anywhere keeps it fresh)."""
    newest = path.lstat().st_mtime
    for directory, _, names in os.walk(path):
        for name in [*names, "."]:
            with contextlib.suppress(FileNotFoundError):
                newest = max(newest, os.lstat(os.path.join(directory, name)).st_mtime)
    return newest


def staging_is_stale(entry: Path, here: str, now: float, older_than: float) -> tuple[bool, str]:
    """Whether GC may remove the staging entry, and why."""
    if entry.name.endswith(DELETING_SUFFIX):
        return True, "interrupted delete"
    if not stat.S_ISDIR(entry.lstat().st_mode):
        return True, "not a directory"
    try:
        owner = read_json_file(entry / OWNER_FILE, MAX_OWNER_BYTES)
    except (OSError, UnsafeInput):
        owner = None
    if isinstance(owner, dict) and owner.get("host") == here and isinstance(owner.get("pid"), int):
        if procinfo.same_process(owner["pid"], owner.get("pid_start")):
            return False, f"owner pid {owner['pid']} is running"
        return True, f"owner pid {owner['pid']} is gone"
    age = now - newest_mtime(entry)
    if age > older_than:
        return True, f"untouched for {age:.0f}s"
    return False, f"touched {age:.0f}s ago"


class Staging:
    """A snapshot being written: the caller fills `dir`, then calls `publish(signer)` once.

    Used as a context manager; leaving it without publishing (or on an exception) removes everything.
    """

    def __init__(
        self,
        layout: StoreLayout,
        root: Path,
        identity: SnapshotIdentity,
        node: dict[str, Any] | None,
        meta: dict[str, Any] | None,
        *,
        hash_workers: int | None,
        chunk_size: int,
    ) -> None:
        self.layout = layout
        self.root = root
        self.dir = root / "files"
        self.identity = identity
        self.node: dict[str, Any] = dict(node or {})
        self.meta: dict[str, Any] = dict(meta or {})
        self.timings: dict[str, float] = {}
        self.hash_workers = hash_workers
        self.chunk_size = chunk_size
        self.snapshot: Snapshot | None = None

    def __enter__(self) -> Staging:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.discard()

    def discard(self) -> None:
        """Remove the staging directory (what was published stays published)."""
        shutil.rmtree(self.root, ignore_errors=True)

    def publish(self, signer: Signer) -> Snapshot:
        from warmstart.snapshot.publish import publish_staging

        if self.snapshot is not None:
            raise SnapshotError(f"staging {self.root.name} was published already as {self.snapshot.id}")
        self.snapshot = publish_staging(self, signer)
        self.discard()
        return self.snapshot

    def collect_files(self) -> dict[str, Path]:
        """Relative path -> staged file; only regular files (symlinks and devices are refused)."""
        files: dict[str, Path] = {}
        for path in sorted(self.dir.rglob("*")):
            relative = path.relative_to(self.dir).as_posix()
            mode = path.lstat().st_mode
            if stat.S_ISDIR(mode):
                continue
            if not stat.S_ISREG(mode):
                raise SnapshotError(
                    f"staged {relative!r} is not a regular file (symlinks and devices are refused)"
                )
            try:
                check_relative_path(relative)
            except ValueError as exc:
                raise SnapshotError(f"staged file cannot be stored: {exc}") from exc
            files[relative] = path
        if not files:
            raise SnapshotError(f"nothing to publish: {self.dir} holds no files")
        return files
