"""Verification: signature, schema, identity, every blob's size and digest.

Nothing a manifest names is used before its signature checks out; a blob is hashed before it is placed.
"""

from __future__ import annotations

import dataclasses
import functools
import stat
from collections.abc import Callable, Iterable

from warmstart.api.identity import SnapshotIdentity
from warmstart.host.parallel import run_heaviest_first
from warmstart.snapshot.catalog import Snapshot, signed_manifest
from warmstart.snapshot.hashing import chunk_ranges, hash_file, hash_range
from warmstart.snapshot.layout import StoreLayout
from warmstart.snapshot.manifest import FileEntry, Manifest, SnapshotInvalid, check_prefix
from warmstart.snapshot.signing import Verifier
from warmstart.snapshot.verified import BlobState, VerifiedRecords

MAX_REPORTED_PROBLEMS = 5
ContentCheck = tuple[int, Callable[[], str], tuple[FileEntry, str, str]]


def verify_snapshot(
    layout: StoreLayout,
    snapshot_id: str,
    verifier: Verifier,
    expected_identity: SnapshotIdentity | None = None,
    *,
    prefix: str | None = None,
    workers: int | None = None,
    records: VerifiedRecords | None = None,
) -> Snapshot:
    """Check signature, schema, identity and every blob's size and digest; SnapshotInvalid otherwise.

    With `prefix`, only blobs of files under it are hashed (signature and schema are always checked); with
    `records`, a blob they say matched, unchanged since, is not hashed again.
    """
    manifest = signed_manifest(layout, snapshot_id, verifier, expected_identity)
    verify_blobs(layout, snapshot_id, selected_entries(manifest, prefix), workers, records)
    return Snapshot(layout.snapshots_dir / snapshot_id, manifest)


def selected_entries(manifest: Manifest, prefix: str | None) -> dict[str, FileEntry]:
    if prefix is None:
        return dict(manifest.files)
    normalized = check_prefix(prefix)
    selected = {path: e for path, e in manifest.files.items() if path.startswith(normalized)}
    if not selected:
        raise SnapshotInvalid(f"no files under prefix {normalized!r}", snapshot_id=manifest.id)
    return selected


def verify_blobs(
    layout: StoreLayout,
    snapshot_id: str,
    entries: dict[str, FileEntry],
    workers: int | None,
    records: VerifiedRecords | None = None,
) -> None:
    problems: list[str] = []
    by_blob: dict[FileEntry, list[str]] = {}  # each distinct (blob, chunking) is hashed once
    for path, entry in entries.items():
        problem = _blob_shape_problem(layout, path, entry)
        if problem:
            problems.append(problem)
        else:
            by_blob.setdefault(dataclasses.replace(entry, mode=0), []).append(path)
    states = _unrecorded(layout, by_blob, records)
    mismatched = _content_mismatches(layout, states, workers)
    for entry, what in mismatched:
        names = ", ".join(repr(p) for p in by_blob[entry])
        problems.append(f"file {names}: blob {entry.digest} {what} does not match (corrupted)")
    if records is not None:
        wrong = {entry for entry, _ in mismatched}
        for entry, state in states.items():
            if state is not None and entry not in wrong:
                records.remember(entry, layout.blob_path(entry.digest), state)
    if problems:
        extra = len(problems) - MAX_REPORTED_PROBLEMS
        reason = "; ".join(problems[:MAX_REPORTED_PROBLEMS]) + (f"; and {extra} more" if extra > 0 else "")
        raise SnapshotInvalid(reason, snapshot_id=snapshot_id)


def _unrecorded(
    layout: StoreLayout, entries: Iterable[FileEntry], records: VerifiedRecords | None
) -> dict[FileEntry, BlobState | None]:
    """The entries to hash, each with its blob's state as seen before hashing (None: not to be recorded);
    those `records` says matched, unchanged since, are left out."""
    if records is None:
        return dict.fromkeys(entries)
    states = {entry: records.state(layout.blob_path(entry.digest)) for entry in entries}
    return {
        entry: state for entry, state in states.items() if state is None or not records.holds(entry, state)
    }


def blobs_not_matching(layout: StoreLayout, entries: Iterable[FileEntry], workers: int | None) -> set[str]:
    """The digests of those blobs (regular files of the right size) whose content is not what their entry
    says; each distinct blob is hashed once, its chunks in parallel."""
    unique = {dataclasses.replace(entry, mode=0) for entry in entries}
    return {entry.digest for entry, _ in _content_mismatches(layout, unique, workers)}


def _content_mismatches(
    layout: StoreLayout, entries: Iterable[FileEntry], workers: int | None
) -> list[tuple[FileEntry, str]]:
    """(entry, what does not match) for every blob or chunk of `entries` that is not what it should be."""
    checks = [check for entry in entries for check in _content_checks(layout, entry)]
    outcomes = run_heaviest_first([(weight, job) for weight, job, _ in checks], workers=workers)
    return [
        (entry, what)
        for (_, _, (entry, expected, what)), actual in zip(checks, outcomes, strict=True)
        if actual != expected
    ]


def _content_checks(layout: StoreLayout, entry: FileEntry) -> list[ContentCheck]:
    """(weight, hashing job, (entry, expected result, what is checked)) for one blob."""
    blob = layout.blob_path(entry.digest)
    if not entry.chunks:
        return [
            (entry.size, _unless_unreadable(lambda: hash_file(blob)[0]), (entry, entry.digest, "content"))
        ]
    return [
        (
            length,
            _unless_unreadable(functools.partial(hash_range, blob, offset, length, entry.chunk_hash)),
            (entry, expected, f"chunk {index} (bytes {offset}..{offset + length - 1})"),
        )
        for index, ((offset, length), expected) in enumerate(
            zip(chunk_ranges(entry.size, entry.chunk_size), entry.chunks, strict=True)
        )
    ]


def _unless_unreadable(job: Callable[[], str]) -> Callable[[], str]:
    """The job's digest, or a note that matches no digest when the blob cannot be read as a file."""

    def guarded() -> str:
        try:
            return job()
        except OSError as exc:
            return f"unreadable ({exc.strerror})"

    return guarded


def _blob_shape_problem(layout: StoreLayout, path: str, entry: FileEntry) -> str | None:
    blob = layout.blob_path(entry.digest)
    try:
        info = blob.lstat()
    except FileNotFoundError:
        return f"file {path!r}: blob {entry.digest} is missing"
    if not stat.S_ISREG(info.st_mode):
        return f"file {path!r}: blob {entry.digest} is not a regular file"
    if info.st_size != entry.size:
        return f"file {path!r}: blob {entry.digest} has {info.st_size} bytes, manifest says {entry.size}"
    return None
