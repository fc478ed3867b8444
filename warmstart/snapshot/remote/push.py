"""Push: a snapshot published in the local store, uploaded so that the bucket never lists it half-there.

Order: every blob (each once: one the bucket holds under its key with the right size is read back and hashed,
and skipped only when its bytes are the blob's; anything else there is uploaded again, repairing the
bucket's copy), then `manifest.json`, then `manifest.sig`, which is
what listing looks for. An upload cut anywhere before the signature leaves blobs and perhaps a manifest,
never a snapshot; the next push of it skips what arrived. After the signature, every blob is looked up once
more and one that went missing meanwhile (a GC that ran in between) is uploaded again.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from pathlib import Path

from warmstart.host.parallel import parallel_map
from warmstart.snapshot.catalog import parse_manifest, read_manifest_bytes, read_signature_bytes
from warmstart.snapshot.layout import MAX_SIGNATURE_BYTES
from warmstart.snapshot.manifest import SnapshotError
from warmstart.snapshot.remote.object_keys import Keys
from warmstart.snapshot.remote.objects import ObjectClient, ObjectMissing
from warmstart.snapshot.remote.stats import Progress, ProgressHook, TransferStats
from warmstart.snapshot.signing import Verifier
from warmstart.snapshot.store import SnapshotStore


@dataclass
class PushResult:
    snapshot_id: str
    stats: TransferStats
    uploaded: list[str] = field(default_factory=list)  # digests
    skipped: list[str] = field(default_factory=list)
    already_published: bool = False


@dataclass
class _Push:
    client: ObjectClient
    keys: Keys
    progress: ProgressHook
    result: PushResult
    lock: threading.Lock = field(default_factory=threading.Lock)

    def upload(self, digest: str, size: int, path: Path, *, repaired: bool = False) -> None:
        self.client.put_file(self.keys.blob(digest), path, size)
        with self.lock:
            stats = self.result.stats
            stats.bytes_transferred += size
            stats.objects_repaired += int(repaired)
            self.result.uploaded.append(digest)
        self.progress(Progress("blob-uploaded", self.result.snapshot_id, digest, size))

    def skip(self, digest: str, size: int) -> None:
        with self.lock:
            stats = self.result.stats
            stats.bytes_skipped += size
            stats.objects_skipped += 1
            self.result.skipped.append(digest)
        self.progress(Progress("blob-skipped", self.result.snapshot_id, digest, size))

    def push_blob(self, digest: str, size: int, path: Path) -> None:
        """Upload the blob unless the bucket has it: same key, size and content (read back and hashed,
        whatever its size: the key and size of an object say nothing of its bytes, and one trusted by them
        would never be repaired)."""
        existing = self.client.head(self.keys.blob(digest))
        if existing is None or existing.size != size:
            self.upload(digest, size, path, repaired=existing is not None)
        elif not self.remote_content_matches(digest, size):
            self.upload(digest, size, path, repaired=True)
        else:
            self.skip(digest, size)

    def remote_content_matches(self, digest: str, size: int) -> bool:
        hasher = hashlib.sha256()
        try:
            seen = self.client.read_into(self.keys.blob(digest), hasher.update, size)
        except ObjectMissing:
            return False
        return seen == size and "sha256:" + hasher.hexdigest() == digest

    def commit(self, snapshot_id: str, raw: bytes, signature: bytes) -> bool:
        """Upload the manifest, then its signature (the step that publishes); False when the bucket had
        this snapshot already."""
        signature_key = self.keys.signature(snapshot_id)
        if self.client.head(signature_key) is not None:
            theirs = self.client.get_bytes(signature_key, MAX_SIGNATURE_BYTES)
            if theirs != signature:
                raise SnapshotError(
                    f"snapshot {snapshot_id} is in {self.client.where} with another signature; "
                    "delete it there to push this one"
                )
            return False
        self.client.put_bytes(self.keys.manifest(snapshot_id), raw)
        self.progress(Progress("manifest-uploaded", snapshot_id))
        self.client.put_bytes(signature_key, signature, create=True)
        return True

    def repair_missing(self, blobs: dict[str, tuple[int, Path]], workers: int) -> None:
        """Upload again any blob that left the bucket since it was checked."""

        def check(item: tuple[str, tuple[int, Path]]) -> None:
            digest, (size, path) = item
            existing = self.client.head(self.keys.blob(digest))
            if existing is None or existing.size != size:
                self.upload(digest, size, path, repaired=True)

        parallel_map(check, list(blobs.items()), workers=workers)


def push_snapshot(
    client: ObjectClient,
    keys: Keys,
    store: SnapshotStore,
    snapshot_id: str,
    *,
    progress: ProgressHook,
    verifier: Verifier | None,
) -> PushResult:
    """Upload the local snapshot `snapshot_id` (verified first, signature and every blob, with `verifier`)."""
    if verifier is not None:
        store.verify(snapshot_id, verifier)
    layout = store.layout
    raw, signature = read_manifest_bytes(layout, snapshot_id), read_signature_bytes(layout, snapshot_id)
    manifest = parse_manifest(raw, snapshot_id)
    result = PushResult(snapshot_id, TransferStats())
    job = _Push(client, keys, progress, result)
    # digest -> (size, blob file) of every distinct blob the snapshot names
    blobs = {entry.digest: (entry.size, store.blob_path(entry.digest)) for entry in manifest.files.values()}
    workers = client.config.concurrency
    largest_first = sorted(blobs.items(), key=lambda item: item[1][0], reverse=True)
    parallel_map(lambda item: job.push_blob(item[0], *item[1]), largest_first, workers=workers)
    progress(Progress("blobs-done", snapshot_id))
    result.already_published = not job.commit(snapshot_id, raw, signature)
    job.repair_missing(blobs, workers)
    progress(Progress("published", snapshot_id))
    return result
