"""The snapshot store: content-addressed blobs, signed manifests, atomic publish, verification and GC.

Shared by the agent (capture, restore), the one-machine mode and the CLI; imports nothing from Kubernetes.
"""

from warmstart.snapshot.manifest import (
    FileEntry,
    IdentityMismatch,
    Manifest,
    SnapshotError,
    SnapshotInvalid,
)
from warmstart.snapshot.signing import (
    SignatureInvalid,
    SigningKeyError,
    generate_ed25519_keypair,
    generate_hmac_key,
    load_signer,
    load_verifier,
)
from warmstart.snapshot.store import GcReport, Snapshot, SnapshotNotFound, SnapshotStore, Staging

__all__ = [
    "FileEntry",
    "GcReport",
    "IdentityMismatch",
    "Manifest",
    "SignatureInvalid",
    "SigningKeyError",
    "Snapshot",
    "SnapshotError",
    "SnapshotInvalid",
    "SnapshotNotFound",
    "SnapshotStore",
    "Staging",
    "generate_ed25519_keypair",
    "generate_hmac_key",
    "load_signer",
    "load_verifier",
]
