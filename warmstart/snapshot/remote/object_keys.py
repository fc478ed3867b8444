"""Object keys: the local store's layout under the bucket's prefix.

    <prefix>blobs/sha256/<hex>                 one object per blob, named by its content
    <prefix>snapshots/<id>/manifest.json       uploaded after every blob the manifest names
    <prefix>snapshots/<id>/manifest.sig        uploaded last: its presence is what publishes the snapshot

Keys that fit none of these (junk, another tool's files) are never read as the store's and never deleted.
"""

from __future__ import annotations

from dataclasses import dataclass

from warmstart.snapshot.layout import MANIFEST_FILE, SIGNATURE_FILE
from warmstart.snapshot.manifest import DIGEST_PATTERN, DIGEST_PREFIX, SNAPSHOT_ID_PATTERN, digest_hex

BLOBS = "blobs/sha256/"
SNAPSHOTS = "snapshots/"


@dataclass(frozen=True)
class Keys:
    prefix: str = ""  # empty, or ending in "/"

    @property
    def blobs(self) -> str:
        return self.prefix + BLOBS

    @property
    def snapshots(self) -> str:
        return self.prefix + SNAPSHOTS

    def blob(self, digest: str) -> str:
        return self.blobs + digest_hex(digest)

    def manifest(self, snapshot_id: str) -> str:
        return f"{self.snapshots}{snapshot_id}/{MANIFEST_FILE}"

    def signature(self, snapshot_id: str) -> str:
        return f"{self.snapshots}{snapshot_id}/{SIGNATURE_FILE}"

    def digest_of(self, key: str) -> str | None:
        """The digest a blob key names; None for anything else under the blobs prefix."""
        digest = DIGEST_PREFIX + key.removeprefix(self.blobs)
        return digest if key.startswith(self.blobs) and DIGEST_PATTERN.fullmatch(digest) else None

    def snapshot_file_of(self, key: str) -> tuple[str, str] | None:
        """(snapshot id, file name) of a manifest or signature key; None for anything else."""
        rest = key[len(self.snapshots) :] if key.startswith(self.snapshots) else ""
        snapshot_id, _, name = rest.partition("/")
        if SNAPSHOT_ID_PATTERN.fullmatch(snapshot_id) and name in (MANIFEST_FILE, SIGNATURE_FILE):
            return snapshot_id, name
        return None
