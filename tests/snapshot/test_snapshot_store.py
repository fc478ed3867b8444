"""The snapshot store on a real directory: publish, list, verify, materialise, dedupe, refusals, GC."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import socket
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
import pytest
from snapshot_helpers import make_identity, write_files

from warmstart.api.identity import SnapshotIdentity
from warmstart.snapshot import (
    IdentityMismatch,
    Snapshot,
    SnapshotError,
    SnapshotInvalid,
    SnapshotNotFound,
    SnapshotStore,
    generate_hmac_key,
    load_verifier,
)
from warmstart.snapshot import gc as gc_module
from warmstart.snapshot.signing import Signer, Verifier, signature_document

FILES = {
    "criu/pages-1.img": os.urandom(3 << 20),
    "criu/core-1.img": b"core" * 1000,
    "criu/empty.img": b"",
    "bin/run.sh": b"#!/bin/sh\necho hi\n",
    "notes.txt": b"read only\n",
}
MODES = {"criu/pages-1.img": 0o600, "bin/run.sh": 0o755, "notes.txt": 0o444}

Publish = Callable[..., Snapshot]


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def blob_files(store: SnapshotStore) -> list[Path]:
    return sorted(store.blobs_dir.iterdir())


# --- round trip ------------------------------------------------------------------------------------------


def test_round_trip_publish_list_verify_materialise(
    store: SnapshotStore, publish: Publish, verifier: Verifier, identity: SnapshotIdentity, tmp_path: Path
) -> None:
    snapshot = publish(FILES, MODES, meta={"model": "tiny"})

    assert [s.id for s in store.list()] == [snapshot.id]
    assert snapshot.id.startswith(identity.digest()[:12])
    assert store.get(snapshot.id).manifest == snapshot.manifest
    assert snapshot.timings["criu_dump"] == 1.5 and "store_hash" in snapshot.timings
    assert snapshot.node == {"name": "node-a"} and snapshot.record.model == "tiny"
    assert snapshot.size == sum(len(content) for content in FILES.values())
    assert list(store.staging_dir.iterdir()) == []  # staging cleaned up after publish

    store.verify(snapshot.id, verifier, identity)

    copied = tmp_path / "copied"
    store.materialize(snapshot.id, copied, verifier, link=False)
    linked = tmp_path / "linked"
    store.materialize(snapshot.id, linked, verifier)
    for relative, content in FILES.items():
        recorded = MODES.get(relative, 0o644)
        assert snapshot.files[relative].mode == recorded
        assert (copied / relative).read_bytes() == content
        assert mode_of(copied / relative) == recorded
        assert (linked / relative).read_bytes() == content
        # A hardlink shares the immutable blob's inode: the recorded mode without its write bits.
        assert mode_of(linked / relative) == recorded & 0o555
        assert (linked / relative).stat().st_ino == store.blob_path(
            snapshot.files[relative].digest
        ).stat().st_ino
        assert (copied / relative).stat().st_ino != (linked / relative).stat().st_ino


def test_blobs_are_read_only_and_named_by_their_sha256(store: SnapshotStore, publish: Publish) -> None:
    snapshot = publish(FILES, MODES)
    for relative, content in FILES.items():
        blob = store.blob_path(snapshot.files[relative].digest)
        assert blob.name == hashlib.sha256(content).hexdigest()
        assert mode_of(blob) & 0o222 == 0


def test_large_files_carry_chunk_digests(store: SnapshotStore, publish: Publish) -> None:
    snapshot = publish(FILES, MODES)
    pages = FILES["criu/pages-1.img"]
    entry = snapshot.files["criu/pages-1.img"]
    assert entry.chunk_size == 1 << 20 and entry.chunk_hash == "blake3"
    assert entry.chunks == tuple(
        blake3.blake3(pages[i : i + (1 << 20)]).hexdigest() for i in range(0, 3 << 20, 1 << 20)
    )
    assert snapshot.files["criu/core-1.img"].chunks == ()  # small files: the whole-file digest suffices


def test_a_v1_manifest_with_sha256_chunk_digests_still_verifies_and_refuses_a_flipped_byte(
    store: SnapshotStore, publish: Publish, signer: Signer, verifier: Verifier
) -> None:
    snapshot = publish(FILES, MODES)
    pages = FILES["criu/pages-1.img"]

    def as_v1(manifest: dict[str, Any]) -> None:  # what a store wrote before chunks named their hash
        manifest["schema"] = "warmstart.dev/snapshot-manifest/v1"
        entry = manifest["files"]["criu/pages-1.img"]
        del entry["chunk_hash"]
        entry["chunks"] = [
            hashlib.sha256(pages[i : i + (1 << 20)]).hexdigest() for i in range(0, 3 << 20, 1 << 20)
        ]

    _rewrite_manifest(snapshot, signer, as_v1)
    assert store.verify(snapshot.id, verifier).files["criu/pages-1.img"].chunk_hash == "sha256"
    _flip_byte(store.blob_path(snapshot.files["criu/pages-1.img"].digest), (2 << 20) + 5)
    with pytest.raises(SnapshotInvalid, match="chunk 2 .* does not match"):
        store.verify(snapshot.id, verifier)


def test_an_unknown_chunk_hash_is_refused_naming_the_field(
    store: SnapshotStore, publish: Publish, signer: Signer, verifier: Verifier
) -> None:
    snapshot = publish(FILES, MODES)
    _rewrite_manifest(snapshot, signer, lambda m: m["files"]["criu/pages-1.img"].update(chunk_hash="md5"))
    with pytest.raises(SnapshotInvalid, match=r"files\['criu/pages-1.img'\]: chunk_hash must be one of"):
        store.verify(snapshot.id, verifier)


def test_chunk_digests_can_be_turned_off(
    tmp_path: Path, identity: SnapshotIdentity, signer: Signer, verifier: Verifier
) -> None:
    plain = SnapshotStore(tmp_path / "plain", chunk_size=0)
    with plain.stage(identity) as staging:
        write_files(staging.dir, FILES)
        snapshot = staging.publish(signer)
    assert all(entry.chunks == () for entry in snapshot.files.values())
    _flip_byte(plain.blob_path(snapshot.files["criu/pages-1.img"].digest), 1 << 20)
    with pytest.raises(
        SnapshotInvalid, match="'criu/pages-1.img': blob sha256:[0-9a-f]+ content does not match"
    ):
        plain.verify(snapshot.id, verifier)
    with pytest.raises(ValueError, match="chunk_size must be 0"):
        SnapshotStore(tmp_path / "x", chunk_size=4096)


def test_manifest_is_canonical_json_with_the_identity(store: SnapshotStore, publish: Publish) -> None:
    snapshot = publish({"a": b"1"})
    manifest = json.loads((snapshot.path / "manifest.json").read_bytes())
    assert manifest["identity_hash"] == SnapshotIdentity.from_dict(manifest["identity"]).digest()
    assert manifest["files"]["a"] == {
        "digest": "sha256:" + hashlib.sha256(b"1").hexdigest(),
        "size": 1,
        "mode": 0o644,
    }
    signature = json.loads((snapshot.path / "manifest.sig").read_bytes())
    assert set(signature) == {"algorithm", "key_id", "signature"}


@pytest.mark.parametrize(
    ("prefix", "reason"), [("nothing/", "no files under prefix"), ("../", "not a relative")]
)
def test_verify_refuses_bad_prefixes(
    store: SnapshotStore, publish: Publish, verifier: Verifier, prefix: str, reason: str
) -> None:
    snapshot = publish(FILES, MODES)
    with pytest.raises((SnapshotInvalid, ValueError), match=reason):
        store.verify(snapshot.id, verifier, prefix=prefix)


def test_materialise_refuses_a_non_empty_destination(
    store: SnapshotStore, publish: Publish, verifier: Verifier, tmp_path: Path
) -> None:
    snapshot = publish(FILES)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(SnapshotError, match="not empty"):
        store.materialize(snapshot.id, tmp_path / "busy", verifier)


# --- deduplication ---------------------------------------------------------------------------------------


def test_identical_files_are_stored_once(
    store: SnapshotStore, publish: Publish, verifier: Verifier, tmp_path: Path
) -> None:
    shared = os.urandom(1 << 20)
    first = publish({"criu/lib.img": shared, "criu/own.img": b"first", "copy/lib.img": shared})
    second = publish({"criu/lib.img": shared, "criu/own.img": b"second"})

    assert first.files["criu/lib.img"].digest == second.files["criu/lib.img"].digest
    assert len(blob_files(store)) == 3  # shared, first's own, second's own
    store.materialize(first.id, tmp_path / "a", verifier)
    store.materialize(second.id, tmp_path / "b", verifier)
    inodes = {(tmp_path / d / "criu/lib.img").stat().st_ino for d in ("a", "b")}
    inodes.add((tmp_path / "a" / "copy/lib.img").stat().st_ino)
    assert len(inodes) == 1


# --- refusals --------------------------------------------------------------------------------------------


def _flip_byte(path: Path, offset: int) -> None:
    os.chmod(path, 0o644)
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _rewrite_manifest(snapshot: Snapshot, signer: Signer, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit the manifest and sign it again with the real key: only the content checks can refuse it."""
    manifest = json.loads((snapshot.path / "manifest.json").read_bytes())
    edit(manifest)
    raw = json.dumps(manifest).encode()
    (snapshot.path / "manifest.json").write_bytes(raw)
    (snapshot.path / "manifest.sig").write_bytes(signature_document(signer, raw))


def _rename_file(old: str, new: str) -> Callable[[dict[str, Any]], None]:
    def edit(manifest: dict[str, Any]) -> None:
        manifest["files"][new] = manifest["files"].pop(old)

    return edit


def _blob(store: SnapshotStore, snapshot: Snapshot, relative: str) -> Path:
    return store.blob_path(snapshot.files[relative].digest)


TAMPERINGS: dict[str, tuple[Callable[[SnapshotStore, Snapshot, Signer], None], list[str]]] = {
    "flipped byte, first byte of the big blob": (
        lambda st, sn, _: _flip_byte(_blob(st, sn, "criu/pages-1.img"), 0),
        ["'criu/pages-1.img'", "corrupted"],
    ),
    "flipped byte, last byte of the big blob": (
        lambda st, sn, _: _flip_byte(_blob(st, sn, "criu/pages-1.img"), -1),
        ["'criu/pages-1.img'", "chunk 2 (bytes 2097152..3145727) does not match", "corrupted"],
    ),
    "flipped byte, last byte of a small blob": (
        lambda st, sn, _: _flip_byte(_blob(st, sn, "bin/run.sh"), -1),
        ["'bin/run.sh'", "corrupted"],
    ),
    "flipped byte, middle of a blob": (
        lambda st, sn, _: _flip_byte(_blob(st, sn, "criu/core-1.img"), 2000),
        ["'criu/core-1.img'", "corrupted"],
    ),
    "truncated blob": (
        lambda st, sn, _: os.truncate(_blob(st, sn, "notes.txt"), 3),
        ["'notes.txt'", "has 3 bytes, manifest says 10"],
    ),
    "missing blob": (
        lambda st, sn, _: _blob(st, sn, "criu/core-1.img").unlink(),
        ["'criu/core-1.img'", "is missing"],
    ),
    "edited manifest": (
        lambda st, sn, _: (sn.path / "manifest.json").write_bytes(
            (sn.path / "manifest.json").read_bytes().replace(b'"node-a"', b'"node-b"')
        ),
        ["manifest.sig", "manifest was modified"],
    ),
    "missing signature": (
        lambda st, sn, _: (sn.path / "manifest.sig").unlink(),
        ["manifest.sig is missing", "unsigned"],
    ),
    "missing manifest": (
        lambda st, sn, _: (sn.path / "manifest.json").unlink(),
        ["manifest.json is missing"],
    ),
    "path with ..": (
        lambda st, sn, signer: _rewrite_manifest(sn, signer, _rename_file("notes.txt", "../../etc/cron.d/x")),
        ["'../../etc/cron.d/x'", "'..'"],
    ),
    "absolute path": (
        lambda st, sn, signer: _rewrite_manifest(sn, signer, _rename_file("notes.txt", "/etc/shadow")),
        ["'/etc/shadow'", "absolute"],
    ),
    "backslash path": (
        lambda st, sn, signer: _rewrite_manifest(sn, signer, _rename_file("notes.txt", "criu\\..\\x")),
        ["backslash"],
    ),
    "empty path": (
        lambda st, sn, signer: _rewrite_manifest(sn, signer, _rename_file("notes.txt", "")),
        ["file path is empty"],
    ),
    "identity hash not matching the identity": (
        lambda st, sn, signer: _rewrite_manifest(sn, signer, lambda m: m.update(identity_hash="0" * 64)),
        ["'identity_hash'"],
    ),
    "identity edited under its hash": (
        lambda st, sn, signer: _rewrite_manifest(sn, signer, lambda m: m["identity"].update(engine="vllm")),
        ["'identity_hash'", "identity hashes to"],
    ),
    "manifest id of another snapshot": (
        lambda st, sn, signer: _rewrite_manifest(
            sn,
            signer,
            lambda m: m.update(id=m["id"][:-6] + ("000000" if m["id"][-6:] != "000000" else "111111")),
        ),
        ["manifest field 'id'", "snapshot directory"],
    ),
    "malformed digest": (
        lambda st, sn, signer: _rewrite_manifest(
            sn, signer, lambda m: m["files"]["notes.txt"].update(digest="md5:1234")
        ),
        ["'notes.txt'", "sha256:<64 lowercase hex>"],
    ),
    "setuid mode": (
        lambda st, sn, signer: _rewrite_manifest(
            sn, signer, lambda m: m["files"]["bin/run.sh"].update(mode=0o4755)
        ),
        ["'bin/run.sh'", "mode"],
    ),
    "chunk list of the wrong length": (
        lambda st, sn, signer: _rewrite_manifest(
            sn, signer, lambda m: m["files"]["criu/pages-1.img"]["chunks"].pop()
        ),
        ["'criu/pages-1.img'", "chunks must list 3"],
    ),
    "unknown schema": (
        lambda st, sn, signer: _rewrite_manifest(sn, signer, lambda m: m.update(schema="other/v9")),
        ["'schema'"],
    ),
}


@pytest.mark.parametrize("case", list(TAMPERINGS))
def test_tampering_is_refused_with_a_reason_naming_the_fault(
    store: SnapshotStore, publish: Publish, signer: Signer, verifier: Verifier, tmp_path: Path, case: str
) -> None:
    snapshot = publish(FILES, MODES)
    store.verify(snapshot.id, verifier)  # sound before the tampering
    tamper, expected = TAMPERINGS[case]
    tamper(store, snapshot, signer)

    with pytest.raises(SnapshotInvalid) as caught:
        store.verify(snapshot.id, verifier)
    for fragment in expected:
        assert fragment in caught.value.reason
    assert snapshot.id in str(caught.value)

    with pytest.raises(SnapshotInvalid):  # materialise verifies first and builds nothing
        store.materialize(snapshot.id, tmp_path / "out", verifier)
    assert not (tmp_path / "out").exists()


def test_wrong_key_is_refused(store: SnapshotStore, publish: Publish, tmp_path: Path) -> None:
    snapshot = publish(FILES)
    other = load_verifier(generate_hmac_key(tmp_path / "other.key"))
    with pytest.raises(SnapshotInvalid, match=r"manifest.sig: signed with key \w+ but .* wrong key"):
        store.verify(snapshot.id, other)


def test_identity_mismatch_lists_each_field(
    store: SnapshotStore, publish: Publish, verifier: Verifier
) -> None:
    snapshot = publish(FILES)
    elsewhere = make_identity(engine_version="2.0", dtype="bfloat16")
    with pytest.raises(IdentityMismatch) as caught:
        store.verify(snapshot.id, verifier, elsewhere)
    assert caught.value.mismatches == [
        "dtype: snapshot has 'float32', here is 'bfloat16'",
        "engine_version: snapshot has '1.0', here is '2.0'",
    ]


def test_a_prefix_verification_hashes_only_that_prefix(
    store: SnapshotStore, publish: Publish, verifier: Verifier
) -> None:
    snapshot = publish(FILES, MODES)
    _flip_byte(_blob(store, snapshot, "bin/run.sh"), 0)
    store.verify(snapshot.id, verifier, prefix="criu/")
    with pytest.raises(SnapshotInvalid, match="'bin/run.sh'"):
        store.verify(snapshot.id, verifier, prefix="bin/")


def test_unknown_and_malformed_ids(store: SnapshotStore, publish: Publish, verifier: Verifier) -> None:
    publish({"a": b"1"})
    with pytest.raises(SnapshotNotFound, match="no snapshot"):
        store.get("0123456789ab-20260101000000-abcdef")
    with pytest.raises(SnapshotNotFound, match="not a snapshot id"):
        store.verify("../../etc", verifier)


# --- staging ---------------------------------------------------------------------------------------------


def test_leaving_staging_without_publish_removes_it(store: SnapshotStore, identity: SnapshotIdentity) -> None:
    with store.stage(identity) as staging:
        write_files(staging.dir, {"criu/a.img": b"a"})
    assert not staging.root.exists()
    with pytest.raises(RuntimeError, match="capture failed"), store.stage(identity) as failing:
        write_files(failing.dir, {"criu/a.img": b"a"})
        raise RuntimeError("capture failed")
    assert not failing.root.exists()
    assert store.list() == [] and blob_files(store) == []


@pytest.mark.parametrize(
    ("prepare", "reason"),
    [
        (lambda d: None, "holds no files"),
        (lambda d: (d / "link").symlink_to("/etc/passwd"), "'link' is not a regular file"),
        (lambda d: (d / "bad\\name").write_bytes(b"x"), "backslash"),
    ],
)
def test_publish_refuses_what_cannot_be_stored(
    store: SnapshotStore,
    identity: SnapshotIdentity,
    signer: Signer,
    prepare: Callable[[Path], None],
    reason: str,
) -> None:
    with store.stage(identity) as staging:
        prepare(staging.dir)
        with pytest.raises(SnapshotError, match=reason):
            staging.publish(signer)
    assert store.list() == []


def test_publish_twice_is_refused(store: SnapshotStore, identity: SnapshotIdentity, signer: Signer) -> None:
    with store.stage(identity) as staging:
        write_files(staging.dir, {"a": b"1"})
        staging.publish(signer)
        with pytest.raises(SnapshotError, match="published already"):
            staging.publish(signer)


# --- gc, retention ---------------------------------------------------------------------------


def test_gc_keeps_referenced_blobs_and_removes_unreferenced(
    store: SnapshotStore, publish: Publish, verifier: Verifier
) -> None:
    shared = os.urandom(4096)
    first = publish({"shared": shared, "own": b"first only"})
    second = publish({"shared": shared, "own": b"second only"})
    store.delete(first.id)

    dry = store.gc(blob_grace=0, dry_run=True)
    assert dry.removed_blobs == [first.files["own"].digest]
    assert len(blob_files(store)) == 3  # a dry run removes nothing

    report = store.gc(blob_grace=0)
    assert report.removed_blobs == [first.files["own"].digest]
    assert report.freed_bytes == len(b"first only")
    assert report.referenced_blobs == 2
    assert {b.name for b in blob_files(store)} == {
        second.files["shared"].digest[7:],
        second.files["own"].digest[7:],
    }
    store.verify(second.id, verifier)


def test_gc_grace_keeps_recent_unreferenced_blobs(store: SnapshotStore, publish: Publish) -> None:
    snapshot = publish({"w": b"weights not referenced any more"})
    digest = snapshot.files["w"].digest
    store.delete(snapshot.id)
    report = store.gc()
    assert report.young_blobs == [digest] and report.removed_blobs == []
    assert store.blob_path(digest).is_file()
    os.utime(store.blob_path(digest), (1, 1))  # as if added long ago
    assert store.gc().removed_blobs == [digest]


def test_gc_removes_no_blob_when_a_manifest_cannot_be_read(
    store: SnapshotStore, publish: Publish, monkeypatch: pytest.MonkeyPatch
) -> None:
    kept = publish({"a": b"kept"})
    store.delete(publish({"b": b"orphan"}).id)

    def failing_read(path: object, limit: int, **kwargs: object) -> bytes:
        raise OSError(errno.EIO, "Input/output error", str(path))

    monkeypatch.setattr(gc_module, "read_regular_file", failing_read)
    report = store.gc(blob_grace=0)
    assert report.removed_blobs == []
    assert kept.id in report.errors[0]


def test_gc_frees_blobs_whatever_junk_a_manifest_holds(store: SnapshotStore, publish: Publish) -> None:
    """Junk names no blob (it cannot block gc for ever); a manifest of any shape that names digests in
    `files` keeps them (a newer schema keeps its blobs)."""
    junk = publish({"a": b"junk manifest"})
    newer = publish({"c": b"newer schema"})
    orphan = publish({"b": b"orphan"})
    store.delete(orphan.id)
    (junk.path / "manifest.json").write_bytes(b"{broken")
    manifest = json.loads((newer.path / "manifest.json").read_bytes())
    (newer.path / "manifest.json").write_text(json.dumps({**manifest, "schema": "from-the-future"}))
    report = store.gc(blob_grace=0)
    assert sorted(report.removed_blobs) == sorted([junk.files["a"].digest, orphan.files["b"].digest])
    assert report.errors == [] and store.blob_path(newer.files["c"].digest).exists()
    assert junk.path.exists()  # within the grace period
    assert junk.id in store.gc(staging_older_than=0).removed_unsigned[0] and not junk.path.exists()


def test_gc_keeps_live_staging_and_removes_abandoned(
    store: SnapshotStore, identity: SnapshotIdentity
) -> None:
    with store.stage(identity) as live:
        write_files(live.dir, {"a": b"1"})
        foreign_fresh = store.staging_dir / "fresh-from-another-node"
        foreign_old = store.staging_dir / "old-from-another-node"
        for directory in (foreign_fresh, foreign_old):
            (directory / "files").mkdir(parents=True)
            owner = {"pid": os.getpid(), "host": f"{socket.gethostname()}-elsewhere/boot", "pid_start": 0}
            (directory / "owner.json").write_text(json.dumps(owner))
        for path in (foreign_old, foreign_old / "files", foreign_old / "owner.json"):
            os.utime(path, (1, 1))

        report = store.gc(staging_older_than=60)

        removed = [entry.split(" ")[0] for entry in report.removed_staging]
        assert removed == ["old-from-another-node"]
        assert live.root.exists() and foreign_fresh.exists() and not foreign_old.exists()


def test_gc_removes_staging_whose_owner_pid_was_reused(
    store: SnapshotStore, identity: SnapshotIdentity
) -> None:
    with store.stage(identity) as staging:
        owner = json.loads((staging.root / "owner.json").read_text())
        owner["pid_start"] = owner["pid_start"] + 1  # same pid, another process start: not our owner
        (staging.root / "owner.json").write_text(json.dumps(owner))
        report = store.gc()
        assert not staging.root.exists()
        assert "is gone" in report.removed_staging[0]


def test_retention_keeps_the_newest_per_identity(store: SnapshotStore, publish: Publish) -> None:
    other = make_identity(engine_version="9")
    mine = [publish({"f": f"mine {i}".encode()}) for i in range(3)]
    theirs = [publish({"f": f"theirs {i}".encode()}, snapshot_identity=other) for i in range(2)]

    assert store.apply_retention(2, other.digest(), dry_run=True) == []
    assert store.apply_retention(1, mine[0].identity_hash[:12]) == [mine[1].id, mine[0].id]
    assert {s.id for s in store.list()} == {mine[2].id, theirs[0].id, theirs[1].id}
    assert store.apply_retention(1) == [theirs[0].id]
    with pytest.raises(ValueError, match="non-negative"):
        store.apply_retention(-1)


def test_list_is_newest_first_and_filters_by_identity(store: SnapshotStore, publish: Publish) -> None:
    other = make_identity(engine_version="9")
    first, second = publish({"a": b"1"}), publish({"a": b"2"})
    third = publish({"a": b"3"}, snapshot_identity=other)
    assert [s.id for s in store.list()] == [third.id, second.id, first.id]
    assert [s.id for s in store.list(first.identity_hash)] == [second.id, first.id]
    assert [s.id for s in store.list(other.digest()[:8])] == [third.id]


def test_a_missing_store_is_named(tmp_path: Path) -> None:
    with pytest.raises(SnapshotError, match="does not exist"):
        SnapshotStore(tmp_path / "nowhere").list()
