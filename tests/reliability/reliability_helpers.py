"""Helpers for the reliability tests: the worker's app under uvicorn in a thread, /metrics samples, raw
loopback sockets."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import uvicorn
from support import free_port

from warmstart.engines.base import Engine
from warmstart.worker.connections import ConnectionLimits, quiet_connection_logs, uvicorn_options
from warmstart.worker.metrics import WorkerMetrics
from warmstart.worker.openai_requests import RequestLimits
from warmstart.worker.server import ServerState, build_app

WAIT_SECONDS = 120.0  # generous: the suite runs on a loaded 2-core machine
POLL_SECONDS = 0.02


def load_tiny_engine(model_dir: Path) -> Engine:
    from warmstart.engines.builtin.engine import BuiltinEngine

    engine = BuiltinEngine(model="tiny", model_dir=model_dir, device="cpu")
    engine.load()
    engine.warm_up()
    return engine


class InProcessWorker:
    """build_app() served by uvicorn on 127.0.0.1 in a thread, configured as the worker configures it."""

    def __init__(
        self,
        engine: Engine,
        connection_limits: ConnectionLimits | None = None,
        request_limits: RequestLimits | None = None,
    ) -> None:
        self.metrics = WorkerMetrics()
        self.request_limits = request_limits or RequestLimits()
        app = build_app(engine, self.metrics, ServerState(ready=True), self.request_limits)
        self.port = free_port()
        quiet_connection_logs()
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            lifespan="off",
            timeout_graceful_shutdown=5,
            **uvicorn_options(connection_limits or ConnectionLimits()),
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="test-uvicorn", daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, "the in-process server to start")

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


def wait_until(condition: Callable[[], object], what: str, timeout: float = WAIT_SECONDS) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(POLL_SECONDS)


def metric_samples(port: int) -> dict[str, float]:
    """The worker's /metrics as {sample name with labels: value}."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def metric(port: int, name: str) -> float:
    return metric_samples(port).get(name, 0.0)


def responses_counted(port: int) -> float:
    """All responses in warmstart_worker_requests_total, whatever their route and status."""
    return sum(v for k, v in metric_samples(port).items() if k.startswith("warmstart_worker_requests_total{"))


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=WAIT_SECONDS)


def closed_by_peer(sock: socket.socket, timeout: float = WAIT_SECONDS) -> bool:
    """True once the server has closed `sock` (reads end of file or a reset), within `timeout`."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except OSError:  # a reset is a close too
        return True
    return True


def raw_post(port: int, path: str, body: bytes, extra_headers: str = "") -> bytes:
    """POST `body` over a fresh connection and return the whole raw response (the server closes)."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n{extra_headers}\r\n"
    )
    with connect(port) as sock:
        sock.sendall(head.encode() + body)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)
