"""Fixtures shared by the capture and restore tests: an empty store and its signing key."""

from __future__ import annotations

from pathlib import Path

import pytest

from warmstart.snapshot.signing import generate_hmac_key
from warmstart.snapshot.store import SnapshotStore


@pytest.fixture
def store(tmp_path: Path) -> SnapshotStore:
    return SnapshotStore(tmp_path / "store")


@pytest.fixture
def key(tmp_path: Path) -> Path:
    return generate_hmac_key(tmp_path / "hmac.key")
