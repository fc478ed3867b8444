"""Where things live in a store: its directories, file names, snapshot ids, and the store-wide flock.

Publishers hold `<root>/.lock` shared while they link blobs and rename their manifest into place; GC holds
it exclusively while it reads every manifest and removes what none references. On NFS, Linux emulates
`flock` with NFS byte-range locks, which hold across clients.

Root acts on what the store holds, so nothing inside it is trusted to be what its name says: the store's
own directories must be real directories (a symbolic link there is refused, never followed), and state
files are read through `fileio.read_regular_file` with the bounds below.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from warmstart.snapshot.manifest import SNAPSHOT_ID_PATTERN, SnapshotError, digest_hex

MANIFEST_FILE = "manifest.json"
SIGNATURE_FILE = "manifest.sig"
OWNER_FILE = "owner.json"
LOCK_FILE = ".lock"
DELETING_SUFFIX = ".deleting"
MAX_MANIFEST_BYTES = 16 << 20
MAX_SIGNATURE_BYTES = 64 << 10
MAX_OWNER_BYTES = 64 << 10


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
        """Create the store's directories where missing; SnapshotError when one is not a real directory."""
        self.root.mkdir(parents=True, exist_ok=True)
        for directory in (self.blobs_dir.parent, self.blobs_dir, self.snapshots_dir, self.staging_dir):
            with contextlib.suppress(FileExistsError):
                directory.mkdir()
        self.check_directories()

    def check_directories(self) -> None:
        """SnapshotError unless each of the store's directories that exists is a real directory."""
        for directory in (self.blobs_dir.parent, self.blobs_dir, self.snapshots_dir, self.staging_dir):
            try:
                mode = directory.lstat().st_mode
            except FileNotFoundError:
                continue
            if not stat.S_ISDIR(mode):
                raise SnapshotError(
                    f"store directory {directory} is not a directory (a symbolic link there is refused)"
                )

    def require_root(self) -> None:
        if not self.root.is_dir():
            raise SnapshotError(
                f"snapshot store {self.root} does not exist (check --store / WARMSTART_STORE)"
            )
        self.check_directories()

    @contextlib.contextmanager
    def lock(self, *, exclusive: bool) -> Iterator[None]:
        self.ensure()
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(self.root / LOCK_FILE, flags, 0o644)
        except OSError as exc:
            raise SnapshotError(f"cannot open the store's lock file {self.root / LOCK_FILE}: {exc}") from exc
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise SnapshotError(f"the store's lock file {self.root / LOCK_FILE} is not a regular file")
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)  # closing releases the lock
