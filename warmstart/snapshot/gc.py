"""Garbage collection (stale staging, unreferenced blobs) and retention (the N newest per identity).

GC holds the store's lock exclusively while it reads every manifest and removes blobs none references.
Unreferenced blobs younger than `blob_grace` seconds are kept (ingesting a blob refreshes its mtime).
An entry of `snapshots/` that is not a signed snapshot directory (no `manifest.sig`, or not a directory at
all), or whose manifest is junk (not a bounded regular file of JSON listing files), is never listed; once
nothing in it changed for `staging_older_than` seconds GC removes it. Publish renames a directory that
already holds both files, so the grace period is only a margin.

GC has no key, so it reads references leniently: every digest a manifest's `files` names keeps its blob,
whether the rest of the manifest is valid or not (a snapshot of a newer schema keeps its blobs), and junk
references nothing, so no junk can stop GC from freeing what nothing references. Only a manifest that cannot
be read at all (an I/O error) makes GC keep every blob, this once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import stat
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from warmstart.fileio import UnsafeInput, loads_json, read_regular_file
from warmstart.snapshot.catalog import is_signed_snapshot_dir, list_snapshots, unpublish
from warmstart.snapshot.layout import (
    DELETING_SUFFIX,
    MANIFEST_FILE,
    MAX_MANIFEST_BYTES,
    SnapshotNotFound,
    StoreLayout,
)
from warmstart.snapshot.manifest import SNAPSHOT_ID_PATTERN, digest_hex
from warmstart.snapshot.signing import Verifier
from warmstart.snapshot.staging_owner import newest_mtime, staging_is_stale, this_host
from warmstart.snapshot.verified import VerifiedRecords


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

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def collect_garbage(
    layout: StoreLayout, *, staging_older_than: float, blob_grace: float | None, dry_run: bool
) -> GcReport:
    """Remove stale staging directories, junk in `snapshots/` and unreferenced blobs older than
    `blob_grace` seconds.

    A staging directory is stale when its owner process (same host) is gone, or, when the owner cannot
    be checked from here, when nothing in it changed for `staging_older_than` seconds. `blob_grace`
    defaults to `staging_older_than`.
    """
    layout.require_root()
    grace = staging_older_than if blob_grace is None else blob_grace
    report = GcReport(dry_run=dry_run)
    with layout.lock(exclusive=True):
        _gc_staging(layout, staging_older_than, report)
        referenced, junk = _scan_snapshots(layout, report)
        _gc_junk(layout, junk, staging_older_than, report)
        if referenced is not None:
            report.referenced_blobs = len(referenced)
            _gc_blobs(layout, referenced, grace, report)
        if not dry_run:
            VerifiedRecords(layout.root).prune({blob.name for blob in layout.blobs_dir.iterdir()})
    return report


def _gc_staging(layout: StoreLayout, older_than: float, report: GcReport) -> None:
    here, now = this_host(), time.time()
    for entry in sorted(layout.staging_dir.iterdir()):
        try:
            stale, why = staging_is_stale(entry, here, now, older_than)
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


def referenced_digests(layout: StoreLayout) -> set[str] | None:
    """Every digest a manifest in `snapshots/` names (junk names none); None when one cannot be read."""
    return _scan_snapshots(layout, GcReport())[0]


def _scan_snapshots(layout: StoreLayout, report: GcReport) -> tuple[set[str] | None, list[Path]]:
    """(every digest a manifest names, or None when a manifest could not be read; the junk entries)."""
    referenced: set[str] = set()
    junk: list[Path] = []
    unreadable = False
    for entry in sorted(layout.snapshots_dir.iterdir()):
        if not SNAPSHOT_ID_PATTERN.fullmatch(entry.name):
            continue  # not a snapshot (listing ignores it too)
        try:
            digests = _entry_digests(entry)
        except FileNotFoundError:  # unpublished meanwhile
            continue
        except OSError as exc:
            report.errors.append(f"snapshot {entry.name}: unreadable manifest ({exc}); no blob removed")
            unreadable = True
            continue
        if digests is None or not is_signed_snapshot_dir(entry):
            junk.append(entry)
        referenced |= digests or set()  # an unsigned directory still in its grace period counts
    return (None if unreadable else referenced), junk


def _entry_digests(entry: Path) -> set[str] | None:
    """The digests the manifest of a `snapshots/` entry names; None when the entry is junk (not a real
    directory, no manifest, or one that is no bounded regular file of JSON with `files`)."""
    if not stat.S_ISDIR(entry.lstat().st_mode):
        return None
    try:
        data = loads_json(read_regular_file(entry / MANIFEST_FILE, MAX_MANIFEST_BYTES), MANIFEST_FILE)
    except (FileNotFoundError, UnsafeInput):
        return None
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, dict):
        return None
    digests = {item.get("digest") for item in files.values() if isinstance(item, dict)}
    return {digest for digest in digests if isinstance(digest, str) and _is_digest(digest)}


def _is_digest(value: str) -> bool:
    try:
        digest_hex(value)
    except ValueError:
        return False
    return True


def _gc_junk(layout: StoreLayout, junk: list[Path], older_than: float, report: GcReport) -> None:
    """Remove what sits in `snapshots/` under a snapshot's name but is no readable signed snapshot, once
    nothing in it changed for `older_than` seconds."""
    now = time.time()
    for entry in junk:
        try:
            age = now - _age_clock(entry)
        except FileNotFoundError:
            continue
        if age <= older_than:
            continue
        report.removed_unsigned.append(f"{entry.name} (no signed manifest; untouched for {age:.0f}s)")
        if not report.dry_run:
            _remove_entry(layout, entry)


def _age_clock(entry: Path) -> float:
    """The newest mtime in a real directory, the entry's own otherwise (a link is never followed)."""
    if stat.S_ISDIR(entry.lstat().st_mode):
        return newest_mtime(entry)
    return entry.lstat().st_mtime


def _remove_entry(layout: StoreLayout, entry: Path) -> None:
    """Remove a directory in one rename out of `snapshots/`, then its contents; unlink anything else."""
    if not stat.S_ISDIR(entry.lstat().st_mode):
        entry.unlink(missing_ok=True)
        return
    doomed = layout.staging_dir / f"{uuid.uuid4().hex}{DELETING_SUFFIX}"
    os.rename(entry, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


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


def apply_retention(
    layout: StoreLayout,
    keep: int,
    identity_hash: str | None = None,
    *,
    verifier: Verifier | None = None,
    dry_run: bool = False,
) -> list[str]:
    """Delete all but the `keep` newest snapshots of each identity; return the deleted ids."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
        raise ValueError(f"keep must be a non-negative integer, got {keep!r}")
    seen: dict[str, int] = {}
    doomed: list[str] = []
    for snapshot in list_snapshots(layout, identity_hash, verifier):  # newest first
        seen[snapshot.identity_hash] = seen.get(snapshot.identity_hash, 0) + 1
        if seen[snapshot.identity_hash] > keep:
            doomed.append(snapshot.id)
    if not dry_run:
        for snapshot_id in doomed:
            with contextlib.suppress(SnapshotNotFound):
                unpublish(layout, snapshot_id)
    return doomed
