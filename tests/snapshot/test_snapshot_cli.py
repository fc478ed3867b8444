"""`warmstart snapshot ...` through the real entry point, JSON output parsed."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from snapshot_helpers import make_identity

from warmstart.cli import main
from warmstart.snapshot import Snapshot, SnapshotStore

Publish = Callable[..., Snapshot]


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any]:
    capsys.readouterr()
    code = main(["snapshot", *argv, "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out) if out.strip() else None


def test_list_and_show(
    store: SnapshotStore, publish: Publish, hmac_key_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    older = publish({"criu/a.img": b"a" * 100}, meta={"model": "tiny"})
    newer = publish({"criu/a.img": b"b" * 100, "criu/b.img": b"c"}, meta={"model": "tiny"})

    code, listed = run_json(capsys, "list", "--store", str(store.root), "--key", str(hmac_key_path))
    assert code == 0
    assert [item["id"] for item in listed] == [newer.id, older.id]
    assert listed[0]["files"] == 2 and listed[0]["size"] == 101
    assert listed[0]["engine"] == "builtin" and listed[0]["model"] == "tiny"
    assert listed[0]["identity_hash"] == newer.identity_hash

    code, shown = run_json(capsys, "show", newer.id, "--store", str(store.root), "--key", str(hmac_key_path))
    assert code == 0
    assert shown["id"] == newer.id and set(shown["files"]) == {"criu/a.img", "criu/b.img"}


def test_tables_name_every_snapshot(
    store: SnapshotStore, publish: Publish, hmac_key_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    snapshot = publish({"criu/a.img": b"a"}, meta={"model": "tiny"})
    key = ["--store", str(store.root), "--key", str(hmac_key_path)]
    assert main(["snapshot", "list", *key]) == 0
    table = capsys.readouterr().out
    assert snapshot.id in table and "tiny" in table and "builtin" in table
    assert main(["snapshot", "show", snapshot.id, *key]) == 0
    assert "criu/a.img" in capsys.readouterr().out


def test_store_and_key_from_environment(
    store: SnapshotStore,
    publish: Publish,
    hmac_key_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    snapshot = publish({"a": b"1"})
    monkeypatch.setenv("WARMSTART_STORE", str(store.root))
    monkeypatch.setenv("WARMSTART_SIGNING_KEY", str(hmac_key_path))
    code, listed = run_json(capsys, "list")
    assert code == 0 and [item["id"] for item in listed] == [snapshot.id]


def test_verify_exits_1_with_the_reason(
    store: SnapshotStore, publish: Publish, hmac_key_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    snapshot = publish({"criu/pages.img": b"pages" * 100})
    code, result = run_json(
        capsys, "verify", snapshot.id, "--store", str(store.root), "--key", str(hmac_key_path)
    )
    assert code == 0 and result["valid"] is True

    blob = store.blob_path(snapshot.files["criu/pages.img"].digest)
    os.chmod(blob, 0o644)
    blob.write_bytes(b"Pages" + blob.read_bytes()[5:])
    code, result = run_json(
        capsys, "verify", snapshot.id, "--store", str(store.root), "--key", str(hmac_key_path)
    )
    assert code == 1
    assert result["valid"] is False and "'criu/pages.img'" in result["reason"]

    assert (
        main(["snapshot", "verify", snapshot.id, "--store", str(store.root), "--key", str(hmac_key_path)])
        == 1
    )
    assert "corrupted" in capsys.readouterr().err


def test_verify_against_an_expected_identity(
    store: SnapshotStore,
    publish: Publish,
    hmac_key_path: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    snapshot = publish({"a": b"1"})
    expected = tmp_path / "identity.json"
    expected.write_text(json.dumps(make_identity(engine_version="7").to_dict()))
    code, result = run_json(
        capsys,
        "verify",
        snapshot.id,
        "--store",
        str(store.root),
        "--key",
        str(hmac_key_path),
        "--expect-identity",
        str(expected),
    )
    assert code == 1 and "engine_version: snapshot has '1.0', here is '7'" in result["reason"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["list"], "pass --store DIR or set WARMSTART_STORE"),
        (["list", "--store", "/nonexistent/store"], "/nonexistent/store does not exist"),
        (["verify", "0123456789ab-20260101000000-abcdef", "--store", "{store}"], "no key: pass --key"),
        (["list", "--store", "{store}"], "no key: pass --key"),
        (["gc", "--store", "{store}", "--keep", "1"], "no key: pass --key"),
        (["verify", "x", "--store", "{store}", "--key", "/nonexistent/key"], "key file /nonexistent/key"),
        (["gc", "--store", "{store}", "--keep", "0"], "--keep must be at least 1"),
        (
            ["verify", "0123456789ab-20260101000000-abcdef", "--store", "{store}", "--key", "{key}"]
            + ["--prefix", "../criu"],
            "--prefix: prefix '../criu' is not a relative path",
        ),
    ],
)
def test_usage_errors_exit_2_naming_what_to_fix(
    store: SnapshotStore,
    hmac_key_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    message: str,
) -> None:
    monkeypatch.delenv("WARMSTART_STORE", raising=False)
    monkeypatch.delenv("WARMSTART_SIGNING_KEY", raising=False)
    store.root.mkdir(parents=True)
    places = {"{store}": str(store.root), "{key}": str(hmac_key_path)}
    assert main(["snapshot", *[places.get(a, a) for a in argv]]) == 2
    assert message in capsys.readouterr().err


def test_verify_of_an_unknown_snapshot_reports_json(
    store: SnapshotStore, hmac_key_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store.root.mkdir(parents=True)
    missing = "0123456789ab-20260101000000-abcdef"
    code, result = run_json(
        capsys, "verify", missing, "--store", str(store.root), "--key", str(hmac_key_path)
    )
    assert code == 1 and result["valid"] is False and f"no snapshot {missing}" in result["reason"]


def test_unknown_snapshot_exits_1(
    store: SnapshotStore, hmac_key_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store.root.mkdir(parents=True)
    argv = [
        "show",
        "0123456789ab-20260101000000-abcdef",
        "--store",
        str(store.root),
        "--key",
        str(hmac_key_path),
    ]
    assert main(["snapshot", *argv]) == 1
    assert "no snapshot 0123456789ab-20260101000000-abcdef" in capsys.readouterr().err


def test_gc_with_retention_dry_run_then_real(
    store: SnapshotStore, publish: Publish, hmac_key_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    snapshots = [publish({"criu/a.img": f"version {i}".encode()}) for i in range(3)]
    orphan = store.stage(make_identity())  # an abandoned staging dir of this (live) process is kept
    common = ["--store", str(store.root), "--keep", "1", "--blob-grace", "0", "--key", str(hmac_key_path)]

    code, report = run_json(capsys, "gc", "--dry-run", *common)
    assert code == 0 and report["dry_run"] is True
    assert report["deleted_snapshots"] == [snapshots[1].id, snapshots[0].id]
    assert len(store.list()) == 3 and len(list(store.blobs_dir.iterdir())) == 3

    code, report = run_json(capsys, "gc", *common)
    assert code == 0
    assert report["deleted_snapshots"] == [snapshots[1].id, snapshots[0].id]
    assert sorted(report["removed_blobs"]) == sorted(s.files["criu/a.img"].digest for s in snapshots[:2])
    assert [s.id for s in store.list()] == [snapshots[2].id]
    assert orphan.root.exists() and report["removed_staging"] == []
    orphan.discard()

    assert main(["snapshot", "gc", "--store", str(store.root)]) == 0
    assert "removed 0 blobs" in capsys.readouterr().out


def test_delete_and_keygen(
    store: SnapshotStore, publish: Publish, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    snapshot = publish({"a": b"1"})
    code, result = run_json(capsys, "delete", snapshot.id, "--store", str(store.root))
    assert code == 0 and result == {"deleted": snapshot.id} and store.list() == []

    code, written = run_json(capsys, "keygen", "--ed25519", str(tmp_path / "keys"))
    assert code == 0 and Path(written["public"]).read_text().startswith("-----BEGIN PUBLIC KEY-----")
    code, written = run_json(capsys, "keygen", "--hmac", str(tmp_path / "keys" / "hmac"))
    assert code == 0 and len(Path(written["hmac"]).read_bytes()) == 64
    assert main(["snapshot", "keygen", "--hmac", str(tmp_path / "keys" / "hmac")]) == 2
    assert "exists already" in capsys.readouterr().err
