"""Records of the blobs this user hashed and found right, so that a restore does not hash them again.

A record says: the blob of this digest (and chunk list) was read and matched while it had this inode, size
and mtime. It is believed only while nobody but this user or root could have changed the blob's bytes
without changing its mtime: the blob has no write bit and belongs to this user or root, the records'
directory and the record belong to this user and nobody else may write them, and the blob lives on a local
filesystem (a network filesystem's attributes are its server's word, and another client's write may not
show in them yet). Any write through the filesystem moves the mtime, so a tampered blob is hashed again and
refused; damage beneath the filesystem (the disk's own) is caught only by hashing: `warmstart snapshot
verify`, or WARMSTART_VERIFIED_RECORDS=0 for every restore.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from warmstart.host.fileio import atomic_file
from warmstart.snapshot.manifest import FileEntry, digest_hex

RECORDS_DIR = "verified"
RECORDS_ENV = "WARMSTART_VERIFIED_RECORDS"
MAX_RECORD_BYTES = 256
LOCAL_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "zfs", "tmpfs", "overlay"})
MOUNTINFO = Path("/proc/self/mountinfo")


def records_wanted() -> bool:
    """Whether restores may skip blobs they verified before (WARMSTART_VERIFIED_RECORDS=0 says no)."""
    return os.environ.get(RECORDS_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


@dataclass(frozen=True)
class BlobState:
    """What a record pins of a blob: while these are unchanged, so are its bytes (see the module)."""

    device: int
    inode: int
    size: int
    mtime_ns: int

    def line(self) -> str:
        return f"{self.device} {self.inode} {self.size} {self.mtime_ns}\n"


class VerifiedRecords:
    """The records of one store (`<root>/verified/`), for this process's user."""

    def __init__(self, root: Path, *, mountinfo: Path = MOUNTINFO) -> None:
        self.directory = root / RECORDS_DIR
        self.mountinfo = mountinfo
        self.uid = os.geteuid()

    def state(self, blob: Path) -> BlobState | None:
        """The blob's state when a record of it could be believed (see the module); None otherwise."""
        try:
            info = blob.lstat()
        except OSError:
            return None
        trusted = (
            stat.S_ISREG(info.st_mode)
            and info.st_mode & 0o222 == 0
            and info.st_uid in (self.uid, 0)
            and filesystem_type(info.st_dev, self.mountinfo) in LOCAL_FILESYSTEMS
        )
        return BlobState(info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns) if trusted else None

    def holds(self, entry: FileEntry, state: BlobState) -> bool:
        """Whether a believable record says the blob, in `state`, matched `entry` when it was hashed."""
        try:
            fd = self._open_directory()
        except OSError:
            return False
        try:
            return _read_own_record(fd, record_name(entry), self.uid) == state.line()
        finally:
            os.close(fd)

    def remember(self, entry: FileEntry, blob: Path, state: BlobState | None = None) -> None:
        """Record that the blob matched `entry` as it was in `state` (by default as it is now, its bytes
        just hashed by this process); nothing when it changed since, or when the record cannot be written:
        the next restore hashes it again."""
        now = self.state(blob)
        if now is None or (state is not None and now != state):
            return
        with contextlib.suppress(OSError):
            with contextlib.suppress(FileExistsError):
                os.mkdir(self.directory, 0o700)
            fd = self._open_directory()
            try:
                with atomic_file(Path(record_name(entry)), 0o600, dir_fd=fd) as out:
                    out.write(now.line().encode())
            finally:
                os.close(fd)

    def prune(self, existing_digests: set[str]) -> None:
        """Remove the records of blobs that are gone (hex digests of the blobs still stored)."""
        with contextlib.suppress(OSError):
            fd = self._open_directory()
            try:
                for name in os.listdir(fd):
                    if name.split("-", 1)[0] not in existing_digests:
                        with contextlib.suppress(OSError):
                            os.unlink(name, dir_fd=fd)
            finally:
                os.close(fd)

    def _open_directory(self) -> int:
        """The records' directory, when it is a real directory of this user that nobody else may write."""
        fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        info = os.fstat(fd)
        if info.st_uid != self.uid or info.st_mode & 0o022:
            os.close(fd)
            raise OSError(errno.EPERM, "records directory not this user's alone", str(self.directory))
        return fd


def record_name(entry: FileEntry) -> str:
    """`<blob hex>-<digest of the chunk list>`: a record is of one blob as one manifest's entry pins it."""
    chunking = f"{entry.chunk_size} {entry.chunk_hash} {' '.join(entry.chunks)}".encode()
    return f"{digest_hex(entry.digest)}-{hashlib.sha256(chunking).hexdigest()[:16]}"


def _read_own_record(directory_fd: int, name: str, uid: int) -> str | None:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=directory_fd)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != uid or info.st_mode & 0o022:
            return None
        return os.read(fd, MAX_RECORD_BYTES).decode(errors="replace")
    finally:
        os.close(fd)


@functools.lru_cache(maxsize=64)
def filesystem_type(device: int, mountinfo: Path = MOUNTINFO) -> str | None:
    """The type of the filesystem mounted from `device` (an st_dev), from the mount table; None if unknown."""
    wanted = f"{os.major(device)}:{os.minor(device)}"
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields, _, rest = line.partition(" - ")
        parts = fields.split()
        if len(parts) > 2 and parts[2] == wanted and rest:
            return rest.split()[0]
    return None
