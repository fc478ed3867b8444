"""CUDA checkpoint API and CRIU + CUDA round trips on a real GPU child process; outputs must be identical."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from warmstart.api.control_dir import READY_FOR_SNAPSHOT, RESTORE_COMPLETE, ControlDir

REPO = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("gpu_child.py")

pytestmark = [pytest.mark.gpu, pytest.mark.spawns]


def _start_child(control: Path, weights: Path, mode: str, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as out:
        # Own session and stdio on files: CRIU must not see pipes shared with the test runner.
        return subprocess.Popen(
            [sys.executable, str(CHILD), str(control), str(weights), mode],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip


def _wait_ready(control: ControlDir, child: subprocess.Popen[bytes], log: Path) -> dict:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        signal = control.read(READY_FOR_SNAPSHOT)
        if signal is not None:
            return signal.payload
        if child.poll() is not None:
            pytest.fail(f"GPU child exited {child.returncode} before ready:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)
    pytest.fail("GPU child never signalled ready-for-snapshot")


def _wait_after(control_dir: Path, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    after = control_dir / "after.json"
    while time.monotonic() < deadline:
        if after.exists():
            return json.loads(after.read_text())
        time.sleep(0.05)
    pytest.fail(f"restored child wrote no {after}")


def _device_used_by(pid: int) -> bool:
    return any("nvidia" in os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.parametrize("mode", ["plain", "arena"])
def test_cuda_checkpoint_api_round_trip_on_child(
    tmp_path: Path, weights_file: Path, cuda_checkpoint: Any, mode: str
) -> None:
    control = ControlDir(tmp_path / "control")
    child = _start_child(control.path, weights_file, mode, tmp_path / "child.log")
    try:
        before = _wait_ready(control, child, tmp_path / "child.log")
        pid = before["pid"]
        assert cuda_checkpoint.state(pid).name == "RUNNING"
        cuda_checkpoint.lock(pid)
        assert cuda_checkpoint.state(pid).name == "LOCKED"
        cuda_checkpoint.checkpoint(pid)
        assert cuda_checkpoint.state(pid).name == "CHECKPOINTED"
        assert not _device_used_by(pid)  # the GPU is really let go
        cuda_checkpoint.restore(pid)
        assert cuda_checkpoint.state(pid).name == "LOCKED"
        cuda_checkpoint.unlock(pid)
        assert cuda_checkpoint.state(pid).name == "RUNNING"
        control.send(RESTORE_COMPLETE)
        after = _wait_after(control.path)
        assert (after["graph"], after["eager"]) == (before["before"]["graph"], before["before"]["eager"])
        assert child.wait(timeout=60) == 0
    finally:
        if child.poll() is None:
            child.kill()


# Two CUDA processes in one tree, as an engine with one process per GPU has: the parent runs the GPU child's
# program itself after starting a second copy of it as its child.
PARENT_AND_CHILD = """
import runpy, subprocess, sys
child_control, control, weights, program = sys.argv[1:5]
subprocess.Popen([sys.executable, program, child_control, weights, "plain"], stdin=subprocess.DEVNULL)
sys.argv = [program, control, weights, "plain"]
runpy.run_path(program, run_name="__main__")
"""


def test_every_cuda_process_of_a_tree_is_checkpointed_and_restored_together(
    tmp_path: Path, weights_file: Path, cuda_checkpoint: Any
) -> None:
    controls = [ControlDir(tmp_path / "rank0"), ControlDir(tmp_path / "rank1")]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    log = tmp_path / "tree.log"
    argv = [sys.executable, "-c", PARENT_AND_CHILD, str(controls[1].path), str(controls[0].path),
            str(weights_file), str(CHILD)]  # fmt: skip
    with open(log, "wb") as out:
        parent = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                  env=env, start_new_session=True)  # fmt: skip
    pids: list[int] = []
    try:
        ready = [_wait_ready(control, parent, log) for control in controls]
        pids = cuda_checkpoint.cuda_processes(parent.pid)
        assert pids == [parent.pid, ready[1]["pid"]] and ready[0]["pid"] == parent.pid
        cuda_checkpoint.suspend_all(pids)
        assert [cuda_checkpoint.state(pid).name for pid in pids] == ["CHECKPOINTED", "CHECKPOINTED"]
        assert not any(_device_used_by(pid) for pid in pids)  # both let the GPU go
        cuda_checkpoint.resume_all(pids)
        assert [cuda_checkpoint.state(pid).name for pid in pids] == ["RUNNING", "RUNNING"]
        for control in controls:
            control.send(RESTORE_COMPLETE)
        for control, before in zip(controls, ready, strict=True):
            after = _wait_after(control.path)
            assert (after["graph"], after["eager"]) == (before["before"]["graph"], before["before"]["eager"])
        assert parent.wait(timeout=60) == 0
    finally:
        for pid in [parent.pid, *pids]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_criu_and_cuda_round_trip_with_weights_out_of_the_image(
    tmp_path: Path, weights_file: Path, cuda_checkpoint: Any, criu_command: str
) -> None:
    from warmstart.checkpoint.criu import Criu

    criu = Criu(criu_command)
    control = ControlDir(tmp_path / "control")
    images = tmp_path / "images"
    child = _start_child(control.path, weights_file, "arena-release", tmp_path / "child.log")
    pid = child.pid
    try:
        ready = _wait_ready(control, child, tmp_path / "child.log")
        assert ready["pid"] == pid
        cuda_checkpoint.lock(pid)
        cuda_checkpoint.checkpoint(pid)
        criu.dump(pid, images, logs_dir=tmp_path)
        assert child.wait(timeout=60) is not None  # CRIU killed the source after the dump
        control.clear(READY_FOR_SNAPSHOT)

        restored = criu.restore(images, logs_dir=tmp_path, detach=True)
        assert restored == pid  # CRIU restores the original pid
        assert cuda_checkpoint.state(pid).name == "CHECKPOINTED"
        cuda_checkpoint.restore(pid)
        cuda_checkpoint.unlock(pid)
        control.send(RESTORE_COMPLETE)
        after = _wait_after(control.path)
        assert (after["graph"], after["eager"]) == (ready["before"]["graph"], ready["before"]["eager"])
    finally:
        if child.poll() is None:
            child.kill()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # the restored process, if the test failed before it exited
