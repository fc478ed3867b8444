"""Capture and restore modes of `warmstart worker`, with the agent's side of the control directory played
by the test: signals in order, nothing listening before resume, port overrides, fallbacks to cold starts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from support import free_port
from worker_helpers import START_TIMEOUT, post

from warmstart.api.control_dir import (
    READY_FOR_SNAPSHOT,
    RESTORE_COMPLETE,
    RESTORE_FAILED,
    SNAPSHOT_COMPLETE,
    ControlDir,
)
from warmstart.api.identity import SnapshotIdentity
from warmstart.host import procinfo

pytestmark = pytest.mark.spawns

TCP_LISTEN = "0A"


def socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def listening(pid: int) -> dict[int, str]:
    """Listening TCP ports in `pid`'s network namespace -> socket inode."""
    ports = {}
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == TCP_LISTEN:
                ports[int(fields[1].rsplit(":", 1)[1], 16)] = fields[9]
    return ports


def fd_targets(pid: int) -> dict[int, str]:
    return {int(fd): os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}


def _stat(pid: int) -> procinfo.ProcStat:
    stat = procinfo.read_stat(pid)
    assert stat is not None, f"process {pid} is gone"
    return stat


def parent_of(pid: int) -> int:
    return _stat(pid).ppid


def session_of(pid: int) -> int:
    return _stat(pid).session


def wait_gone(pid: int, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not procinfo.is_running(pid):
            return True
        time.sleep(0.05)
    return False


def test_capture_then_restore_complete_serves_on_the_new_port(start_worker, tmp_path: Path) -> None:
    control, logs = tmp_path / "control", tmp_path / "logs"
    port, new_port = free_port(), free_port()
    worker = start_worker(
        "--mode", "capture", "--port", str(port), "--control-dir", str(control), "--log-dir", str(logs)
    )
    ready = worker.wait_for_file(control / READY_FOR_SNAPSHOT)
    engine = ready["pid"]
    assert parent_of(engine) == worker.process.pid
    assert session_of(engine) == engine, "the engine must lead its own session"
    identity = SnapshotIdentity.from_dict(ready["identity"])
    assert ready["identity_hash"] == identity.digest()
    assert identity.engine == "builtin" and ready["weights_released"] is False
    assert Path(ready["model_dir"]).is_dir()
    assert all(Path(path).is_file() for path in ready["engine"]["weight_files"])

    # Quiesced: no socket at all, nothing listening on the port, no descriptor on the control directory.
    assert socket_inodes(engine) == set()
    assert port not in listening(engine)
    targets = fd_targets(engine)
    assert targets[0] == "/dev/null"
    assert targets[1] == targets[2] == str(logs / "engine.log")
    assert not [t for t in targets.values() if t.startswith(str(control))]
    assert sorted(targets) == [0, 1, 2], f"unexpected descriptors: {targets}"
    worker.wait_for_log("ready for snapshot")  # the engine's last line before it waits for its signal
    assert not ControlDir(control).present(RESTORE_COMPLETE) and socket_inodes(engine) == set()

    ControlDir(control).send(RESTORE_COMPLETE, {"port": new_port, "host": "127.0.0.1"})
    worker.wait_ready(new_port)
    assert listening(engine).get(new_port) in socket_inodes(engine)
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    body = post(new_port, "/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 4}).json()
    assert body["usage"]["completion_tokens"] >= 1
    metrics = httpx.get(f"http://127.0.0.1:{new_port}/metrics").text
    assert 'warmstart_worker_start_seconds{mode="restore"}' in metrics
    assert worker.stop() == 0
    assert wait_gone(engine)


def test_capture_then_snapshot_complete_exits_cleanly(start_worker, tmp_path: Path) -> None:
    control = tmp_path / "control"
    worker = start_worker("--mode", "capture", "--port", str(free_port()), "--control-dir", str(control))
    engine = worker.wait_for_file(control / READY_FOR_SNAPSHOT)["pid"]
    ControlDir(control).send(SNAPSHOT_COMPLETE)
    assert worker.process.wait(timeout=60) == 0, worker.logs()
    assert wait_gone(engine)
    assert (control / "logs" / "engine.log").exists()


def test_capture_with_released_weights_reacquires_them(start_worker, tmp_path: Path) -> None:
    control, port = tmp_path / "control", free_port()
    worker = start_worker(
        "--mode", "capture", "--port", str(port), "--control-dir", str(control), "--release-weights"
    )
    assert worker.wait_for_file(control / READY_FOR_SNAPSHOT)["weights_released"] is True
    ControlDir(control).send(RESTORE_COMPLETE)
    worker.wait_ready(port)
    greedy = {
        "model": "tiny",
        "prompt": "Once upon a time",
        "max_tokens": 24,
        "temperature": 0,
        "ignore_eos": True,
    }
    text = post(port, "/v1/completions", greedy).json()["choices"][0]["text"]
    cold_port = free_port()
    cold = start_worker("--mode", "cold", "--port", str(cold_port))
    cold.wait_ready(cold_port)
    assert post(cold_port, "/v1/completions", greedy).json()["choices"][0]["text"] == text


def test_capture_then_restore_failed_keeps_the_original_serving(start_worker, tmp_path: Path) -> None:
    control, port = tmp_path / "control", free_port()
    worker = start_worker("--mode", "capture", "--port", str(port), "--control-dir", str(control))
    worker.wait_for_file(control / READY_FOR_SNAPSHOT)
    ControlDir(control).send(RESTORE_FAILED, {"reason": "criu dump failed (test)"})
    worker.wait_ready(port)
    assert "criu dump failed (test)" in worker.logs()


def test_capture_clears_stale_signals_first(start_worker, tmp_path: Path) -> None:
    control, port = tmp_path / "control", free_port()
    ControlDir(control).send(SNAPSHOT_COMPLETE, {"stale": True})
    worker = start_worker("--mode", "capture", "--port", str(port), "--control-dir", str(control))
    worker.wait_for_file(control / READY_FOR_SNAPSHOT)
    assert not ControlDir(control).present(SNAPSHOT_COMPLETE), "the leftover is cleared before the start"
    # Still capturing: it takes the next signal, and a capture that had taken the leftover would have ended.
    ControlDir(control).send(RESTORE_FAILED, {"reason": "stale-signal test"})
    worker.wait_ready(port)
    assert "snapshot complete; this process is done" not in worker.logs()


def test_restore_mode_cold_starts_when_the_restore_failed(start_worker, tmp_path: Path) -> None:
    control, port = tmp_path / "control", free_port()
    worker = start_worker("--mode", "restore", "--port", str(port), "--control-dir", str(control))
    worker.wait_for_log("restore mode: waiting")
    assert worker.process.poll() is None and "engine process" not in worker.logs()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    ControlDir(control).send(RESTORE_FAILED, {"reason": "identity mismatch (test)"})
    worker.wait_ready(port)
    assert "identity mismatch (test)" in worker.logs()
    metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    assert 'warmstart_worker_start_seconds{mode="cold"}' in metrics


def test_restore_mode_cold_starts_after_the_timeout(start_worker, tmp_path: Path) -> None:
    control, port = tmp_path / "control", free_port()
    worker = start_worker(
        "--mode", "restore", "--port", str(port), "--control-dir", str(control), "--restore-timeout", "1"
    )
    worker.wait_ready(port)
    assert "no restore within" in worker.logs()


def test_restore_mode_adopts_the_restored_engine_and_forwards_signals(
    start_worker, worker_cache: Path, tmp_path: Path
) -> None:
    """Stand-in for an agent's restore: an engine in capture mode started elsewhere is handed over."""
    control, port = tmp_path / "control", free_port()
    env = dict(os.environ, WARMSTART_CACHE=str(worker_cache))
    with open(tmp_path / "engine.log", "ab") as log:
        engine = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "warmstart.worker.engine_process",
                "--model",
                "tiny",
                "--mode",
                "capture",
                "--port",
                str(port),
                "--control-dir",
                str(control),
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env=env,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not (control / READY_FOR_SNAPSHOT).exists():
            assert engine.poll() is None and time.monotonic() < deadline, (
                tmp_path / "engine.log"
            ).read_text()
            time.sleep(0.05)
        worker = start_worker("--mode", "restore", "--port", str(port), "--control-dir", str(control))
        worker.wait_for_log("restore mode: waiting")
        ControlDir(control).send(RESTORE_COMPLETE, {"pid": engine.pid})
        worker.wait_ready(port)
        worker.wait_for_log(f"restored engine is pid {engine.pid}")
        worker.process.send_signal(signal.SIGTERM)
        assert engine.wait(timeout=30) == 0
        assert worker.process.wait(timeout=30) == 0
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()


def test_bad_arguments_name_what_to_fix(worker_cache: Path) -> None:
    env = dict(os.environ, WARMSTART_CACHE=str(worker_cache))
    env.pop("WARMSTART_CONTROL_DIR", None)
    result = subprocess.run(
        [sys.executable, "-m", "warmstart", "worker", "--mode", "capture"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 2
    assert "--control-dir" in result.stderr
    result = subprocess.run(
        [sys.executable, "-m", "warmstart", "worker", "--model", "nope"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 2
    assert "neither a preset" in result.stderr


def test_control_dir_comes_from_the_environment(worker_cache: Path, tmp_path: Path) -> None:
    env = dict(os.environ, WARMSTART_CACHE=str(worker_cache), WARMSTART_CONTROL_DIR=str(tmp_path / "ctl"))
    process = subprocess.Popen(
        [sys.executable, "-m", "warmstart", "worker", "--mode", "capture", "--port", str(free_port())],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not (tmp_path / "ctl" / READY_FOR_SNAPSHOT).exists():
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        payload = json.loads((tmp_path / "ctl" / READY_FOR_SNAPSHOT).read_text())
        ControlDir(tmp_path / "ctl").send(SNAPSHOT_COMPLETE)
        assert process.wait(timeout=60) == 0
        assert wait_gone(payload["pid"])
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
