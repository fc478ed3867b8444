"""Where things live in a store: its directories, file names, snapshot ids, and the store-wide flock.

Publishers hold `<root>/.lock` shared while they link blobs and rename their manifest into place; GC holds
it exclusively while it reads every manifest and removes what none references. On NFS, Linux emulates
`flock` with NFS byte-range locks, which hold across clients.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from warmstart.snapshot.manifest import SNAPSHOT_ID_PATTERN, SnapshotError, digest_hex

MANIFEST_FILE = "manifest.json"
SIGNATURE_FILE = "manifest.sig"
OWNER_FILE = "owner.json"
LOCK_FILE = ".lock"
DELETING_SUFFIX = ".deleting"


class SnapshotNotFound(SnapshotError, LookupError):
    """No snapshot with that id in this store."""


@dataclass(frozen=True)
class StoreLayout:
    root: Path

    @property
    def blobs_dir(self) -> Path:
        return self.root / "blobs" / "sha256"

    @property
    def snapshots_dir(self) -> Path:
        return self.root / "snapshots"

    @property
    def staging_dir(self) -> Path:
        return self.root / "staging"

    def blob_path(self, digest: str) -> Path:
        return self.blobs_dir / digest_hex(digest)

    def snapshot_dir(self, snapshot_id: str) -> Path:
        """The directory of `snapshot_id`; SnapshotNotFound when it is not a snapshot id at all."""
        if not isinstance(snapshot_id, str) or not SNAPSHOT_ID_PATTERN.fullmatch(snapshot_id):
            raise SnapshotNotFound(
                f"{snapshot_id!r} is not a snapshot id (expected <12 hex>-<yyyymmddHHMMSS>-<6 hex>)"
            )
        return self.snapshots_dir / snapshot_id

    def ensure(self) -> None:
        for directory in (self.blobs_dir, self.snapshots_dir, self.staging_dir):
            directory.mkdir(parents=True, exist_ok=True)

    def require_root(self) -> None:
        if not self.root.is_dir():
            raise SnapshotError(
                f"snapshot store {self.root} does not exist (check --store / WARMSTART_STORE)"
            )

    @contextlib.contextmanager
    def lock(self, *, exclusive: bool) -> Iterator[None]:
        self.ensure()
        fd = os.open(self.root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)  # closing releases the lock
