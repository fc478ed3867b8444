"""Garbage collection: stale staging, junk in `snapshots/`, unreferenced blobs.

GC decides what is garbage without the store's lock: it reads every manifest in `snapshots/` first (a file
hard-linked under many directories is read once), then takes the lock exclusively only to remove
unreferenced blobs, after a re-check that costs a few `lstat`s per snapshot directory. Publishers hold the
lock shared while they link blobs and rename a manifest in, so under the exclusive lock `snapshots/` holds
every manifest that relies on a blob; a directory that is new or changed since the unlocked read is read
there (at most `MAX_LOCKED_READS` of them: when more changed, GC reads again without the lock, and when
`snapshots/` keeps changing it removes no blob this time). Stale staging directories and junk in
`snapshots/` are removed without the lock; a staging directory found stale is judged once more under the
exclusive lock first, since a directory is made bare and given its owner record under the shared lock.
A planted directory therefore costs GC's own time, never a capture's wait for the lock.

Unreferenced blobs younger than `blob_grace` seconds are kept (ingesting a blob refreshes its mtime).
An entry of `snapshots/` that is not a signed snapshot directory (no `manifest.sig`, or not a directory at
all), whose manifest is junk (not a bounded regular file of JSON listing files; one that names no
`sha256:` digest at all is junk without being parsed), or, when GC is given the store's verifier, whose
signature claims that key but does not sign the manifest (a forgery, found before the manifest is parsed),
is never listed; once nothing in it changed for `staging_older_than` seconds GC removes it. Publish
renames a directory that already holds both files, so the grace period is only a margin.

GC reads references leniently otherwise: every digest a manifest's `files` names keeps its blob, whether
the rest of the manifest is valid or not (a snapshot of a newer schema, or one signed with another key,
keeps its blobs), and junk references nothing, so no junk can stop GC from freeing what nothing
references. Only a manifest that cannot be read at all (an I/O error) makes GC keep every blob, this once.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from warmstart.host.fileio import UnsafeInput, loads_json, read_regular_file
from warmstart.snapshot.catalog import is_signed_snapshot_dir
from warmstart.snapshot.layout import (
    DELETING_SUFFIX,
    MANIFEST_FILE,
    MAX_MANIFEST_BYTES,
    MAX_SIGNATURE_BYTES,
    SIGNATURE_FILE,
    StoreLayout,
)
from warmstart.snapshot.manifest import DIGEST_PATTERN, SNAPSHOT_ID_PATTERN
from warmstart.snapshot.signing import SignatureInvalid, SignedWithAnotherKey, Verifier, signature_of
from warmstart.snapshot.staging_owner import newest_mtime, staging_is_stale, this_host
from warmstart.snapshot.verified import VerifiedRecords

MAX_LOCKED_READS = 16  # manifests GC may read under the exclusive lock (new since its unlocked read)
MAX_UNLOCKED_ROUNDS = 3  # unlocked reads before GC gives up on a `snapshots/` that keeps changing
_DIGEST_STRING = re.compile(rb'"sha256:[0-9a-f]{64}"')
_CHANGING = (
    f"snapshots/ kept changing while gc read it (more than {MAX_LOCKED_READS} directories new or changed "
    f"after {MAX_UNLOCKED_ROUNDS} reads); no blob removed this time"
)


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
    removed_unsigned: list[str] = field(default_factory=list)  # snapshots/ entries publish never made
    errors: list[str] = field(default_factory=list)


def collect_garbage(
    layout: StoreLayout,
    *,
    staging_older_than: float,
    blob_grace: float | None,
    dry_run: bool,
    verifier: Verifier | None = None,
    keep_blobs: Callable[[], Iterable[str]] = frozenset,
) -> GcReport:
    """Remove stale staging directories, junk in `snapshots/` and unreferenced blobs older than
    `blob_grace` seconds (see the module's docstring for what is read with and without the lock), never
    one of the digests `keep_blobs()` returns (asked under the exclusive lock).

    A staging directory is stale when its owner process (same boot, same pid namespace) is gone, or, when
    the owner cannot be checked from here, when nothing in it changed for `staging_older_than` seconds.
    `blob_grace` defaults to `staging_older_than`. With `verifier`, a snapshot directory whose signature
    claims its key but does not sign its manifest is junk.
    """
    layout.require_root()
    layout.ensure()
    grace = staging_older_than if blob_grace is None else blob_grace
    report = GcReport(dry_run=dry_run)
    looks_stale = _stale_staging(
        sorted(layout.staging_dir.iterdir()), staging_older_than, report, final=False
    )
    scan = SnapshotScan(layout, verifier)
    with layout.lock(exclusive=True):  # a few lstats per snapshot directory, then the blobs
        stale = _stale_staging(looks_stale, staging_older_than, report, final=True)
        referenced = scan.referenced()
        if referenced is not None:
            report.referenced_blobs = len(referenced)
            _gc_blobs(layout, referenced | set(keep_blobs()), grace, report)
    # Neither needs the lock: a stale staging directory has no publish in progress, and junk in
    # `snapshots/` is nothing a publish made (it renames a signed directory in whole).
    doomed = [] if dry_run else [_set_aside(layout, entry) for entry in stale]
    doomed += _old_junk(layout, scan, staging_older_than, report)
    for path in filter(None, doomed):
        shutil.rmtree(path, ignore_errors=True)
    report.errors += scan.errors()
    if not dry_run:
        VerifiedRecords(layout.root).prune({blob.name for blob in layout.blobs_dir.iterdir()})
    return report


def remove_unreferenced_blobs(layout: StoreLayout, digests: Iterable[str]) -> list[str] | None:
    """Remove those of `digests` that no manifest in `snapshots/` names (manifests read without the lock,
    then brought up to date under the exclusive lock, as GC does); the removed digests, or None when none
    was removed because a manifest could not be read or `snapshots/` kept changing."""
    wanted = set(digests)
    if not wanted:
        return []
    scan = SnapshotScan(layout)
    with layout.lock(exclusive=True):
        referenced = scan.referenced()
        if referenced is None:
            return None
        removed = sorted(wanted - referenced)
        for digest in removed:
            layout.blob_path(digest).unlink(missing_ok=True)
    return removed


# --- staging --------------------------------------------------------------------------------------------


def _stale_staging(
    entries: Iterable[Path], older_than: float, report: GcReport, *, final: bool
) -> list[Path]:
    """The stale ones of `entries`; those kept are reported, and those found stale too when `final`.

    They are judged first without the lock, then (`final`) once more under the exclusive lock: without it
    GC may see a directory between its making and its owner record (both under the shared lock), and with
    no record to read it would be judged by age alone.
    """
    here, now = this_host(), time.time()
    stale = []
    for entry in entries:
        try:
            is_stale, why = staging_is_stale(entry, here, now, older_than)
        except FileNotFoundError:  # discarded by its owner meanwhile
            continue
        if is_stale:
            stale.append(entry)
        if final or not is_stale:
            (report.removed_staging if is_stale else report.kept_staging).append(f"{entry.name} ({why})")
    return stale


def _set_aside(layout: StoreLayout, entry: Path) -> Path | None:
    """Unlink an entry that is no directory; a directory is renamed out of the way (unless it was already)
    and returned, to be removed."""
    try:
        if not stat.S_ISDIR(entry.lstat().st_mode):
            entry.unlink(missing_ok=True)
            return None
        if entry.name.endswith(DELETING_SUFFIX):
            return entry
        doomed = layout.staging_dir / f"{uuid.uuid4().hex}{DELETING_SUFFIX}"
        os.rename(entry, doomed)
        return doomed
    except FileNotFoundError:
        return None


# --- what snapshots/ references -------------------------------------------------------------------------


Fingerprint = tuple[Any, ...]


@dataclass(frozen=True)
class _Seen:
    """One entry of `snapshots/` as read: the digests it names, whether it is junk, or why it was not
    readable."""

    fingerprint: Fingerprint
    digests: frozenset[str] = frozenset()
    junk: bool = False
    unreadable: str = ""


class SnapshotScan:
    """The digests the manifests in `snapshots/` name, read without the store's lock when it is made, then
    brought up to date under it by `lstat` alone, reading only the entries new or changed since (snapshot
    directories are renamed in whole and never written in place, so an unchanged fingerprint is an
    unchanged manifest).
    """

    def __init__(self, layout: StoreLayout, verifier: Verifier | None = None) -> None:
        self.layout = layout
        self.verifier = verifier
        self.seen: dict[str, _Seen] = {}
        self.current = True  # whether few enough entries changed under the lock to read them there
        self._judged: dict[Fingerprint, set[str] | None] = {}
        self._forgeries: dict[tuple[Fingerprint, bytes], bool] = {}
        self._last_raw: tuple[Fingerprint, bytes] | None = None
        for _ in range(MAX_UNLOCKED_ROUNDS):  # until few entries changed since the previous read
            changed = self._changes()
            self._read(changed)
            if len(changed) <= MAX_LOCKED_READS:
                break

    def referenced(self) -> set[str] | None:
        """Under the lock: every digest a manifest names (an unsigned directory still in its grace period
        counts too), once what changed since is read; None when a manifest could not be read, or when more
        than `MAX_LOCKED_READS` entries changed (nothing is read then)."""
        changed = self._changes()
        self.current = len(changed) <= MAX_LOCKED_READS
        if not self.current:
            return None
        self._read(changed)
        if any(seen.unreadable for seen in self.seen.values()):
            return None
        return {digest for seen in self.seen.values() for digest in seen.digests}

    def junk(self) -> dict[str, Fingerprint]:
        return {name: seen.fingerprint for name, seen in self.seen.items() if seen.junk}

    def errors(self) -> list[str]:
        unreadable = [
            f"snapshot {name}: unreadable manifest ({seen.unreadable}); no blob removed"
            for name, seen in sorted(self.seen.items())
            if seen.unreadable
        ]
        return unreadable if self.current else [*unreadable, _CHANGING]

    def _changes(self) -> dict[str, Fingerprint]:
        """The entries new or changed since they were read, with their fingerprints now; entries gone since
        are forgotten."""
        present: dict[str, Fingerprint] = {}
        for entry in self.layout.snapshots_dir.iterdir():
            if not SNAPSHOT_ID_PATTERN.fullmatch(entry.name):
                continue  # not a snapshot (listing ignores it too)
            fingerprint = _fingerprint(entry)
            if fingerprint is not None:
                present[entry.name] = fingerprint
        for name in set(self.seen) - set(present):
            del self.seen[name]
        return {
            name: fingerprint
            for name, fingerprint in present.items()
            if name not in self.seen or self.seen[name].fingerprint != fingerprint
        }

    def _read(self, changed: dict[str, Fingerprint]) -> None:
        for name, fingerprint in sorted(changed.items()):
            entry = self.layout.snapshots_dir / name
            try:
                self.seen[name] = self._read_entry(entry, fingerprint)
            except FileNotFoundError:  # unpublished meanwhile
                self.seen.pop(name, None)
            except OSError as exc:
                self.seen[name] = _Seen(fingerprint, unreadable=str(exc))

    def _read_entry(self, entry: Path, fingerprint: Fingerprint) -> _Seen:
        if not stat.S_ISDIR(entry.lstat().st_mode):
            return _Seen(fingerprint, junk=True)
        signed = is_signed_snapshot_dir(entry)
        manifest = _manifest_key(fingerprint)
        try:
            if signed and self.verifier is not None and self._forged(entry, manifest, self.verifier):
                return _Seen(fingerprint, junk=True)
            digests = self._digests(entry, manifest)
        except (FileNotFoundError, UnsafeInput):  # no manifest, or no regular file of bounded size
            return _Seen(fingerprint, junk=True)
        if digests is None:
            return _Seen(fingerprint, junk=True)
        return _Seen(fingerprint, frozenset(digests), junk=not signed)

    def _raw(self, entry: Path, manifest: Fingerprint | None) -> bytes:
        """The manifest's bytes; the last ones read serve again for another name of the same file."""
        if manifest is not None and self._last_raw is not None and self._last_raw[0] == manifest:
            return self._last_raw[1]
        raw = read_regular_file(entry / MANIFEST_FILE, MAX_MANIFEST_BYTES)
        if manifest is not None:
            self._last_raw = (manifest, raw)
        return raw

    def _digests(self, entry: Path, manifest: Fingerprint | None) -> set[str] | None:
        """`_manifest_digests` of the entry's manifest, judged once per file however many links it has."""
        if manifest is not None and manifest in self._judged:
            return self._judged[manifest]
        digests = _manifest_digests(self._raw(entry, manifest))
        if manifest is not None:
            self._judged[manifest] = digests
        return digests

    def _forged(self, entry: Path, manifest: Fingerprint | None, verifier: Verifier) -> bool:
        """Whether the entry's signature is no signature, or claims the verifier's key without signing the
        manifest; a signature of another key is not judged here (that snapshot may be someone's)."""
        try:
            document = read_regular_file(entry / SIGNATURE_FILE, MAX_SIGNATURE_BYTES)
        except UnsafeInput:
            return True
        except OSError:
            return False
        try:
            signature = signature_of(verifier, document)
        except SignedWithAnotherKey:
            return False
        except SignatureInvalid:  # no signature document, or one of this key that is not base64
            return True
        if manifest is not None and (manifest, signature) in self._forgeries:
            return self._forgeries[manifest, signature]
        forged = not verifier.check(self._raw(entry, manifest), signature)
        if manifest is not None:
            self._forgeries[manifest, signature] = forged
        return forged


def _manifest_key(fingerprint: Fingerprint) -> Fingerprint | None:
    """Which file a directory's manifest is (device, inode, size, mtime), from its fingerprint: a forger
    may hard-link one file under many names, and it is read and judged once."""
    if len(fingerprint) == 4 and isinstance(fingerprint[2], tuple):
        return (fingerprint[0], *fingerprint[2])
    return None


def _fingerprint(entry: Path) -> Fingerprint | None:
    """What changes when a `snapshots/` entry or its files are replaced or written; None when it is gone.
    (A directory's own mtime is not in it: marking a snapshot used sets it.)"""
    try:
        info = entry.lstat()
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(info.st_mode):
        return (info.st_dev, info.st_ino, info.st_mode)
    parts: list[Any] = [info.st_dev, info.st_ino]
    for name in (MANIFEST_FILE, SIGNATURE_FILE):
        try:
            item = os.lstat(entry / name)
        except OSError as exc:
            parts.append(exc.errno)
            continue
        parts.append((item.st_ino, item.st_mode, item.st_size, item.st_mtime_ns))
    return tuple(parts)


def _manifest_digests(raw: bytes) -> set[str] | None:
    """The digests a manifest's `files` names; None when it is junk (not JSON with `files`). Bytes that
    hold no digest string at all are junk without being parsed (parsing 16 MiB of junk takes a while)."""
    if not _DIGEST_STRING.search(raw):
        return None
    try:
        data = loads_json(raw, MANIFEST_FILE)
    except UnsafeInput:
        return None
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, dict):
        return None
    digests = {item.get("digest") for item in files.values() if isinstance(item, dict)}
    return {digest for digest in digests if isinstance(digest, str) and DIGEST_PATTERN.fullmatch(digest)}


# --- junk in snapshots/ ---------------------------------------------------------------------------------


def _old_junk(
    layout: StoreLayout, scan: SnapshotScan, older_than: float, report: GcReport
) -> list[Path | None]:
    """Set aside each junk entry untouched for more than `older_than` seconds (walked without the lock)
    and still as it was judged (`_set_aside`; a junk name, being a snapshot id, never ends in the deleting
    suffix); the directories to remove."""
    now, doomed = time.time(), []
    for name, fingerprint in sorted(scan.junk().items()):
        entry = layout.snapshots_dir / name
        try:
            age = now - _age_clock(entry)
        except FileNotFoundError:
            continue
        if age <= older_than or _fingerprint(entry) != fingerprint:
            continue  # recent, or changed or gone since it was judged
        report.removed_unsigned.append(f"{name} (no signed manifest; untouched for {age:.0f}s)")
        if not report.dry_run:
            doomed.append(_set_aside(layout, entry))
    return doomed


def _age_clock(entry: Path) -> float:
    """The newest mtime in a real directory, the entry's own otherwise (a link is never followed)."""
    info = entry.lstat()
    return newest_mtime(entry) if stat.S_ISDIR(info.st_mode) else info.st_mtime


# --- blobs ----------------------------------------------------------------------------------------------


def _gc_blobs(layout: StoreLayout, referenced: set[str], grace: float, report: GcReport) -> None:
    now = time.time()
    for blob in sorted(layout.blobs_dir.iterdir()):
        digest = f"sha256:{blob.name}"
        if digest in referenced:
            continue
        try:
            info = blob.lstat()
        except FileNotFoundError:
            continue
        if now - info.st_mtime < grace:
            report.young_blobs.append(digest)
            continue
        report.removed_blobs.append(digest)
        report.freed_bytes += info.st_size
        if not report.dry_run:
            try:
                blob.unlink(missing_ok=True)
            except OSError as exc:  # a directory planted among the blobs
                report.errors.append(f"blob {digest}: cannot remove ({exc.strerror})")
