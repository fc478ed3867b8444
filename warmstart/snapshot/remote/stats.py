"""What transfers did, for the agent's metrics: per call (`TransferStats` in each result) and in total
(`Counters`, updated as objects move, so a failed pull still counts what it moved)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field, fields


@dataclass
class TransferStats:
    bytes_transferred: int = 0
    objects_transferred: int = 0
    bytes_skipped: int = 0  # already where they were going (bucket, or the node's cache)
    objects_skipped: int = 0
    objects_repaired: int = 0  # found damaged or gone and moved again
    seconds: float = 0.0


@dataclass
class Counters:
    """Totals since the store object was made; read them any time (the agent exports them)."""

    bytes_pushed: int = 0
    bytes_pulled: int = 0
    objects_pushed: int = 0
    objects_pulled: int = 0
    objects_skipped: int = 0
    bytes_skipped: int = 0
    objects_repaired: int = 0
    pushes: int = 0
    pulls: int = 0
    failures: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **amounts: int) -> None:
        with self._lock:
            for name, amount in amounts.items():
                setattr(self, name, getattr(self, name) + amount)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}


@dataclass(frozen=True)
class Progress:
    """One step of a push or pull, for a caller's progress hook.

    Steps: push: "blob-uploaded", "blob-skipped", "blobs-done", "manifest-uploaded", "published";
    pull: "manifest-verified", "bytes-fetched", "blob-fetched", "blobs-done", "published".
    """

    step: str
    snapshot_id: str
    digest: str | None = None
    bytes: int = 0


ProgressHook = Callable[[Progress], None]


def no_progress(_event: Progress) -> None:
    return None
