"""The tests' S3-compatible object store: Versity's S3 gateway (`versitygw`) serving a plain directory.

Built once from its published Go module into the cache (its own stamp), started by `start_s3_server` with a
listen address, a data directory and credentials of the caller's choice. The gateway's POSIX backend keeps
each bucket as a top-level directory of the data directory and each object as a file written to a temporary
and renamed, so a PUT is atomic; it speaks the S3 API the snapshot store uses (multipart uploads,
ListObjectsV2, ranged GETs, conditional PUT with If-None-Match).

    hack/control-plane build            builds it with the rest (cached; `--force` rebuilds)
    hack/control-plane up --object-store    one beside the real nodes, as their cluster's snapshot store
"""

from __future__ import annotations

import json
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from . import build, versions
from .cluster import Component, ControlPlaneError, free_port, wait_for

if TYPE_CHECKING:
    from .node import RealNode

COMMAND = "versitygw"
READY_TIMEOUT_SECONDS = 30.0


# -- the build -----------------------------------------------------------------------------------------------


def server_path() -> Path:
    return versions.bin_dir() / COMMAND


def wanted_stamp() -> dict[str, object]:
    return {"recipe": versions.S3_BUILD_RECIPE, "versitygw": versions.VERSITYGW}


def is_cached() -> bool:
    try:
        recorded = json.loads(versions.s3_stamp_path().read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    return recorded == wanted_stamp() and server_path().is_file()


def build_s3_server(force: bool = False) -> Path:
    """`go install` the gateway's command at the pinned release (its module has no replace directives, so
    the proxy's version of it builds as published), without cgo, stripped."""
    if is_cached() and not force:
        print(f"s3 server: cached ({server_path()})")
        return server_path()
    progress = build.Progress("s3")
    versions.s3_stamp_path().unlink(missing_ok=True)
    out = versions.bin_dir()
    out.mkdir(parents=True, exist_ok=True)
    package = f"{versions.VERSITYGW_MODULE}/cmd/{COMMAND}@v{versions.VERSITYGW}"
    progress.step(f"building {package} (no cgo)")
    env = {**build.go_env(), "GOBIN": str(out), "CGO_ENABLED": "0"}
    build.run_go(["install", "-trimpath", f"-ldflags={build.LDFLAGS}", package], cwd=Path("/"), env=env)
    versions.s3_stamp_path().write_text(json.dumps(wanted_stamp()) + "\n")
    progress.step(f"done: {server_path()}")
    return server_path()


# -- a running server ----------------------------------------------------------------------------------------


def new_credentials() -> tuple[str, str]:
    """A fresh (access key id, secret access key) pair."""
    return "ws" + secrets.token_hex(8), secrets.token_urlsafe(30)


def http_answers(host: str, port: int, timeout: float = 2.0) -> bool:
    """Whether an HTTP server answers on host:port (any status: the gateway refuses anonymous requests)."""
    with socket.create_connection((host, port), timeout=timeout) as connection:
        connection.settimeout(timeout)
        connection.sendall(f"GET / HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode())
        return connection.recv(16).startswith(b"HTTP/1.")


@dataclass
class S3Server:
    """One gateway process serving `data_dir`; each bucket is a directory in it."""

    data_dir: Path
    host: str = "127.0.0.1"
    port: int = 0
    access_key_id: str = field(default_factory=lambda: new_credentials()[0])
    secret_access_key: str = field(default_factory=lambda: new_credentials()[1])
    region: str = "us-east-1"
    binary: Path = field(default_factory=server_path)
    log: Path | None = None
    # What the command runs under, e.g. ("nsenter", "--net=/run/netns/node-b") for another network namespace.
    command_prefix: Sequence[str] = ()
    component: Component | None = None
    startup_seconds: float = 0.0

    @property
    def endpoint(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def argv(self) -> list[str]:
        listen = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
        return [
            *self.command_prefix, str(self.binary), "--port", listen, "--access", self.access_key_id,
            "--secret", self.secret_access_key, "--region", self.region, "--quiet",
            "posix", str(self.data_dir),
        ]  # fmt: skip

    def create_bucket(self, name: str) -> None:
        """A bucket, the POSIX backend's way: a directory at the top of the data directory."""
        (self.data_dir / name).mkdir(parents=True, exist_ok=True)

    def start(
        self,
        *,
        die_with_parent: bool = True,
        timeout: float = READY_TIMEOUT_SECONDS,
        ready: Callable[[], bool] | None = None,
    ) -> None:
        """Start the process and wait until it answers HTTP (or `ready()` holds, for an address this process
        cannot reach, such as one inside another network namespace)."""
        if not self.binary.is_file():
            raise ControlPlaneError(f"{self.binary} is not built: run `hack/control-plane build`")
        if self.port == 0:
            self.port = free_port()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = self.log or self.data_dir.parent / f"{COMMAND}-{self.port}.log"
        started = time.monotonic()
        self.component = Component(COMMAND, self.argv(), log)
        self.component.start(die_with_parent)
        probe = ready or (lambda: http_answers(self.host, self.port))
        component = self.component

        def answered() -> bool:
            component.check_running()  # a ControlPlaneError ends the wait at once, with the log
            return probe()

        wait_for(answered, timeout=timeout, interval=0.05, message=f"the S3 server at {self.endpoint}")
        self.startup_seconds = time.monotonic() - started

    def stop(self) -> None:
        if self.component is not None:
            self.component.stop()

    def running(self) -> bool:
        process = self.component.process if self.component else None
        return process is not None and process.poll() is None


def start_s3_server(
    data_dir: Path,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    buckets: Sequence[str] = (),
    credentials: tuple[str, str] | None = None,
    command_prefix: Sequence[str] = (),
    log: Path | None = None,
    die_with_parent: bool = True,
    ready: Callable[[], bool] | None = None,
) -> S3Server:
    """A started gateway on host:port (port 0: a free one) serving `data_dir`, with `buckets` created."""
    access_key_id, secret_access_key = credentials or new_credentials()
    server = S3Server(
        data_dir=data_dir, host=host, port=port, access_key_id=access_key_id,
        secret_access_key=secret_access_key, log=log, command_prefix=tuple(command_prefix),
    )  # fmt: skip
    for bucket in buckets:
        server.create_bucket(bucket)
    server.start(die_with_parent=die_with_parent, ready=ready)
    return server


# -- beside the real nodes -----------------------------------------------------------------------------------


def listening(holder_pid: int, port: int) -> bool:
    """Whether a TCP socket listens on `port` in the network namespace of `holder_pid`."""
    rows = Path(f"/proc/{holder_pid}/net/tcp").read_text().splitlines()[1:]
    return any(row.split()[1].endswith(f":{port:04X}") and row.split()[3] == "0A" for row in rows)


def start_beside_nodes(
    node: RealNode, data_dir: Path, buckets: Sequence[str], *, log: Path, die_with_parent: bool = True
) -> S3Server:
    """A server in the apiserver's network namespace at the first real node's link address: the pods and
    agents of every real node reach it; nothing outside the nodes' networks does."""
    port = free_port()
    return start_s3_server(
        data_dir, host=node.plane.addresses.api_ip, port=port, buckets=buckets,
        command_prefix=("nsenter", f"--net={node.api_netns}"), log=log, die_with_parent=die_with_parent,
        ready=lambda: listening(node.api_holder, port),
    )  # fmt: skip
