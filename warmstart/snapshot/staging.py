"""Staging: a snapshot being written, published once (`publish.py`) or removed.

`<root>/staging/<uuid>/` holds `owner.json` (pid, its start time, host and boot: `staging_owner.py`),
`files/` (the caller's) and, while publishing, `snapshot/`. GC removes a staging directory once its owner
process is gone, or, when the owner runs elsewhere, once nothing in it changed for a while.
"""

from __future__ import annotations

import shutil
import stat
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from warmstart.api.identity import SnapshotIdentity
from warmstart.snapshot.catalog import Snapshot
from warmstart.snapshot.manifest import SnapshotError, check_relative_path
from warmstart.snapshot.publish import publish_staging
from warmstart.snapshot.staging_owner import create_staging_root

if TYPE_CHECKING:
    from warmstart.snapshot.signing import Signer
    from warmstart.snapshot.store import SnapshotStore


class Staging:
    """A snapshot being written: the caller fills `dir`, then calls `publish(signer)` once.

    Used as a context manager; leaving it without publishing (or on an exception) removes everything.
    """

    def __init__(
        self,
        store: SnapshotStore,
        identity: SnapshotIdentity,
        node: dict[str, Any] | None,
        meta: dict[str, Any] | None,
    ) -> None:
        self.layout = store.layout
        self.root = create_staging_root(store.layout)
        self.dir = self.root / "files"
        self.identity = identity
        self.node: dict[str, Any] = dict(node or {})
        self.meta: dict[str, Any] = dict(meta or {})
        self.timings: dict[str, float] = {}
        self.hash_workers = store.hash_workers
        self.chunk_size = store.chunk_size
        self.records = store.records  # where the published blobs, hashed here, are recorded as verified
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
