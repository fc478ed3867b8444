"""Hostile store contents, planted where root reads and writes: symbolic links, FIFOs, devices, huge and
deeply nested files, unsigned snapshots. Each is refused with the store's own error (or skipped), nothing
outside the store is written or read, and nothing hangs: GC runs in a child process with a time bound."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from warmstart.api.identity import SnapshotIdentity
from warmstart.checkpoint.restore import FailureCounter
from warmstart.host.fileio import UnsafeInput
from warmstart.snapshot.manifest import Manifest, SnapshotError, SnapshotInvalid
from warmstart.snapshot.signing import Signer, Verifier, signature_document
from warmstart.snapshot.signing_keys import signing_keys
from warmstart.snapshot.store import Snapshot, SnapshotStore

pytestmark = pytest.mark.reliability

GC_SECONDS = 120  # a generous bound for one gc in a child process on a loaded machine
IDENTITY = SnapshotIdentity(model_digest="sha256:" + "ab" * 32, engine="builtin", engine_version="x")
DEEP_ARRAY = b"[" * 100_000 + b"]" * 100_000
DEEP_OBJECT = b'{"a":' * 50_000 + b"1" + b"}" * 50_000
REFUSED: Counter[str] = Counter()  # bad inputs tried and refused, by kind (for the reliability table)


@dataclass
class Store:
    store: SnapshotStore
    signer: Signer
    verifier: Verifier
    snapshot: Snapshot
    outside: Path  # beside the store: must stay untouched

    @property
    def root(self) -> Path:
        return self.store.root


def make_store(tmp_path: Path, meta: dict[str, object] | None = None) -> Store:
    root = tmp_path / "store"
    root.mkdir()
    signer, verifier, _ = signing_keys(root, None)
    store = SnapshotStore(root)
    snapshot = publish(store, signer, {"criu/pages-1.img": b"pages" * 100}, meta)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_bytes(b"not the store's")
    return Store(store, signer, verifier, snapshot, outside)


def publish(
    store: SnapshotStore, signer: Signer, files: dict[str, bytes], meta: dict[str, object] | None = None
) -> Snapshot:
    with store.stage(IDENTITY, meta=meta) as staging:
        for relative, content in files.items():
            target = staging.dir / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content)
        return staging.publish(signer)


def tree_state(directory: Path) -> dict[str, tuple[int, int, int]]:
    """(mode, size, mtime_ns) of everything under `directory`: equal before and after means untouched."""
    found = {}
    for path in [directory, *directory.rglob("*")]:
        info = path.lstat()
        found[str(path.relative_to(directory))] = (info.st_mode, info.st_size, info.st_mtime_ns)
    return found


def age(path: Path, seconds: float = 10 * 86400) -> None:
    """Make `path` and what is under it look untouched for `seconds` (links themselves, not followed)."""
    when = os.lstat(path).st_mtime - seconds
    items = [path, *path.rglob("*")] if stat.S_ISDIR(path.lstat().st_mode) else [path]
    for item in items:
        os.utime(item, (when, when), follow_symlinks=False)


def gc_in_child(root: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """`warmstart snapshot gc` in a child process; a hang ends in TimeoutExpired, never blocks the suite."""
    return subprocess.run(
        [sys.executable, "-m", "warmstart", "snapshot", "gc", "--store", str(root), "--json", *extra],
        capture_output=True, text=True, timeout=GC_SECONDS,
    )  # fmt: skip


def plant(path: Path, kind: str, outside: Path) -> None:
    """Put a hostile thing at `path`: a FIFO, a device, a link to a device, a deep or a huge file."""
    path.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero's numbers
    elif kind == "link-to-zero":
        path.symlink_to("/dev/zero")
    elif kind == "link-outside":
        path.symlink_to(outside / "precious")
    elif kind == "deep":
        path.write_bytes(DEEP_ARRAY)
    elif kind == "deep-object":
        path.write_bytes(DEEP_OBJECT)
    elif kind == "huge":
        with open(path, "wb") as handle:
            handle.truncate(64 << 20)  # sparse: over every bound, cheap to make
    else:
        raise AssertionError(kind)


@pytest.fixture(scope="module", autouse=True)
def report_refusals(pytestconfig: pytest.Config) -> Iterator[None]:
    yield
    reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")
    capture = pytestconfig.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and REFUSED:
        total = sum(REFUSED.values())
        details = ", ".join(f"{kind} {count}" for kind, count in sorted(REFUSED.items()))
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"hostile store contents tried and refused: {total} ({details})")


KINDS = ["fifo", "device", "link-to-zero", "link-outside", "deep", "deep-object", "huge"]
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")


def kinds_for_files() -> list[object]:
    return [pytest.param(k, marks=needs_root) if k == "device" else k for k in KINDS]


# --- manifest and signature: read by list, get, verify, gc ----------------------------------------------


@pytest.mark.spawns
@pytest.mark.parametrize("name", ["manifest.json", "manifest.sig"])
@pytest.mark.parametrize("kind", kinds_for_files())
def test_hostile_manifest_or_signature_is_refused_and_gc_returns(
    tmp_path: Path, name: str, kind: str
) -> None:
    s = make_store(tmp_path)
    before = tree_state(s.outside)
    plant(s.snapshot.path / name, kind, s.outside)
    with pytest.raises(SnapshotInvalid, match="manifest"):
        s.store.verify(s.snapshot.id, s.verifier)
    if name == "manifest.json":
        with pytest.raises(SnapshotInvalid):
            s.store.get(s.snapshot.id)
    listed = s.store.list()  # skipped (a link or FIFO as manifest.sig: not a signed snapshot)
    assert listed == [] or [x.id for x in listed] == [s.snapshot.id]
    result = gc_in_child(s.root, "--blob-grace", "0")
    assert result.returncode in (0, 1), result.stderr
    assert "Traceback" not in result.stderr
    assert tree_state(s.outside) == before
    REFUSED[f"{name} {kind}"] += 1


@pytest.mark.spawns
@pytest.mark.parametrize("kind", kinds_for_files())
def test_hostile_staging_owner_does_not_hang_gc(tmp_path: Path, kind: str) -> None:
    s = make_store(tmp_path)
    before = tree_state(s.outside)
    staging = s.store.stage(IDENTITY)
    plant(staging.root / "owner.json", kind, s.outside)
    result = gc_in_child(s.root, "--staging-older-than", "0")
    assert result.returncode == 0, result.stderr
    assert staging.root.name in json.loads(result.stdout)["removed_staging"][0]
    assert tree_state(s.outside) == before
    REFUSED[f"owner.json {kind}"] += 1


@pytest.mark.spawns
def test_a_lock_held_by_gc_is_released_when_a_state_file_is_a_fifo(tmp_path: Path) -> None:
    """The FIFO hang held the exclusive lock: a delete after gc must go through."""
    s = make_store(tmp_path)
    staging = s.store.stage(IDENTITY)
    plant(staging.root / "owner.json", "fifo", s.outside)
    plant(s.snapshot.path / "manifest.json", "fifo", s.outside)
    assert gc_in_child(s.root).returncode in (0, 1)
    s.store.delete(s.snapshot.id)
    REFUSED["gc with FIFOs"] += 1


# --- symbolic links in the store's own directories ------------------------------------------------------


def test_publish_replaces_a_blob_that_is_a_link_and_never_touches_its_target(tmp_path: Path) -> None:
    s = make_store(tmp_path)
    content = b"weights" * 10
    target = s.outside / "same-size"
    target.write_bytes(b"x" * len(content))
    before = tree_state(s.outside)
    blob = s.store.blob_path("sha256:" + hashlib.sha256(content).hexdigest())
    blob.symlink_to(target)
    snapshot = publish(s.store, s.signer, {"w": content})
    assert stat.S_ISREG(blob.lstat().st_mode) and blob.read_bytes() == content
    s.store.verify(snapshot.id, s.verifier)
    assert tree_state(s.outside) == before
    REFUSED["blob link"] += 1


@pytest.mark.parametrize("directory", ["snapshots", "staging", "blobs", "blobs/sha256"])
def test_a_store_directory_that_is_a_link_is_refused(tmp_path: Path, directory: str) -> None:
    s = make_store(tmp_path)
    real = s.root / directory
    os.rename(real, s.outside / "moved")
    real.symlink_to(s.outside / "moved")
    before = tree_state(s.outside)
    with pytest.raises(SnapshotError, match="not a directory"):
        publish(s.store, s.signer, {"x": b"new bytes"})
    with pytest.raises(SnapshotError, match="not a directory"):
        s.store.gc(blob_grace=0)
    assert tree_state(s.outside) == before
    REFUSED[f"{directory} link"] += 1


def test_a_snapshot_directory_that_is_a_link_is_not_listed_nor_verified(tmp_path: Path) -> None:
    s = make_store(tmp_path)
    os.rename(s.snapshot.path, s.outside / "snap")
    s.snapshot.path.symlink_to(s.outside / "snap")
    assert s.store.list() == []
    with pytest.raises(SnapshotInvalid, match="not a directory"):
        s.store.verify(s.snapshot.id, s.verifier)
    REFUSED["snapshot dir link"] += 1


def test_materialise_refuses_a_destination_that_is_a_link(tmp_path: Path) -> None:
    s = make_store(tmp_path)
    destination = tmp_path / "images"
    destination.symlink_to(s.outside)
    before = tree_state(s.outside)
    with pytest.raises(SnapshotError, match="symbolic link"):
        s.store.materialize(s.snapshot.id, destination, s.verifier)
    assert tree_state(s.outside) == before
    REFUSED["materialise destination link"] += 1


@pytest.mark.parametrize("kind", ["directory-link", "fifo", "deep", "huge", "link-to-zero"])
def test_failure_counter_never_follows_or_hangs(tmp_path: Path, kind: str) -> None:
    s = make_store(tmp_path)
    before = tree_state(s.outside)
    counter = FailureCounter(s.root)
    failures = s.root / "restore-failures"
    if kind == "directory-link":
        failures.symlink_to(s.outside)
        with pytest.raises(UnsafeInput):
            counter.record(s.snapshot.id, "boom")
    else:
        failures.mkdir()
        plant(failures / f"{s.snapshot.id}.json", kind, s.outside)
    assert counter.count(s.snapshot.id) == 0 and counter.last_reason(s.snapshot.id) == ""
    assert not counter.invalid(s.snapshot.id)
    assert tree_state(s.outside) == before
    REFUSED[f"failure counter {kind}"] += 1


@pytest.mark.parametrize("count", [1e400, -5, True, "3", [3], None])
def test_failure_counter_refuses_counts_that_are_not_counts(tmp_path: Path, count: object) -> None:
    failures = tmp_path / "restore-failures"
    failures.mkdir()
    raw = json.dumps({"count": count}) if count != 1e400 else '{"count": 1e400}'
    (failures / "0123456789ab-20260101000000-abcdef.json").write_text(raw)
    assert FailureCounter(tmp_path).count("0123456789ab-20260101000000-abcdef") == 0
    REFUSED["failure counter value"] += 1


# --- unsigned snapshots ---------------------------------------------------------------------------------


def plant_unsigned_copy(s: Store) -> Path:
    """A newer-looking snapshot directory with a manifest but no manifest.sig."""
    manifest = json.loads((s.snapshot.path / "manifest.json").read_bytes())
    newer = s.snapshot.id[:13] + "29991231235959-ffffff"
    manifest["id"], manifest["created"] = newer, "2999-12-31T23:59:59.000000Z"
    directory = s.root / "snapshots" / newer
    directory.mkdir()
    (directory / "manifest.json").write_text(json.dumps(manifest))
    return directory


def test_an_unsigned_snapshot_is_not_listed_and_gc_collects_it_after_the_grace(tmp_path: Path) -> None:
    s = make_store(tmp_path)
    unsigned = plant_unsigned_copy(s)
    assert [x.id for x in s.store.list()] == [s.snapshot.id]
    assert s.store.gc().removed_unsigned == [] and unsigned.exists()  # within the grace period
    age(unsigned)
    report = s.store.gc()
    assert unsigned.name in report.removed_unsigned[0] and not unsigned.exists()
    s.store.verify(s.snapshot.id, s.verifier)
    REFUSED["unsigned snapshot"] += 1


def test_junk_under_a_snapshot_name_is_collected_and_never_followed(tmp_path: Path) -> None:
    s = make_store(tmp_path)
    before = tree_state(s.outside)
    link = s.root / "snapshots" / (s.snapshot.id[:13] + "29991231235959-eeeeee")
    link.symlink_to(s.outside)
    age(link)
    report = s.store.gc()
    assert link.name in report.removed_unsigned[0] and not os.path.lexists(link)
    assert tree_state(s.outside) == before
    REFUSED["snapshot name link"] += 1


# --- the CLI finds the store's own key ------------------------------------------------------------------


def test_snapshot_verify_uses_the_stores_own_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from warmstart.cli import main

    monkeypatch.delenv("WARMSTART_SIGNING_KEY", raising=False)
    s = make_store(tmp_path)
    assert main(["snapshot", "verify", s.snapshot.id, "--store", str(s.root), "--json"]) == 0


# --- listing: signatures before parsing, the directory's name is the id -----------------------------------


JUNK_MANIFEST_BYTES = 15 << 20  # just under the 16 MiB bound: costly to parse, free to hard-link


def plant_junk_snapshots(s: Store, count: int, signature: bytes) -> list[Path]:
    """`count` directories named like newer snapshots of the same identity, each holding a regular
    `manifest.sig` (`signature`) and a hard link to one near-limit JSON manifest."""
    junk = s.root / "junk-manifest.json"
    with open(junk, "wb") as handle:
        handle.write(b"{")
        handle.write(b'"k": 0, ' * ((JUNK_MANIFEST_BYTES - 16) // 8))
        handle.write(b'"k": 0}')
    planted = []
    for index in range(count):
        directory = s.root / "snapshots" / f"{s.snapshot.id[:13]}29991231235959-{index:06x}"
        directory.mkdir()
        os.link(junk, directory / "manifest.json")
        (directory / "manifest.sig").write_bytes(signature)
        planted.append(directory)
    return planted


def forged_signature(s: Store) -> bytes:
    """A signature document naming the store's real key (its id is no secret), with a made-up signature."""
    document = json.loads((s.snapshot.path / "manifest.sig").read_bytes())
    return json.dumps({**document, "signature": "AAAA" * 11}).encode()


@pytest.mark.parametrize("signature", ["junk", "another key", "forged"])
def test_listing_checks_signatures_before_a_manifest_is_parsed(
    tmp_path: Path, signature: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = make_store(tmp_path)
    other_signer, _, _ = signing_keys(tmp_path / "other", None)
    document = {
        "junk": b"\x00 not a signature",
        "another key": signature_document(other_signer, b"anything"),
        "forged": forged_signature(s),
    }[signature]
    plant_junk_snapshots(s, 20, document)
    parsed: list[bytes] = []
    real_parse = Manifest.from_bytes
    monkeypatch.setattr(
        Manifest, "from_bytes", classmethod(lambda cls, raw: parsed.append(raw) or real_parse(raw))
    )
    listed = s.store.list(IDENTITY.digest(), verifier=s.verifier)
    assert [x.id for x in listed] == [s.snapshot.id]
    assert len(parsed) == 1  # the real manifest only: no junk parsed, whatever its size
    with pytest.raises(SnapshotInvalid, match="manifest.sig"):
        s.store.get(f"{s.snapshot.id[:13]}29991231235959-000000", verifier=s.verifier)
    REFUSED[f"listed junk, {signature} signature"] += 20


def test_a_copied_snapshot_directory_is_not_a_second_snapshot(tmp_path: Path) -> None:
    s = make_store(tmp_path)
    copy = s.root / "snapshots" / f"{s.snapshot.id[:13]}29991231235959-c0ffee"
    shutil.copytree(s.snapshot.path, copy)
    for verifier in (s.verifier, None):
        assert [x.id for x in s.store.list(verifier=verifier)] == [s.snapshot.id]
    with pytest.raises(SnapshotInvalid, match="directory"):
        s.store.get(copy.name, verifier=s.verifier)
    REFUSED["copied snapshot directory"] += 1


def test_retention_counts_only_verified_snapshots(tmp_path: Path) -> None:
    s = make_store(tmp_path)
    plant_junk_snapshots(s, 3, forged_signature(s))
    assert s.store.apply_retention(1, verifier=s.verifier) == []
    s.store.verify(s.snapshot.id, s.verifier)
    REFUSED["forged snapshots at retention"] += 3


# --- publish: a blob already there is checked, a failed publish leaves no blob ----------------------------


def test_publish_replaces_a_planted_blob_of_the_right_size(tmp_path: Path) -> None:
    s = make_store(tmp_path)
    content = b"the real weights " * 100
    blob = s.store.blob_path("sha256:" + hashlib.sha256(content).hexdigest())
    blob.write_bytes(b"X" * len(content))  # planted before the capture that needs it
    blob.chmod(0o444)
    snapshot = publish(s.store, s.signer, {"w": content})
    s.store.verify(snapshot.id, s.verifier)  # valid at birth
    assert blob.read_bytes() == content
    REFUSED["planted blob of the right size"] += 1


def test_publish_replaces_a_blob_of_the_wrong_size(tmp_path: Path) -> None:
    s = make_store(tmp_path)
    content = b"the real weights " * 100
    blob = s.store.blob_path("sha256:" + hashlib.sha256(content).hexdigest())
    blob.write_bytes(content[:3])  # a blob cut short (a crash, a full disk) before a capture that needs it
    blob.chmod(0o444)
    snapshot = publish(s.store, s.signer, {"w": content})
    s.store.verify(snapshot.id, s.verifier)  # valid at birth
    assert blob.read_bytes() == content
    REFUSED["blob of the wrong size"] += 1


class FailingSigner:
    """A signer that fails as a full disk would, after every blob was ingested."""

    algorithm, key_id = "hmac-sha256", "0" * 16

    def sign(self, data: bytes) -> bytes:
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_failed_publish_removes_the_blobs_it_wrote_and_keeps_shared_ones(tmp_path: Path) -> None:
    s = make_store(tmp_path)
    shared = s.snapshot.files["criu/pages-1.img"]
    blobs_before = sorted(p.name for p in s.store.blobs_dir.iterdir())
    with pytest.raises(OSError, match="No space"):
        publish(s.store, FailingSigner(), {"criu/pages-1.img": b"pages" * 100, "own": b"only this one"})  # type: ignore[arg-type]
    assert sorted(p.name for p in s.store.blobs_dir.iterdir()) == blobs_before
    assert s.store.blob_path(shared.digest).exists()
    s.store.verify(s.snapshot.id, s.verifier)
    assert list(s.store.staging_dir.iterdir()) == []


@pytest.mark.spawns
def test_a_publish_that_fills_the_disk_frees_it_for_the_next_one(tmp_path: Path, small_mount) -> None:
    store = SnapshotStore(small_mount("1m") / "store")
    signer, _, _ = signing_keys(tmp_path / "keys", None)
    with store.stage(IDENTITY) as staging:
        fd = os.open(staging.dir / "pages.img", os.O_WRONLY | os.O_CREAT)
        try:
            while True:
                os.write(fd, b"p" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
        finally:
            os.close(fd)
        with pytest.raises(OSError, match="No space"):
            staging.publish(signer)  # its manifest finds no room
    snapshot = publish(store, signer, {"criu/pages-1.img": b"the next capture"})
    assert [x.id for x in store.list()] == [snapshot.id]
    REFUSED["full disk at publish"] += 1
