"""Manifest signatures: HMAC-SHA256 (shared secret) or Ed25519 (private key signs, public key verifies).

`criu restore` runs as root, so a forged manifest is code execution on the node: nothing in a snapshot is
trusted before its manifest's signature checks out. `manifest.sig` is a small JSON document:
``{"algorithm": "hmac-sha256" | "ed25519", "key_id": "<16 hex>", "signature": "<base64>"}``, where
`key_id` is the first 16 hex digits of the SHA-256 of the secret (HMAC) or of the raw public key (Ed25519).

Key files are recognised by content: a PEM private key signs with Ed25519, a PEM public key verifies with
Ed25519, anything else is an HMAC secret (its exact bytes, at least 16 of them).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from warmstart.host.fileio import UnsafeInput, loads_json, read_regular_file, write_exclusive

SIGNING_KEY_ENV = "WARMSTART_SIGNING_KEY"
HMAC_SHA256 = "hmac-sha256"
ED25519 = "ed25519"
MIN_HMAC_KEY_BYTES = 16
MAX_KEY_FILE_BYTES = 64 << 10
_PEM_MARKER = b"-----BEGIN "


class SigningKeyError(ValueError):
    """A key file is missing, unreadable or of the wrong kind."""


class SignatureInvalid(ValueError):
    """A signature is missing, malformed, made with another key, or does not match the data."""


class SignedWithAnotherKey(SignatureInvalid):
    """A well-formed signature document names another algorithm or key than the verifier's."""


class Signer(Protocol):
    algorithm: str
    key_id: str

    def sign(self, data: bytes) -> bytes: ...


class Verifier(Protocol):
    algorithm: str
    key_id: str

    def check(self, data: bytes, signature: bytes) -> bool: ...


def key_id_of(key_material: bytes) -> str:
    return hashlib.sha256(key_material).hexdigest()[:16]


@dataclass(frozen=True)
class HmacKey:
    """HMAC-SHA256 with a shared secret: signs and verifies."""

    secret: bytes
    algorithm: str = HMAC_SHA256

    def __post_init__(self) -> None:
        if len(self.secret) < MIN_HMAC_KEY_BYTES:
            raise SigningKeyError(
                f"HMAC key has {len(self.secret)} bytes; use at least {MIN_HMAC_KEY_BYTES} "
                "(generate one with `warmstart snapshot keygen --hmac PATH`)"
            )

    @property
    def key_id(self) -> str:
        return key_id_of(self.secret)

    def sign(self, data: bytes) -> bytes:
        return hmac.new(self.secret, data, hashlib.sha256).digest()

    def check(self, data: bytes, signature: bytes) -> bool:
        return hmac.compare_digest(self.sign(data), signature)


class Ed25519Signer:
    algorithm = ED25519

    def __init__(self, private_key: object) -> None:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        if not isinstance(private_key, Ed25519PrivateKey):
            raise SigningKeyError(f"expected an Ed25519 private key, got {type(private_key).__name__}")
        self._key = private_key
        self.key_id = key_id_of(_raw_public_bytes(private_key.public_key()))

    def sign(self, data: bytes) -> bytes:
        return self._key.sign(data)

    def verifier(self) -> Ed25519Verifier:
        return Ed25519Verifier(self._key.public_key())


class Ed25519Verifier:
    algorithm = ED25519

    def __init__(self, public_key: object) -> None:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        if not isinstance(public_key, Ed25519PublicKey):
            raise SigningKeyError(f"expected an Ed25519 public key, got {type(public_key).__name__}")
        self._key = public_key
        self.key_id = key_id_of(_raw_public_bytes(public_key))

    def check(self, data: bytes, signature: bytes) -> bool:
        from cryptography.exceptions import InvalidSignature

        try:
            self._key.verify(signature, data)
        except InvalidSignature:
            return False
        return True


def _raw_public_bytes(public_key: object) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return public_key.public_bytes(  # type: ignore[attr-defined]
        encoding=serialization.Encoding.Raw, format=serialization.PublicFormat.Raw
    )


# --- signature documents ---------------------------------------------------------------------------------


def signature_document(signer: Signer, data: bytes) -> bytes:
    """The bytes of `manifest.sig` for `data`."""
    document = {
        "algorithm": signer.algorithm,
        "key_id": signer.key_id,
        "signature": base64.b64encode(signer.sign(data)).decode("ascii"),
    }
    return json.dumps(document, sort_keys=True, indent=2).encode() + b"\n"


def verify_document(verifier: Verifier, data: bytes, document: bytes) -> None:
    """Raise SignatureInvalid with the precise reason unless `document` is a valid signature of `data`."""
    check_signature(verifier, data, signature_of(verifier, document))


def signature_of(verifier: Verifier, document: bytes) -> bytes:
    """The raw signature in `document` once it names the verifier's algorithm and key; SignatureInvalid
    otherwise. Cheap: it reads none of the signed data, so a document made with another key (or none) is
    refused before the data is even read."""
    try:
        parsed = loads_json(document, "signature")
    except UnsafeInput as exc:
        raise SignatureInvalid(str(exc)) from exc
    if not isinstance(parsed, dict):
        raise SignatureInvalid("signature must be a JSON object with algorithm, key_id and signature")
    for field in ("algorithm", "key_id", "signature"):
        if not isinstance(parsed.get(field), str):
            raise SignatureInvalid(f"signature field {field!r} is missing or not a string")
    if parsed["algorithm"] != verifier.algorithm:
        raise SignedWithAnotherKey(
            f"signed with {parsed['algorithm']!r} but the verification key is {verifier.algorithm!r}"
        )
    if parsed["key_id"] != verifier.key_id:
        raise SignedWithAnotherKey(
            f"signed with key {parsed['key_id']} but the verification key is {verifier.key_id}: wrong key"
        )
    try:
        return base64.b64decode(parsed["signature"], validate=True)
    except (binascii.Error, ValueError) as exc:
        raise SignatureInvalid(f"signature field 'signature' is not valid base64 ({exc})") from exc


def check_signature(verifier: Verifier, data: bytes, signature: bytes) -> None:
    """SignatureInvalid unless `signature` (raw, from `signature_of`) signs `data`."""
    if not verifier.check(data, signature):
        raise SignatureInvalid("signature does not match the signed bytes: the manifest was modified")


# --- loading and generating keys -------------------------------------------------------------------------


def _read_key_file(given: str | os.PathLike[str] | None) -> tuple[Path, bytes]:
    """The key file's path (the file named by WARMSTART_SIGNING_KEY when none is given) and its bytes."""
    if given is None or str(given) == "":
        given = os.environ.get(SIGNING_KEY_ENV)
        if not given:
            raise SigningKeyError(f"no signing key: pass a key file or set {SIGNING_KEY_ENV} to its path")
    path = Path(given)
    try:  # a Kubernetes Secret's files are symbolic links: follow them, but read only a small regular file
        content = read_regular_file(path, MAX_KEY_FILE_BYTES, follow_symlinks=True)
    except FileNotFoundError as exc:
        raise SigningKeyError(f"key file {path} does not exist") from exc
    except OSError as exc:
        raise SigningKeyError(f"key file {path} cannot be read: {exc.strerror}") from exc
    except UnsafeInput as exc:
        raise SigningKeyError(f"key file refused: {exc}") from exc
    if not content:
        raise SigningKeyError(f"key file {path} is empty")
    return path, content


def _is_private_pem(content: bytes) -> bool:
    return content.lstrip().startswith(_PEM_MARKER) and b"PRIVATE KEY" in content.split(b"\n", 1)[0]


def _load_pem(path: Path, content: bytes) -> Ed25519Signer | Ed25519Verifier:
    from cryptography.hazmat.primitives import serialization

    try:
        if _is_private_pem(content):
            return Ed25519Signer(serialization.load_pem_private_key(content, password=None))
        return Ed25519Verifier(serialization.load_pem_public_key(content))
    except TypeError as exc:  # encrypted private key
        raise SigningKeyError(f"key file {path}: encrypted private keys are not supported ({exc})") from exc
    except ValueError as exc:
        raise SigningKeyError(f"key file {path} is not a valid PEM key: {exc}") from exc
    except SigningKeyError as exc:
        raise SigningKeyError(f"key file {path}: {exc}") from exc


def _parse_key(key_path: Path, content: bytes) -> HmacKey | Ed25519Signer | Ed25519Verifier:
    if content.lstrip().startswith(_PEM_MARKER):
        return _load_pem(key_path, content)
    try:
        return HmacKey(content)
    except SigningKeyError as exc:
        raise SigningKeyError(f"key file {key_path}: {exc}") from exc


def keys_from_content(key_path: Path, content: bytes) -> tuple[Signer, Verifier]:
    """Signer and verifier of a private key file's content (read by the caller, e.g. after checking who
    may have written it)."""
    key = _parse_key(key_path, content)
    if isinstance(key, Ed25519Verifier):
        raise SigningKeyError(f"key file {key_path} is a public key; signing needs the private key")
    return key, key.verifier() if isinstance(key, Ed25519Signer) else key


def load_signer(path: str | os.PathLike[str] | None = None) -> Signer:
    """The signer for a key file (or the file named by WARMSTART_SIGNING_KEY)."""
    return keys_from_content(*_read_key_file(path))[0]


def load_verifier(path: str | os.PathLike[str] | None = None) -> Verifier:
    """The verifier for a key file: an Ed25519 public (or private) key, or an HMAC secret."""
    key = _parse_key(*_read_key_file(path))
    return key.verifier() if isinstance(key, Ed25519Signer) else key


class KeyExists(SigningKeyError):
    """A key file is where a new one was to be written (perhaps by a concurrent writer: it is complete)."""


def _write_secret(path: Path, content: bytes, mode: int) -> None:
    """Create `path` with `content`, whole or not at all: a concurrent reader never sees it half written,
    and of two concurrent writers one wins and the other gets KeyExists."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        write_exclusive(path.name, content, dir_fd=fd, mode=mode)
    except FileExistsError as exc:
        raise KeyExists(f"{path} exists already; remove it or choose another path") from exc
    finally:
        os.close(fd)


def generate_hmac_key(path: str | os.PathLike[str]) -> Path:
    """Write a new random HMAC secret (64 hex characters, mode 0600); KeyExists rather than overwrite."""
    target = Path(path)
    _write_secret(target, secrets.token_hex(32).encode(), 0o600)
    return target


def generate_ed25519_keypair(directory: str | os.PathLike[str]) -> tuple[Path, Path]:
    """Write `signing-key.pem` (private, 0600) and `signing-key.pub.pem` (public) into `directory`."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    folder = Path(directory)
    private_path, public_path = folder / "signing-key.pem", folder / "signing-key.pub.pem"
    for existing in (private_path, public_path):
        if os.path.lexists(existing):
            raise KeyExists(f"{existing} exists already; remove it or choose another directory")
    key = Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public_pem = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    _write_secret(private_path, private_pem, 0o600)
    _write_secret(public_path, public_pem, 0o644)
    return private_path, public_path
