"""Fixtures for the snapshot store tests: a store in a temporary directory, keys, identities, a writer."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from snapshot_helpers import make_identity, write_files

from warmstart.api.identity import SnapshotIdentity
from warmstart.snapshot import SnapshotStore, generate_hmac_key, load_signer, load_verifier
from warmstart.snapshot.signing import Signer, Verifier


@pytest.fixture
def store(tmp_path: Path) -> SnapshotStore:
    # A small chunk size, so the tests' multi-MiB files take the chunked verification path.
    return SnapshotStore(tmp_path / "store", chunk_size=1 << 20)


@pytest.fixture
def hmac_key_path(tmp_path: Path) -> Path:
    return generate_hmac_key(tmp_path / "keys" / "hmac.key")


@pytest.fixture
def signer(hmac_key_path: Path) -> Signer:
    return load_signer(hmac_key_path)


@pytest.fixture
def verifier(hmac_key_path: Path) -> Verifier:
    return load_verifier(hmac_key_path)


@pytest.fixture
def identity() -> SnapshotIdentity:
    return make_identity()


@pytest.fixture
def publish(store: SnapshotStore, signer: Signer, identity: SnapshotIdentity) -> Callable[..., object]:
    """publish(files, modes=None, identity=None) -> Snapshot, through the real staging path."""

    def _publish(
        files: dict[str, bytes],
        modes: dict[str, int] | None = None,
        snapshot_identity: SnapshotIdentity | None = None,
        meta: dict[str, object] | None = None,
    ) -> object:
        with store.stage(snapshot_identity or identity, node={"name": "node-a"}, meta=meta) as staging:
            write_files(staging.dir, files, modes)
            staging.timings["criu_dump"] = 1.5
            return staging.publish(signer)

    return _publish
