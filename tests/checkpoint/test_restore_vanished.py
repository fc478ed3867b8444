"""A snapshot deleted (and its blobs collected) while it is being restored is not a failed restore: the
pod is answered restore-failed saying the snapshot went away, and nothing is counted against it."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from warmstart.api.control_dir import RESTORE_FAILED, ControlDir
from warmstart.api.identity import SnapshotIdentity
from warmstart.checkpoint.criu import Criu
from warmstart.checkpoint.restore import FailureCounter, SnapshotVanished, restore
from warmstart.checkpoint.sandbox import Sandbox, waiting_init_command
from warmstart.snapshot.signing import Verifier, load_signer, load_verifier
from warmstart.snapshot.store import SnapshotStore

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="a sandbox needs root (PID and mount namespaces)"),
    pytest.mark.spawns,
]
IDENTITY = SnapshotIdentity(model_digest="sha256:" + "ef" * 32, engine="target", engine_version="1")


class CallingBackVerifier:
    """The real verifier, calling `on_call(n)` before its n-th check (a second restorer's moment)."""

    def __init__(self, inner: Verifier, on_call: Callable[[int], None]) -> None:
        self.inner, self.on_call, self.calls = inner, on_call, 0
        self.algorithm, self.key_id = inner.algorithm, inner.key_id

    def check(self, data: bytes, signature: bytes) -> bool:
        self.calls += 1
        self.on_call(self.calls)
        return self.inner.check(data, signature)


def _delete_and_collect(store: SnapshotStore, snapshot_id: str) -> None:
    store.delete(snapshot_id)
    store.gc(blob_grace=0)


@pytest.mark.parametrize("when", ["before the restore", "between its signature and its blobs"])
def test_a_snapshot_deleted_during_its_restore_is_not_counted_against_it(
    tmp_path: Path, store: SnapshotStore, key: Path, sandboxes: list[Sandbox], when: str
) -> None:
    with store.stage(IDENTITY) as staging:
        (staging.dir / "criu").mkdir()
        (staging.dir / "criu" / "pages-1.img").write_bytes(b"pages" * 1000)
        snapshot = staging.publish(load_signer(key))
    if when == "before the restore":
        _delete_and_collect(store, snapshot.id)
        verifier: Verifier = load_verifier(key)
    else:  # the manifest is read and checked, then the snapshot goes before its blobs are hashed
        verifier = CallingBackVerifier(
            load_verifier(key), lambda call: call == 2 and _delete_and_collect(store, snapshot.id)
        )
    sandbox = Sandbox.start(tmp_path / "restore", waiting_init_command(), reserve_pids=True)
    sandboxes.append(sandbox)
    control = ControlDir(sandbox.host_dir / "control")
    with pytest.raises(SnapshotVanished, match="deleted while it was being restored"):
        restore(
            store=store, verifier=verifier, snapshot_id=snapshot.id, expected_identity=IDENTITY,
            sandbox=sandbox, control=control, criu=Criu(str(tmp_path / "criu-never-runs")),
            work_dir=tmp_path / "images",
        )  # fmt: skip
    answered = control.read(RESTORE_FAILED)
    assert answered is not None and "deleted" in answered.payload["reason"]  # the worker cold-starts
    assert answered.payload["failures"] is None
    assert FailureCounter(store.root).count(snapshot.id) == 0
