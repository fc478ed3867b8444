"""What transfers did, for the agent's metrics (`TransferStats` in each result), and their progress hooks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class TransferStats:
    bytes_transferred: int = 0
    bytes_skipped: int = 0  # already where they were going (bucket, or the node's cache)
    objects_skipped: int = 0
    objects_repaired: int = 0  # found damaged or gone and moved again


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
