"""Control-directory signals between a worker and the agent that checkpoints or restores it.

The control directory is shared by both (an emptyDir in a pod, a plain directory on one machine); its
path comes from `WARMSTART_CONTROL_DIR`. Each signal is a small JSON file written atomically (write to a
temporary name, fsync, rename), so a reader never sees half a signal.

The directory belongs to the tenant as much as to the agent, so every operation reaches it without
following a symbolic link in its last component and works on bare names inside it through its descriptor;
a signal is read only when it is a regular file of at most `MAX_SIGNAL_BYTES` (opened non-blocking: a FIFO
planted as a signal cannot hang a reader); anything else is a `SignalError`.

Payload keys beyond the pid: `ready-for-snapshot` may carry `weight_staging` (the engine's plan for a weight
stager, see `warmstart.gpu.weight_stager`); `restore-complete` may carry `host`, `port`,
`restore_started_at` and `weight_stager_socket` (a file name in this directory where a stager waits).

`ready-for-snapshot` also carries `restore_facts`, and a restore pod's worker writes `restore-facts` as it
starts: the cheap facts a restore pod must share with the capture (`warmstart.api.restore_facts`).

`restore-claim` decides who starts the engine of a restore pod, so there are never two on one GPU. It is
created once and never replaced (`ControlDir.claim`): the restorer takes it (`holder: restore`) before it
touches the pod or starts CRIU, and then always answers with `restore-complete` or `restore-failed`; the
worker takes it (`holder: cold`) before it cold-starts because no restore came in time. Whoever finds the
other's claim gives way: a restorer does nothing (it sends nothing, the pod is a cold start), a worker keeps
waiting for the restorer's answer.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from warmstart.host.fileio import (
    UnsafeInput,
    directory_fd,
    loads_json,
    read_regular_file,
    write_atomic,
    write_exclusive,
)

CONTROL_DIR_ENV = "WARMSTART_CONTROL_DIR"

READY_FOR_SNAPSHOT = "ready-for-snapshot"  # worker: engine initialised, warm, quiesced; payload has the pid
SNAPSHOT_COMPLETE = "snapshot-complete"  # agent: capture done, the source may exit
RESTORE_COMPLETE = "restore-complete"  # agent: process restored (and GPU state); payload: resume settings
RESTORE_FAILED = "restore-failed"  # agent: restore failed; payload has the reason; worker cold-starts
# restorer or worker: who starts this pod's engine; created once, never replaced
RESTORE_CLAIM = "restore-claim"
RESTORE_FACTS = "restore-facts"  # restore pod's worker, as it starts: what the agent checks first

SIGNALS = (
    READY_FOR_SNAPSHOT, SNAPSHOT_COMPLETE, RESTORE_COMPLETE, RESTORE_FAILED, RESTORE_CLAIM, RESTORE_FACTS,
)  # fmt: skip

CLAIM_RESTORE = "restore"  # the agent (or `warmstart serve`) restores the engine
CLAIM_COLD = "cold"  # the worker cold-starts the engine
CLAIM_HOLDERS = (CLAIM_RESTORE, CLAIM_COLD)

MAX_SIGNAL_BYTES = 16 << 20  # a weight staging plan lists every tensor: large, never this large
CLAIM_ATTEMPTS = 3


class SignalTimeout(TimeoutError):
    """None of the awaited signals appeared in time."""


class SignalError(RuntimeError):
    """A signal (or the control directory) is not what the protocol writes: a link, a FIFO, bad JSON, ..."""


@dataclass(frozen=True)
class Signal:
    name: str
    payload: dict[str, Any]


@dataclass(frozen=True)
class Claim:
    """The restore claim as it stands: who holds it, and whether this caller just took it."""

    holder: str
    ours: bool
    payload: dict[str, Any]


class ControlDir:
    """One worker's control directory."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    @contextlib.contextmanager
    def directory(self, *, create: bool = False) -> Iterator[int]:
        """A descriptor of the directory, reached without following a link in its last component.

        FileNotFoundError when it does not exist (and `create` is false); SignalError when it is a link.
        """
        if create:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with directory_fd(self.path.parent, self.path.name, create=create) as fd:
                yield fd
        except UnsafeInput as exc:
            raise SignalError(f"control directory {self.path}: {exc}") from exc

    def send(self, name: str, payload: dict[str, Any] | None = None) -> None:
        _check_name(name)
        with self.directory(create=True) as fd:
            write_atomic(Path(name), json.dumps(payload or {}, sort_keys=True).encode(), dir_fd=fd)

    def read(self, name: str) -> Signal | None:
        """The signal `name`, None while it does not exist; SignalError when it is not a signal file."""
        _check_name(name)
        try:
            with self.directory() as fd:
                raw = read_regular_file(name, MAX_SIGNAL_BYTES, dir_fd=fd)
            payload = loads_json(raw or b"{}", str(self.path / name))
        except FileNotFoundError:
            return None
        except UnsafeInput as exc:
            raise SignalError(f"control signal in {self.path}: {exc}") from exc
        if not isinstance(payload, dict):
            raise SignalError(f"control signal {self.path / name} holds no JSON object")
        return Signal(name, payload)

    def present(self, name: str) -> bool:
        _check_name(name)
        try:
            with self.directory() as fd:
                os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def clear(self, *names: str) -> None:
        for name in names:
            _check_name(name)
        try:
            with self.directory() as fd:
                for name in names or SIGNALS:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name, dir_fd=fd)
        except FileNotFoundError:
            return

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

    def claim(self, holder: str, **details: Any) -> Claim:
        """Take the restore claim for `holder` unless it is held; the claim that holds, either way."""
        if holder not in CLAIM_HOLDERS:
            raise ValueError(f"unknown claim holder {holder!r}; known: {', '.join(CLAIM_HOLDERS)}")
        record = {"holder": holder, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}
        record.update(details)
        for _ in range(CLAIM_ATTEMPTS):  # retried only when a claim vanished between the two steps
            with self.directory(create=True) as fd:
                try:
                    write_exclusive(RESTORE_CLAIM, json.dumps(record, sort_keys=True).encode(), dir_fd=fd)
                    return Claim(holder, True, record)
                except FileExistsError:
                    pass
            held = self.read(RESTORE_CLAIM)
            if held is not None:
                if (theirs := held.payload.get("holder")) not in CLAIM_HOLDERS:
                    raise SignalError(f"{self.path / RESTORE_CLAIM} names no known holder: {theirs!r}")
                return Claim(str(theirs), False, held.payload)
        raise SignalError(f"{self.path / RESTORE_CLAIM} keeps appearing and vanishing")


def _check_name(name: str) -> None:
    if name not in SIGNALS:
        raise ValueError(f"unknown signal {name!r}; known: {', '.join(SIGNALS)}")
