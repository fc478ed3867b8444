"""The supervisor's startup endpoint (`warmstart.worker.probe`): `/started?wait=S` is held until the engine's
own `/ready` answers 200, bounded, and follows the engine to the port a restore names."""

from __future__ import annotations

import http.client
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from warmstart.worker.probe import ProbeServer
from warmstart.worker_flags import STARTED_WAIT_MAX_SECONDS, probe_port


class Engine:
    """An engine's server whose `/ready` answers 503 until `ready` is set."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                self.send_response(200 if self.path == "/ready" and engine.ready.is_set() else 503)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self.server.server_address[1])
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def engine() -> Iterator[Engine]:
    started = Engine()
    yield started
    started.server.shutdown()
    started.server.server_close()


def get(port: int, path: str) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=STARTED_WAIT_MAX_SECONDS + 5)
    try:
        connection.request("GET", path)
        return connection.getresponse().status
    finally:
        connection.close()


def test_a_startup_probe_is_held_until_the_engine_serves(engine: Engine) -> None:
    where: dict[str, int | None] = {"port": None}  # no engine yet: a restore is under way
    probe = ProbeServer(0, lambda: where["port"]).start()
    try:
        assert get(probe.port, "/started") == 503
        assert get(probe.port, "/started?wait=0.05") == 503
        answers: list[int] = []
        waiting = threading.Thread(target=lambda: answers.append(get(probe.port, "/started?wait=5")))
        waiting.start()
        where["port"] = engine.port  # restored, serving, not ready yet
        waiting.join(0.2)
        assert waiting.is_alive(), "a probe asked to wait was answered before the engine was ready"
        engine.ready.set()
        waiting.join(10)
        assert answers == [200]
        assert get(probe.port, f"/started?wait={STARTED_WAIT_MAX_SECONDS + 1}") == 400
        assert get(probe.port, "/started?wait=soon") == 400
        assert get(probe.port, "/ready") == 404
    finally:
        probe.stop()


def test_the_probe_port_is_the_one_after_the_engines() -> None:
    assert probe_port(8000) == 8001
    assert probe_port(65535) == 65534
