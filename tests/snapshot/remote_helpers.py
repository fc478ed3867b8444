"""Helpers for the remote store tests' subprocesses."""

from __future__ import annotations

import os
import signal

from warmstart.snapshot import SnapshotStore
from warmstart.snapshot.remote import Credentials, Progress, RemoteConfig, RemoteStore


def push_in_process(
    root: str,
    snapshot_id: str,
    die_at: str,
    endpoint: str,
    bucket: str,
    prefix: str,
    access: str,
    secret: str,
) -> None:
    """Push the snapshot and SIGKILL this process at the step `die_at` (no cleanup of any kind runs)."""
    config = RemoteConfig(
        bucket=bucket, endpoint=endpoint, prefix=prefix, credentials=Credentials(access, secret),
        part_size=5 << 20, multipart_threshold=5 << 20,
    )  # fmt: skip

    def die(event: Progress) -> None:
        if event.step == die_at:
            os.kill(os.getpid(), signal.SIGKILL)

    RemoteStore(SnapshotStore(root), config).push(snapshot_id, progress=die)
    raise SystemExit(f"the push finished without reaching {die_at!r}")
