"""Verified-blob records on a real directory: a restore skips hashing only what it may believe unchanged."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from snapshot_helpers import write_files

from warmstart.api.identity import SnapshotIdentity
from warmstart.snapshot import Snapshot, SnapshotInvalid, SnapshotStore
from warmstart.snapshot import verify as verify_module
from warmstart.snapshot.signing import Signer, Verifier
from warmstart.snapshot.verified import RECORDS_DIR, VerifiedRecords, filesystem_type, records_wanted

FILES = {
    "criu/pages-1.img": os.urandom(3 << 20),  # chunked (the store below chunks at 1 MiB)
    "criu/core-1.img": b"core" * 1000,
}
BIG = "criu/pages-1.img"

Publish = Callable[..., Snapshot]


@pytest.fixture
def recording(tmp_path: Path) -> SnapshotStore:
    """A store whose restores keep verified records (the same directory as the `store` fixture's)."""
    return SnapshotStore(tmp_path / "store", chunk_size=1 << 20, verified_records=True)


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The blobs (by path) whose bytes verification reads, in the order it reads them."""
    reads: list[str] = []
    for name in ("hash_file", "hash_range"):
        real = getattr(verify_module, name)

        def counting(
            path: Path, *args: object, _real: Callable[..., object] = real, **kwargs: object
        ) -> object:
            reads.append(Path(path).name)
            return _real(path, *args, **kwargs)

        monkeypatch.setattr(verify_module, name, counting)
    return reads


def _blob(store: SnapshotStore, snapshot: Snapshot, relative: str = BIG) -> Path:
    return store.blob_path(snapshot.files[relative].digest)


def _overwrite_keeping_mode(path: Path, offset: int) -> None:
    """Flip a byte the way a writer would, then put the read-only mode back (the mtime moves with it)."""
    mode = path.stat().st_mode
    os.chmod(path, 0o644)
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
    os.chmod(path, mode)


def test_a_restore_hashes_a_blob_once_and_believes_its_record_after(
    recording: SnapshotStore, publish: Publish, verifier: Verifier, tmp_path: Path, hashed: list[str]
) -> None:
    snapshot = publish(FILES)
    recording.materialize(snapshot.id, tmp_path / "first", verifier)
    assert hashed, "the first restore hashes every blob"
    assert len(os.listdir(recording.root / RECORDS_DIR)) == 2
    hashed.clear()

    recording.materialize(snapshot.id, tmp_path / "second", verifier)
    assert hashed == []
    assert (tmp_path / "second" / BIG).read_bytes() == FILES[BIG]

    recording.verify(snapshot.id, verifier)  # an explicit verification hashes regardless
    assert _blob(recording, snapshot).name in hashed


@pytest.mark.parametrize("offset", [0, -1])
def test_a_blob_written_after_its_record_is_hashed_again_and_refused(
    recording: SnapshotStore, publish: Publish, verifier: Verifier, tmp_path: Path, offset: int
) -> None:
    snapshot = publish(FILES)
    recording.materialize(snapshot.id, tmp_path / "first", verifier)
    _overwrite_keeping_mode(_blob(recording, snapshot), offset)

    with pytest.raises(SnapshotInvalid, match=f"'{BIG}'.*corrupted"):
        recording.materialize(snapshot.id, tmp_path / "second", verifier)
    assert not (tmp_path / "second").exists()


def test_a_blob_replaced_by_another_file_is_hashed_again_and_refused(
    recording: SnapshotStore, publish: Publish, verifier: Verifier, tmp_path: Path
) -> None:
    """Another inode in the blob's place, even with the old size, mode and mtime, is not the recorded blob."""
    snapshot = publish(FILES)
    recording.materialize(snapshot.id, tmp_path / "first", verifier)
    blob = _blob(recording, snapshot)
    before = blob.stat()
    forged = blob.with_name("forged")
    forged.write_bytes(b"\0" * before.st_size)
    os.chmod(forged, 0o444)
    os.utime(forged, ns=(before.st_atime_ns, before.st_mtime_ns))
    os.replace(forged, blob)

    with pytest.raises(SnapshotInvalid, match="corrupted"):
        recording.materialize(snapshot.id, tmp_path / "second", verifier)


def test_hashing_every_time_catches_what_no_attribute_shows(
    store: SnapshotStore, recording: SnapshotStore, publish: Publish, verifier: Verifier, tmp_path: Path
) -> None:
    """The owner can put the mtime back after a write: only a store without records (or `verify`) sees it."""
    snapshot = publish(FILES)
    recording.materialize(snapshot.id, tmp_path / "first", verifier)
    blob = _blob(recording, snapshot)
    before = blob.stat()
    _overwrite_keeping_mode(blob, 7)
    os.utime(blob, ns=(before.st_atime_ns, before.st_mtime_ns))

    with pytest.raises(SnapshotInvalid, match="corrupted"):
        store.materialize(snapshot.id, tmp_path / "without-records", verifier)
    with pytest.raises(SnapshotInvalid, match="corrupted"):
        recording.verify(snapshot.id, verifier)


def _untrust_records_dir(root: Path) -> None:
    os.chmod(root / RECORDS_DIR, 0o777)


def _make_blob_writable(root: Path) -> None:
    for blob in (root / "blobs" / "sha256").iterdir():
        os.chmod(blob, 0o644)


def _replace_records_dir_with_link(root: Path) -> None:
    records = root / RECORDS_DIR
    shutil.move(records, root / "elsewhere")
    records.symlink_to(root / "elsewhere")


def _open_each_record_to_others(root: Path) -> None:
    for record in (root / RECORDS_DIR).iterdir():
        os.chmod(record, 0o666)


UNBELIEVABLE: dict[str, Callable[[Path], None]] = {
    "records directory writable by others": _untrust_records_dir,
    "records directory a symbolic link": _replace_records_dir_with_link,
    "record writable by others": _open_each_record_to_others,
    "blob with a write bit": _make_blob_writable,
}


@pytest.mark.parametrize("case", list(UNBELIEVABLE))
def test_records_that_someone_else_could_have_written_are_not_believed(
    recording: SnapshotStore,
    publish: Publish,
    verifier: Verifier,
    tmp_path: Path,
    hashed: list[str],
    case: str,
) -> None:
    snapshot = publish(FILES)
    recording.materialize(snapshot.id, tmp_path / "first", verifier)
    UNBELIEVABLE[case](recording.root)
    hashed.clear()

    recording.materialize(snapshot.id, tmp_path / "second", verifier)
    assert _blob(recording, snapshot).name in hashed


def test_a_record_is_of_one_chunk_list(
    recording: SnapshotStore, publish: Publish, verifier: Verifier, tmp_path: Path
) -> None:
    """The same blob pinned by other chunk digests (another signed manifest) is hashed against those."""
    snapshot = publish(FILES)
    recording.materialize(snapshot.id, tmp_path / "first", verifier)
    entry = snapshot.files[BIG]
    other = type(entry)(
        entry.digest, entry.size, entry.mode, entry.chunk_size, ("0" * 64,) * 3, entry.chunk_hash
    )
    state = recording.records.state(_blob(recording, snapshot)) if recording.records else None
    assert state is not None
    assert recording.records is not None and recording.records.holds(entry, state)
    assert not recording.records.holds(other, state)


def test_no_record_is_believed_on_a_network_filesystem(
    recording: SnapshotStore, publish: Publish, verifier: Verifier, tmp_path: Path
) -> None:
    snapshot = publish(FILES)
    blob = _blob(recording, snapshot)
    device = blob.stat().st_dev
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        f"36 25 {os.major(device)}:{os.minor(device)} / {recording.root} rw - nfs4 server:/export rw\n"
    )
    filesystem_type.cache_clear()
    try:
        assert VerifiedRecords(recording.root, mountinfo=mountinfo).state(blob) is None
        assert filesystem_type(device, mountinfo) == "nfs4"
    finally:
        filesystem_type.cache_clear()


def test_gc_removes_the_records_of_removed_blobs(
    recording: SnapshotStore, publish: Publish, verifier: Verifier, tmp_path: Path
) -> None:
    kept = publish(FILES)
    gone = publish({"criu/other.img": os.urandom(1000)})
    recording.materialize(kept.id, tmp_path / "kept", verifier)
    recording.materialize(gone.id, tmp_path / "gone", verifier)
    assert len(os.listdir(recording.root / RECORDS_DIR)) == 3

    recording.delete(gone.id)
    recording.gc(staging_older_than=0, blob_grace=0)

    left = os.listdir(recording.root / RECORDS_DIR)
    assert len(left) == 2
    assert {name.split("-", 1)[0] for name in left} == {p.name for p in recording.blobs_dir.iterdir()}


@pytest.mark.parametrize(("value", "wanted"), [(None, True), ("1", True), ("0", False), ("off", False)])
def test_records_are_on_unless_turned_off(
    monkeypatch: pytest.MonkeyPatch, value: str | None, wanted: bool
) -> None:
    if value is None:
        monkeypatch.delenv("WARMSTART_VERIFIED_RECORDS", raising=False)
    else:
        monkeypatch.setenv("WARMSTART_VERIFIED_RECORDS", value)
    assert records_wanted() is wanted


def test_a_blob_that_changed_while_it_was_hashed_gets_no_record(
    recording: SnapshotStore,
    publish: Publish,
    verifier: Verifier,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    snapshot = publish(FILES)
    blob = _blob(recording, snapshot)
    real = verify_module.hash_range

    def touched_meanwhile(path: Path, *args: object) -> str:
        os.utime(blob, ns=(0, blob.stat().st_mtime_ns + 1))  # a write would move the mtime like this
        return real(path, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(verify_module, "hash_range", touched_meanwhile)
    recording.materialize(snapshot.id, tmp_path / "first", verifier)

    records = os.listdir(recording.root / RECORDS_DIR)
    assert [name for name in records if name.startswith(blob.name)] == []
    assert len(records) == 1  # the small blob, hashed whole, unchanged


def test_a_snapshot_published_by_a_recording_store_is_restored_without_hashing(
    recording: SnapshotStore,
    signer: Signer,
    verifier: Verifier,
    identity: SnapshotIdentity,
    tmp_path: Path,
    hashed: list[str],
) -> None:
    """The publisher hashed every blob it stored: its records spare the first restore the same work."""
    with recording.stage(identity) as staging:
        write_files(staging.dir, FILES)
        snapshot = staging.publish(signer)
    hashed.clear()

    recording.materialize(snapshot.id, tmp_path / "first", verifier)
    assert hashed == []
    _overwrite_keeping_mode(_blob(recording, snapshot), 3)
    with pytest.raises(SnapshotInvalid, match="corrupted"):
        recording.materialize(snapshot.id, tmp_path / "second", verifier)
