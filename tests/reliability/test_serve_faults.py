"""`warmstart serve` against a hostile or half-written store: identity records copied across names, planted
links where sandboxes are made, deeply nested state files, unsigned snapshots, and a serve killed between
publishing its snapshot and recording its identity. The start decision is checked with the real LocalNode
and stand-in start methods; the kill runs a real capture and restore with CRIU (root)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support import free_port
from test_store_hostile import (
    DEEP_ARRAY,
    IDENTITY,
    REFUSED,
    make_store,
    plant,
    plant_unsigned_copy,
    tree_state,
)

from warmstart.api.capture_record import CaptureRecord, WorkerRecord
from warmstart.api.identity import SnapshotIdentity
from warmstart.serve.identity_cache import IdentityCache
from warmstart.serve.local_node import LocalNode
from warmstart.serve.worker_spec import ServeError, StartReport, WorkerSpec
from warmstart.snapshot.signing_keys import signing_keys
from warmstart.snapshot.store import SnapshotStore

pytestmark = pytest.mark.reliability
OTHER = SnapshotIdentity(model_digest="sha256:" + "cd" * 32, engine="builtin", engine_version="x")


def decision_node(store_root: Path, work_dir: Path, spec: WorkerSpec | None = None) -> LocalNode:
    """A LocalNode whose starts only report what it decided (no worker is run)."""
    signer, verifier, _ = signing_keys(store_root, None)
    node = LocalNode(spec or WorkerSpec(), SnapshotStore(store_root), signer, verifier, object(), work_dir)  # type: ignore[arg-type]
    node.start_cold_and_capture = lambda: StartReport("cold+capture", 0.0)  # type: ignore[method-assign]
    node.start_restored = lambda sid, identity: StartReport("restore", 0.0, sid)  # type: ignore[method-assign]
    return node


def test_an_identity_record_copied_over_another_name_is_refused(tmp_path: Path) -> None:
    signer, verifier, _ = signing_keys(tmp_path, None)
    cache = IdentityCache(tmp_path, signer, verifier)
    tiny, other = WorkerSpec(model="tiny"), WorkerSpec(model="other")
    cache.record(tiny, IDENTITY, str(tmp_path))
    cache.record(other, OTHER, str(tmp_path))
    for suffix in (".json", ".sig"):  # no key needed: both files are copied as they are
        shutil.copyfile(
            cache.directory / f"{cache.key(tiny)}{suffix}", cache.directory / f"{cache.key(other)}{suffix}"
        )
    identity, reason = cache.lookup(other)
    assert identity is None and "another worker" in reason
    assert cache.lookup(tiny) == (IDENTITY, "")
    REFUSED["identity record copied across names"] += 1


@pytest.mark.parametrize("kind", ["deep", "fifo", "link-to-zero", "huge"])
@pytest.mark.parametrize("name", [".json", ".sig"])
def test_a_hostile_identity_record_is_a_miss_and_serve_cold_starts(
    tmp_path: Path, kind: str, name: str
) -> None:
    s = make_store(tmp_path)
    node = decision_node(s.root, tmp_path / "pods")
    node.identities.record(node.spec, IDENTITY, str(tmp_path))
    plant(node.identities.directory / f"{node.identities.key(node.spec)}{name}", kind, s.outside)
    report = node.start()
    assert report.mode == "cold+capture" and "not trusted" in report.reason
    REFUSED[f"identity record {kind}"] += 1


@pytest.mark.parametrize("target", ["manifest.json", "manifest.sig", "failure counter"])
def test_deeply_nested_state_files_do_not_stop_serve(tmp_path: Path, target: str) -> None:
    s = make_store(tmp_path, meta={})
    node = decision_node(s.root, tmp_path / "pods")
    node.identities.record(node.spec, IDENTITY, str(tmp_path))
    if target == "failure counter":
        (s.root / "restore-failures").mkdir()
        path = s.root / "restore-failures" / f"{s.snapshot.id}.json"
    else:
        path = s.snapshot.path / target
    path.write_bytes(DEEP_ARRAY)
    report = node.start()  # a RecursionError here was a traceback and serve exited
    assert report.mode in ("restore", "cold+capture")
    REFUSED[f"deep {target} at serve"] += 1


def test_serve_does_not_try_an_unsigned_snapshot_first(tmp_path: Path) -> None:
    s = make_store(tmp_path)
    plant_unsigned_copy(s)
    node = decision_node(s.root, tmp_path / "pods")
    node.identities.record(node.spec, IDENTITY, str(tmp_path))
    assert node.start().snapshot_id == s.snapshot.id
    REFUSED["unsigned snapshot at serve"] += 1


@pytest.mark.parametrize("planted", ["sandbox", "images", "work dir"])
def test_sandbox_directories_never_follow_a_planted_link(tmp_path: Path, planted: str) -> None:
    s = make_store(tmp_path)
    before = tree_state(s.outside)
    pods = s.root / "pods"
    node = decision_node(s.root, pods)
    if planted == "work dir":
        pods.symlink_to(s.outside)
        with pytest.raises(ServeError, match="symbolic link"):
            node._new_sandbox_dir("cold")
    else:
        pods.mkdir()
        name = f"cold-1-{os.getpid()}" + ("-images" if planted == "images" else "")
        (pods / name).symlink_to(s.outside)
        made = node._new_sandbox_dir("cold")
        assert not made.is_symlink() and (made / "control" / "logs").is_dir()
    assert tree_state(s.outside) == before
    REFUSED[f"{planted} link"] += 1


@pytest.mark.parametrize("planted", ["file", "link"])
def test_a_default_work_directory_that_is_no_directory_gives_way_to_a_temporary_one(
    tmp_path: Path, planted: str
) -> None:
    s = make_store(tmp_path)
    pods = s.root / "pods"
    if planted == "file":
        pods.write_bytes(b"junk")
    else:
        pods.symlink_to(s.outside)
    before = tree_state(s.outside)
    signer, verifier, _ = signing_keys(s.root, None)
    node = LocalNode(WorkerSpec(), s.store, signer, verifier, None)  # the default work directory
    made = node._new_sandbox_dir("cold")
    assert not made.is_relative_to(s.root) and (made / "control" / "logs").is_dir()
    assert str(made.parent) in node.notes[0]
    node.stop_all()
    assert not made.parent.exists()  # a temporary work directory does not outlive its run
    assert tree_state(s.outside) == before
    REFUSED[f"work dir {planted}"] += 1


def test_a_lost_identity_record_is_recovered_from_the_published_snapshot(tmp_path: Path) -> None:
    s = make_store(tmp_path)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "weights").write_bytes(b"w")
    os.utime(model_dir / "weights", (1, 1))  # unchanged since long before the capture
    node = decision_node(s.root, tmp_path / "pods")
    meta = CaptureRecord(
        identity_cache_key=node.identities.key(node.spec), worker=WorkerRecord(model_dir=str(model_dir))
    ).to_meta()
    with s.store.stage(IDENTITY, meta=meta) as staging:
        (staging.dir / "criu").mkdir()
        (staging.dir / "criu" / "core.img").write_bytes(b"core")
        published = staging.publish(s.signer)
    report = node.start()  # no identity record: the last serve died right after publishing
    assert report.mode == "restore" and report.snapshot_id == published.id and "recovered" in report.reason
    assert node.identities.lookup(node.spec) == (IDENTITY, "")

    (model_dir / "weights").write_bytes(b"changed after the capture")
    for path in node.identities.directory.iterdir():
        path.unlink()
    assert node.start().mode == "cold+capture"  # model files newer than the snapshot: no recovery


KILLED_SERVE = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    from warmstart.checkpoint.criu import Criu
    from warmstart.serve.identity_cache import IdentityCache
    from warmstart.serve.local_node import LocalNode
    from warmstart.serve.worker_spec import WorkerSpec
    from warmstart.snapshot.signing_keys import signing_keys
    from warmstart.snapshot.store import SnapshotStore

    store_root, criu_command, port = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    signer, verifier, _ = signing_keys(store_root, None)
    # killed where the identity record would be written, right after the publish
    IdentityCache.record = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
    node = LocalNode(WorkerSpec(port=port), SnapshotStore(store_root), signer, verifier,
                     Criu(criu_command, timeout=300), store_root / "pods")
    node.start()
    """
)


@pytest.mark.spawns
@pytest.mark.integration
def test_serve_killed_between_publish_and_identity_record_restores_next_time(
    tmp_path: Path, criu_command: str
) -> None:
    store_root = tmp_path / "store"
    store_root.mkdir()
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_SERVE, str(store_root), criu_command, str(free_port())],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    store = SnapshotStore(store_root)
    assert len(store.list()) == 1
    signer, verifier, _ = signing_keys(store_root, None)
    from warmstart.checkpoint.criu import Criu

    node = LocalNode(
        WorkerSpec(port=free_port()),
        store,
        signer,
        verifier,
        Criu(criu_command, timeout=300),
        store_root / "pods",
    )
    try:
        report = node.start()
    finally:
        node.stop_all()
    assert report.mode == "restore", report.reason
    assert [s.id for s in store.list()] == [report.snapshot_id]  # no second capture
