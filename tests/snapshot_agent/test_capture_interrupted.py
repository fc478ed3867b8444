"""Killing or interrupting a capture at each phase leaves no visible snapshot, and the source either keeps
running or is cleanly gone."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from warmstart.snapshot.signing import generate_hmac_key
from warmstart.snapshot.store import SnapshotStore
from warmstart.snapshot_agent.sandbox import namespace_pids, pid_namespace_of

pytestmark = pytest.mark.integration
DRIVER = Path(__file__).with_name("capture_driver.py")
PHASES = ["wait_ready", "criu_dump", "copy_sandbox_files", "publish"]


def _wait_for(condition, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout}s"
        time.sleep(0.02)


def _source_pids(init_pid: int, namespace: str) -> list[int]:
    """Host PIDs of the target process (anything in the sandbox's namespace but its init)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != init_pid:
            with contextlib.suppress(OSError):
                if pid_namespace_of(int(entry)) == namespace and namespace_pids(int(entry))[-1] != 1:
                    found.append(int(entry))
    return found


def _process_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGINT], ids=["killed", "ctrl-c"])
@pytest.mark.parametrize("phase", PHASES)
def test_interrupted_capture_leaves_no_snapshot(
    tmp_path: Path, criu_command: str, phase: str, how: signal.Signals
) -> None:
    store = SnapshotStore(tmp_path / "store")
    key = generate_hmac_key(tmp_path / "hmac.key")
    work = tmp_path / "work"
    work.mkdir()
    with open(tmp_path / "driver.err", "wb") as errors:
        driver = subprocess.Popen(
            [sys.executable, str(DRIVER), str(store.root), str(key), str(work), criu_command, phase],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=errors,
        )  # fmt: skip
    init_pid = None
    try:
        _wait_for(
            lambda: (work / "phase").exists() and (work / "phase").read_text() == phase, f"phase {phase}"
        )
        sandbox = json.loads((work / "sandbox.json").read_text())
        init_pid, namespace = sandbox["init_pid"], sandbox["pid_namespace"]
        driver.send_signal(how)
        driver.wait(timeout=60)
        assert driver.returncode != 0  # it never finished
        assert not store.root.exists() or store.list() == []

        sources = _source_pids(init_pid, namespace)
        if sources:  # still there: it must be a live process, not a zombie or a stopped half-dump
            assert all(_process_state(pid) in "RS" for pid in sources)
        if how == signal.SIGINT and phase != "wait_ready":
            # an orderly interruption resumed the source: it answered and is gone, or is answering now
            _wait_for(lambda: (work / "sandbox" / "control" / "answer").exists(), "the source answered")
    finally:
        if driver.poll() is None:
            driver.kill()
        if init_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(init_pid, signal.SIGKILL)
