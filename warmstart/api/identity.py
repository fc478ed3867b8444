"""What a snapshot is valid for.

A snapshot may only be restored where it was valid to take it. The identity collects every fact that
makes a checkpointed process meaningful elsewhere; its hash is SHA-256 over the canonical JSON of those
facts. Kubernetes-free: shared by the operator, the agent, the worker and the store.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

IDENTITY_VERSION = 1


def canonical_json(value: Any) -> bytes:
    """JSON with sorted keys, no whitespace and UTF-8: the same value always gives the same bytes."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


@dataclass(frozen=True)
class SnapshotIdentity:
    """The facts a restore must match exactly.

    `model_digest` is a digest over the model's bytes (not its name), `image` names the worker image (in a
    cluster the container image; on one machine the Python runtime and warmstart version). GPU fields are
    empty strings / 0 for CPU workers.
    """

    model_digest: str
    engine: str
    engine_version: str
    engine_args: dict[str, Any] = field(default_factory=dict)
    dtype: str = "float32"
    parallelism: int = 1
    device: str = "cpu"
    gpu_product: str = ""
    compute_capability: str = ""
    driver_major: int = 0
    image: str = ""

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["identity_version"] = IDENTITY_VERSION
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SnapshotIdentity:
        version = data.get("identity_version", IDENTITY_VERSION)
        if version != IDENTITY_VERSION:
            raise ValueError(f"identity_version {version} is not supported (expected {IDENTITY_VERSION})")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known - {"identity_version"})
        if unknown:
            raise ValueError(f"unknown identity fields: {', '.join(unknown)}")
        return cls(**{k: v for k, v in data.items() if k in known})

    def digest(self) -> str:
        """Hex SHA-256 of the canonical JSON: the identity hash."""
        return hashlib.sha256(canonical_json(self.to_dict())).hexdigest()

    def mismatches(self, other: SnapshotIdentity) -> list[str]:
        """Human-readable differences, one per field, empty when the identities match."""
        mine, theirs = self.to_dict(), other.to_dict()
        return [
            f"{name}: snapshot has {mine[name]!r}, here is {theirs[name]!r}"
            for name in sorted(mine)
            if mine[name] != theirs[name]
        ]

    def short(self) -> str:
        return self.digest()[:12]
