"""The snapshot store: content-addressed blobs, signed manifests, atomic publish, verification, GC.

Layout on a plain directory (a local disk, or an NFS-backed RWX volume shared by nodes)::

    <root>/blobs/sha256/<hex>            immutable file contents, read-only, written once, fsync'd
    <root>/snapshots/<id>/manifest.json  identity, files -> {digest, size, mode}, timings, node, meta
    <root>/snapshots/<id>/manifest.sig   signature over manifest.json's exact bytes
    <root>/staging/<uuid>/               work in progress: owner.json, files/ (the caller's), snapshot/

A snapshot becomes visible by one atomic rename of `staging/<uuid>/snapshot` to `snapshots/<id>`, after its
blobs and manifest are on disk, so nothing half-written is ever listed.

Garbage collection and publishing coordinate through `flock` on `<root>/.lock`: publishers hold it shared
while they link blobs and rename their manifest into place, GC holds it exclusively while it collects the
referenced digests and removes the rest. A blob that a live publisher has linked is therefore either already
referenced by a published manifest, or GC runs entirely before the publisher links it. Blobs added on their
own (`add_blob_from_file`, e.g. model weights a later snapshot will reference) are protected by a grace
period: GC keeps unreferenced blobs younger than `blob_grace` seconds (adding or re-adding a blob refreshes
its mtime). On NFS, Linux emulates `flock` with NFS byte-range locks, which hold across clients.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import functools
import json
import logging
import os
import secrets
import shutil
import socket
import stat
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any

from warmstart import procinfo
from warmstart.fileio import fsync_dir, write_new_file
from warmstart.identity import SnapshotIdentity
from warmstart.parallel import parallel_map, run_heaviest_first
from warmstart.snapshot.hashing import (
    chunk_ranges,
    hash_file,
    hash_files,
    hash_range,
)
from warmstart.snapshot.manifest import (
    CREATED_FORMAT,
    MIN_CHUNK_SIZE,
    SNAPSHOT_ID_PATTERN,
    FileEntry,
    IdentityMismatch,
    Manifest,
    SnapshotError,
    SnapshotInvalid,
    check_prefix,
    check_relative_path,
    digest_hex,
)
from warmstart.snapshot.signing import (
    SignatureInvalid,
    Signer,
    Verifier,
    signature_document,
    verify_document,
)

log = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.json"
SIGNATURE_FILE = "manifest.sig"
OWNER_FILE = "owner.json"
LOCK_FILE = ".lock"
DELETING_SUFFIX = ".deleting"
MAX_REPORTED_PROBLEMS = 5
DEFAULT_CHUNK_SIZE = 64 << 20  # files above this also get per-chunk digests, verified in parallel


class SnapshotNotFound(SnapshotError, LookupError):
    """No snapshot with that id in this store."""


# --- small filesystem helpers ----------------------------------------------------------------------------


def _touch(path: Path) -> None:
    """Refresh a blob's mtime (the GC grace clock); a blob owned by another user keeps its old one."""
    with contextlib.suppress(PermissionError):
        os.utime(path)


def _copy_file(source: Path, target: Path, mode: int) -> None:
    """Copy through a temporary name, fsync, then rename into place: `target` is never half-written."""
    temporary = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        shutil.copyfile(source, temporary)
        os.chmod(temporary, mode)
        with open(temporary, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)


def _newest_mtime(path: Path) -> float:
    """The latest mtime of `path` and everything under it (a capture writing anywhere keeps it fresh)."""
    newest = path.lstat().st_mtime
    for directory, _, names in os.walk(path):
        for name in [*names, "."]:
            with contextlib.suppress(FileNotFoundError):
                newest = max(newest, os.lstat(os.path.join(directory, name)).st_mtime)
    return newest


def _utc_now() -> datetime:
    return datetime.now(UTC)


def _this_host() -> str:
    """Hostname plus boot id: a pid means something only on the same host since the same boot."""
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot_id = ""
    return f"{socket.gethostname()}/{boot_id}"


# --- public value types ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Snapshot:
    """A published snapshot (its manifest as read from the store, not necessarily verified)."""

    path: Path
    manifest: Manifest

    @property
    def id(self) -> str:
        return self.manifest.id

    @property
    def identity(self) -> SnapshotIdentity:
        return self.manifest.identity

    @property
    def identity_hash(self) -> str:
        return self.manifest.identity_hash

    @property
    def created(self) -> datetime:
        return self.manifest.created_at

    @property
    def size(self) -> int:
        return self.manifest.size

    @property
    def files(self) -> dict[str, FileEntry]:
        return self.manifest.files

    @property
    def refs(self) -> dict[str, FileEntry]:
        return self.manifest.refs

    @property
    def timings(self) -> dict[str, float]:
        return self.manifest.timings

    @property
    def node(self) -> dict[str, Any]:
        return self.manifest.node

    @property
    def meta(self) -> dict[str, Any]:
        return self.manifest.meta

    def summary(self) -> dict[str, Any]:
        """What `snapshot list --json` prints for one snapshot."""
        return {
            "id": self.id,
            "identity_hash": self.identity_hash,
            "engine": self.identity.engine,
            "engine_version": self.identity.engine_version,
            "model_digest": self.identity.model_digest,
            "model": self.meta.get("model", ""),
            "size": self.size,
            "files": len(self.files),
            "refs": len(self.refs),
            "created": self.manifest.created,
            "node": self.node,
        }


@dataclass
class GcReport:
    dry_run: bool = False
    removed_blobs: list[str] = field(default_factory=list)
    freed_bytes: int = 0
    removed_staging: list[str] = field(default_factory=list)
    kept_staging: list[str] = field(default_factory=list)
    young_blobs: list[str] = field(default_factory=list)  # unreferenced, within the grace period
    referenced_blobs: int = 0
    deleted_snapshots: list[str] = field(default_factory=list)  # by retention, when the caller ran it
    errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --- staging ---------------------------------------------------------------------------------------------


class Staging:
    """A snapshot being written: the caller fills `dir`, then calls `publish(signer)` once.

    Used as a context manager; leaving it without publishing (or on an exception) removes everything.
    """

    def __init__(
        self,
        store: SnapshotStore,
        root: Path,
        identity: SnapshotIdentity,
        node: dict[str, Any] | None,
        meta: dict[str, Any] | None,
    ) -> None:
        self.store = store
        self.root = root
        self.dir = root / "files"
        self.identity = identity
        self.node: dict[str, Any] = dict(node or {})
        self.meta: dict[str, Any] = dict(meta or {})
        self.timings: dict[str, float] = {}
        self.refs: dict[str, str] = {}
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

    def add_reference(self, name: str, digest: str) -> None:
        """Reference a blob stored on its own (e.g. weights): GC keeps it while a snapshot references it."""
        check_relative_path(name)
        if not self.store.has_blob(digest):
            raise SnapshotError(f"reference {name!r}: blob {digest} is not in the store {self.store.root}")
        self.refs[name] = digest

    def publish(self, signer: Signer) -> Snapshot:
        if self.snapshot is not None:
            raise SnapshotError(f"staging {self.root.name} was published already as {self.snapshot.id}")
        files = self._collect_files()
        modes = {path: stat.S_IMODE(path.stat().st_mode) for path in files.values()}
        started = time.monotonic()
        hashed = hash_files(
            files.values(), workers=self.store.hash_workers, fsync=True, chunk_size=self.store.chunk_size
        )
        self.timings["store_hash"] = round(time.monotonic() - started, 6)
        entries = {
            relative: FileEntry(
                digest=hashed[path].digest,
                size=hashed[path].size,
                mode=modes[path],
                chunk_size=hashed[path].chunk_size,
                chunks=hashed[path].chunks,
            )
            for relative, path in files.items()
        }
        self.snapshot = self.store._publish(self, files, entries, signer)
        self.discard()
        return self.snapshot

    def _collect_files(self) -> dict[str, Path]:
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


# --- the store -------------------------------------------------------------------------------------------


class SnapshotStore:
    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        hash_workers: int | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
    ) -> None:
        if chunk_size != 0 and chunk_size < MIN_CHUNK_SIZE:
            raise ValueError(
                f"chunk_size must be 0 (no chunk digests) or at least {MIN_CHUNK_SIZE}, got {chunk_size}"
            )
        self.root = Path(root)
        self.hash_workers = hash_workers
        self.chunk_size = chunk_size
        self.blobs_dir = self.root / "blobs" / "sha256"
        self.snapshots_dir = self.root / "snapshots"
        self.staging_dir = self.root / "staging"

    def __repr__(self) -> str:
        return f"SnapshotStore({str(self.root)!r})"

    # layout and locking

    def _ensure_layout(self) -> None:
        for directory in (self.blobs_dir, self.snapshots_dir, self.staging_dir):
            directory.mkdir(parents=True, exist_ok=True)

    def _require_root(self) -> None:
        if not self.root.is_dir():
            raise SnapshotError(
                f"snapshot store {self.root} does not exist (check --store / WARMSTART_STORE)"
            )

    @contextlib.contextmanager
    def _lock(self, *, exclusive: bool) -> Iterator[None]:
        self._ensure_layout()
        fd = os.open(self.root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    # blobs

    def blob_path(self, digest: str) -> Path:
        return self.blobs_dir / digest_hex(digest)

    def has_blob(self, digest: str) -> bool:
        return self.blob_path(digest).is_file()

    def _ingest(self, source: Path, digest: str, size: int, mode: int) -> None:
        """Make `source` (already hashed, on disk) the blob for `digest`; drop it when the blob exists."""
        target = self.blob_path(digest)
        try:
            existing = target.stat()
        except FileNotFoundError:
            existing = None
        if existing is not None and existing.st_size == size:
            _touch(target)
            return
        os.chmod(source, mode & 0o555)
        if existing is not None:  # wrong size: a damaged blob; replace it with good bytes
            log.warning("replacing damaged blob %s (size %d, expected %d)", digest, existing.st_size, size)
            os.replace(source, target)
        else:
            try:
                os.link(source, target)
            except FileExistsError:  # a concurrent publisher stored the same bytes first
                pass
            except OSError as exc:
                if exc.errno != errno.EXDEV:
                    raise
                _copy_file(source, target, mode & 0o555)
        _touch(target)  # a linked file keeps its old mtime; the GC grace period starts now

    def add_blob_from_file(self, path: str | os.PathLike[str], *, move: bool = False) -> str:
        """Store a file's bytes as a blob and return its digest (`sha256:<hex>`).

        With `move=True` the file itself becomes the blob (hardlinked, then removed from its old name) when
        it lives on the store's filesystem; otherwise its bytes are copied in and the file is left alone.
        """
        source = Path(path)
        if not source.is_file():
            raise SnapshotError(f"{source} is not a regular file")
        self._ensure_layout()
        mode = stat.S_IMODE(source.stat().st_mode)
        with self._new_staging_root() as staging_root:
            if move:
                digest, size = hash_file(source, fsync=True)
                candidate = source
            else:
                candidate = staging_root / "blob"
                _copy_file(source, candidate, mode)
                digest, size = hash_file(candidate)
            with self._lock(exclusive=False):
                self._ingest(candidate, digest, size, mode)
                fsync_dir(self.blobs_dir)
            if move:
                source.unlink(missing_ok=True)
        return digest

    # staging and publishing

    @contextlib.contextmanager
    def _new_staging_root(self) -> Iterator[Path]:
        root = self._create_staging_root()
        try:
            yield root
        finally:
            shutil.rmtree(root, ignore_errors=True)

    def _create_staging_root(self) -> Path:
        """A staging directory and its owner record, made under the shared lock: GC never sees it bare."""
        owner = {
            "pid": os.getpid(),
            "pid_start": procinfo.start_ticks(os.getpid()),
            "host": _this_host(),
            "created": _utc_now().strftime(CREATED_FORMAT),
        }
        with self._lock(exclusive=False):
            root = self.staging_dir / uuid.uuid4().hex
            root.mkdir()
            write_new_file(root / OWNER_FILE, json.dumps(owner).encode())
            (root / "files").mkdir()
        return root

    def stage(
        self,
        identity: SnapshotIdentity,
        *,
        node: dict[str, Any] | None = None,
        meta: dict[str, Any] | None = None,
    ) -> Staging:
        """A new staging area for a snapshot of `identity`; use it as a context manager."""
        return Staging(self, self._create_staging_root(), identity, node, meta)

    def _new_snapshot_id(self, identity_hash: str, created: datetime) -> str:
        return f"{identity_hash[:12]}-{created.strftime('%Y%m%d%H%M%S')}-{secrets.token_hex(3)}"

    def _publish(
        self, staging: Staging, files: dict[str, Path], entries: dict[str, FileEntry], signer: Signer
    ) -> Snapshot:
        identity_hash = staging.identity.digest()
        created = _utc_now()
        snapshot_id = self._new_snapshot_id(identity_hash, created)
        output = staging.root / "snapshot"
        output.mkdir()
        with self._lock(exclusive=False):
            started = time.monotonic()
            parallel_map(
                lambda item: self._ingest(files[item[0]], item[1].digest, item[1].size, item[1].mode),
                list(entries.items()),
                workers=self.hash_workers,
            )
            fsync_dir(self.blobs_dir)
            refs = self._reference_entries(staging.refs)
            staging.timings["store_ingest"] = round(time.monotonic() - started, 6)
            manifest = Manifest(
                id=snapshot_id,
                created=created.strftime(CREATED_FORMAT),
                identity=staging.identity,
                identity_hash=identity_hash,
                files=entries,
                refs=refs,
                timings=dict(staging.timings),
                node=staging.node,
                meta=staging.meta,
            )
            manifest_bytes = manifest.to_bytes()
            write_new_file(output / MANIFEST_FILE, manifest_bytes)
            write_new_file(output / SIGNATURE_FILE, signature_document(signer, manifest_bytes))
            fsync_dir(output)
            final = self.snapshots_dir / snapshot_id
            os.rename(output, final)
            fsync_dir(self.snapshots_dir)
        log.info("published snapshot %s (%d files, %d bytes)", snapshot_id, len(entries), manifest.size)
        return Snapshot(final, manifest)

    def _reference_entries(self, refs: dict[str, str]) -> dict[str, FileEntry]:
        """Entries for referenced blobs, checked and refreshed under the publish lock."""
        entries: dict[str, FileEntry] = {}
        for name, digest in refs.items():
            path = self.blob_path(digest)
            try:
                info = path.stat()
            except FileNotFoundError as exc:
                raise SnapshotError(f"reference {name!r}: blob {digest} vanished from the store") from exc
            _touch(path)
            entries[name] = FileEntry(digest=digest, size=info.st_size, mode=stat.S_IMODE(info.st_mode))
        return entries

    # reading

    def _snapshot_dir(self, snapshot_id: str) -> Path:
        if not isinstance(snapshot_id, str) or not SNAPSHOT_ID_PATTERN.fullmatch(snapshot_id):
            raise SnapshotNotFound(
                f"{snapshot_id!r} is not a snapshot id (expected <12 hex>-<yyyymmddHHMMSS>-<6 hex>)"
            )
        return self.snapshots_dir / snapshot_id

    def _read_manifest_bytes(self, snapshot_id: str) -> bytes:
        directory = self._snapshot_dir(snapshot_id)
        try:
            return (directory / MANIFEST_FILE).read_bytes()
        except FileNotFoundError as exc:
            if not directory.is_dir():
                raise SnapshotNotFound(f"no snapshot {snapshot_id} in {self.root}") from exc
            raise SnapshotInvalid(f"{MANIFEST_FILE} is missing", snapshot_id=snapshot_id) from exc

    def get(self, snapshot_id: str) -> Snapshot:
        """The snapshot's manifest as stored (not verified: use `verify` before trusting it)."""
        raw = self._read_manifest_bytes(snapshot_id)
        try:
            manifest = Manifest.from_bytes(raw)
        except SnapshotInvalid as exc:
            raise SnapshotInvalid(exc.reason, snapshot_id=snapshot_id) from exc
        return Snapshot(self.snapshots_dir / snapshot_id, manifest)

    def list(self, identity_hash: str | None = None) -> list[Snapshot]:
        """Published snapshots, newest first; `identity_hash` may be a full hash or a prefix of one."""
        self._require_root()
        if not self.snapshots_dir.is_dir():
            return []
        found: list[Snapshot] = []
        for entry in self.snapshots_dir.iterdir():
            if not SNAPSHOT_ID_PATTERN.fullmatch(entry.name):
                continue
            if identity_hash and not entry.name.startswith(identity_hash[:12]):
                continue
            try:
                snapshot = self.get(entry.name)
            except SnapshotError as exc:
                log.warning("skipping unreadable snapshot %s: %s", entry.name, exc)
                continue
            if identity_hash is None or snapshot.identity_hash.startswith(identity_hash):
                found.append(snapshot)
        found.sort(key=lambda s: (s.manifest.created, s.id), reverse=True)
        return found

    def latest(self, identity_hash: str) -> Snapshot | None:
        snapshots = self.list(identity_hash)
        return snapshots[0] if snapshots else None

    def delete(self, snapshot_id: str) -> None:
        """Unpublish a snapshot at once (one rename); its blobs stay until GC finds them unreferenced.

        The rename waits for a running GC: a manifest vanishing while GC reads them all would look unreadable.
        """
        directory = self._snapshot_dir(snapshot_id)
        doomed = self.staging_dir / f"{uuid.uuid4().hex}{DELETING_SUFFIX}"
        try:
            with self._lock(exclusive=False):
                os.rename(directory, doomed)
        except FileNotFoundError as exc:
            raise SnapshotNotFound(f"no snapshot {snapshot_id} in {self.root}") from exc
        shutil.rmtree(doomed, ignore_errors=True)

    # verification and materialisation

    def verify(
        self,
        snapshot_id: str,
        verifier: Verifier,
        expected_identity: SnapshotIdentity | None = None,
        *,
        prefix: str | None = None,
    ) -> Snapshot:
        """Check signature, schema, identity and every blob's size and SHA-256; SnapshotInvalid otherwise.

        With `prefix`, only blobs of files under it are hashed (signature and schema are always checked).
        """
        manifest = self._verified_manifest(snapshot_id, verifier)
        if expected_identity is not None and expected_identity.digest() != manifest.identity_hash:
            raise IdentityMismatch(manifest.identity.mismatches(expected_identity), snapshot_id=snapshot_id)
        self._verify_blobs(snapshot_id, self._selected_entries(manifest, prefix, include_refs=prefix is None))
        return Snapshot(self.snapshots_dir / snapshot_id, manifest)

    def _verified_manifest(self, snapshot_id: str, verifier: Verifier) -> Manifest:
        raw = self._read_manifest_bytes(snapshot_id)
        try:
            signature = (self.snapshots_dir / snapshot_id / SIGNATURE_FILE).read_bytes()
        except FileNotFoundError as exc:
            raise SnapshotInvalid(
                f"{SIGNATURE_FILE} is missing: the snapshot is unsigned", snapshot_id=snapshot_id
            ) from exc
        try:
            verify_document(verifier, raw, signature)
        except SignatureInvalid as exc:
            raise SnapshotInvalid(f"{SIGNATURE_FILE}: {exc}", snapshot_id=snapshot_id) from exc
        try:
            manifest = Manifest.from_bytes(raw)
        except SnapshotInvalid as exc:
            raise SnapshotInvalid(exc.reason, snapshot_id=snapshot_id) from exc
        if manifest.id != snapshot_id:
            raise SnapshotInvalid(
                f"manifest field 'id' is {manifest.id!r} but the snapshot directory is {snapshot_id!r}",
                snapshot_id=snapshot_id,
            )
        actual_hash = manifest.identity.digest()
        if manifest.identity_hash != actual_hash:
            raise SnapshotInvalid(
                f"manifest field 'identity_hash' is {manifest.identity_hash} but the identity hashes to "
                f"{actual_hash}",
                snapshot_id=snapshot_id,
            )
        return manifest

    @staticmethod
    def _selected_entries(
        manifest: Manifest, prefix: str | None, *, include_refs: bool
    ) -> dict[str, FileEntry]:
        if prefix is None:
            selected = dict(manifest.files)
        else:
            normalized = check_prefix(prefix)
            selected = {path: e for path, e in manifest.files.items() if path.startswith(normalized)}
            if not selected:
                raise SnapshotInvalid(f"no files under prefix {normalized!r}", snapshot_id=manifest.id)
        if include_refs:
            selected.update({f"ref:{name}": entry for name, entry in manifest.refs.items()})
        return selected

    def _verify_blobs(self, snapshot_id: str, entries: dict[str, FileEntry]) -> None:
        problems: list[str] = []
        by_blob: dict[FileEntry, list[str]] = {}  # each distinct (blob, chunking) is hashed once
        for path, entry in entries.items():
            problem = self._blob_shape_problem(path, entry)
            if problem:
                problems.append(problem)
            else:
                by_blob.setdefault(dataclasses.replace(entry, mode=0), []).append(path)
        checks = [check for entry in by_blob for check in self._content_checks(entry)]
        outcomes = run_heaviest_first([(weight, job) for weight, job, _ in checks], workers=self.hash_workers)
        for (_, _, (entry, expected, what)), actual in zip(checks, outcomes, strict=True):
            if actual != expected:
                names = ", ".join(repr(p) for p in by_blob[entry])
                problems.append(f"file {names}: blob {entry.digest} {what} does not match (corrupted)")
        if problems:
            extra = len(problems) - MAX_REPORTED_PROBLEMS
            reason = "; ".join(problems[:MAX_REPORTED_PROBLEMS]) + (
                f"; and {extra} more" if extra > 0 else ""
            )
            raise SnapshotInvalid(reason, snapshot_id=snapshot_id)

    def _content_checks(
        self, entry: FileEntry
    ) -> list[tuple[int, Callable[[], str], tuple[FileEntry, str, str]]]:
        """(weight, hashing job, (entry, expected result, what is checked)) for one blob."""
        blob = self.blob_path(entry.digest)
        if not entry.chunks:
            return [(entry.size, lambda: hash_file(blob)[0], (entry, entry.digest, "content"))]
        return [
            (
                length,
                functools.partial(hash_range, blob, offset, length),
                (entry, expected, f"chunk {index} (bytes {offset}..{offset + length - 1})"),
            )
            for index, ((offset, length), expected) in enumerate(
                zip(chunk_ranges(entry.size, entry.chunk_size), entry.chunks, strict=True)
            )
        ]

    def _blob_shape_problem(self, path: str, entry: FileEntry) -> str | None:
        blob = self.blob_path(entry.digest)
        try:
            info = blob.lstat()
        except FileNotFoundError:
            return f"file {path!r}: blob {entry.digest} is missing"
        if not stat.S_ISREG(info.st_mode):
            return f"file {path!r}: blob {entry.digest} is not a regular file"
        if info.st_size != entry.size:
            return f"file {path!r}: blob {entry.digest} has {info.st_size} bytes, manifest says {entry.size}"
        return None

    def materialize(
        self,
        snapshot_id: str,
        dest: str | os.PathLike[str],
        verifier: Verifier,
        *,
        prefix: str | None = None,
        expected_identity: SnapshotIdentity | None = None,
        strip_prefix: bool = False,
        link: bool = True,
    ) -> Snapshot:
        """Verify, then build `dest` from blobs: hardlinks on the same filesystem, copies otherwise.

        Files keep their paths relative to the snapshot (`criu/pages-1.img` -> `dest/criu/pages-1.img`), or
        lose the prefix with `strip_prefix=True`. Copies get the recorded mode exactly; a hardlink shares the
        immutable blob's inode, so it carries the recorded mode without write bits (when the blob's mode
        differs from that, the file is copied instead).
        """
        snapshot = self.verify(snapshot_id, verifier, expected_identity, prefix=prefix)
        selected = self._selected_entries(snapshot.manifest, prefix, include_refs=False)
        target_root = Path(dest)
        if target_root.exists() and any(target_root.iterdir()):
            raise SnapshotError(f"materialise destination {target_root} is not empty")
        target_root.mkdir(parents=True, exist_ok=True)
        cut = len(check_prefix(prefix)) if (prefix and strip_prefix) else 0
        plan = [(target_root / path[cut:], entry) for path, entry in selected.items()]
        for directory in {target.parent for target, _ in plan}:
            directory.mkdir(parents=True, exist_ok=True)
        use_link = [link]
        parallel_map(lambda item: self._place(item[0], item[1], use_link), plan, workers=self.hash_workers)
        return snapshot

    def _place(self, target: Path, entry: FileEntry, use_link: list[bool]) -> None:
        blob = self.blob_path(entry.digest)
        if use_link[0] and stat.S_IMODE(blob.stat().st_mode) == entry.mode & 0o555:
            try:
                os.link(blob, target)
                return
            except FileNotFoundError as exc:
                raise SnapshotInvalid(f"blob {entry.digest} vanished while materialising {target}") from exc
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                    raise
                use_link[0] = False  # another filesystem (or no hardlinks there): copy from now on
        _copy_file(blob, target, entry.mode)

    # garbage collection and retention

    def gc(
        self, *, staging_older_than: float = 3600, blob_grace: float | None = None, dry_run: bool = False
    ) -> GcReport:
        """Remove stale staging directories and unreferenced blobs older than `blob_grace` seconds.

        A staging directory is stale when its owner process (same host) is gone, or, when the owner cannot
        be checked from here, when nothing in it changed for `staging_older_than` seconds. `blob_grace`
        defaults to `staging_older_than`.
        """
        self._require_root()
        grace = staging_older_than if blob_grace is None else blob_grace
        report = GcReport(dry_run=dry_run)
        with self._lock(exclusive=True):
            self._gc_staging(staging_older_than, report)
            referenced = self._referenced_digests(report)
            if referenced is not None:
                self._gc_blobs(referenced, grace, report)
        return report

    def _gc_staging(self, older_than: float, report: GcReport) -> None:
        here, now = _this_host(), time.time()
        for entry in sorted(self.staging_dir.iterdir()):
            try:
                stale, why = self._staging_is_stale(entry, here, now, older_than)
            except FileNotFoundError:  # discarded by its owner meanwhile
                continue
            if not stale:
                report.kept_staging.append(f"{entry.name} ({why})")
                continue
            report.removed_staging.append(f"{entry.name} ({why})")
            if not report.dry_run:
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)

    @staticmethod
    def _staging_is_stale(entry: Path, here: str, now: float, older_than: float) -> tuple[bool, str]:
        if entry.name.endswith(DELETING_SUFFIX):
            return True, "interrupted delete"
        try:
            owner = json.loads((entry / OWNER_FILE).read_bytes())
        except (OSError, ValueError):
            owner = None
        if isinstance(owner, dict) and owner.get("host") == here and isinstance(owner.get("pid"), int):
            if procinfo.same_process(owner["pid"], owner.get("pid_start")):
                return False, f"owner pid {owner['pid']} is running"
            return True, f"owner pid {owner['pid']} is gone"
        age = now - _newest_mtime(entry)
        if age > older_than:
            return True, f"untouched for {age:.0f}s"
        return False, f"touched {age:.0f}s ago"

    def _referenced_digests(self, report: GcReport) -> set[str] | None:
        """Every digest a published manifest names; None (remove no blob) when a manifest is unreadable."""
        referenced: set[str] = set()
        for entry in self.snapshots_dir.iterdir():
            if not SNAPSHOT_ID_PATTERN.fullmatch(entry.name):
                continue  # not a snapshot (list() ignores it too)
            try:
                raw = (entry / MANIFEST_FILE).read_bytes()
                referenced |= Manifest.from_bytes(raw).digests()
            except (OSError, SnapshotInvalid) as exc:
                report.errors.append(f"snapshot {entry.name}: unreadable manifest ({exc}); no blob removed")
                return None
        report.referenced_blobs = len(referenced)
        return referenced

    def _gc_blobs(self, referenced: set[str], grace: float, report: GcReport) -> None:
        now = time.time()
        for blob in sorted(self.blobs_dir.iterdir()):
            digest = f"sha256:{blob.name}"
            if digest in referenced:
                continue
            info = blob.lstat()
            if now - info.st_mtime < grace:
                report.young_blobs.append(digest)
                continue
            report.removed_blobs.append(digest)
            report.freed_bytes += info.st_size
            if not report.dry_run:
                blob.unlink(missing_ok=True)

    def apply_retention(
        self, keep: int, identity_hash: str | None = None, *, dry_run: bool = False
    ) -> list[str]:
        """Delete all but the `keep` newest snapshots of each identity; return the deleted ids."""
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
            raise ValueError(f"keep must be a non-negative integer, got {keep!r}")
        seen: dict[str, int] = {}
        doomed: list[str] = []
        for snapshot in self.list(identity_hash):  # newest first
            seen[snapshot.identity_hash] = seen.get(snapshot.identity_hash, 0) + 1
            if seen[snapshot.identity_hash] > keep:
                doomed.append(snapshot.id)
        if not dry_run:
            for snapshot_id in doomed:
                with contextlib.suppress(SnapshotNotFound):
                    self.delete(snapshot_id)
        return doomed
