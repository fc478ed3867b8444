"""The snapshot store: content-addressed blobs, signed manifests, atomic publish, verification and GC.

Shared by the agent (capture, restore), the one-machine mode and the CLI; imports nothing from Kubernetes.
"""

from warmstart.snapshot.manifest import IdentityMismatch, SnapshotError, SnapshotInvalid
from warmstart.snapshot.signing import (
    SignatureInvalid,
    SigningKeyError,
    generate_ed25519_keypair,
    generate_hmac_key,
    load_signer,
    load_verifier,
)
from warmstart.snapshot.store import Snapshot, SnapshotNotFound, SnapshotStore

__all__ = [
    "IdentityMismatch",
    "SignatureInvalid",
    "SigningKeyError",
    "Snapshot",
    "SnapshotError",
    "SnapshotInvalid",
    "SnapshotNotFound",
    "SnapshotStore",
    "generate_ed25519_keypair",
    "generate_hmac_key",
    "load_signer",
    "load_verifier",
]
