"""The privileged side never follows a path the tenant controls: not at capture (files the engine holds
open), not at restore (the target's volume), not in the control directory (signals and the directory)."""

from __future__ import annotations

import os
import shlex
import sys
import threading
from pathlib import Path

import pytest
from support import wait_for_line

from warmstart.api.control_dir import (
    READY_FOR_SNAPSHOT,
    RESTORE_COMPLETE,
    RESTORE_FAILED,
    ControlDir,
    SignalError,
)
from warmstart.api.identity import SnapshotIdentity
from warmstart.checkpoint.capture import CaptureError, capture
from warmstart.checkpoint.criu import Criu
from warmstart.checkpoint.restore import RestoreFailed, restore
from warmstart.checkpoint.sandbox import MOUNTPOINT, Sandbox, waiting_init_command
from warmstart.snapshot.signing import load_signer, load_verifier
from warmstart.snapshot.store import SnapshotStore

HERE = Path(__file__).parent
SECRET = b"only-root-may-read-this\n" * 4


@pytest.fixture
def criu(criu_command: str) -> Criu:
    return Criu(criu_command, timeout=120)


def _secret_file(tmp_path: Path) -> Path:
    secret = tmp_path / "root-only"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    return secret


def _start_in_sandbox(host_dir: Path, script: str, args: str, sandboxes: list[Sandbox]) -> Sandbox:
    (host_dir / "control" / "logs").mkdir(parents=True, exist_ok=True)
    control = MOUNTPOINT / "control"
    command = f"setsid {shlex.quote(sys.executable)} {HERE / script} {control} {args}"
    sandbox = Sandbox.start(
        host_dir, ["/bin/sh", "-c", f"{command} </dev/null >{control}/logs/out 2>&1 & wait"]
    )
    sandboxes.append(sandbox)
    return sandbox


def _store_holds(store: SnapshotStore, content: bytes) -> list[Path]:
    return [path for path in store.root.rglob("*") if path.is_file() and content in path.read_bytes()]


def _capture_target(tmp_path: Path, store: SnapshotStore, key: Path, criu: Criu, sandboxes: list[Sandbox]):
    sandbox = _start_in_sandbox(tmp_path / "capture", "target_process.py", "9", sandboxes)
    control = ControlDir(sandbox.host_dir / "control")
    result = capture(store=store, signer=load_signer(key), sandbox=sandbox, control=control, criu=criu)
    return sandbox, result.snapshot


def _restore(tmp_path: Path, sandbox: Sandbox, store: SnapshotStore, key: Path, snapshot_id: str, criu: Criu):
    identity = SnapshotIdentity(model_digest=f"sha256:{9:0>64}", engine="target", engine_version="1")
    return restore(
        store=store, verifier=load_verifier(key), snapshot_id=snapshot_id, expected_identity=identity,
        sandbox=sandbox, control=ControlDir(sandbox.host_dir / "control"), criu=criu,
        work_dir=tmp_path / "restore-work",
    )  # fmt: skip


@pytest.mark.spawns
@pytest.mark.integration
def test_a_link_the_worker_holds_open_never_brings_its_target_into_the_store(
    tmp_path: Path, store: SnapshotStore, key: Path, criu: Criu, sandboxes: list[Sandbox]
) -> None:
    host_dir = tmp_path / "capture"
    (host_dir / "control" / "logs").mkdir(parents=True)
    (host_dir / "control" / "logs" / "leak").symlink_to(_secret_file(tmp_path))
    link_inside = MOUNTPOINT / "control" / "logs" / "leak"
    sandbox = _start_in_sandbox(host_dir, "hostile_target.py", str(link_inside), sandboxes)
    result = capture(
        store=store, signer=load_signer(key), sandbox=sandbox,
        control=ControlDir(host_dir / "control"), criu=criu,
    )  # fmt: skip
    assert _store_holds(store, SECRET) == []
    assert "sandbox/control/logs/leak" not in result.snapshot.files
    assert "sandbox/control/logs/out" in result.snapshot.files  # the engine's real open files still travel


@pytest.mark.spawns
@pytest.mark.integration
def test_a_link_planted_where_a_snapshot_file_goes_is_replaced_not_followed(
    tmp_path: Path, store: SnapshotStore, key: Path, criu: Criu, sandboxes: list[Sandbox]
) -> None:
    source, snapshot = _capture_target(tmp_path, store, key, criu, sandboxes)
    victim = tmp_path / "victim"
    victim.write_bytes(b"must stay as it is\n")
    target = Sandbox.start(tmp_path / "restored", waiting_init_command(), reserve_pids=True)
    sandboxes.append(target)
    (target.host_dir / "control" / "logs").mkdir(parents=True)
    (target.host_dir / "control" / "logs" / "out").symlink_to(victim)
    _restore(tmp_path, target, store, key, snapshot.id, criu)
    assert victim.read_bytes() == b"must stay as it is\n"
    assert not (target.host_dir / "control" / "logs" / "out").is_symlink()
    restored = wait_for_line(target.host_dir / "control" / "answer").split()[0]
    assert restored == wait_for_line(source.host_dir / "control" / "answer").split()[0]


@pytest.mark.spawns
@pytest.mark.integration
def test_a_link_planted_where_a_snapshot_directory_goes_is_refused_clearly(
    tmp_path: Path, store: SnapshotStore, key: Path, criu: Criu, sandboxes: list[Sandbox]
) -> None:
    _, snapshot = _capture_target(tmp_path, store, key, criu, sandboxes)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    target = Sandbox.start(tmp_path / "restored", waiting_init_command(), reserve_pids=True)
    sandboxes.append(target)
    (target.host_dir / "control").mkdir()
    (target.host_dir / "control" / "logs").symlink_to(elsewhere)
    with pytest.raises(RestoreFailed, match="symbolic link"):
        _restore(tmp_path, target, store, key, snapshot.id, criu)
    assert list(elsewhere.iterdir()) == []
    failed = ControlDir(target.host_dir / "control").read(RESTORE_FAILED)
    assert failed is not None and "control/logs" in failed.payload["reason"]
    assert target.host_pids() == [target.init_pid]  # CRIU never ran


def _read_in_thread(control: ControlDir, name: str) -> list[object]:
    """`control.read(name)` in a thread; [outcome] once it returned or raised, [] while it hangs."""
    outcome: list[object] = []

    def read() -> None:
        try:
            outcome.append(control.read(name))
        except Exception as exc:
            outcome.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=60)
    return outcome


def test_a_fifo_as_a_signal_is_a_clear_error_not_a_hang(tmp_path: Path) -> None:
    control = ControlDir(tmp_path / "control")
    control.path.mkdir()
    fifo = control.path / READY_FOR_SNAPSHOT
    os.mkfifo(fifo)
    outcome = _read_in_thread(control, READY_FOR_SNAPSHOT)
    if not outcome:  # release a reader stuck in open() before failing
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert outcome, "reading a FIFO planted as a signal hung"
    assert isinstance(outcome[0], SignalError) and "FIFO" in str(outcome[0])


def test_a_link_as_a_signal_is_a_clear_error(tmp_path: Path) -> None:
    control = ControlDir(tmp_path / "control")
    control.path.mkdir()
    secret = tmp_path / "root-only.json"
    secret.write_text('{"token": "secret"}')
    secret.chmod(0o600)
    (control.path / RESTORE_COMPLETE).symlink_to(secret)
    with pytest.raises(SignalError, match="symbolic link"):
        control.read(RESTORE_COMPLETE)


def test_a_link_as_the_control_directory_is_never_written_through(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "control").symlink_to(elsewhere)
    control = ControlDir(tmp_path / "control")
    with pytest.raises(SignalError, match="symbolic link"):
        control.send(RESTORE_COMPLETE, {"port": 1})
    with pytest.raises(SignalError, match="symbolic link"):
        control.read(RESTORE_COMPLETE)
    assert list(elsewhere.iterdir()) == []


def test_sending_over_a_planted_link_replaces_the_link(tmp_path: Path) -> None:
    control = ControlDir(tmp_path / "control")
    control.path.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    (control.path / RESTORE_FAILED).symlink_to(victim)
    control.send(RESTORE_FAILED, {"reason": "test"})
    assert victim.read_text() == "untouched"
    assert control.read(RESTORE_FAILED).payload == {"reason": "test"}


@pytest.mark.spawns
@pytest.mark.integration
def test_a_fifo_as_ready_for_snapshot_fails_the_capture_clearly(
    tmp_path: Path, store: SnapshotStore, key: Path, sandboxes: list[Sandbox]
) -> None:
    sandbox = Sandbox.start(tmp_path / "capture", ["/bin/sh", "-c", "sleep 600 & wait"])
    sandboxes.append(sandbox)
    control = ControlDir(sandbox.host_dir / "control")
    control.path.mkdir()
    os.mkfifo(control.path / READY_FOR_SNAPSHOT)
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            capture(
                store=store, signer=load_signer(key), sandbox=sandbox, control=control, criu=Criu("unused")
            )
        except BaseException as exc:
            outcome.append(exc)

    capturing = threading.Thread(target=run, daemon=True)
    capturing.start()
    capturing.join(timeout=60)
    if capturing.is_alive():  # release the old code's blocked open() before failing
        os.close(os.open(control.path / READY_FOR_SNAPSHOT, os.O_WRONLY | os.O_NONBLOCK))
    assert outcome, "the capture hung on a FIFO planted as ready-for-snapshot"
    assert isinstance(outcome[0], CaptureError) and "FIFO" in str(outcome[0])


@pytest.mark.spawns
@pytest.mark.integration
def test_a_file_the_worker_only_maps_travels_and_the_restore_maps_it_again(
    tmp_path: Path, store: SnapshotStore, key: Path, criu: Criu, sandboxes: list[Sandbox]
) -> None:
    """A JIT's shared object, loaded and its descriptor closed, lives in the worker's own files: a restore
    into a new sandbox (a new pod) finds it there only because the capture carried it."""
    source = _start_in_sandbox(tmp_path / "capture", "mapping_target.py", "", sandboxes)
    result = capture(
        store=store, signer=load_signer(key), sandbox=source,
        control=ControlDir(source.host_dir / "control"), criu=criu,
    )  # fmt: skip
    assert "sandbox/control/cache/launcher.so" in result.snapshot.files
    target = Sandbox.start(tmp_path / "restored", waiting_init_command(), reserve_pids=True)
    sandboxes.append(target)
    assert not (target.host_dir / "control" / "cache").exists()
    _restore(tmp_path, target, store, key, result.snapshot.id, criu)
    answer = wait_for_line(target.host_dir / "control" / "answer")
    assert answer == "loaded True\n"
