"""Interrupted captures and concurrent publishers, with real processes."""

from __future__ import annotations

import multiprocessing
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import snapshot_helpers
from support import python_path_env, wait_until

from warmstart.snapshot import Snapshot, SnapshotStore
from warmstart.snapshot.layout import OWNER_FILE
from warmstart.snapshot.signing import Verifier

HELPERS_DIR = Path(snapshot_helpers.__file__).parent

KILLED_CAPTURE = textwrap.dedent(
    """
    import sys
    from snapshot_helpers import make_identity
    from warmstart.snapshot import SnapshotStore

    staging = SnapshotStore(sys.argv[1]).stage(make_identity())
    (staging.dir / "criu").mkdir()
    with open(staging.dir / "criu" / "pages-1.img", "wb") as image:
        image.write(b"x" * 4096)
        image.flush()
        print(staging.root, flush=True)
        while True:  # still writing when it is killed
            image.write(b"y" * 4096)
    """
)


@pytest.mark.spawns
def test_a_capture_killed_mid_write_leaves_nothing_listed(store: SnapshotStore) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_CAPTURE, str(store.root)],
        env=python_path_env(HELPERS_DIR),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        staging_root = Path(child.stdout.readline().strip())  # type: ignore[union-attr]
        assert staging_root.parent == store.staging_dir
        assert (staging_root / "files" / "criu" / "pages-1.img").exists()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert child.returncode == -signal.SIGKILL

    assert store.list() == []
    assert list(store.snapshots_dir.iterdir()) == []
    report = store.gc()  # the default bound is an hour: the dead owner alone makes it stale
    assert [entry.split(" ")[0] for entry in report.removed_staging] == [staging_root.name]
    assert "is gone" in report.removed_staging[0]
    assert not staging_root.exists()


@pytest.mark.spawns
def test_concurrent_publishers_of_one_identity_all_succeed_while_gc_runs(
    store: SnapshotStore, hmac_key_path: Path, verifier: Verifier, tmp_path: Path
) -> None:
    publishers = 6
    store.root.mkdir(parents=True)
    stop_file = tmp_path / "stop-gc"
    context = multiprocessing.get_context("spawn")
    with context.Pool(publishers + 1) as pool:
        collector = pool.apply_async(
            snapshot_helpers.collect_garbage_until, (str(store.root), str(stop_file))
        )
        jobs = [
            pool.apply_async(
                snapshot_helpers.publish_in_process, (str(store.root), str(hmac_key_path), index)
            )
            for index in range(publishers)
        ]
        ids = [job.get(timeout=120) for job in jobs]
        stop_file.touch()
        assert collector.get(timeout=120) >= 1

    assert len(set(ids)) == publishers
    listed = store.list()
    assert sorted(s.id for s in listed) == sorted(ids)
    for snapshot_id in ids:
        store.verify(snapshot_id, verifier)
    shared_digests = {s.files["criu/shared.img"].digest for s in listed}
    assert len(shared_digests) == 1
    assert len(list(store.blobs_dir.iterdir())) == publishers + 1  # one shared blob, one own blob each


def wait_until_blocked_on_a_lock(thread: threading.Thread) -> None:
    """Until `thread` sleeps in the kernel waiting for a file lock (flock), as its /proc entry says."""
    wchan = Path(f"/proc/self/task/{thread.native_id}/wchan")

    def blocked() -> bool:
        assert thread.is_alive(), f"{thread.name} ended without waiting for the lock"
        return "lock_inode_wait" in wchan.read_text()

    wait_until(blocked, f"{thread.name} waiting for a file lock")


def test_a_delete_waits_for_a_running_gc(store: SnapshotStore, publish: Callable[..., Snapshot]) -> None:
    snapshot = publish({"criu/a.img": b"a"})
    with store.layout.lock(exclusive=True):  # what gc() holds while it reads every manifest
        deleting = threading.Thread(target=store.delete, args=(snapshot.id,))
        deleting.start()
        wait_until_blocked_on_a_lock(deleting)
        assert (store.snapshots_dir / snapshot.id / "manifest.json").is_file()
    deleting.join()
    assert store.list() == []
    assert store.gc().errors == []


def test_gc_never_takes_a_staging_directory_being_made_for_abandoned(store: SnapshotStore) -> None:
    live = store.stage(snapshot_helpers.make_identity())  # a real owner record, this process's
    reports = []
    with store.layout.lock(exclusive=False):  # what making a staging directory holds
        being_made = store.staging_dir / uuid.uuid4().hex
        being_made.mkdir()  # bare: its owner record comes next
        collecting = threading.Thread(target=lambda: reports.append(store.gc(staging_older_than=0)))
        collecting.start()
        wait_until_blocked_on_a_lock(collecting)
        shutil.copyfile(live.root / OWNER_FILE, being_made / OWNER_FILE)
    collecting.join()
    assert being_made.is_dir(), reports[0].removed_staging
    assert len(reports[0].kept_staging) == 2 and reports[0].removed_staging == []
    live.discard()
