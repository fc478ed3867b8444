"""Pull: a snapshot fetched from the bucket into the node's local store, trusted only once verified.

1. `manifest.sig` and `manifest.json` are read (each bounded in size) and the signature, id and identity are
   checked before any blob is asked for: a forged manifest costs two small reads.
2. The blobs the local store lacks are fetched into a staging directory of the local store, in parallel and
   in pieces: a large blob's signed chunks each get a ranged GET whose bytes are hashed as they arrive and
   compared with the chunk's digest; a blob without chunks is hashed whole (SHA-256, the digest naming it).
   A piece longer or shorter than it should be, or a digest that does not match, refuses the pull.
3. The verified files are linked into `blobs/sha256/` and the manifest renamed into `snapshots/<id>`
   (`adopt`): nothing of a refused or interrupted pull is ever published, and its staging directory is
   removed.

A pull gives up within bounds: each request has the client's timeouts and retries, the first failure stops
the other threads from starting more pieces, and `timeout` bounds the whole pull: it is checked before each
piece starts and as each piece's bytes arrive, so a pull past it stops within one streamed chunk (or, when
the bytes stall, within the client's read timeout).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from warmstart.api.identity import SnapshotIdentity
from warmstart.host.fileio import NEW_FILE_FLAGS
from warmstart.host.parallel import parallel_map, share_among_threads
from warmstart.snapshot.adopt import BlobsMissing, adopt, check_signed_manifest
from warmstart.snapshot.blobs import existing_blob_of_size
from warmstart.snapshot.catalog import Snapshot, is_signed_snapshot_dir
from warmstart.snapshot.hashing import CHUNK_HASHES, chunk_ranges, hash_file
from warmstart.snapshot.layout import MAX_MANIFEST_BYTES, MAX_SIGNATURE_BYTES, SnapshotNotFound
from warmstart.snapshot.manifest import FileEntry, Manifest, SnapshotInvalid, digest_hex
from warmstart.snapshot.remote.cache import BlobHolds
from warmstart.snapshot.remote.object_keys import Keys
from warmstart.snapshot.remote.objects import (
    ObjectClient,
    ObjectMissing,
    ObjectShorter,
    ObjectTooLarge,
    RemoteUnavailable,
)
from warmstart.snapshot.remote.stats import Progress, ProgressHook, TransferStats
from warmstart.snapshot.signing import Verifier
from warmstart.snapshot.staging_owner import create_staging_root
from warmstart.snapshot.store import SnapshotStore
from warmstart.snapshot.verify import blobs_not_matching

MAX_ADOPT_ROUNDS = 2


@dataclass
class PullResult:
    snapshot: Snapshot
    stats: TransferStats
    fetched: list[str] = field(default_factory=list)  # digests fetched from the bucket
    cached: list[str] = field(default_factory=list)  # digests the local store had
    from_cache: bool = False  # the snapshot itself was in the local store: nothing was read remotely


@dataclass(frozen=True)
class Piece:
    """Bytes [start, start + length) of one blob, written at the same offset of its staging file."""

    digest: str
    path: Path
    start: int
    length: int
    expected: str | None  # hex digest of exactly these bytes, when one is signed for them
    algorithm: str = "sha256"
    whole: bool = False  # the whole object in one GET (no Range header)


def plan_pieces(entry: FileEntry, path: Path, part_size: int) -> list[Piece]:
    """How one blob is fetched: its signed chunks, or whole when small, or in unverified parts that are then
    hashed whole."""
    if entry.chunks:
        return [
            Piece(entry.digest, path, offset, length, expected, entry.chunk_hash)
            for (offset, length), expected in zip(
                chunk_ranges(entry.size, entry.chunk_size), entry.chunks, strict=True
            )
        ]
    if entry.size <= part_size:
        return [Piece(entry.digest, path, 0, entry.size, digest_hex(entry.digest), whole=True)]
    return [
        Piece(entry.digest, path, start, length, None)
        for start, length in chunk_ranges(entry.size, part_size)
    ]


@dataclass
class _Pull:
    client: ObjectClient
    keys: Keys
    store: SnapshotStore
    snapshot_id: str
    progress: ProgressHook
    deadline: float | None
    timeout: float | None
    result_stats: TransferStats = field(default_factory=TransferStats)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fetch(self, entries: list[FileEntry], files_dir: Path) -> dict[str, Path]:
        """Fetch and verify the blobs of `entries` into `files_dir`; digest -> verified file."""
        targets = {entry.digest: files_dir / digest_hex(entry.digest) for entry in entries}
        for entry in entries:
            _allocate(targets[entry.digest], entry.size)
        part_size = self.client.config.part_size
        pieces = [
            piece for entry in entries for piece in plan_pieces(entry, targets[entry.digest], part_size)
        ]
        pieces.sort(key=lambda piece: piece.length, reverse=True)
        threads = max(1, min(self.client.config.concurrency, len(pieces)))
        share_among_threads(self._fetch_all, iter(pieces), threads, name="pull")
        unchunked = [entry for entry in entries if not entry.chunks and entry.size > part_size]
        parallel_map(lambda entry: self._check_whole(entry, targets[entry.digest]), unchunked)
        parallel_map(_fsync, list(targets.values()))  # on disk before a blob name points at them
        for entry in entries:
            self.progress(Progress("blob-fetched", self.snapshot_id, entry.digest, entry.size))
        return targets

    def _fetch_all(self, pieces: Iterator[Piece]) -> None:
        for piece in pieces:
            self._check_deadline()
            self._fetch_piece(piece)

    def _check_deadline(self) -> None:
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise RemoteUnavailable(
                f"pull of {self.snapshot_id} from {self.client.where} did not finish within {self.timeout:g}s"
            )

    def _fetch_piece(self, piece: Piece) -> None:
        hasher = CHUNK_HASHES[piece.algorithm]() if piece.expected is not None else None
        fd = os.open(piece.path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        offset = piece.start

        def sink(view: memoryview) -> None:
            nonlocal offset
            self._check_deadline()  # the whole pull's bound, not only each piece's start
            _write_at(fd, view, offset)
            offset += len(view)
            if hasher is not None:
                hasher.update(view)

        try:
            byte_range = None if piece.whole else (piece.start, piece.start + piece.length)
            try:
                seen = self.client.read_into(self.keys.blob(piece.digest), sink, piece.length, byte_range)
            except ObjectMissing as exc:
                raise SnapshotInvalid(
                    f"blob {piece.digest} is missing from the object store", snapshot_id=self.snapshot_id
                ) from exc
            except ObjectShorter as exc:
                raise SnapshotInvalid(
                    f"blob {piece.digest} ends before byte {piece.start} in the object store "
                    "(truncated or altered object refused)",
                    snapshot_id=self.snapshot_id,
                ) from exc
        finally:
            os.close(fd)
        where = f"blob {piece.digest} bytes {piece.start}..{piece.start + piece.length - 1}"
        if seen != piece.length:
            raise SnapshotInvalid(
                f"{where}: the object store sent {seen} bytes where {piece.length} were expected "
                "(truncated or altered object refused)",
                snapshot_id=self.snapshot_id,
            )
        if hasher is not None and hasher.hexdigest() != piece.expected:
            raise SnapshotInvalid(
                f"{where} do not match their signed {piece.algorithm} digest "
                "(tampered or corrupted object refused)",
                snapshot_id=self.snapshot_id,
            )
        with self.lock:
            self.result_stats.bytes_transferred += piece.length
        self.progress(Progress("bytes-fetched", self.snapshot_id, piece.digest, piece.length))

    def _check_whole(self, entry: FileEntry, path: Path) -> None:
        if hash_file(path)[0] != entry.digest:
            raise SnapshotInvalid(
                f"blob {entry.digest} does not match its digest (tampered or corrupted object refused)",
                snapshot_id=self.snapshot_id,
            )


def pull_snapshot(
    client: ObjectClient,
    keys: Keys,
    store: SnapshotStore,
    snapshot_id: str,
    verifier: Verifier,
    *,
    expected_identity: SnapshotIdentity | None,
    progress: ProgressHook,
    verify_cached: bool,
    timeout: float | None,
    holds: BlobHolds,
) -> PullResult:
    """Fetch `snapshot_id` into the local store, verified (see the module's docstring); the blobs it names
    are in `holds` while it runs (the cache trim keeps those it finds cached)."""
    started = time.monotonic()
    layout = store.layout
    layout.ensure()
    if is_signed_snapshot_dir(layout.snapshots_dir / snapshot_id):
        snapshot = store.check_signature(snapshot_id, verifier, expected_identity)
        return PullResult(snapshot, TransferStats(), from_cache=True)
    deadline = None if timeout is None else started + timeout
    job = _Pull(client, keys, store, snapshot_id, progress, deadline, timeout)
    raw, signature, manifest = fetch_signed_manifest(client, keys, snapshot_id, verifier, expected_identity)
    progress(Progress("manifest-verified", snapshot_id))
    with holds.holding(manifest.digests()):
        result = _fetch_and_adopt(job, raw, signature, manifest, verify_cached)
    progress(Progress("published", snapshot_id))
    return result


def fetch_signed_manifest(
    client: ObjectClient,
    keys: Keys,
    snapshot_id: str,
    verifier: Verifier,
    expected_identity: SnapshotIdentity | None = None,
) -> tuple[bytes, bytes, Manifest]:
    """The bucket's manifest bytes, signature bytes and manifest, once `check_signed_manifest` passes."""
    try:
        signature = client.get_bytes(keys.signature(snapshot_id), MAX_SIGNATURE_BYTES)
        raw = client.get_bytes(keys.manifest(snapshot_id), MAX_MANIFEST_BYTES)
    except ObjectMissing as exc:
        raise SnapshotNotFound(f"no snapshot {snapshot_id} in the object store {client.where}") from exc
    except ObjectTooLarge as exc:
        raise SnapshotInvalid(f"refused: {exc}", snapshot_id=snapshot_id) from exc
    return raw, signature, check_signed_manifest(raw, signature, snapshot_id, verifier, expected_identity)


def _fetch_and_adopt(
    job: _Pull, raw: bytes, signature: bytes, manifest: Manifest, verify_cached: bool
) -> PullResult:
    store, layout = job.store, job.store.layout
    entries = manifest.representatives()
    wanted, replace = _what_to_fetch(store, entries, verify_cached)
    staging_root = create_staging_root(layout)
    fetched: dict[str, Path] = {}
    try:
        for _ in range(MAX_ADOPT_ROUNDS):
            fetched |= job.fetch([entries[digest] for digest in wanted], staging_root / "files")
            job.progress(Progress("blobs-done", job.snapshot_id))
            try:
                snapshot = adopt(
                    layout, staging_root, raw, signature, manifest, fetched, replace=frozenset(replace)
                )
                break
            except BlobsMissing as exc:  # a local GC took cached blobs meanwhile: fetch them too
                wanted = exc.digests
                shutil.rmtree(staging_root / "snapshot", ignore_errors=True)
        else:
            raise BlobsMissing(wanted)
    finally:
        shutil.rmtree(staging_root, ignore_errors=True)
    cached = sorted(set(entries) - set(fetched))
    stats = job.result_stats
    stats.objects_skipped = len(cached)
    stats.objects_repaired = len(replace)
    stats.bytes_skipped = sum(entries[digest].size for digest in cached)
    return PullResult(snapshot, stats, sorted(fetched), cached)


def _what_to_fetch(
    store: SnapshotStore, entries: dict[str, FileEntry], verify_cached: bool
) -> tuple[list[str], set[str]]:
    """The digests to fetch, and those among them whose local blob is damaged (to be replaced)."""
    layout = store.layout
    present = {
        digest for digest, entry in entries.items() if existing_blob_of_size(layout, digest, entry.size)
    }
    cached = [entries[digest] for digest in present]
    replace = blobs_not_matching(layout, cached, store.hash_workers) if verify_cached else set()
    return [digest for digest in entries if digest not in present or digest in replace], replace


def _allocate(path: Path, size: int) -> None:
    fd = os.open(path, NEW_FILE_FLAGS, 0o600)
    try:
        if size:
            os.ftruncate(fd, size)
    finally:
        os.close(fd)


def _write_at(fd: int, view: memoryview, offset: int) -> None:
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
