"""The store's signing key, shared by the node agent and the one-machine mode."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from warmstart.snapshot.signing import Signer, Verifier


def store_key_path(store_root: Path) -> Path:
    """Where a store keeps its own HMAC key."""
    return Path(store_root) / "keys" / "hmac.key"


def signing_keys(store_root: Path, key: str | None) -> tuple[Signer, Verifier, str]:
    """Signer and verifier from `key`, or from `<store>/keys/hmac.key`, generated once when missing.

    The third value is a note for the user when a key was generated, else "".
    """
    from warmstart.snapshot.signing import generate_hmac_key, load_signer, load_verifier

    note = ""
    if key is None:
        path = store_key_path(store_root)
        if not path.exists():
            generate_hmac_key(path)
            note = f"generated a signing key at {path} (mode 0600); pass --key to use your own"
        key = str(path)
    return load_signer(key), load_verifier(key), note
