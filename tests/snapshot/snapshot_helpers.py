"""Helpers shared by the snapshot store tests (and the subprocesses they start)."""

from __future__ import annotations

import os
from pathlib import Path

from warmstart.identity import SnapshotIdentity


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
