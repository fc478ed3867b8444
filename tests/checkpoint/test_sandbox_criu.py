"""Real CRIU dumps and restores of a small stateful process inside one-machine sandboxes."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from support import wait_for_line, wait_until

from warmstart.api.control_dir import READY_FOR_SNAPSHOT, RESTORE_COMPLETE, SNAPSHOT_COMPLETE, ControlDir
from warmstart.checkpoint.criu import RESTORE_READERS, Criu, CriuError
from warmstart.checkpoint.sandbox import MOUNTPOINT, Sandbox, waiting_init_command

pytestmark = [pytest.mark.integration, pytest.mark.spawns]
TARGET = Path(__file__).with_name("target_process.py")


def _target_init(seed: int, *extra: str) -> list[str]:
    control = MOUNTPOINT / "control"
    target = f"{sys.executable} {TARGET} {control} {seed} {' '.join(extra)}"
    script = f"setsid {target} </dev/null >{control}/logs/out 2>&1 & wait"
    return ["/bin/sh", "-c", script]


def _capture(
    tmp_path: Path, criu: Criu, sandboxes: list[Sandbox], seed: int, *extra: str
) -> tuple[Path, Path]:
    """Run the target in a sandbox, dump it (leaving it running), let it exit; returns images and logs."""
    host = tmp_path / "capture"
    (host / "control" / "logs").mkdir(parents=True)
    sandbox = Sandbox.start(host, _target_init(seed, *extra))
    sandboxes.append(sandbox)
    control = ControlDir(host / "control")
    ready = control.wait(READY_FOR_SNAPSHOT, timeout=30)
    images = tmp_path / "images"
    criu.in_namespaces_of(sandbox.init_pid).dump(
        ready.payload["pid"], images, logs_dir=tmp_path / "criu-logs", leave_running=True
    )
    saved_logs = tmp_path / "saved-logs"
    shutil.copytree(host / "control" / "logs", saved_logs)
    control.send(SNAPSHOT_COMPLETE)
    sandbox.process.wait(timeout=30)
    return images, saved_logs


def _restore_sandbox(tmp_path: Path, name: str, saved_logs: Path) -> Sandbox:
    """A fresh sandbox holding the stdio files the process had at dump time."""
    host = tmp_path / name
    shutil.copytree(saved_logs, host / "control" / "logs")
    return Sandbox.start(host, waiting_init_command(), reserve_pids=True)


def test_two_restores_run_side_by_side_and_answer_identically(
    tmp_path: Path, criu_command: str, sandboxes: list[Sandbox]
) -> None:
    criu = Criu(criu_command, timeout=120)
    images, saved_logs = _capture(tmp_path, criu, sandboxes, seed=11)
    restored = []
    for index in range(2):
        sandbox = _restore_sandbox(tmp_path, f"restore-{index}", saved_logs)
        sandboxes.append(sandbox)
        namespace_pid = criu.in_namespaces_of(sandbox.init_pid).restore(
            images, logs_dir=tmp_path / f"restore-{index}-logs"
        )
        sandbox.set_main_pid(namespace_pid)
        restored.append((sandbox, namespace_pid, sandbox.host_pid(namespace_pid)))

    (first, pid_a, host_a), (second, pid_b, host_b) = restored
    assert pid_a == pid_b  # the PID the process had when it was dumped, in both namespaces
    assert host_a is not None and host_b is not None and host_a != host_b
    assert first.pid_namespace != second.pid_namespace
    for index, (sandbox, _, _) in enumerate(restored):
        ControlDir(sandbox.host_dir / "control").send(RESTORE_COMPLETE, {"port": 9000 + index})
    answers = [wait_for_line(sandbox.host_dir / "control" / "answer").split() for sandbox, _, _ in restored]
    assert answers[0][0] == answers[1][0]  # same state, same continuation
    assert [answer[2] for answer in answers] == ["9000", "9001"]  # each got its own resume payload
    for sandbox, _, _ in restored:
        assert sandbox.process.wait(timeout=30) == 0  # init leaves once the restored process exits


@pytest.mark.parametrize(
    ("held", "readers"), [([], None), (["hold=200"], 4)], ids=["small", "200MiB-4-readers"]
)
def test_restore_answers_like_the_uninterrupted_process(
    tmp_path: Path, criu_command: str, sandboxes: list[Sandbox], monkeypatch: pytest.MonkeyPatch,
    held: list[str], readers: int | None,
) -> None:  # fmt: skip
    criu = Criu(criu_command, timeout=120)
    if readers is not None:  # the restorer fills the held memory with several readers, in place
        if not criu.reads_pages_in_parallel():
            pytest.skip("this CRIU is not the build with parallel page reads (hack/criu-setup makes it)")
        monkeypatch.setenv(RESTORE_READERS, str(readers))
    images, saved_logs = _capture(tmp_path, criu, sandboxes, 5, *held)
    sandbox = _restore_sandbox(tmp_path, "restore", saved_logs)
    sandboxes.append(sandbox)
    sandbox.set_main_pid(criu.in_namespaces_of(sandbox.init_pid).restore(images, logs_dir=tmp_path / "logs"))
    if readers is not None:
        assert f"with {readers} readers" in (tmp_path / "logs" / "restore.log").read_text()
    ControlDir(sandbox.host_dir / "control").send(RESTORE_COMPLETE)
    restored_answer = wait_for_line(sandbox.host_dir / "control" / "answer").split()[0]

    reference_host = tmp_path / "reference"
    (reference_host / "control" / "logs").mkdir(parents=True)
    reference = Sandbox.start(reference_host, _target_init(5, *held))
    sandboxes.append(reference)
    ControlDir(reference_host / "control").wait(READY_FOR_SNAPSHOT, timeout=30)
    ControlDir(reference_host / "control").send(RESTORE_COMPLETE)
    assert wait_for_line(reference_host / "control" / "answer").split()[0] == restored_answer


def test_restore_without_the_log_files_fails_with_criu_reason(
    tmp_path: Path, criu_command: str, sandboxes: list[Sandbox]
) -> None:
    criu = Criu(criu_command, timeout=120)
    images, _ = _capture(tmp_path, criu, sandboxes, seed=3)
    sandbox = Sandbox.start(tmp_path / "bare", waiting_init_command(), reserve_pids=True)
    sandboxes.append(sandbox)
    with pytest.raises(CriuError, match=r"CRIU restore failed: .*Error"):
        criu.in_namespaces_of(sandbox.init_pid).restore(images, logs_dir=tmp_path / "bare-logs")
    sandbox.kill_all_but_init()
    wait_until(lambda: sandbox.host_pids() == [sandbox.init_pid], "only the init left")
    assert sandbox.alive()  # a failed restore does not end the sandbox: it can cold-start instead
