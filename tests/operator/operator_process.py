"""Run `warmstart operator` as a real subprocess against a cluster, with its logs kept for failures."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from support import free_port

REPO = Path(__file__).resolve().parents[2]


class OperatorProcess:
    def __init__(self, kubeconfig: Path, log_path: Path, env: dict[str, str] | None = None) -> None:
        self.kubeconfig = kubeconfig
        self.log_path = log_path
        self.metrics_port = free_port()
        self.liveness_port = free_port()
        self.extra_env = env or {}
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60) -> None:
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), **self.extra_env}
        argv = [
            sys.executable,
            "-m",
            "warmstart",
            "operator",
            "--all-namespaces",
            "--metrics-port",
            str(self.metrics_port),
            "--liveness-port",
            str(self.liveness_port),
        ]
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"operator exited with {self.process.returncode}:\n{self.log_tail()}")
            if self.alive():
                return
            time.sleep(0.2)
        raise TimeoutError(f"operator not live after {timeout}s:\n{self.log_tail()}")

    def alive(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.liveness_port}/healthz", timeout=2) as reply:
                return reply.status == 200
        except OSError:
            return False

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as reply:
            return reply.read().decode()

    def rss_bytes(self) -> int:
        if self.process is None:
            return 0
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def cpu_seconds(self) -> float:
        """User + system CPU time the operator process has used so far."""
        if self.process is None:
            return 0.0
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, grace: float = 10) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)  # kopf stops cleanly on SIGTERM
        try:
            self.process.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(5)


@contextmanager
def running_operator(kubeconfig: Path, log_path: Path, env: dict[str, str]) -> Iterator[OperatorProcess]:
    """An operator for the duration of the block, whose log must show no traceback and no handler kopf gave
    up on when it stopped."""
    process = OperatorProcess(kubeconfig, log_path, env=env)
    process.start()
    try:
        yield process
    finally:
        process.stop()
    text = log_path.read_text(errors="replace")
    assert "Traceback" not in text and "failed permanently" not in text, process.log_tail(120)
