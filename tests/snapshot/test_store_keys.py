"""The key a store gets when given none: generated once outside the store, private to its user, refused
when anyone else could have written it, and created whole by whichever of several processes comes first."""

from __future__ import annotations

import multiprocessing
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from warmstart.snapshot.signing import (
    SigningKeyError,
    generate_hmac_key,
    load_signer,
    signature_document,
    verify_document,
)
from warmstart.snapshot.signing_keys import (
    KEY_DIR_ENV,
    default_key_path,
    key_dir,
    signing_keys,
    verification_key,
)

CONTENDERS = 8
ROUNDS = 30


@pytest.fixture(autouse=True)
def own_key_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A key directory per test (some tests spoil theirs)."""
    monkeypatch.setenv(KEY_DIR_ENV, str(tmp_path / "generated-keys"))


def test_the_default_key_lives_outside_the_store_and_a_key_planted_there_is_not_trusted(
    tmp_path: Path,
) -> None:
    store = tmp_path / "store"
    store.mkdir()
    planted = load_signer(generate_hmac_key(store / "keys" / "hmac.key"))  # where earlier versions kept it
    signer, verifier, note = signing_keys(store, None)
    path = default_key_path(store)
    assert path.parent == key_dir() and not path.is_relative_to(store) and str(path) in note
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    with pytest.raises(ValueError, match="wrong key"):
        verify_document(verifier, b"forged", signature_document(planted, b"forged"))
    again = signing_keys(store, None)
    assert again[2] == "" and again[0].key_id == signer.key_id  # generated once, then reused
    assert verification_key(store, None).key_id == signer.key_id


def _make_writable_by_others(path: Path) -> None:
    path.chmod(0o620)


def _make_readable_by_others(path: Path) -> None:
    path.chmod(0o644)


def _make_a_link(path: Path) -> None:
    real = path.with_name("real.key")
    path.rename(real)
    path.symlink_to(real)


def _give_to_another_user(path: Path) -> None:
    os.chown(path, 65534, 65534)


def _open_the_directory(path: Path) -> None:
    path.parent.chmod(0o777)


@pytest.mark.parametrize(
    "tamper, reason",
    [
        (_make_writable_by_others, "mode 0620"),
        (_make_readable_by_others, "mode 0644"),
        (_make_a_link, "symbolic link"),
        pytest.param(
            _give_to_another_user, "owned by uid 65534",
            marks=pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root"),
        ),
        (_open_the_directory, "directory"),
    ],
)  # fmt: skip
def test_a_default_key_others_could_have_written_is_refused(tmp_path: Path, tamper, reason: str) -> None:
    store = tmp_path / "store"
    store.mkdir()
    signing_keys(store, None)
    tamper(default_key_path(store))
    with pytest.raises(SigningKeyError, match=reason):
        signing_keys(store, None)
    with pytest.raises(SigningKeyError, match=reason):
        verification_key(store, None)


def _report_key_id(barrier: Any, results: Any, store: str) -> None:
    barrier.wait()
    try:
        results.put(signing_keys(Path(store), None)[0].key_id)
    except Exception as exc:  # reported to the test, which fails naming it
        results.put(f"failed: {type(exc).__name__}: {exc}")


@pytest.mark.spawns
def test_processes_creating_a_stores_key_at_once_all_get_the_one_written_first(tmp_path: Path) -> None:
    context = multiprocessing.get_context("fork")
    for round_number in range(ROUNDS):
        store = tmp_path / f"store-{round_number}"
        store.mkdir()
        barrier, results = context.Barrier(CONTENDERS), context.Queue()
        contenders = [
            context.Process(target=_report_key_id, args=(barrier, results, str(store)))
            for _ in range(CONTENDERS)
        ]
        for process in contenders:
            process.start()
        key_ids = [results.get(timeout=120) for _ in contenders]
        for process in contenders:
            process.join(timeout=120)
        assert len(set(key_ids)) == 1 and not key_ids[0].startswith("failed"), key_ids
        assert key_ids[0] == signing_keys(store, None)[0].key_id
