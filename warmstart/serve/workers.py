"""Waiting for a worker to serve, and cold workers as plain child processes (no sandbox)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

from warmstart.serve.worker_spec import CONTROL_SUBDIR, READY_PATH, ServeError, WorkerSpec

if TYPE_CHECKING:
    from warmstart.checkpoint.sandbox import Sandbox


def wait_http_ready(spec: WorkerSpec, deadline: float, worker: Sandbox | PlainWorker) -> None:
    """Poll the worker until it answers HTTP; fails naming its logs when it dies first or takes too long."""
    logs = f"see {worker.host_dir / 'init.log'} and {worker.host_dir / CONTROL_SUBDIR / 'logs'}/"
    while True:
        try:
            with urllib.request.urlopen(spec.base_url + READY_PATH, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if not worker.alive():
            raise ServeError(f"the worker exited before it served; {logs}")
        if time.monotonic() >= deadline:
            raise ServeError(f"the worker did not answer on {spec.base_url} within --ready-timeout; {logs}")
        time.sleep(0.02)


class PlainWorker:
    """A cold worker as a plain child process, for machines where sandboxes cannot be made (not root)."""

    def __init__(self, host_dir: Path, process: subprocess.Popen[bytes]) -> None:
        self.host_dir = host_dir
        self.process = process

    @classmethod
    def start(cls, host_dir: Path, spec: WorkerSpec) -> PlainWorker:
        with open(host_dir / "init.log", "ab") as log_file:
            process = subprocess.Popen(
                spec.command("cold", host_dir / CONTROL_SUBDIR), stdin=subprocess.DEVNULL, stdout=log_file,
                stderr=log_file, start_new_session=True,
            )  # fmt: skip
        return cls(host_dir, process)

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, grace: float = 5.0) -> None:
        if not self.alive():
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
