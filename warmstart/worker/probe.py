"""The supervisor's startup endpoint: `GET /started?wait=S` on the probe port, 200 once the engine's own
`/ready` answers 200 (`worker_flags.STARTED_PATH`).

It listens from the container's start, in every mode. A restored engine opens its server only once it is
restored, so a startup probe sent to the engine during a restore is refused and the kubelet asks again a
period later; asked here, the answer is held (up to `wait` seconds) and given the moment the engine serves.
The engine's port is a callable: a restore's answer may move the engine to another port.
"""

from __future__ import annotations

import http.client
import logging
import threading
import time
import urllib.parse
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from warmstart.worker_flags import STARTED_PATH, STARTED_WAIT_MAX_SECONDS

log = logging.getLogger(__name__)

ASK_EVERY_SECONDS = 0.02
ASK_TIMEOUT_SECONDS = 0.5


def engine_ready(port: int | None) -> bool:
    """Whether the engine's `/ready` on this host answers 200 now."""
    if port is None:
        return False
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=ASK_TIMEOUT_SECONDS)
    try:
        connection.request("GET", "/ready")
        return connection.getresponse().status == 200
    except OSError:
        return False
    finally:
        connection.close()


def ready_within(port: Callable[[], int | None], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not engine_ready(port()):
        if time.monotonic() >= deadline:
            return False
        time.sleep(ASK_EVERY_SECONDS)
    return True


def wait_seconds(query: str) -> float | None:
    """`wait` from a query string (0 when absent); None when it is not a number of seconds in bounds."""
    values = urllib.parse.parse_qs(query).get("wait", ["0"])
    try:
        seconds = float(values[-1])
    except ValueError:
        return None
    return seconds if 0 <= seconds <= STARTED_WAIT_MAX_SECONDS else None


class ProbeServer:
    """`/started` on `port` (all addresses: the kubelet probes the pod's IP), in a thread of its own."""

    def __init__(self, port: int, engine_port: Callable[[], int | None]) -> None:
        handler = type("Handler", (_Handler,), {"engine_port": staticmethod(engine_port)})
        self._server = ThreadingHTTPServer(("0.0.0.0", port), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="probe", daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> ProbeServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class _Handler(BaseHTTPRequestHandler):
    engine_port: Callable[[], int | None]

    def do_GET(self) -> None:  # noqa: N802 (the name http.server calls)
        url = urllib.parse.urlsplit(self.path)
        if url.path != STARTED_PATH:
            self._answer(404, b'{"error": "not found"}')
            return
        seconds = wait_seconds(url.query)
        if seconds is None:
            self._answer(400, f'{{"error": "wait: seconds from 0 to {STARTED_WAIT_MAX_SECONDS:g}"}}'.encode())
        elif ready_within(self.engine_port, seconds):
            self._answer(200, b'{"status": "started"}')
        else:
            self._answer(503, b'{"status": "starting"}')

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (http.server's signature)
        return  # one probe a second: not worth a log line each
