"""Helpers for worker tests: start a real `warmstart worker` and talk to it."""

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

START_TIMEOUT = 120.0


class Worker:
    """A `warmstart worker` supervisor process started by a test."""

    def __init__(self, cache: Path, workdir: Path, *args: str) -> None:
        self.workdir = workdir
        self.log_path = workdir / "supervisor.log"
        self.log_dir = _engine_log_dir(args)
        if self.log_dir is None:
            self.log_dir = workdir / "logs"
            args = (*args, "--log-dir", str(self.log_dir))
        env = dict(os.environ, WARMSTART_CACHE=str(cache), PYTHONUNBUFFERED="1")
        env.pop("WARMSTART_CONTROL_DIR", None)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "warmstart", "worker", "--model", "tiny", "--device", "cpu", *args],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )

    def logs(self) -> str:
        engine_logs = "".join(path.read_text() for path in self.log_dir.glob("engine.log"))
        return f"--- supervisor ---\n{self.log_path.read_text()}\n--- engine ---\n{engine_logs}"

    def wait_ready(self, port: int, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"worker exited with {self.process.returncode} before serving\n{self.logs()}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        pytest.fail(f"worker not ready on port {port} within {timeout}s\n{self.logs()}")

    def wait_for_file(self, path: Path, timeout: float = START_TIMEOUT) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if path.exists():
                return json.loads(path.read_text())
            if self.process.poll() is not None:
                pytest.fail(f"worker exited with {self.process.returncode}\n{self.logs()}")
            time.sleep(0.05)
        pytest.fail(f"{path.name} did not appear within {timeout}s\n{self.logs()}")

    def wait_for_log(self, text: str, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.logs():
            if self.process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"{text!r} never appeared in the logs\n{self.logs()}")
            time.sleep(0.05)

    def stop(self, timeout: float = 30) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            pytest.fail(f"worker did not stop within {timeout}s after SIGTERM\n{self.logs()}")


def _engine_log_dir(args: tuple[str, ...]) -> Path | None:
    """Where the supervisor started with `args` puts the engine's log (None: not given)."""
    for flag, below in (("--log-dir", ""), ("--control-dir", "logs")):
        if flag in args:
            return Path(args[args.index(flag) + 1]) / below
    return None


def post(port: int, path: str, body: object, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{port}{path}", json=body, timeout=timeout)
