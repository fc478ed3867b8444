"""The supervisor's probe endpoints (`warmstart.worker.probe`): `/ready?wait=S` is held until the engine's
own `/ready` answers 200, bounded, and follows the engine to the port a restore names; `/live` passes while
the engine starts (up to its start timeout), then follows the engine's `/health`."""

from __future__ import annotations

import http.client
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from warmstart.api.worker_options import PROBE_WAIT_MAX_SECONDS, probe_port
from warmstart.worker.probe import EngineWatch, ProbeServer


class Engine:
    """An engine's server: `/ready` answers 503 until `ready` is set, `/health` 200 until `hung` is."""

    def __init__(self) -> None:
        self.ready, self.hung = threading.Event(), threading.Event()
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                ok = {"/ready": engine.ready.is_set(), "/health": not engine.hung.is_set()}.get(self.path)
                self.send_response(200 if ok else 503)
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


def free_port() -> int:
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    port = int(server.server_address[1])
    server.server_close()
    return port  # nobody listens there: an engine still being restored


def get(port: int, path: str) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=PROBE_WAIT_MAX_SECONDS + 5)
    try:
        connection.request("GET", path)
        return connection.getresponse().status
    finally:
        connection.close()


def test_a_readiness_probe_is_held_until_the_engine_serves(engine: Engine) -> None:
    watch = EngineWatch(free_port(), start_timeout=600)
    probe = ProbeServer(0, watch).start()
    try:
        assert get(probe.port, "/ready") == 503
        assert get(probe.port, "/ready?wait=0.05") == 503
        answers: list[int] = []
        waiting = threading.Thread(target=lambda: answers.append(get(probe.port, "/ready?wait=5")))
        waiting.start()
        watch.port = engine.port  # restored on the port its answer named, serving, not ready yet
        waiting.join(0.2)
        assert waiting.is_alive(), "a probe asked to wait was answered before the engine was ready"
        engine.ready.set()
        waiting.join(10)
        assert answers == [200]
        assert get(probe.port, f"/ready?wait={PROBE_WAIT_MAX_SECONDS + 1}") == 400
        assert get(probe.port, "/ready?wait=soon") == 400
        assert get(probe.port, "/health") == 404
    finally:
        probe.stop()


def test_liveness_passes_while_the_engine_starts_then_follows_its_health(engine: Engine) -> None:
    watch = EngineWatch(engine.port, start_timeout=600)
    probe = ProbeServer(0, watch).start()
    try:
        assert get(probe.port, "/live") == 200  # starting: the engine answers nothing useful yet
        watch.start_timeout = 0
        assert get(probe.port, "/live") == 503  # never ready within its start timeout: restart it
        engine.ready.set()
        assert get(probe.port, "/ready") == 200
        assert get(probe.port, "/live") == 200  # ready once: now its /health counts
        engine.hung.set()
        assert get(probe.port, "/live") == 503
    finally:
        probe.stop()


def test_the_probe_port_is_the_one_after_the_engines() -> None:
    assert probe_port(8000) == 8001
    assert probe_port(65535) == 65534


def test_probes_are_answered_by_the_threads_started_with_the_server() -> None:
    """No thread per request: each would take a PID of the pod's namespace, which a restore may need."""
    server = ProbeServer(0, EngineWatch(port=free_port(), start_timeout=60.0)).start()
    try:
        started = {thread.ident for thread in threading.enumerate()}
        paths = ["/ready?wait=0.5"] * 3 + ["/live"] * 3  # held readiness probes beside liveness ones
        clients = [threading.Thread(target=get, args=(server.port, path)) for path in paths]
        for client in clients:
            client.start()
        time.sleep(0.25)  # the readiness probes are being held now
        serving = {thread.ident for thread in threading.enumerate()} - {client.ident for client in clients}
        for client in clients:
            client.join(10)
        assert serving == started == {thread.ident for thread in threading.enumerate()}
    finally:
        server.stop()
