"""pytest fixtures for a real S3-compatible object store on loopback (see `hack/control_plane/s3.py`).

`s3_server_factory` (function scope): `start(bucket="snapshots")` starts a fresh gateway (Versity's S3
gateway over a directory of its own, with fresh credentials and one bucket) and returns it; every server a
test started is stopped when the test ends. Tests that stop and restart a server use it.

`s3_server` (function scope): one such server already started.

The server object (control_plane.s3.S3Server):
    .endpoint            "http://127.0.0.1:<port>"
    .access_key_id, .secret_access_key, .region
    .data_dir            the directory it serves; `<data_dir>/<bucket>/<key>` is an object's file
    .stop(), .start()    stop it (SIGTERM, then SIGKILL), start it again on the same port and directory
    .running()

When the gateway is not built, tests using it are skipped with the command that builds it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from control_plane import s3

BUCKET = "snapshots"

StartS3 = Callable[..., s3.S3Server]


@pytest.fixture
def s3_server_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StartS3]:
    if not s3.is_cached():
        pytest.skip(f"no S3 server built ({s3.server_path()}): run `hack/control-plane build`")
    started: list[s3.S3Server] = []

    def start(bucket: str = BUCKET) -> s3.S3Server:
        root = tmp_path_factory.mktemp("s3")
        server = s3.start_s3_server(root / "data", buckets=[bucket], log=root / "versitygw.log")
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def s3_server(s3_server_factory: StartS3) -> s3.S3Server:
    return s3_server_factory()
