"""Killing or interrupting a capture at each phase leaves no visible snapshot, and the source is cleanly gone
with the sandbox its capturer owned (after being told to carry on, when the capturer could say so)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support import wait_until, with_default_sigint

from warmstart.api.control_dir import RESTORE_COMPLETE
from warmstart.checkpoint.sandbox import pid_namespace_of
from warmstart.snapshot.signing import generate_hmac_key
from warmstart.snapshot.store import SnapshotStore

pytestmark = [pytest.mark.integration, pytest.mark.spawns]
DRIVER = Path(__file__).with_name("capture_driver.py")
PHASES = ["wait_ready", "criu_dump", "copy_sandbox_files", "publish"]


def _namespace_pids(namespace: str) -> list[int]:
    """Host PIDs of the processes still in PID namespace `namespace` (zombies have no namespace link)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if pid_namespace_of(int(entry)) == namespace:
                    found.append(int(entry))
    return found


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
            preexec_fn=with_default_sigint,
        )  # fmt: skip
    init_pid = None
    try:
        wait_until(
            lambda: (work / "phase").exists() and (work / "phase").read_text() == phase,
            f"phase {phase}",
            timeout=60,
        )
        sandbox = json.loads((work / "sandbox.json").read_text())
        init_pid, namespace = sandbox["init_pid"], sandbox["pid_namespace"]
        driver.send_signal(how)
        driver.wait(timeout=60)
        assert driver.returncode != 0  # it never finished
        assert not store.root.exists() or store.list() == []

        control = work / "sandbox" / "control"
        if how == signal.SIGINT and phase != "wait_ready":
            # an orderly interruption told the source to carry on before the capturer exited
            assert json.loads((control / RESTORE_COMPLETE).read_text())["restored_in_place"] is True
        # The sandbox dies with its owner: no half-dumped or frozen source is left behind.
        wait_until(lambda: not _namespace_pids(namespace), "the sandbox's processes gone", timeout=60)
    finally:
        if driver.poll() is None:
            driver.kill()
        if init_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(init_pid, signal.SIGKILL)
