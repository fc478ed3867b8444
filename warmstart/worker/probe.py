"""The supervisor's probe endpoints on the probe port (`api.worker_options`), for the kubelet.

- `GET /ready?wait=S`: 200 once the engine's own `/ready` answers 200, the answer held up to S seconds
  until then. It listens from the container's start, in every mode: a restored engine opens its server only
  once it is restored, so a probe sent to the engine during a restore would be refused and asked again a
  period later; asked here, it is answered the moment the engine serves.
- `GET /live`: 200 while the engine starts (until `start_timeout` has passed without it ever being ready),
  then while the engine's `/health` answers 200.

The engine's port may change: a restore's answer may move the engine to another port.

Requests are handled by a fixed set of threads started with the server, never a thread per request: every
thread takes a PID of the pod's namespace, and a restore needs the PIDs the captured engine had. The capture
pod's supervisor started the same threads, in the same order, before its engine; a thread per probe would
take the next PIDs whenever the kubelet asked, up to the engine's own before the agent can reserve them.
"""

from __future__ import annotations

import http.client
import queue
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, HTTPServer

from warmstart.api.worker_options import PROBE_LIVE_PATH, PROBE_READY_PATH, PROBE_WAIT_MAX_SECONDS

ASK_EVERY_SECONDS = 0.02
ASK_TIMEOUT_SECONDS = 0.5  # the least an ask of the engine waits for its answer
# Under the 2 s the kubelet waits (the operator's probe timeoutSeconds): an engine busy with a burst of
# requests answers later than unloaded, and is alive all the same.
LIVE_ASK_TIMEOUT_SECONDS = 1.5
HANDLER_THREADS = 4  # a held readiness probe, a liveness probe, and room for a retry of each


@dataclass
class EngineWatch:
    """What the endpoints look at: the engine's port, how long it may take to be ready the first time,
    and whether it has been."""

    port: int
    start_timeout: float
    started: float = field(default_factory=time.monotonic)
    ready_once: bool = False

    def answers(self, path: str, timeout: float = ASK_TIMEOUT_SECONDS) -> bool:
        """Whether the engine answers 200 on `path` within `timeout`."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            connection.request("GET", path)
            return connection.getresponse().status == 200
        except OSError:
            return False
        finally:
            connection.close()

    def ready_within(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while not self.answers("/ready", max(ASK_TIMEOUT_SECONDS, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                return False
            time.sleep(ASK_EVERY_SECONDS)
        self.ready_once = True
        return True

    def live(self) -> bool:
        if self.ready_once:
            return self.answers("/health", LIVE_ASK_TIMEOUT_SECONDS)
        return time.monotonic() - self.started < self.start_timeout


def wait_seconds(query: str) -> float | None:
    """`wait` from a query string (0 when absent); None when it is not a number of seconds in bounds."""
    values = urllib.parse.parse_qs(query).get("wait", ["0"])
    try:
        seconds = float(values[-1])
    except ValueError:
        return None
    return seconds if 0 <= seconds <= PROBE_WAIT_MAX_SECONDS else None


class ProbeServer(HTTPServer):
    """The endpoints on `port` (all addresses: the kubelet probes the pod's IP). Requests wait in a queue for
    `HANDLER_THREADS` threads started up front."""

    def __init__(self, port: int, engine: EngineWatch) -> None:
        super().__init__(("0.0.0.0", port), type("Handler", (_Handler,), {"engine": engine}))
        self._requests: queue.Queue[tuple[socket.socket, object] | None] = queue.Queue()
        self._handlers = [
            threading.Thread(target=self._handle_queued, name=f"probe-handler-{n}", daemon=True)
            for n in range(HANDLER_THREADS)
        ]

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def start(self) -> ProbeServer:
        for thread in self._handlers:
            thread.start()
        threading.Thread(target=self.serve_forever, name="probe", daemon=True).start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()

    def process_request(self, request: socket.socket, client_address: object) -> None:  # type: ignore[override]
        self._requests.put((request, client_address))

    def server_close(self) -> None:
        super().server_close()
        for _ in self._handlers:
            self._requests.put(None)

    def _handle_queued(self) -> None:
        while (queued := self._requests.get()) is not None:
            request, client_address = queued
            try:
                self.finish_request(request, client_address)
            except Exception:  # noqa: BLE001 (what socketserver does with a handler's error)
                self.handle_error(request, client_address)
            finally:
                self.shutdown_request(request)


class _Handler(BaseHTTPRequestHandler):
    engine: EngineWatch

    def do_GET(self) -> None:  # noqa: N802 (the name http.server calls)
        url = urllib.parse.urlsplit(self.path)
        if url.path == PROBE_LIVE_PATH:
            self._answer(
                *((200, b'{"status": "live"}') if self.engine.live() else (503, b'{"status": "down"}'))
            )
        elif url.path != PROBE_READY_PATH:
            self._answer(404, b'{"error": "not found"}')
        elif (seconds := wait_seconds(url.query)) is None:
            self._answer(400, f'{{"error": "wait: seconds from 0 to {PROBE_WAIT_MAX_SECONDS:g}"}}'.encode())
        elif self.engine.ready_within(seconds):
            self._answer(200, b'{"status": "ready"}')
        else:
            self._answer(503, b'{"status": "starting"}')

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (http.server's signature)
        return  # a probe a second: not worth a log line each
