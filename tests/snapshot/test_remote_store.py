"""The remote store against a real S3 server (Versity's gateway on loopback): push, pull, refusals, an
interrupted push, a server stopped mid-pull, GC in the bucket, and the node cache's bound."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import snapshot_helpers
from control_plane.s3 import S3Server
from s3_plugin import BUCKET, StartS3
from support import python_path_env

from warmstart.snapshot import Snapshot, SnapshotError, SnapshotInvalid, SnapshotNotFound, SnapshotStore
from warmstart.snapshot.remote import (
    Credentials,
    Progress,
    RemoteAccessDenied,
    RemoteConfig,
    RemoteConfigError,
    RemoteError,
    RemoteStore,
    RemoteUnavailable,
    mark_used,
    trim_cache,
)
from warmstart.snapshot.remote.cache import BlobHolds
from warmstart.snapshot.remote.object_keys import Keys
from warmstart.snapshot.signing import Verifier

HELPERS_DIR = Path(snapshot_helpers.__file__).parent
PREFIX = "cluster-a/"
MIB = 1 << 20

# The store fixture chunks files above 1 MiB: `pages` has 6 signed chunks and, at 6 MiB, is uploaded
# multipart (5 MiB parts); `shared` is stored once though two files hold it; `empty` is a zero-byte object.
PAGES = os.urandom(6 * MIB + 123)
SHARED = os.urandom(200_000)
FILES = {
    "criu/pages-1.img": PAGES,
    "criu/core-1.img": b"core" * 1000,
    "criu/shared-a.img": SHARED,
    "criu/shared-b.img": SHARED,
    "criu/empty.img": b"",
    "bin/run.sh": b"#!/bin/sh\necho hi\n",
}
MODES = {"bin/run.sh": 0o755, "criu/pages-1.img": 0o600}

Publish = Callable[..., Snapshot]


def config_for(server: S3Server, **overrides: Any) -> RemoteConfig:
    settings: dict[str, Any] = {
        "bucket": BUCKET,
        "endpoint": server.endpoint,
        "prefix": PREFIX,
        "credentials": Credentials(server.access_key_id, server.secret_access_key),
        "part_size": 5 * MIB,
        "multipart_threshold": 5 * MIB,
        "concurrency": 4,
    }
    settings.update(overrides)
    return RemoteConfig(**settings)


def object_path(server: S3Server, key: str) -> Path:
    """Where the gateway keeps an object: a file under the bucket's directory."""
    return server.data_dir / BUCKET / key


def blob_object(server: S3Server, digest: str) -> Path:
    return object_path(server, Keys(PREFIX).blob(digest))


def fresh_store(tmp_path: Path, name: str) -> SnapshotStore:
    return SnapshotStore(tmp_path / name, chunk_size=MIB)


def assert_nothing_published(store: SnapshotStore) -> None:
    """No snapshot, no blob, no staging directory left behind."""
    assert store.list() == []
    for directory in (store.snapshots_dir, store.blobs_dir, store.staging_dir):
        assert not directory.exists() or list(directory.iterdir()) == []


def materialised(store: SnapshotStore, snapshot_id: str, verifier: Verifier, dest: Path) -> dict[str, bytes]:
    store.materialize(snapshot_id, dest, verifier, link=False)
    return {
        path.relative_to(dest).as_posix(): path.read_bytes() for path in dest.rglob("*") if path.is_file()
    }


@pytest.fixture
def remote(s3_server: S3Server, store: SnapshotStore) -> RemoteStore:
    return RemoteStore(store, config_for(s3_server))


# --- round trip ------------------------------------------------------------------------------------------


@pytest.mark.spawns
def test_push_then_pull_on_another_node_round_trips_byte_for_byte(
    s3_server: S3Server, remote: RemoteStore, publish: Publish, verifier: Verifier, tmp_path: Path
) -> None:
    snapshot = publish(FILES, MODES)
    distinct = {entry.digest: entry.size for entry in snapshot.files.values()}

    pushed = remote.push(snapshot.id, verifier=verifier)

    assert sorted(pushed.uploaded) == sorted(distinct) and pushed.skipped == []
    assert pushed.stats.bytes_transferred == sum(distinct.values())
    assert [listed.id for listed in remote.list()] == [snapshot.id]
    for digest, size in distinct.items():  # the server's own files hold the blobs' bytes
        assert blob_object(s3_server, digest).read_bytes() == remote.local.blob_path(digest).read_bytes()
        assert blob_object(s3_server, digest).stat().st_size == size
    e_tags = {digest: remote.client.head(Keys(PREFIX).blob(digest)).e_tag for digest in distinct}  # type: ignore[union-attr]
    pages = snapshot.files["criu/pages-1.img"].digest
    assert str(e_tags.pop(pages)).endswith('-2"')  # multipart: a 5 MiB and a 1 MiB part
    assert not any("-" in str(e_tag) for e_tag in e_tags.values())  # one PUT each
    sent_manifest = object_path(s3_server, Keys(PREFIX).manifest(snapshot.id)).read_bytes()
    assert sent_manifest == (snapshot.path / "manifest.json").read_bytes()

    node_b = RemoteStore(fresh_store(tmp_path, "node-b"), config_for(s3_server))
    pulled = node_b.pull(snapshot.id, verifier, expected_identity=snapshot.identity)

    assert pulled.snapshot.id == snapshot.id and not pulled.from_cache
    assert sorted(pulled.fetched) == sorted(distinct) and pulled.cached == []
    assert pulled.stats.bytes_transferred == sum(distinct.values())
    for name in ("manifest.json", "manifest.sig"):  # the signed files kept byte for byte
        assert (node_b.local.snapshots_dir / snapshot.id / name).read_bytes() == (
            snapshot.path / name
        ).read_bytes()
    node_b.local.verify(snapshot.id, verifier, snapshot.identity)
    assert materialised(node_b.local, snapshot.id, verifier, tmp_path / "restored") == FILES
    assert list(node_b.local.staging_dir.iterdir()) == []

    again = node_b.pull(snapshot.id, verifier)
    assert again.from_cache and again.stats.bytes_transferred == 0


@pytest.mark.spawns
def test_a_pull_fetches_only_the_blobs_the_node_cache_lacks(
    s3_server: S3Server,
    remote: RemoteStore,
    publish: Publish,
    signer: Any,
    verifier: Verifier,
    tmp_path: Path,
) -> None:
    first = publish(FILES, MODES)
    second = publish({**FILES, "criu/core-1.img": b"another core" * 100})
    remote.push(first.id)
    remote.push(second.id)
    node_b = RemoteStore(fresh_store(tmp_path, "node-b"), config_for(s3_server))
    node_b.pull(first.id, verifier)

    pulled = node_b.pull(second.id, verifier)

    new_core = second.files["criu/core-1.img"].digest
    assert pulled.fetched == [new_core]
    assert set(pulled.cached) == second.manifest.digests() - {new_core}
    assert pulled.stats.bytes_transferred == len(b"another core" * 100)
    node_b.local.verify(second.id, verifier)


# --- push: each blob once, the signature last ---------------------------------------------------------------


@pytest.mark.spawns
def test_a_blob_the_bucket_holds_is_not_uploaded_again(
    s3_server: S3Server, remote: RemoteStore, publish: Publish
) -> None:
    first = publish(FILES, MODES)
    second = publish({"criu/pages-1.img": PAGES, "criu/own.img": b"only in the second"})
    remote.push(first.id)
    pages = first.files["criu/pages-1.img"].digest
    before = blob_object(s3_server, pages).stat()

    pushed = remote.push(second.id)

    assert pushed.skipped == [pages]
    assert pushed.uploaded == [second.files["criu/own.img"].digest]
    assert pushed.stats.bytes_skipped == len(PAGES) and pushed.stats.objects_skipped == 1
    after = blob_object(s3_server, pages).stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)  # never rewritten

    repeated = remote.push(second.id)
    assert repeated.already_published and repeated.uploaded == []
    assert repeated.stats.objects_skipped == 2


@pytest.mark.spawns
def test_a_small_blob_of_the_right_size_but_wrong_bytes_is_uploaded_again(
    s3_server: S3Server, remote: RemoteStore, publish: Publish, verifier: Verifier, tmp_path: Path
) -> None:
    snapshot = publish(FILES, MODES)
    remote.push(snapshot.id)
    core = snapshot.files["criu/core-1.img"].digest
    damaged = blob_object(s3_server, core)
    damaged.write_bytes(b"CORE" * 1000)  # same size

    pushed = remote.push(snapshot.id)

    assert pushed.uploaded == [core] and pushed.stats.objects_repaired == 1
    assert damaged.read_bytes() == b"core" * 1000
    node_b = RemoteStore(fresh_store(tmp_path, "node-b"), config_for(s3_server))
    node_b.pull(snapshot.id, verifier)


@pytest.mark.spawns
def test_a_large_blob_of_the_right_size_but_wrong_bytes_is_uploaded_again(
    s3_server: S3Server, remote: RemoteStore, publish: Publish, verifier: Verifier, tmp_path: Path
) -> None:
    """Above 8 MiB too (a multipart object): a re-push reads back what the bucket holds, never trusts it by
    key and size, and repairs the bucket's copy."""
    weights = os.urandom(9 * MIB + 5)
    snapshot = publish({**FILES, "criu/pages-2.img": weights}, MODES)
    remote.push(snapshot.id)
    large = snapshot.files["criu/pages-2.img"].digest
    damaged = blob_object(s3_server, large)
    damaged.write_bytes(os.urandom(len(weights)))  # same size, other bytes

    pushed = remote.push(snapshot.id)

    print(f"re-push over a same-size junk object of {len(weights)} bytes: uploaded {len(pushed.uploaded)}, "
          f"skipped {len(pushed.skipped)}, repaired {pushed.stats.objects_repaired}")  # fmt: skip
    assert pushed.uploaded == [large] and pushed.stats.objects_repaired == 1
    assert damaged.read_bytes() == weights
    node_b = RemoteStore(fresh_store(tmp_path, "node-b"), config_for(s3_server))
    node_b.pull(snapshot.id, verifier)
    node_b.local.verify(snapshot.id, verifier)


@pytest.mark.spawns
def test_the_signature_is_put_only_where_none_is(s3_server: S3Server, remote: RemoteStore) -> None:
    key = Keys(PREFIX).signature("0" * 12 + "-20260101000000-000000")
    assert remote.client.put_bytes(key, b"first", create=True)
    assert not remote.client.put_bytes(key, b"second", create=True)  # If-None-Match: *
    assert object_path(s3_server, key).read_bytes() == b"first"


@pytest.mark.spawns
def test_a_snapshot_in_the_bucket_under_another_signature_is_not_overwritten(
    s3_server: S3Server, remote: RemoteStore, publish: Publish, tmp_path: Path
) -> None:
    snapshot = publish(FILES, MODES)
    remote.push(snapshot.id)
    signature_key = Keys(PREFIX).signature(snapshot.id)
    object_path(s3_server, signature_key).write_bytes(b'{"another": "signature"}')

    with pytest.raises(SnapshotError, match="with another signature"):
        remote.push(snapshot.id)
    assert object_path(s3_server, signature_key).read_bytes() == b'{"another": "signature"}'


KILLED_PUSH = textwrap.dedent(
    """
    import sys
    from remote_helpers import push_in_process
    push_in_process(*sys.argv[1:])
    """
)


@pytest.mark.spawns
@pytest.mark.parametrize("step", ["blobs-done", "manifest-uploaded"])
def test_a_push_killed_before_its_signature_is_never_listed(
    s3_server: S3Server, remote: RemoteStore, publish: Publish, verifier: Verifier, tmp_path: Path, step: str
) -> None:
    snapshot = publish(FILES, MODES)
    config = remote.config
    assert config.credentials is not None
    credentials = config.credentials
    child = subprocess.run(
        [sys.executable, "-c", KILLED_PUSH, str(remote.local.root), snapshot.id, step,
         s3_server.endpoint, BUCKET, PREFIX, credentials.access_key_id, credentials.secret_access_key],
        env=python_path_env(HELPERS_DIR), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert child.returncode == -signal.SIGKILL, child.stderr

    keys = Keys(PREFIX)
    assert remote.list() == []
    assert object_path(s3_server, keys.manifest(snapshot.id)).exists() == (step == "manifest-uploaded")
    assert not object_path(s3_server, keys.signature(snapshot.id)).exists()
    assert all(blob_object(s3_server, digest).exists() for digest in snapshot.manifest.digests())
    node_b = RemoteStore(fresh_store(tmp_path, "node-b"), config_for(s3_server))
    with pytest.raises(SnapshotNotFound):
        node_b.pull(snapshot.id, verifier)
    assert_nothing_published(node_b.local)

    finished = remote.push(snapshot.id)  # the next push skips what arrived and publishes

    assert finished.uploaded == [] and len(finished.skipped) == len(snapshot.manifest.digests())
    assert [listed.id for listed in remote.list()] == [snapshot.id]
    node_b.pull(snapshot.id, verifier)


# --- pull: nothing untrusted is published ------------------------------------------------------------------


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _shared_digest(snapshot: Snapshot) -> str:
    return snapshot.files["criu/shared-a.img"].digest


def _flip_in_chunked_blob(server: S3Server, snapshot: Snapshot) -> str:
    _flip_byte(blob_object(server, snapshot.files["criu/pages-1.img"].digest), 3 * MIB + 7)
    return "do not match their signed blake3 digest"


def _flip_in_small_blob(server: S3Server, snapshot: Snapshot) -> str:
    _flip_byte(blob_object(server, snapshot.files["criu/core-1.img"].digest), 0)
    return "do not match their signed sha256 digest"


def _truncate_blob(server: S3Server, snapshot: Snapshot) -> str:
    blob_object(server, _shared_digest(snapshot)).write_bytes(SHARED[:-1])
    return "truncated or altered object refused"


def _truncate_chunked_blob(server: S3Server, snapshot: Snapshot) -> str:
    # chunks 0-2 intact, the ranges of chunks 3-6 start past its end (the server answers 416)
    blob_object(server, snapshot.files["criu/pages-1.img"].digest).write_bytes(PAGES[: 3 * MIB])
    return "truncated or altered object refused"


def _lengthen_blob(server: S3Server, snapshot: Snapshot) -> str:
    blob_object(server, _shared_digest(snapshot)).write_bytes(SHARED + b"!")
    return "truncated or altered object refused"


def _fill_empty_blob(server: S3Server, snapshot: Snapshot) -> str:
    blob_object(server, snapshot.files["criu/empty.img"].digest).write_bytes(b"x")
    return "truncated or altered object refused"


def _edit_manifest(server: S3Server, snapshot: Snapshot) -> str:
    raw = (snapshot.path / "manifest.json").read_bytes()
    assert b'"mode": 493' in raw  # bin/run.sh, 0o755
    object_path(server, Keys(PREFIX).manifest(snapshot.id)).write_bytes(
        raw.replace(b'"mode": 493', b'"mode": 511')
    )
    return "the manifest was modified"


def _bloat_manifest(server: S3Server, snapshot: Snapshot) -> str:
    path = object_path(server, Keys(PREFIX).manifest(snapshot.id))
    with path.open("ab") as manifest:  # past the store's 16 MiB bound for a manifest, never read whole
        manifest.truncate(17 * MIB)
    return "more than the 16777216 bytes allowed"


def _forge_signature(server: S3Server, snapshot: Snapshot) -> str:
    object_path(server, Keys(PREFIX).signature(snapshot.id)).write_bytes(b'{"algorithm": "hmac-sha256"}')
    return "manifest.sig"


# Each changes one object in the bucket and returns what the refusal must say.
TAMPERINGS: dict[str, Callable[[S3Server, Snapshot], str]] = {
    "a byte of a chunked blob": _flip_in_chunked_blob,
    "a byte of a small blob": _flip_in_small_blob,
    "a truncated blob": _truncate_blob,
    "a truncated chunked blob": _truncate_chunked_blob,
    "a blob grown longer": _lengthen_blob,
    "the empty blob given bytes": _fill_empty_blob,
    "the manifest": _edit_manifest,
    "a manifest too large": _bloat_manifest,
    "the signature": _forge_signature,
}


@pytest.mark.spawns
@pytest.mark.parametrize("tampering", list(TAMPERINGS))
def test_a_tampered_object_is_refused_and_nothing_is_published(
    s3_server: S3Server,
    remote: RemoteStore,
    publish: Publish,
    verifier: Verifier,
    tmp_path: Path,
    tampering: str,
) -> None:
    snapshot = publish(FILES, MODES)
    remote.push(snapshot.id)
    reason = TAMPERINGS[tampering](s3_server, snapshot)
    node_b = RemoteStore(fresh_store(tmp_path, "node-b"), config_for(s3_server))
    steps: list[str] = []

    with pytest.raises(SnapshotInvalid) as refused:
        node_b.pull(snapshot.id, verifier, progress=lambda event: steps.append(event.step))

    assert reason in str(refused.value)
    assert_nothing_published(node_b.local)
    if tampering in ("the manifest", "a manifest too large", "the signature"):  # before any blob
        assert steps == []


@pytest.mark.spawns
def test_an_identity_other_than_expected_is_refused_before_any_blob(
    s3_server: S3Server, remote: RemoteStore, publish: Publish, verifier: Verifier, tmp_path: Path
) -> None:
    snapshot = publish(FILES, MODES)
    remote.push(snapshot.id)
    node_b = RemoteStore(fresh_store(tmp_path, "node-b"), config_for(s3_server))
    steps: list[str] = []

    with pytest.raises(SnapshotInvalid, match="identity mismatch: engine_version"):
        node_b.pull(
            snapshot.id, verifier, expected_identity=snapshot_helpers.make_identity(engine_version="2.0"),
            progress=lambda event: steps.append(event.step),
        )  # fmt: skip
    assert steps == []
    assert_nothing_published(node_b.local)


@pytest.mark.spawns
def test_a_cache_trim_during_a_pull_keeps_the_cached_blobs_the_pull_counts_on(
    s3_server: S3Server, remote: RemoteStore, publish: Publish, verifier: Verifier, tmp_path: Path
) -> None:
    first = publish(FILES, MODES)
    second = publish({"criu/pages-1.img": PAGES, "criu/own.img": b"second"})
    remote.push(first.id)
    remote.push(second.id)
    node_b = RemoteStore(fresh_store(tmp_path, "node-b"), config_for(s3_server))
    node_b.pull(first.id, verifier)
    pages = first.files["criu/pages-1.img"].digest
    only_first = first.files["criu/core-1.img"].digest
    taken: list[str] = []

    def trim_first_once(event: Progress) -> None:  # after the fetch, before the rename that publishes
        if event.step == "blobs-done" and not taken:
            taken.extend(node_b.trim_cache(max_bytes=0, busy=()).removed)

    pulled = node_b.pull(second.id, verifier, progress=trim_first_once)

    assert taken == [first.id]
    assert not node_b.local.blob_path(only_first).exists()
    assert pages in pulled.cached and pages not in pulled.fetched
    node_b.local.verify(second.id, verifier)


@pytest.mark.spawns
def test_a_cached_blob_that_the_local_gc_takes_during_a_pull_is_fetched_after_all(
    s3_server: S3Server, remote: RemoteStore, publish: Publish, verifier: Verifier, tmp_path: Path
) -> None:
    first = publish(FILES, MODES)
    second = publish({"criu/pages-1.img": PAGES, "criu/own.img": b"second"})
    remote.push(first.id)
    remote.push(second.id)
    node_b = RemoteStore(fresh_store(tmp_path, "node-b"), config_for(s3_server))
    node_b.pull(first.id, verifier)
    pages = first.files["criu/pages-1.img"].digest
    taken: list[str] = []

    def collect_first_once(event: Progress) -> None:  # after the fetch, before the rename that publishes
        if event.step == "blobs-done" and not taken:  # a GC that knows nothing of the pull (`snapshot gc`)
            node_b.local.delete(first.id)
            taken.extend(node_b.local.gc(blob_grace=0).removed_blobs)
            assert not node_b.local.blob_path(pages).exists()

    pulled = node_b.pull(second.id, verifier, progress=collect_first_once)

    assert pages in taken
    assert pages in pulled.fetched
    node_b.local.verify(second.id, verifier)


@pytest.mark.spawns
def test_a_damaged_cached_blob_is_fetched_again_when_the_cache_is_verified(
    s3_server: S3Server, remote: RemoteStore, publish: Publish, verifier: Verifier, tmp_path: Path
) -> None:
    first = publish(FILES, MODES)
    second = publish({"criu/pages-1.img": PAGES, "criu/own.img": b"second"})
    remote.push(first.id)
    remote.push(second.id)
    node_b = RemoteStore(fresh_store(tmp_path, "node-b"), config_for(s3_server))
    node_b.pull(first.id, verifier)
    pages = node_b.local.blob_path(first.files["criu/pages-1.img"].digest)
    os.chmod(pages, 0o644)
    _flip_byte(pages, 5)

    pulled = node_b.pull(second.id, verifier, verify_cached=True)

    assert first.files["criu/pages-1.img"].digest in pulled.fetched and pulled.stats.objects_repaired == 1
    node_b.local.verify(second.id, verifier)
    node_b.local.verify(first.id, verifier)  # the same blob, repaired for both


# --- an unreachable or vanishing server --------------------------------------------------------------------

BOUNDED = {"connect_timeout": 1.0, "request_timeout": 10.0, "read_timeout": 5.0, "max_retries": 1,
           "retry_timeout": 2.0}  # fmt: skip


@pytest.mark.spawns
def test_the_server_stopped_mid_pull_fails_with_a_clear_error_and_leaves_nothing(
    s3_server: S3Server, remote: RemoteStore, publish: Publish, verifier: Verifier, tmp_path: Path
) -> None:
    snapshot = publish(FILES, MODES)
    remote.push(snapshot.id)
    node_b = RemoteStore(fresh_store(tmp_path, "node-b"), config_for(s3_server, concurrency=1, **BOUNDED))
    fetched: list[Progress] = []

    def stop_after_first_piece(event: Progress) -> None:
        if event.step == "bytes-fetched":
            fetched.append(event)
            if len(fetched) == 1:
                s3_server.stop()  # returns once the process is gone

    with pytest.raises(RemoteUnavailable) as unavailable:
        node_b.pull(snapshot.id, verifier, progress=stop_after_first_piece)

    assert len(fetched) == 1 and not s3_server.running()
    message = str(unavailable.value)
    assert s3_server.endpoint in message and "1 retries within 2s" in message
    assert_nothing_published(node_b.local)

    s3_server.start()  # the same port and data: the next pull succeeds
    pulled = node_b.pull(snapshot.id, verifier)
    assert sorted(pulled.fetched) == sorted(snapshot.manifest.digests())
    node_b.local.verify(snapshot.id, verifier)


@pytest.mark.spawns
def test_an_unreachable_server_fails_every_call_within_its_bounds(
    s3_server_factory: StartS3, store: SnapshotStore, publish: Publish, verifier: Verifier, tmp_path: Path
) -> None:
    server = s3_server_factory()
    server.stop()
    snapshot = publish(FILES, MODES)
    remote = RemoteStore(store, config_for(server, **BOUNDED))
    node_b = RemoteStore(fresh_store(tmp_path, "node-b"), config_for(server, **BOUNDED))
    calls: dict[str, Callable[[], object]] = {
        "push": lambda: remote.push(snapshot.id),
        "list": remote.list,
        "pull": lambda: node_b.pull(snapshot.id, verifier),
        "gc": remote.gc,
    }

    for call in calls.values():
        with pytest.raises(
            RemoteUnavailable, match=r"connect 1s, request 10s, stall 5s, 1 retries within 2s"
        ):
            call()
    assert_nothing_published(node_b.local)


@pytest.mark.spawns
def test_credentials_come_from_a_directory_and_wrong_ones_are_named_as_such(
    s3_server: S3Server, remote: RemoteStore, publish: Publish, verifier: Verifier, tmp_path: Path
) -> None:
    snapshot = publish(FILES, MODES)
    remote.push(snapshot.id)
    secret_dir = tmp_path / "secret"
    secret_dir.mkdir()
    (secret_dir / "access-key-id").write_text(s3_server.access_key_id)
    (secret_dir / "secret-access-key").write_text("not-the-secret")
    config = config_for(s3_server, credentials=None, credentials_dir=secret_dir, credentials_refresh=0)
    node_b = RemoteStore(fresh_store(tmp_path, "node-b"), config)

    with pytest.raises(RemoteAccessDenied, match="check the credentials"):
        node_b.list()
    with pytest.raises(RemoteAccessDenied):
        node_b.pull(snapshot.id, verifier)
    assert_nothing_published(node_b.local)

    (secret_dir / "secret-access-key").write_text(s3_server.secret_access_key)  # the Secret rotated
    assert [listed.id for listed in node_b.list()] == [snapshot.id]  # the same client reads it again
    node_b.pull(snapshot.id, verifier)


@pytest.mark.spawns
def test_a_missing_bucket_is_named(s3_server: S3Server, store: SnapshotStore) -> None:
    remote = RemoteStore(store, config_for(s3_server, bucket="no-such-bucket"))
    with pytest.raises(RemoteError, match="bucket no-such-bucket does not exist"):
        remote.list()


# --- listing, delete, GC in the bucket ---------------------------------------------------------------------


@pytest.mark.spawns
def test_delete_unpublishes_at_once_and_gc_keeps_every_blob_a_remaining_snapshot_names(
    s3_server: S3Server, remote: RemoteStore, publish: Publish, verifier: Verifier, tmp_path: Path
) -> None:
    first = publish({"a.img": b"only in the first" * 100, "b.img": b"in both" * 100})
    second = publish({"b.img": b"in both" * 100, "c.img": b"only in the second" * 100})
    third = publish({"d.img": b"only in the third" * 100})
    for snapshot in (first, second, third):
        remote.push(snapshot.id)
    keys = Keys(PREFIX)
    junk = {
        keys.blobs + "not-a-digest": b"junk",
        keys.snapshots + "not-an-id/manifest.json": b"junk",
        keys.snapshots + f"{first.id}/notes.txt": b"junk",
        "elsewhere/blobs/sha256/" + "0" * 64: b"another store's",
    }
    for key, content in junk.items():
        object_path(s3_server, key).parent.mkdir(parents=True, exist_ok=True)
        object_path(s3_server, key).write_bytes(content)
    orphan = "sha256:" + "e" * 64
    blob_object(s3_server, orphan).write_bytes(b"no manifest names me")

    remote.delete(first.id)
    assert {listed.id for listed in remote.list()} == {second.id, third.id}
    with pytest.raises(SnapshotNotFound):
        remote.delete(first.id)

    young = remote.gc()  # within the grace period nothing goes
    assert young.removed_blobs == [] and orphan in young.young_blobs

    report = remote.gc(referenced=[second.id], grace=0)

    assert report.deleted_snapshots == [third.id]
    only_first, only_third = first.files["a.img"].digest, third.files["d.img"].digest
    assert sorted(report.removed_blobs) == sorted([only_first, only_third, orphan])
    assert report.errors == [] and report.ignored_keys == 3
    for key in junk:
        assert object_path(s3_server, key).exists()
    assert {s.id for s in remote.list()} == {second.id}
    node_b = RemoteStore(fresh_store(tmp_path, "node-b"), config_for(s3_server))
    node_b.pull(second.id, verifier)
    node_b.local.verify(second.id, verifier)


@pytest.mark.spawns
def test_gc_removes_an_unfinished_push_and_stops_at_an_unreadable_manifest(
    s3_server: S3Server, remote: RemoteStore, publish: Publish
) -> None:
    kept = publish({"kept.img": b"kept" * 100})
    unfinished = publish({"unfinished.img": b"never signed" * 100})
    remote.push(kept.id)
    remote.push(unfinished.id)
    keys = Keys(PREFIX)
    object_path(s3_server, keys.signature(unfinished.id)).unlink()  # as if cut before its signature
    unfinished_blob = unfinished.files["unfinished.img"].digest

    report = remote.gc(grace=0)

    assert report.removed_unsigned == [unfinished.id] and report.removed_blobs == [unfinished_blob]
    assert not object_path(s3_server, keys.manifest(unfinished.id)).exists()

    object_path(s3_server, keys.manifest(kept.id)).write_bytes(b"{not json")
    blob_object(s3_server, "sha256:" + "f" * 64).write_bytes(b"unreferenced")
    stopped = remote.gc(grace=0)
    assert stopped.removed_blobs == [] and "unreadable manifest.json" in stopped.errors[0]
    assert blob_object(s3_server, kept.files["kept.img"].digest).exists()


# --- the node cache's bound ---------------------------------------------------------------------------------


def test_the_cache_is_trimmed_by_age_and_size_least_recently_used_first_never_a_busy_one(
    store: SnapshotStore, publish: Publish, verifier: Verifier
) -> None:
    snapshots = [
        publish({f"own-{index}.img": os.urandom(100_000), "shared.img": SHARED}) for index in range(4)
    ]
    now = 1_000_000.0
    for age, snapshot in zip((400, 300, 200, 100), snapshots, strict=True):
        mark_used(store, snapshot.id, now - age)

    by_age = trim_cache(store, max_age=350, now=now)
    assert by_age.removed == [snapshots[0].id]
    assert not store.blob_path(snapshots[0].files["own-0.img"].digest).exists()
    assert by_age.freed_bytes == 100_000

    # room for the shared blob and two own blobs: the least recently used of the rest goes, unless busy
    by_size = trim_cache(store, max_bytes=len(SHARED) + 200_000, busy={snapshots[1].id}, now=now)
    assert by_size.kept_busy == [snapshots[1].id]
    assert by_size.removed == [snapshots[2].id]
    assert by_size.bytes_after == len(SHARED) + 200_000 and not by_size.over_limit
    assert {s.id for s in store.list()} == {snapshots[1].id, snapshots[3].id}
    for snapshot in (snapshots[1], snapshots[3]):
        store.verify(snapshot.id, verifier)

    stuck = trim_cache(store, max_bytes=1, busy={snapshots[1].id, snapshots[3].id}, now=now)
    assert stuck.removed == [] and stuck.over_limit


def test_the_blobs_a_deleted_snapshot_left_count_against_the_bound_and_go_before_any_snapshot(
    store: SnapshotStore, publish: Publish, verifier: Verifier
) -> None:
    kept = publish({"kept.img": os.urandom(100_000), "shared.img": SHARED})
    deleted = publish({"deleted.img": os.urandom(300_000), "shared.img": SHARED})
    store.delete(deleted.id)  # by the cleanup loop: the store's GC keeps its young blobs for an hour
    left = deleted.files["deleted.img"].digest
    assert store.gc().removed_blobs == [] and store.blob_path(left).exists()

    report = trim_cache(store, max_bytes=len(SHARED) + 100_000)

    assert report.bytes_before == len(SHARED) + 400_000
    assert report.removed == [] and report.freed_bytes == 300_000
    assert report.bytes_after == len(SHARED) + 100_000 and not report.over_limit
    assert not store.blob_path(left).exists()
    store.verify(kept.id, verifier)


def test_over_the_bound_a_busy_snapshot_and_the_blobs_a_pull_holds_are_kept(
    store: SnapshotStore, publish: Publish, verifier: Verifier
) -> None:
    busy = publish({"busy.img": os.urandom(100_000)})
    idle = publish({"idle.img": os.urandom(100_000)})
    deleted = publish({"held.img": os.urandom(50_000), "loose.img": os.urandom(20_000)})
    store.delete(deleted.id)
    held, loose = deleted.files["held.img"].digest, deleted.files["loose.img"].digest
    holds = BlobHolds()

    with holds.holding([held]):  # a pull in progress found it cached and counts on it
        report = trim_cache(store, max_bytes=1, busy={busy.id}, holds=holds)

    assert report.removed == [idle.id] and report.kept_busy == [busy.id]
    assert report.bytes_after == 150_000 and report.over_limit
    assert store.blob_path(held).exists() and not store.blob_path(loose).exists()
    store.verify(busy.id, verifier)
    after_the_pull = trim_cache(store, max_bytes=1, busy={busy.id}, holds=holds)
    assert after_the_pull.bytes_after == 100_000 and not store.blob_path(held).exists()


# --- configuration ------------------------------------------------------------------------------------------


def test_configuration_from_the_environment_and_a_credentials_directory(tmp_path: Path) -> None:
    secret_dir = tmp_path / "secret"
    secret_dir.mkdir()
    (secret_dir / "access-key-id").write_text("AKIDFROMFILE\n")
    (secret_dir / "secret-access-key").write_text("from-a-file\n")
    environ = {
        "WARMSTART_S3_BUCKET": "snapshots",
        "WARMSTART_S3_ENDPOINT": "http://s3.storage:9000",
        "WARMSTART_S3_PREFIX": "cluster-a",
        "WARMSTART_S3_CREDENTIALS_DIR": str(secret_dir),
        "AWS_ACCESS_KEY_ID": "ignored-when-a-directory-is-set",
        "AWS_SECRET_ACCESS_KEY": "ignored",
        "WARMSTART_S3_RETRY_TIMEOUT": "7.5",
        "WARMSTART_S3_CONCURRENCY": "3",
    }

    config = RemoteConfig.from_env(environ)

    assert (config.bucket, config.key_prefix, config.retry_timeout, config.concurrency) == (
        "snapshots", "cluster-a/", 7.5, 3,
    )  # fmt: skip
    assert config.allow_http and config.sign_payload
    resolved = config.resolve_credentials()
    assert resolved is not None and resolved.access_key_id == "AKIDFROMFILE"
    assert "from-a-file" not in repr(resolved) and "from-a-file" not in repr(config)
    (secret_dir / "secret-access-key").write_text("rotated\n")
    rotated = config.resolve_credentials()
    assert rotated is not None and rotated.secret_access_key == "rotated"

    with pytest.raises(RemoteConfigError, match="WARMSTART_S3_BUCKET"):
        RemoteConfig.from_env({})
    with pytest.raises(RemoteConfigError, match="WARMSTART_S3_MAX_RETRIES"):
        RemoteConfig.from_env({"WARMSTART_S3_BUCKET": "b", "WARMSTART_S3_MAX_RETRIES": "many"})
    assert not RemoteConfig(bucket="b", endpoint="https://s3.example").sign_payload
