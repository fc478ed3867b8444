"""The snapshot manifest: what a snapshot holds and what it is valid for, checked field by field.

`manifest.json` is written once at publish and signed over its exact bytes. Parsing checks every field,
so a malformed manifest is refused with a reason naming the field, before any path in it is used.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from typing import Any

from warmstart.api.capture_record import CaptureRecord
from warmstart.api.identity import SnapshotIdentity
from warmstart.host.fileio import UnsafeInput, loads_json
from warmstart.snapshot.hashing import CHUNK_HASHES

MANIFEST_SCHEMA = "warmstart.dev/snapshot-manifest/v2"  # v2: chunk digests name their hash
READABLE_SCHEMAS = ("warmstart.dev/snapshot-manifest/v1", MANIFEST_SCHEMA)
CHUNK_HASH_NAMES = tuple(CHUNK_HASHES)
DIGEST_PREFIX = "sha256:"
_HEX64 = re.compile(r"[0-9a-f]{64}")
DIGEST_PATTERN = re.compile(r"sha256:([0-9a-f]{64})")
CREATED_FORMAT = "%Y-%m-%dT%H:%M:%S.%fZ"
SNAPSHOT_ID_PATTERN = re.compile(r"[0-9a-f]{12}-[0-9]{14}-[0-9a-f]{6}")


class SnapshotError(Exception):
    """Base of the store's errors."""


class SnapshotInvalid(SnapshotError):
    """A snapshot failed verification; `reason` names the file or field at fault."""

    def __init__(self, reason: str, *, snapshot_id: str | None = None) -> None:
        self.reason = reason
        self.snapshot_id = snapshot_id
        super().__init__(f"snapshot {snapshot_id}: {reason}" if snapshot_id else reason)


class IdentityMismatch(SnapshotInvalid):
    """The snapshot was taken for another identity; `mismatches` lists each differing field."""

    def __init__(self, mismatches: list[str], *, snapshot_id: str | None = None) -> None:
        self.mismatches = mismatches
        super().__init__("identity mismatch: " + "; ".join(mismatches), snapshot_id=snapshot_id)


def digest_hex(digest: str) -> str:
    """The hex part of a `sha256:<hex>` digest; ValueError naming the digest when it is malformed."""
    found = DIGEST_PATTERN.fullmatch(digest) if isinstance(digest, str) else None
    if found is None:
        raise ValueError(f"digest {digest!r} must look like 'sha256:<64 lowercase hex>'")
    return found.group(1)


def check_relative_path(path: str) -> str:
    """Return `path` when it is a safe relative POSIX path inside a snapshot; ValueError saying why not."""
    if not isinstance(path, str) or path == "":
        raise ValueError("file path is empty")
    if "\\" in path:
        raise ValueError(f"file path {path!r} contains a backslash")
    if "\x00" in path:
        raise ValueError(f"file path {path!r} contains a NUL byte")
    if path.startswith("/"):
        raise ValueError(f"file path {path!r} is absolute")
    parts = path.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"file path {path!r} has an empty, '.' or '..' component")
    return path


def check_prefix(prefix: str) -> str:
    """A materialisation prefix such as `criu/` or `criu`: a safe relative path, returned with a slash."""
    stripped = prefix.rstrip("/")
    try:
        check_relative_path(stripped)
    except ValueError as exc:
        raise ValueError(f"prefix {prefix!r} is not a relative path inside the snapshot: {exc}") from exc
    return stripped + "/"


MIN_CHUNK_SIZE = 1 << 20


@dataclass(frozen=True)
class FileEntry:
    """One file: its blob's digest, size and mode, and for large files the digest of each chunk.

    SHA-256 of one stream cannot be split across cores, so a large file also records the hex digest of
    every `chunk_size` bytes (`chunk_hash`: BLAKE3, or SHA-256 in v1 manifests): verification hashes those
    chunks in parallel. The chunk digests, signed with the manifest, pin the content as firmly as the
    whole-file digest that names the blob.
    """

    digest: str
    size: int
    mode: int
    chunk_size: int = 0
    chunks: tuple[str, ...] = ()
    chunk_hash: str = "sha256"

    def __post_init__(self) -> None:
        if not self.chunks:  # nothing the chunk hash applies to: one spelling of such an entry
            object.__setattr__(self, "chunk_hash", "sha256")

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"digest": self.digest, "size": self.size, "mode": self.mode}
        if self.chunks:
            data["chunk_size"] = self.chunk_size
            data["chunks"] = list(self.chunks)
            data["chunk_hash"] = self.chunk_hash
        return data


@dataclass(frozen=True)
class Manifest:
    id: str
    created: str  # ISO 8601 UTC with microseconds, e.g. 2026-01-02T03:04:05.123456Z
    identity: SnapshotIdentity
    identity_hash: str
    files: dict[str, FileEntry]
    timings: dict[str, float] = field(default_factory=dict)
    node: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)  # the capture record, as signed

    @cached_property
    def record(self) -> CaptureRecord:
        """The capture record `meta` holds (checked when a manifest is parsed)."""
        return CaptureRecord.of(self.meta)

    @property
    def size(self) -> int:
        """Bytes of the snapshot's files."""
        return sum(entry.size for entry in self.files.values())

    def digests(self) -> set[str]:
        """Every blob the snapshot needs."""
        return {entry.digest for entry in self.files.values()}

    def representatives(self) -> dict[str, FileEntry]:
        """One entry per distinct blob, the first by path (entries of one digest hold the same bytes)."""
        chosen: dict[str, FileEntry] = {}
        for path in sorted(self.files):
            chosen.setdefault(self.files[path].digest, self.files[path])
        return chosen

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": MANIFEST_SCHEMA,
            "id": self.id,
            "created": self.created,
            "identity": self.identity.to_dict(),
            "identity_hash": self.identity_hash,
            "files": {path: self.files[path].to_dict() for path in sorted(self.files)},
            "timings": self.timings,
            "node": self.node,
            "meta": self.meta,
        }

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True, indent=2).encode() + b"\n"

    @classmethod
    def from_bytes(cls, raw: bytes) -> Manifest:
        """Parse and check every field; SnapshotInvalid naming the field when something is wrong."""
        try:
            data = loads_json(raw, "manifest.json")
        except UnsafeInput as exc:
            raise SnapshotInvalid(str(exc)) from exc
        if not isinstance(data, dict):
            raise SnapshotInvalid("manifest.json must hold a JSON object")
        if data.get("schema") not in READABLE_SCHEMAS:
            raise SnapshotInvalid(
                f"manifest field 'schema' is {data.get('schema')!r}, expected one of "
                + ", ".join(repr(schema) for schema in READABLE_SCHEMAS)
            )
        snapshot_id = _string_field(data, "id")
        if not SNAPSHOT_ID_PATTERN.fullmatch(snapshot_id):
            raise SnapshotInvalid(f"manifest field 'id' {snapshot_id!r} is not a snapshot id")
        created = _string_field(data, "created")
        try:
            datetime.strptime(created, CREATED_FORMAT)
        except ValueError as exc:
            raise SnapshotInvalid(
                f"manifest field 'created' {created!r} is not YYYY-MM-DDTHH:MM:SS.ffffffZ"
            ) from exc
        identity_data = data.get("identity")
        if not isinstance(identity_data, dict):
            raise SnapshotInvalid("manifest field 'identity' is missing or not an object")
        try:
            identity = SnapshotIdentity.from_dict(identity_data)
        except (TypeError, ValueError) as exc:
            raise SnapshotInvalid(f"manifest field 'identity' is invalid: {exc}") from exc
        identity_hash = _string_field(data, "identity_hash")
        if data.get("refs"):
            raise SnapshotInvalid(
                "manifest field 'refs' is not supported: every blob must be listed in 'files'"
            )
        manifest = cls(
            id=snapshot_id,
            created=created,
            identity=identity,
            identity_hash=identity_hash,
            files=_entries(data, "files"),
            timings=_timings(data),
            node=_object_field(data, "node"),
            meta=_object_field(data, "meta"),
        )
        try:
            manifest.record  # noqa: B018 (parsed here, so a wrong type is refused with the manifest)
        except ValueError as exc:
            raise SnapshotInvalid(f"manifest field 'meta': {exc}") from exc
        return manifest


def _string_field(data: dict[str, Any], name: str) -> str:
    value = data.get(name)
    if not isinstance(value, str) or not value:
        raise SnapshotInvalid(f"manifest field {name!r} is missing or not a non-empty string")
    return value


def _object_field(data: dict[str, Any], name: str) -> dict[str, Any]:
    value = data.get(name, {})
    if not isinstance(value, dict):
        raise SnapshotInvalid(f"manifest field {name!r} must be an object")
    return value


def _timings(data: dict[str, Any]) -> dict[str, float]:
    timings = _object_field(data, "timings")
    for name, value in timings.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise SnapshotInvalid(f"manifest field 'timings.{name}' must be a number of seconds")
    return {name: float(value) for name, value in timings.items()}


def _entries(data: dict[str, Any], name: str) -> dict[str, FileEntry]:
    raw = data.get(name)
    if not isinstance(raw, dict):
        raise SnapshotInvalid(f"manifest field {name!r} is missing or not an object")
    entries: dict[str, FileEntry] = {}
    for path, entry in raw.items():
        try:
            check_relative_path(path)
        except ValueError as exc:
            raise SnapshotInvalid(f"manifest {name}: {exc}") from exc
        entries[path] = _entry(name, path, entry)
    return entries


def _entry(section: str, path: str, entry: Any) -> FileEntry:
    where = f"manifest {section}[{path!r}]"
    if not isinstance(entry, dict):
        raise SnapshotInvalid(f"{where} must be an object with digest, size and mode")
    try:
        digest_hex(entry.get("digest"))
    except ValueError as exc:
        raise SnapshotInvalid(f"{where}: {exc}") from exc
    size, mode = entry.get("size"), entry.get("mode", 0o444)
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise SnapshotInvalid(f"{where}: size must be a non-negative integer, got {size!r}")
    if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o777:
        raise SnapshotInvalid(f"{where}: mode must be an integer permission mask (0..0o777), got {mode!r}")
    chunk_size, chunks = _chunks(where, entry, size)
    chunk_hash = entry.get("chunk_hash", "sha256")
    if chunk_hash not in CHUNK_HASH_NAMES:
        raise SnapshotInvalid(
            f"{where}: chunk_hash must be one of {', '.join(CHUNK_HASH_NAMES)}, got {chunk_hash!r}"
        )
    return FileEntry(
        digest=entry["digest"], size=size, mode=mode, chunk_size=chunk_size, chunks=chunks,
        chunk_hash=chunk_hash,
    )  # fmt: skip


def _chunks(where: str, entry: dict[str, Any], size: int) -> tuple[int, tuple[str, ...]]:
    if "chunks" not in entry and "chunk_size" not in entry:
        return 0, ()
    chunk_size, chunks = entry.get("chunk_size"), entry.get("chunks")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < MIN_CHUNK_SIZE:
        raise SnapshotInvalid(f"{where}: chunk_size must be an integer of at least {MIN_CHUNK_SIZE}")
    expected = -(-size // chunk_size)
    if not isinstance(chunks, list) or len(chunks) != expected:
        raise SnapshotInvalid(f"{where}: chunks must list {expected} digests for {size} bytes")
    for index, chunk in enumerate(chunks):
        if not isinstance(chunk, str) or not _HEX64.fullmatch(chunk):
            raise SnapshotInvalid(f"{where}: chunks[{index}] is not 64 lowercase hex digits")
    return chunk_size, tuple(chunks)
