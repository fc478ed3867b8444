"""The tests' S3 server: its build is cached by a stamp, and a start that fails says why."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from control_plane import s3, versions
from control_plane.cluster import ControlPlaneError


def test_the_s3_server_build_is_keyed_by_its_stamp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WARMSTART_CACHE", str(tmp_path))
    assert not s3.is_cached()
    versions.bin_dir().mkdir(parents=True)
    s3.server_path().write_text("")
    versions.s3_stamp_path().write_text(json.dumps({**s3.wanted_stamp(), "versitygw": "0.0.1"}))
    assert not s3.is_cached()
    versions.s3_stamp_path().write_text(json.dumps(s3.wanted_stamp()))
    assert s3.is_cached()


@pytest.mark.spawns
def test_a_server_that_cannot_listen_fails_its_start_with_its_log(tmp_path: Path) -> None:
    if not s3.is_cached():
        pytest.skip(f"no S3 server built ({s3.server_path()}): run `hack/control-plane build`")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(
            ControlPlaneError, match=r"versitygw exited with code \d+; last log lines"
        ) as failed:
            s3.start_s3_server(tmp_path / "data", port=port, buckets=["b"])
    assert "address already in use" in str(failed.value)
    assert (tmp_path / "data" / "b").is_dir()
