"""The restore claim between a real restore (real CRIU) and a real worker supervisor in restore mode as the
restore sandbox's PID 1 (as `warmstart serve` runs it), in both orders: never two engines in one pod."""

from __future__ import annotations

import os
import shlex
import sys
import threading
from pathlib import Path

import pytest
from support import free_port, recording_criu_command, wait_for_line, wait_until

from warmstart.api.control_dir import (
    CLAIM_COLD,
    CLAIM_RESTORE,
    RESTORE_CLAIM,
    RESTORE_COMPLETE,
    RESTORE_FAILED,
    ControlDir,
)
from warmstart.api.identity import SnapshotIdentity
from warmstart.checkpoint.capture import capture
from warmstart.checkpoint.criu import Criu
from warmstart.checkpoint.restore import FailureCounter, RestoreClaimed, RestoreResult, restore
from warmstart.checkpoint.sandbox import MOUNTPOINT, Sandbox
from warmstart.snapshot.signing import load_signer, load_verifier
from warmstart.snapshot.store import Snapshot, SnapshotStore

pytestmark = [pytest.mark.integration, pytest.mark.spawns]
TARGET = Path(__file__).with_name("target_process.py")
CONTROL_INSIDE = MOUNTPOINT / "control"


def _capture(
    tmp_path: Path, store: SnapshotStore, key: Path, criu_command: str, sandboxes: list[Sandbox]
) -> tuple[Sandbox, Snapshot]:
    host_dir = tmp_path / "capture"
    (host_dir / "control" / "logs").mkdir(parents=True)
    # It lingers after answering, as a serving engine would: a restored copy is still running when its
    # supervisor (slow on a loaded machine) reads restore-complete.
    target = f"{shlex.quote(sys.executable)} {TARGET} {CONTROL_INSIDE} 9 linger"
    script = f"setsid {target} </dev/null >{CONTROL_INSIDE}/logs/out 2>&1 & wait"
    source = Sandbox.start(host_dir, ["/bin/sh", "-c", script])
    sandboxes.append(source)
    control = ControlDir(host_dir / "control")
    result = capture(
        store=store, signer=load_signer(key), sandbox=source, control=control, criu=Criu(criu_command)
    )
    return source, result.snapshot


def _supervised_sandbox(
    host_dir: Path, cache: Path, sandboxes: list[Sandbox], start_when: Path | None
) -> Sandbox:
    """A restore sandbox whose PID 1 is `warmstart worker --mode restore` (after `start_when` exists)."""
    supervisor = [
        sys.executable, "-m", "warmstart", "worker", "--model", "tiny", "--device", "cpu",
        "--mode", "restore", "--restore-timeout", "1", "--control-dir", str(CONTROL_INSIDE),
        "--port", str(free_port()),
    ]  # fmt: skip
    wait = f"while [ ! -e {shlex.quote(str(start_when))} ]; do sleep 0.05; done; " if start_when else ""
    script = f"{wait}exec {shlex.join(supervisor)}"
    env = {**_environment(), "WARMSTART_CACHE": str(cache), "PYTHONUNBUFFERED": "1"}
    sandbox = Sandbox.start(host_dir, ["/bin/sh", "-c", script], env=env, reserve_pids=True)
    sandboxes.append(sandbox)
    return sandbox


def _environment() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if name != "WARMSTART_CONTROL_DIR"}


def _supervisor_log(sandbox: Sandbox) -> str:
    return (sandbox.host_dir / "init.log").read_text(errors="replace")


def _restore(tmp_path: Path, sandbox: Sandbox, store: SnapshotStore, key: Path, snapshot_id: str, criu: Criu):
    identity = SnapshotIdentity(model_digest=f"sha256:{9:0>64}", engine="target", engine_version="1")
    return restore(
        store=store, verifier=load_verifier(key), snapshot_id=snapshot_id, expected_identity=identity,
        sandbox=sandbox, control=ControlDir(sandbox.host_dir / "control"), criu=criu,
        work_dir=tmp_path / "restore-work",
    )  # fmt: skip


def _gated_criu(directory: Path, criu_command: str, gate: Path) -> str:
    """The real CRIU, whose `restore` waits until `gate` exists (a restore that takes its time)."""
    wrapper = directory / "gated-criu"
    wait = f"while [ ! -e {shlex.quote(str(gate))} ]; do sleep 0.05; done"
    wrapper.write_text(f'#!/bin/sh\nif [ "$1" = restore ]; then {wait}; fi\nexec {criu_command} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def test_a_restore_that_finds_the_workers_cold_claim_runs_no_criu(
    tmp_path: Path, store: SnapshotStore, key: Path, criu_command: str, sandboxes: list[Sandbox]
) -> None:
    _, snapshot = _capture(tmp_path, store, key, criu_command, sandboxes)
    pod = _supervised_sandbox(tmp_path / "pod", tmp_path / "cache", sandboxes, start_when=None)
    control = ControlDir(pod.host_dir / "control")
    wait_until(
        lambda: control.present(RESTORE_CLAIM), "the supervisor's claim after its restore timeout", 120
    )
    assert control.read(RESTORE_CLAIM).payload["holder"] == CLAIM_COLD
    wrapper, invoked = recording_criu_command(tmp_path, criu_command)
    with pytest.raises(RestoreClaimed, match="cold start"):
        _restore(tmp_path, pod, store, key, snapshot.id, Criu(wrapper))
    assert invoked() == []  # CRIU never ran
    assert control.read(RESTORE_COMPLETE) is None and control.read(RESTORE_FAILED) is None  # nothing said
    assert FailureCounter(store.root).count(snapshot.id) == 0  # not the snapshot's fault
    assert not (pod.host_dir / "control" / "logs" / "out").exists()  # nothing of the snapshot placed
    assert "started (cold)" in _supervisor_log(pod)


def test_a_supervisor_whose_timeout_passes_during_a_restore_waits_for_it_and_starts_no_engine(
    tmp_path: Path, store: SnapshotStore, key: Path, criu_command: str, sandboxes: list[Sandbox]
) -> None:
    source, snapshot = _capture(tmp_path, store, key, criu_command, sandboxes)
    start_supervisor, release_criu = tmp_path / "start-supervisor", tmp_path / "release-criu"
    pod = _supervised_sandbox(tmp_path / "pod", tmp_path / "cache", sandboxes, start_when=start_supervisor)
    control = ControlDir(pod.host_dir / "control")
    criu = Criu(_gated_criu(tmp_path, criu_command, release_criu), timeout=600)
    results: list[RestoreResult | BaseException] = []

    def run_restore() -> None:
        try:
            results.append(_restore(tmp_path, pod, store, key, snapshot.id, criu))
        except BaseException as exc:
            results.append(exc)

    restoring = threading.Thread(target=run_restore, daemon=True)
    restoring.start()
    try:
        wait_until(lambda: control.present(RESTORE_CLAIM), "the restore's claim", 120)
        assert control.read(RESTORE_CLAIM).payload["holder"] == CLAIM_RESTORE
        start_supervisor.touch()  # its restore timeout now passes while CRIU is still at work
        wait_until(
            lambda: "a restore holds the claim" in _supervisor_log(pod), "the supervisor giving way", 120
        )
    finally:
        release_criu.touch()
        restoring.join(timeout=600)
    assert results and isinstance(results[0], RestoreResult), results
    wait_until(lambda: "restored engine is pid" in _supervisor_log(pod), "the supervisor adopting it", 120)
    restored_answer = wait_for_line(pod.host_dir / "control" / "answer").split()[0]
    assert restored_answer == wait_for_line(source.host_dir / "control" / "answer").split()[0]
    (pod.host_dir / "control" / "exit").touch()  # the restored engine may end now
    assert pod.process.wait(timeout=60) == 0  # the restored engine ended, and the supervisor with it
    log = _supervisor_log(pod)
    assert "started (cold)" not in log and not (pod.host_dir / "control" / "logs" / "engine.log").exists(), (
        log
    )
