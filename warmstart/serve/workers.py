"""Waiting for the worker serve started to serve, and cold workers as plain child processes (no sandbox)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

from warmstart.serve.readiness import has_socket, ready_probe, socket_holder
from warmstart.serve.worker_spec import CONTROL_SUBDIR, READY_PATH, ServeError, WorkerExited, WorkerSpec

if TYPE_CHECKING:
    from warmstart.checkpoint.sandbox import Sandbox


def wait_http_ready(spec: WorkerSpec, deadline: float, worker: Sandbox | PlainWorker) -> None:
    """Poll the worker until it answers HTTP, through a connection one of its own processes accepted (see
    `readiness`); fails naming its logs when it dies first or takes too long, and at once, naming the
    process, when another process answers on its port."""
    logs = f"see {worker.host_dir / 'init.log'} and {worker.host_dir / CONTROL_SUBDIR / 'logs'}/"
    while True:
        with ready_probe(spec.host, spec.port, READY_PATH) as inode:
            if inode and any(has_socket(pid, inode) for pid in worker.host_pids()):
                return
            holder = socket_holder(inode) if inode else ""
        if holder:
            raise ServeError(
                f"{spec.base_url} is answered by another process ({holder}), not by the worker serve "
                f"started: the port is in use; {logs}"
            )
        if not worker.alive():
            raise WorkerExited(f"the worker exited before it served; {logs}")
        if time.monotonic() >= deadline:
            raise ServeError(f"the worker did not answer on {spec.base_url} within --ready-timeout; {logs}")
        time.sleep(0.02)


class PlainWorker:
    """A cold worker as a plain child process, for machines where sandboxes cannot be made (not root)."""

    def __init__(self, host_dir: Path, spec: WorkerSpec) -> None:
        self.host_dir = host_dir
        with open(host_dir / "init.log", "ab") as log_file:
            self.process = subprocess.Popen(
                spec.command("cold", host_dir / CONTROL_SUBDIR), stdin=subprocess.DEVNULL, stdout=log_file,
                stderr=log_file, start_new_session=True,
            )  # fmt: skip

    def alive(self) -> bool:
        return self.process.poll() is None

    def host_pids(self) -> list[int]:
        """The worker's process and its descendants."""
        from warmstart.checkpoint.sandbox import children_of

        found, pending = [], [self.process.pid]
        while pending:
            pid = pending.pop()
            found.append(pid)
            pending += children_of(pid)
        return found

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
