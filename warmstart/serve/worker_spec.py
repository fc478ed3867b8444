"""What a worker of `warmstart serve` runs, and how one came up."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

CONTROL_SUBDIR = "control"  # a sandbox's control directory, relative to its private directory
READY_PATH = "/ready"  # 200 once the worker serves


class ServeError(RuntimeError):
    """The worker could not be brought up at all (not even by a cold start)."""


class WorkerExited(ServeError):
    """The worker's process tree ended before it served."""


@dataclass
class WorkerSpec:
    """What to run: the same engine, model and device for cold starts, captures and restores."""

    engine: str = "builtin"
    model: str = "tiny"
    device: str = "cpu"
    host: str = "127.0.0.1"
    port: int = 8000
    extra_args: list[str] = field(default_factory=list)

    def command(self, mode: str, control_dir: Path) -> list[str]:
        return [
            sys.executable, "-m", "warmstart", "worker", "--engine", self.engine, "--model", self.model,
            "--device", self.device, "--mode", mode, "--host", self.host, "--port", str(self.port),
            "--control-dir", str(control_dir), *self.extra_args,
        ]  # fmt: skip

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass
class StartReport:
    """How a worker came up; what the table prints."""

    mode: str  # "restore", "cold+capture", "cold"
    seconds_to_ready: float
    snapshot_id: str = ""
    snapshot_bytes: int = 0
    reason: str = ""
    timings: dict[str, float] = field(default_factory=dict)
