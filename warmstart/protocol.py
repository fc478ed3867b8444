"""Control-directory signals between a worker and the agent that checkpoints or restores it.

The control directory is shared by both (an emptyDir in a pod, a plain directory on one machine); its
path comes from `WARMSTART_CONTROL_DIR`. Each signal is a small JSON file written atomically (write to a
temporary name, fsync, rename), so a reader never sees half a signal.

Payload keys beyond the pid: `ready-for-snapshot` may carry `weight_staging` (the engine's plan for a weight
stager, see `warmstart.engines.weight_stager`); `restore-complete` may carry `host`, `port`,
`restore_started_at` and `weight_stager_socket` (a file name in this directory where a stager waits).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from warmstart.fileio import write_atomic

CONTROL_DIR_ENV = "WARMSTART_CONTROL_DIR"

READY_FOR_SNAPSHOT = "ready-for-snapshot"  # worker: engine initialised, warm, quiesced; payload has the pid
SNAPSHOT_COMPLETE = "snapshot-complete"  # agent: capture done, the source may exit
RESTORE_COMPLETE = "restore-complete"  # agent: process restored (and GPU state); payload: resume settings
RESTORE_FAILED = "restore-failed"  # agent: restore failed; payload has the reason; worker cold-starts

SIGNALS = (READY_FOR_SNAPSHOT, SNAPSHOT_COMPLETE, RESTORE_COMPLETE, RESTORE_FAILED)


class SignalTimeout(TimeoutError):
    """None of the awaited signals appeared in time."""


@dataclass(frozen=True)
class Signal:
    name: str
    payload: dict[str, Any]


class ControlDir:
    """One worker's control directory."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    @classmethod
    def from_env(cls) -> ControlDir:
        value = os.environ.get(CONTROL_DIR_ENV)
        if not value:
            raise RuntimeError(f"{CONTROL_DIR_ENV} is not set: the worker needs a control directory")
        return cls(value)

    def _file(self, name: str) -> Path:
        if name not in SIGNALS:
            raise ValueError(f"unknown signal {name!r}; known: {', '.join(SIGNALS)}")
        return self.path / name

    def send(self, name: str, payload: dict[str, Any] | None = None) -> None:
        target = self._file(name)
        self.path.mkdir(parents=True, exist_ok=True)
        write_atomic(target, json.dumps(payload or {}, sort_keys=True).encode())

    def read(self, name: str) -> Signal | None:
        try:
            raw = self._file(name).read_bytes()
        except FileNotFoundError:
            return None
        return Signal(name, json.loads(raw or b"{}"))

    def present(self, name: str) -> bool:
        return self._file(name).exists()

    def clear(self, *names: str) -> None:
        for name in names or SIGNALS:
            self._file(name).unlink(missing_ok=True)

    def wait(self, *names: str, timeout: float | None = None, interval: float = 0.01) -> Signal:
        """Block until one of `names` appears; return the first found, in the order given."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            for name in names:
                signal = self.read(name)
                if signal is not None:
                    return signal
            if deadline is not None and time.monotonic() >= deadline:
                raise SignalTimeout(f"none of {', '.join(names)} appeared in {self.path} within {timeout}s")
            time.sleep(interval)
