"""Helpers shared by the snapshot store tests (and the subprocesses they start)."""

from __future__ import annotations

import os
from pathlib import Path

from warmstart.api.identity import SnapshotIdentity


def make_identity(engine_version: str = "1.0", **overrides: object) -> SnapshotIdentity:
    fields: dict[str, object] = {
        "model_digest": "sha256:" + "ab" * 32,
        "engine": "builtin",
        "engine_version": engine_version,
        "engine_args": {"max_len": 128},
    }
    fields.update(overrides)
    return SnapshotIdentity(**fields)  # type: ignore[arg-type]


def write_files(directory: Path, files: dict[str, bytes], modes: dict[str, int] | None = None) -> None:
    for relative, content in files.items():
        target = directory / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
        os.chmod(target, (modes or {}).get(relative, 0o644))


SHARED_CONTENT = b"shared library pages " * 50_000


def publish_in_process(root: str, key_path: str, index: int) -> str:
    """A publisher process: stage a shared and an own file of the common identity, publish, return its id."""
    from warmstart.snapshot import SnapshotStore, load_signer

    store = SnapshotStore(root)
    with store.stage(make_identity(), node={"name": f"publisher-{index}"}) as staging:
        write_files(
            staging.dir,
            {"criu/shared.img": SHARED_CONTENT, "criu/own.img": f"publisher {index} ".encode() * 10_000},
        )
        return staging.publish(load_signer(key_path)).id


def collect_garbage_until(root: str, stop_file: str) -> int:
    """GC in a loop, as aggressively as it allows, until `stop_file` exists; returns the number of rounds."""
    from warmstart.snapshot import SnapshotStore

    store = SnapshotStore(root)
    rounds = 0
    while not os.path.exists(stop_file) or rounds == 0:
        store.gc(staging_older_than=0, blob_grace=0)
        rounds += 1
    return rounds
