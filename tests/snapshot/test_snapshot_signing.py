"""Manifest signatures: both algorithms, key loading by content, and every kind of refusal."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from warmstart.snapshot import (
    SignatureInvalid,
    SigningKeyError,
    generate_ed25519_keypair,
    generate_hmac_key,
    load_signer,
    load_verifier,
)
from warmstart.snapshot.signing import ED25519, HMAC_SHA256, signature_document, verify_document

DATA = b'{"id": "manifest"}\n'


@pytest.fixture(params=["hmac", "ed25519"])
def key_files(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, Path, str]:
    """(signing key file, verification key file, algorithm) for each algorithm."""
    if request.param == "hmac":
        path = generate_hmac_key(tmp_path / "hmac.key")
        return path, path, HMAC_SHA256
    private, public = generate_ed25519_keypair(tmp_path / "ed")
    return private, public, ED25519


def test_sign_and_verify_round_trip(key_files: tuple[Path, Path, str]) -> None:
    signing_path, verifying_path, algorithm = key_files
    signer, verifier = load_signer(signing_path), load_verifier(verifying_path)
    document = signature_document(signer, DATA)
    parsed = json.loads(document)
    assert parsed["algorithm"] == algorithm == verifier.algorithm
    assert parsed["key_id"] == signer.key_id == verifier.key_id
    assert len(parsed["key_id"]) == 16
    verify_document(verifier, DATA, document)


def test_edited_data_is_refused(key_files: tuple[Path, Path, str]) -> None:
    signing_path, verifying_path, _ = key_files
    document = signature_document(load_signer(signing_path), DATA)
    with pytest.raises(SignatureInvalid, match="manifest was modified"):
        verify_document(load_verifier(verifying_path), DATA.replace(b"manifest", b"manifesT"), document)


def test_wrong_key_is_refused_by_key_id(key_files: tuple[Path, Path, str], tmp_path: Path) -> None:
    signing_path, _, algorithm = key_files
    if algorithm == HMAC_SHA256:
        other = load_verifier(generate_hmac_key(tmp_path / "other.key"))
    else:
        other = load_verifier(generate_ed25519_keypair(tmp_path / "other")[1])
    document = signature_document(load_signer(signing_path), DATA)
    with pytest.raises(SignatureInvalid, match="wrong key"):
        verify_document(other, DATA, document)


def test_forged_signature_with_right_key_id_is_refused(key_files: tuple[Path, Path, str]) -> None:
    signing_path, verifying_path, _ = key_files
    document = json.loads(signature_document(load_signer(signing_path), DATA))
    raw = bytearray(base64.b64decode(document["signature"]))
    raw[0] ^= 0x01
    document["signature"] = base64.b64encode(bytes(raw)).decode()
    with pytest.raises(SignatureInvalid, match="does not match"):
        verify_document(load_verifier(verifying_path), DATA, json.dumps(document).encode())


def test_algorithm_mismatch_is_refused(tmp_path: Path) -> None:
    hmac_signer = load_signer(generate_hmac_key(tmp_path / "h.key"))
    ed_verifier = load_verifier(generate_ed25519_keypair(tmp_path / "ed")[1])
    with pytest.raises(SignatureInvalid, match="'hmac-sha256' but the verification key is 'ed25519'"):
        verify_document(ed_verifier, DATA, signature_document(hmac_signer, DATA))


@pytest.mark.parametrize(
    ("document", "reason"),
    [
        (b"not json", "not valid JSON"),
        (b"[]", "JSON object"),
        (b'{"algorithm": "hmac-sha256", "key_id": "x"}', "'signature' is missing"),
        (b'{"algorithm": 1, "key_id": "x", "signature": "x"}', "'algorithm' is missing or not a string"),
    ],
)
def test_malformed_signature_documents_are_refused(tmp_path: Path, document: bytes, reason: str) -> None:
    verifier = load_verifier(generate_hmac_key(tmp_path / "h.key"))
    with pytest.raises(SignatureInvalid, match=reason):
        verify_document(verifier, DATA, document)


def test_private_pem_verifies_too(tmp_path: Path) -> None:
    private, _ = generate_ed25519_keypair(tmp_path)
    verify_document(load_verifier(private), DATA, signature_document(load_signer(private), DATA))


def test_public_key_cannot_sign(tmp_path: Path) -> None:
    _, public = generate_ed25519_keypair(tmp_path)
    with pytest.raises(SigningKeyError, match="public key; signing needs the private key"):
        load_signer(public)


def test_key_path_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = generate_hmac_key(tmp_path / "env.key")
    monkeypatch.setenv("WARMSTART_SIGNING_KEY", str(path))
    assert load_signer().key_id == load_verifier(path).key_id


def test_missing_key_names_the_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WARMSTART_SIGNING_KEY", raising=False)
    with pytest.raises(SigningKeyError, match="WARMSTART_SIGNING_KEY"):
        load_verifier()


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"", "is empty"),
        (b"short", "at least 16"),
        (b"-----BEGIN PUBLIC KEY-----\ngarbage\n-----END PUBLIC KEY-----\n", "not a valid PEM key"),
    ],
)
def test_bad_key_files_are_refused_naming_the_file(tmp_path: Path, content: bytes, reason: str) -> None:
    path = tmp_path / "bad.key"
    path.write_bytes(content)
    with pytest.raises(SigningKeyError, match=reason) as caught:
        load_verifier(path)
    assert str(path) in str(caught.value)


def test_key_generation_refuses_to_overwrite(tmp_path: Path) -> None:
    path = generate_hmac_key(tmp_path / "k")
    assert path.stat().st_mode & 0o777 == 0o600
    with pytest.raises(SigningKeyError, match="exists already"):
        generate_hmac_key(path)
    generate_ed25519_keypair(tmp_path / "ed")
    with pytest.raises(SigningKeyError, match="exists already"):
        generate_ed25519_keypair(tmp_path / "ed")
