"""A hostile client against a real worker: oversized and malformed requests, idle and half-sent
connections, and clients that leave mid-generation. Loopback only, bounded in count and time."""

from __future__ import annotations

import contextlib
import json
import selectors
import socket
import threading
import time

import h11
import httpx
import pytest
from reliability_helpers import (
    POLL_SECONDS,
    WAIT_SECONDS,
    InProcessWorker,
    closed_by_peer,
    connect,
    metric,
    raw_post,
    responses_counted,
    wait_until,
)

from warmstart.worker.connections import ConnectionLimits

pytestmark = [pytest.mark.reliability, pytest.mark.spawns]

IDLE_CONNECTIONS = 300
LONG = {"model": "tiny", "prompt": "x", "max_tokens": 500, "temperature": 0, "ignore_eos": True}
RUNNING = "warmstart_worker_requests_running"
WAITING = "warmstart_worker_requests_waiting"
CANCELLED = "warmstart_worker_requests_cancelled_total"


def post(port: int, body: object, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{port}{path}", json=body, timeout=120)


def assert_400_naming(response: httpx.Response, param: str, status: int = 400) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "body,param",
    [
        pytest.param({"n": 17}, "n", id="n-over-the-limit"),
        pytest.param({"n": 10**30}, "n", id="n-huge"),
        pytest.param({"prompt": ["a"] * 33}, "prompt", id="too-many-prompts"),
        pytest.param({"prompt": ["a"] * 8, "n": 16}, "n", id="too-many-choices"),
        pytest.param({"max_tokens": 600}, "max_tokens", id="max-tokens-past-the-context"),
        pytest.param({"max_tokens": 10**400}, "max_tokens", id="max-tokens-with-400-digits"),
        pytest.param({"stop": ["a", "b", "c", "d", "e"]}, "stop", id="too-many-stop-strings"),
        pytest.param({"stop": "s" * 257}, "stop", id="stop-string-too-long"),
        pytest.param({"temperature": 10**400}, "temperature", id="temperature-overflows-a-float"),
        pytest.param({"stream_options": {"include_usage": True}}, "stream_options", id="options-no-stream"),
    ],
)
def test_unbounded_completion_requests_are_refused_naming_the_field(worker, body: dict, param: str) -> None:
    _, port = worker
    assert_400_naming(post(port, {"model": "tiny", "prompt": "hello", **body}), param)


def test_too_many_chat_messages_are_refused(worker) -> None:
    _, port = worker
    messages = [{"role": "user", "content": "hi"}] * 1025
    assert_400_naming(post(port, {"model": "tiny", "messages": messages}, "/v1/chat/completions"), "messages")


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_an_oversized_body_is_a_413(worker, declared: bool) -> None:
    _, port = worker
    body = json.dumps({"model": "tiny", "prompt": "x" * (5 * 1024 * 1024)}).encode()
    content = body if declared else iter([body[i : i + 65536] for i in range(0, len(body), 65536)])
    response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", content=content, timeout=120)
    assert response.status_code == 413, response.text
    assert response.json()["error"]["code"] == "body_too_large"


@pytest.mark.parametrize(
    "raw,param",
    [
        pytest.param(b'{"model": "tiny", "prompt": "\\ud800"}', "prompt", id="lone-surrogate-prompt"),
        pytest.param(b'{"model": "tiny", "prompt": ["ok", "\\udfff"]}', "prompt[1]", id="in-a-prompt-list"),
        pytest.param(b'{"model": "\\ud800", "prompt": "x"}', "model", id="lone-surrogate-model"),
        pytest.param(b'{"model": "tiny", "prompt": "x", "stop": "\\ud83d"}', "stop", id="in-stop"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_where(worker, raw: bytes, param: str) -> None:
    _, port = worker
    response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", content=raw, timeout=60)
    assert_400_naming(response, param)
    assert "surrogate" in response.json()["error"]["message"]


def test_a_lone_surrogate_in_a_chat_message_is_a_400(worker) -> None:
    _, port = worker
    raw = b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800 hi"}]}'
    response = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", content=raw, timeout=60)
    assert_400_naming(response, "messages[0].content")


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(
            b'{"model": "tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", id="100000-deep"
        ),
        pytest.param(b'{"model": "tiny", "prompt": ' + b"[" * 40 + b"]" * 40 + b"}", id="40-deep"),
        pytest.param(
            b'{"model": "tiny", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", id="5000-digits"
        ),
        pytest.param(b'{"model": "tiny", "prompt": "x", "temperature": NaN}', id="nan"),
        pytest.param(b'{"model": "tiny", "prompt": "\xff\xfe"}', id="not-utf-8"),
    ],
)
def test_malformed_json_is_a_clear_400_and_counted(worker, raw: bytes) -> None:
    _, port = worker
    before = metric(port, 'warmstart_worker_requests_total{route="/v1/completions",status="400"}')
    response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", content=raw, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"
    after = metric(port, 'warmstart_worker_requests_total{route="/v1/completions",status="400"}')
    assert after == before + 1


def test_every_response_is_counted(worker) -> None:
    _, port = worker
    base = f"http://127.0.0.1:{port}"
    before = responses_counted(port)  # this /metrics call is counted after it answers
    statuses = [
        httpx.get(f"{base}/v1/models").status_code,
        httpx.get(f"{base}/no/such/route").status_code,
        httpx.post(f"{base}/v1/models").status_code,
        httpx.post(f"{base}/v1/responses", json={"model": "tiny", "input": "hi"}).status_code,
        post(port, {"model": "tiny", "prompt": "hi", "max_tokens": 2}).status_code,
        post(port, {"model": "nope", "prompt": "hi"}).status_code,
        httpx.post(f"{base}/v1/completions", content=b"[" * 50_000, timeout=60).status_code,
    ]
    assert statuses == [200, 404, 405, 400, 200, 404, 400]
    assert responses_counted(port) == before + 1 + len(statuses)


def test_an_unknown_route_gets_an_openai_style_404(worker) -> None:
    _, port = worker
    response = httpx.get(f"http://127.0.0.1:{port}/v1/embeddings")
    assert response.status_code == 404
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_idle_connections_are_closed_and_a_real_request_still_succeeds(serve_in_process) -> None:
    server = serve_in_process(connection_limits=ConnectionLimits(keep_alive_seconds=1.0))
    idle = [connect(server.port) for _ in range(IDLE_CONNECTIONS)]
    try:
        response = httpx.post(
            f"{server.base_url}/v1/completions",
            json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
            timeout=120,
        )
        assert response.status_code == 200, response.text
        assert all(closed_by_peer(sock) for sock in idle)  # bounded: each within WAIT_SECONDS
    finally:
        for sock in idle:
            sock.close()


def test_a_connection_kept_alive_after_a_request_is_closed_when_idle(serve_in_process) -> None:
    server = serve_in_process(connection_limits=ConnectionLimits(keep_alive_seconds=1.0))
    with connect(server.port) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        assert closed_by_peer(sock)


def test_a_request_head_that_trickles_in_is_cut_off(serve_in_process) -> None:
    server = serve_in_process(connection_limits=ConnectionLimits(keep_alive_seconds=1.0))
    with connect(server.port) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never the blank line that ends it
        assert closed_by_peer(sock)


def test_past_the_connection_limit_the_longest_idle_makes_room(serve_in_process) -> None:
    limits = ConnectionLimits(max_connections=50, keep_alive_seconds=600.0)  # only eviction closes them
    server = serve_in_process(connection_limits=limits)
    idle = [connect(server.port) for _ in range(100)]
    try:
        wait_until(
            lambda: len(server.server.server_state.connections) <= 50, "idle connections to be evicted"
        )
        response = httpx.get(f"{server.base_url}/health", timeout=120)
        assert response.status_code == 200
        assert closed_by_peer(idle[0])  # the oldest went first
    finally:
        for sock in idle:
            sock.close()


def test_a_flood_of_invalid_requests_does_not_flood_the_log(worker) -> None:
    process, port = worker
    for _ in range(IDLE_CONNECTIONS):
        with connect(port) as sock:
            sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
            closed_by_peer(sock)
    assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
    process.wait_for_log("Invalid HTTP request received")
    assert process.logs().count("Invalid HTTP request received") <= 10


def _wait_running(port: int) -> None:
    wait_until(lambda: metric(port, RUNNING) >= 1, "the generation to start")


def _wait_stopped(port: int, cancelled_before: float) -> None:
    wait_until(
        lambda: metric(port, RUNNING) == 0 and metric(port, WAITING) == 0, "running and waiting to drop to 0"
    )
    assert metric(port, CANCELLED) >= cancelled_before + 1


def test_a_streamed_generation_stops_when_its_client_disconnects(worker) -> None:
    _, port = worker
    cancelled = metric(port, CANCELLED)
    tokens_before = metric(port, "warmstart_worker_completion_tokens_total")
    with httpx.stream(
        "POST", f"http://127.0.0.1:{port}/v1/completions", json={**LONG, "stream": True}, timeout=120
    ) as response:
        assert response.status_code == 200
        next(response.iter_lines())  # the first token is out: generation runs; then leave
    _wait_stopped(port, cancelled)
    assert metric(port, "warmstart_worker_completion_tokens_total") - tokens_before < LONG["max_tokens"]


def test_a_non_streamed_generation_stops_when_its_client_disconnects(worker) -> None:
    _, port = worker
    cancelled = metric(port, CANCELLED)
    body = json.dumps({**LONG, "n": 16, "max_tokens": 490}).encode()
    sock = connect(port)
    try:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        _wait_running(port)
    finally:
        sock.close()
    _wait_stopped(port, cancelled)
    status_499 = 'warmstart_worker_requests_total{route="/v1/completions",status="499"}'
    wait_until(lambda: metric(port, status_499) >= 1, "the abandoned request to be counted")


def test_running_and_waiting_gauges_follow_the_load(worker) -> None:
    _, port = worker
    samples = metric(port, RUNNING), metric(port, WAITING)
    assert samples == (0, 0)
    result: dict[str, httpx.Response] = {}
    thread = threading.Thread(
        target=lambda: result.update(r=post(port, {**LONG, "n": 16, "max_tokens": 200}))
    )
    thread.start()
    seen: set[tuple[float, float]] = set()

    def loaded() -> bool:
        seen.add((metric(port, RUNNING), metric(port, WAITING)))
        return any(running >= 1 and waiting >= 1 for running, waiting in seen) or not thread.is_alive()

    wait_until(loaded, "running and waiting to be seen together")
    thread.join(timeout=300)
    assert result["r"].status_code == 200
    assert any(running >= 1 and waiting >= 1 for running, waiting in seen), seen  # 8 engine slots, n = 16
    assert (metric(port, RUNNING), metric(port, WAITING)) == (0, 0)


def test_the_gauges_are_documented(worker) -> None:
    _, port = worker
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    assert f"# TYPE {RUNNING} gauge" in text and f"# TYPE {WAITING} gauge" in text
    from warmstart.worker import metrics

    assert RUNNING in (metrics.__doc__ or "") and WAITING in (metrics.__doc__ or "")


def test_raw_helper_sanity(worker) -> None:
    _, port = worker
    assert raw_post(port, "/v1/completions", b"{}").startswith(b"HTTP/1.1 400")


# --- stalled bodies, a bound per client, heads, framing -------------------------------------------------

NEVER = 600.0  # a deadline no test waits for: only what is under test closes connections


def stalled_post(port: int, source: str = "127.0.0.1", declared: int = 100) -> socket.socket:
    """A connection from `source` that sends a whole request head, then none of its body."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_SECONDS, source_address=(source, 0))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {declared}\r\n\r\n".encode()
    )
    return sock


def waiting_on_bodies(server: InProcessWorker, source: str = "127.0.0.1") -> list[int]:
    """The client ports of the connections from `source` whose request head is in and whose body the
    server is waiting for."""
    return [
        c.client[1]
        for c in server.server.server_state.connections
        if c.client and c.client[0] == source and c.conn.their_state is h11.SEND_BODY and c.waiting_since()
    ]


def stall(server: InProcessWorker, source: str) -> socket.socket:
    """A stalled POST from `source`, once the server has its head."""
    sock = stalled_post(server.port, source)
    port = sock.getsockname()[1]
    wait_until(lambda: port in waiting_on_bodies(server, source), f"the head from port {port}")
    return sock


def answer_then_close(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes `sock`."""
    sock.settimeout(WAIT_SECONDS)
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def test_stalled_bodies_are_evicted_like_idle_connections(serve_in_process) -> None:
    limits = ConnectionLimits(
        max_connections=20,
        max_connections_per_client=1000,
        keep_alive_seconds=NEVER,
        body_timeout_seconds=NEVER,
    )
    server = serve_in_process(connection_limits=limits)
    stalled = []
    try:
        for _ in range(20):
            stalled.append(stall(server, "127.0.0.1"))
        response = httpx.post(
            f"{server.base_url}/v1/completions", json={**LONG, "max_tokens": 2}, timeout=120
        )
        assert response.status_code == 200, response.text  # a 503 until the 30 s body timeout before
        assert answer_then_close(stalled[0]).startswith(b"HTTP/1.1 408")  # the longest stalled went
    finally:
        for sock in stalled:
            sock.close()


def trickle_until_closed(sock: socket.socket) -> bytes:
    """Send a byte of body every POLL_SECONDS until the server closes `sock`; what it answered."""
    sock.setblocking(False)
    received, deadline = b"", time.monotonic() + WAIT_SECONDS
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except BlockingIOError:
            chunk = None
        except OSError:
            return received
        if chunk == b"":
            return received
        received += chunk or b""
        with contextlib.suppress(BlockingIOError, OSError):
            sock.send(b" ")
        time.sleep(POLL_SECONDS)
    raise AssertionError(f"the server kept a trickling body open for {WAIT_SECONDS} s: {received[:200]!r}")


@pytest.mark.parametrize("path", ["/v1/completions", "/health"], ids=["read-body", "unread-body"])
def test_a_body_that_trickles_in_is_cut_off_and_the_connection_closed(serve_in_process, path: str) -> None:
    """A whole body within body_timeout_seconds, however fast its bytes come; a route that answers without
    reading the body (GET) does not leave the connection to the trickle either."""
    limits = ConnectionLimits(keep_alive_seconds=1.0, body_timeout_seconds=2.0)
    server = serve_in_process(connection_limits=limits)
    method = "POST" if path == "/v1/completions" else "GET"
    with connect(server.port) as sock:
        sock.sendall(
            f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100000\r\n\r\n".encode()
        )
        answered = trickle_until_closed(sock)
    assert answered.startswith(b"HTTP/1.1 408" if method == "POST" else b"HTTP/1.1 200"), answered[:200]


def test_one_address_cannot_hold_more_than_its_share(serve_in_process) -> None:
    limits = ConnectionLimits(
        max_connections_per_client=4, keep_alive_seconds=NEVER, body_timeout_seconds=NEVER
    )
    server = serve_in_process(connection_limits=limits)
    hostile = []
    try:
        for _ in range(10):
            hostile.append(stall(server, "127.0.0.2"))
        for sock in hostile[:6]:  # each made room for a newer one of its own address
            assert answer_then_close(sock).startswith(b"HTTP/1.1 408")
        still_open = sorted(sock.getsockname()[1] for sock in hostile[6:])
        assert sorted(waiting_on_bodies(server, "127.0.0.2")) == still_open
        assert httpx.get(f"{server.base_url}/health", timeout=60).status_code == 200  # another address
    finally:
        for sock in hostile:
            sock.close()


@pytest.mark.parametrize(
    "limits",
    [ConnectionLimits(max_connections_per_client=1, keep_alive_seconds=NEVER),
     ConnectionLimits(max_connections=1, keep_alive_seconds=NEVER)],
    ids=["per-client", "all"],
)  # fmt: skip
def test_with_every_connection_busy_a_newcomer_gets_a_503(serve_in_process, limits: ConnectionLimits) -> None:
    server = serve_in_process(connection_limits=limits)
    with httpx.Client(timeout=120) as busy:
        thread = threading.Thread(target=lambda: busy.post(f"{server.base_url}/v1/completions", json=LONG))
        thread.start()
        wait_until(lambda: metric_of(server, RUNNING) >= 1, "the generation to start")
        with connect(server.port) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            answered = answer_then_close(sock)
        thread.join(timeout=300)
    assert answered.startswith(b"HTTP/1.1 503") and b"too_many_connections" in answered, answered[:300]


def metric_of(server: InProcessWorker, name: str) -> float:
    return server.metrics.registry.get_sample_value(name) or 0.0


@pytest.mark.parametrize("size", [15 * 1024, 20 * 1024])
def test_a_request_head_in_one_packet_is_bounded_too(serve_in_process, size: int) -> None:
    server = serve_in_process(connection_limits=ConnectionLimits(keep_alive_seconds=NEVER))
    head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nX-Pad: "
    head += b"a" * (size - len(head) - 4) + b"\r\n\r\n"
    with connect(server.port) as sock:
        sock.sendall(head)  # one write: the whole head is in the server's first read
        answered = answer_then_close(sock)
    assert answered.startswith(b"HTTP/1.1 200" if size <= 16 * 1024 else b"HTTP/1.1 400"), answered[:200]


def test_a_request_framed_by_length_and_chunks_closes_its_connection(serve_in_process) -> None:
    server = serve_in_process(connection_limits=ConnectionLimits(keep_alive_seconds=NEVER))
    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode()
    chunked = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    with connect(server.port) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked
        )
        answered = answer_then_close(sock)  # kept open for another request before (RFC 9112, 6.3)
    assert answered.startswith(b"HTTP/1.1 200"), answered[:300]


def test_one_model_is_found_by_its_id(worker) -> None:
    _, port = worker
    base = f"http://127.0.0.1:{port}"
    listed = httpx.get(f"{base}/v1/models").json()["data"][0]
    assert httpx.get(f"{base}/v1/models/tiny").json() == listed
    for other in ("nope", "org/tiny"):
        response = httpx.get(f"{base}/v1/models/{other}")
        assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"


def test_a_client_leaving_mid_body_is_counted_as_gone_not_as_an_error(worker) -> None:
    process, port = worker
    gone = 'warmstart_worker_requests_total{route="/v1/completions",status="499"}'
    before = metric(port, gone)
    with stalled_post(port) as sock:
        sock.sendall(b'{"model": "ti')  # and leaves
    wait_until(lambda: metric(port, gone) == before + 1, "the abandoned request to be counted")
    assert "unexpected error" not in process.logs()


FLOOD_CONNECTIONS = 1100  # past the default bound of 1024, from five addresses: each under its own share
FLOOD_SOURCES = [f"127.0.0.{n}" for n in range(2, 7)]
REAL_REQUESTS = 20


class StalledBodyFlood(threading.Thread):
    """Keeps FLOOD_CONNECTIONS connections open that each send a request head and stall their body,
    opening a new one for every one the server closes; counts what it opened and the 408s it got."""

    def __init__(self, port: int) -> None:
        super().__init__(name="stalled-body-flood", daemon=True)
        self.port, self.stop, self.opened, self.timed_out = port, threading.Event(), 0, 0

    def run(self) -> None:
        with selectors.DefaultSelector() as selector:
            while not self.stop.is_set():
                while len(selector.get_map()) < FLOOD_CONNECTIONS:
                    source = FLOOD_SOURCES[self.opened % len(FLOOD_SOURCES)]
                    selector.register(stalled_post(self.port, source), selectors.EVENT_READ)
                    self.opened += 1
                for key, _ in selector.select(POLL_SECONDS):  # answered (408) or closed: let go
                    selector.unregister(key.fileobj)
                    with contextlib.suppress(OSError), key.fileobj as sock:  # type: ignore[union-attr]
                        self.timed_out += sock.recv(65536).startswith(b"HTTP/1.1 408")
            for key in list(selector.get_map().values()):
                key.fileobj.close()  # type: ignore[union-attr]

    def close(self) -> None:
        self.stop.set()
        self.join(timeout=WAIT_SECONDS)


def test_a_flood_of_stalled_bodies_leaves_room_for_real_clients(serve_in_process) -> None:
    server = serve_in_process(connection_limits=ConnectionLimits())  # the defaults a worker runs with
    flood = StalledBodyFlood(server.port)
    flood.start()
    try:
        connections = server.server.server_state.connections
        wait_until(lambda: len(connections) >= ConnectionLimits().max_connections, "the server to be full")
        statuses = [
            httpx.post(
                f"{server.base_url}/v1/completions", json={**LONG, "max_tokens": 2}, timeout=120
            ).status_code
            for _ in range(REAL_REQUESTS)
        ]
    finally:
        flood.close()
    print(f"{flood.opened} stalled bodies opened, {flood.timed_out} answered 408; real requests: {statuses}")
    assert statuses == [200] * REAL_REQUESTS  # every one a 503 before, until the app's body timeout
