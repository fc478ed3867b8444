"""How the worker's HTTP server treats connections: how many, how many per client, how long a client may
keep the server waiting for a request head or body, how big a head, and a log that a flood of bad
connections cannot fill.

The defaults, and why:
- `max_connections` 1024: far more than the engine can batch (8-256 sequences), so real clients never
  meet it, yet a bounded number of file descriptors and buffers. Past it, the connection that has kept the
  server waiting longest is closed to make room: idle (no request in flight) or stalled (a request whose
  body has not all arrived). A connection whose request is being answered is never closed for room; when
  every one is, the newcomer's request is answered 503, which OpenAI clients retry.
- `max_connections_per_client` 256 (a quarter): one address (a host, or a proxy in front of many) cannot
  take every connection. Past it, that address's own longest-waiting connection makes room, else the new
  one is answered 503 and closed.
- `keep_alive_seconds` 5 (uvicorn's own default): a connection with no request in flight, before its first
  request or between requests, is closed after this long; a request head must arrive whole within it
  (slowloris), and a body that stops arriving for this long is cut off. Short enough that a flood of idle
  or stalled sockets drains in seconds, long enough for a client to reuse its connection for the next turn.
  uvicorn alone only times out idle time *between* requests and never a body.
- `body_timeout_seconds` 30: a whole request body must arrive within this long of its head (4 MiB at
  about 1 Mbit/s); a body cut off by either bound is answered 408 and the connection closed.
- `max_head_bytes` 16 KiB (h11's default, set explicitly): request line plus headers, however they arrive
  (h11 alone bounds only a head still incomplete). OpenAI clients send about 1 KiB; 16 KiB leaves room for
  long bearer tokens. Larger heads get a 400 and the connection is closed.
- A request framed both by Content-Length and by chunked Transfer-Encoding is read as chunked (h11) and
  its connection closed after the answer (RFC 9112, 6.3: such a message may be a smuggling attempt).
- `backlog` 1024: at most one more full set of connections waiting for accept(); under a SYN flood the
  kernel refuses beyond it rather than queueing without end (the kernel also caps it at somaxconn).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from warmstart.api.worker_options import DEFAULTS

LOG_REPEAT_SECONDS = 10.0


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = DEFAULTS["http_max_connections"]
    max_connections_per_client: int = DEFAULTS["http_max_connections_per_client"]
    keep_alive_seconds: float = DEFAULTS["http_keep_alive_seconds"]
    body_timeout_seconds: float = DEFAULTS["http_body_timeout_seconds"]
    max_head_bytes: int = 16 * 1024
    backlog: int = 1024


def uvicorn_options(limits: ConnectionLimits) -> dict[str, Any]:
    """The uvicorn.Config keyword arguments that enforce `limits`."""
    return {
        "http": protocol_for(limits),
        # The protocol bounds connections itself: uvicorn's limit also counts the tasks of connections
        # already closed to make room, and would turn away the very client they were closed for.
        "limit_concurrency": None,
        # uvicorn takes an int; the protocol below applies the exact value to every waiting phase.
        "timeout_keep_alive": max(1, round(limits.keep_alive_seconds)),
        "h11_max_incomplete_event_size": limits.max_head_bytes,
        "backlog": limits.backlog,
        "access_log": False,
    }


class BoundedHeadConnection(h11.Connection):
    """h11's server side, refusing a request head over `max_head_bytes` however it arrived (h11 bounds only
    a head it is still waiting to complete; one that comes in a single read is parsed whatever its size)."""

    def __init__(self, max_head_bytes: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=max_head_bytes)
        self.max_head_bytes = max_head_bytes

    def next_event(self) -> Any:
        if self.their_state is not h11.IDLE:
            return super().next_event()
        buffered = len(self.trailing_data[0])
        event = super().next_event()
        if isinstance(event, h11.Request) and buffered - len(self.trailing_data[0]) > self.max_head_bytes:
            raise h11.RemoteProtocolError(
                f"request head over {self.max_head_bytes} bytes", error_status_hint=431
            )
        return event


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol bound to `limits`, as the module's docstring describes."""

    limits: ConnectionLimits = ConnectionLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn = BoundedHeadConnection(self.limits.max_head_bytes)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._idle_since = 0.0  # when it last started waiting for a request head
        self._heard = 0.0  # when its last byte arrived
        self._head_at = 0.0  # when its current request's head was complete

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._idle_since = self._heard = self.loop.time()
        self._schedule()
        self._make_room()

    def data_received(self, data: bytes) -> None:
        self._heard = self.loop.time()
        super().data_received(data)
        self._schedule()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle and self.cycle is not None:  # a new request's head is in
            self._head_at = self.loop.time()
            if _framed_twice(self.headers):
                self.cycle.keep_alive = False
            self._schedule()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self._awaiting_head():
            self._idle_since = self.loop.time()
        self._schedule()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        super().connection_lost(exc)

    def waiting_since(self) -> float | None:
        """Since when the server has been waiting for this client (for a head, or for more of a body), None
        while it is answering a request (or the connection is closing)."""
        if self.transport is None or self.transport.is_closing():
            return None
        if self._awaiting_head():  # not reset by bytes of a head trickling in
            return self._idle_since
        if self.conn.their_state is h11.SEND_BODY:
            return self._heard
        return None

    def _awaiting_head(self) -> bool:
        request_done = self.cycle is None or self.cycle.response_complete
        return request_done and self.conn.their_state in (h11.IDLE, h11.DONE)

    def _deadline(self) -> float | None:
        since = self.waiting_since()
        if since is None:
            return None
        deadline = since + self.limits.keep_alive_seconds
        if self.conn.their_state is h11.SEND_BODY:  # the whole body is bounded too
            deadline = min(deadline, self._head_at + self.limits.body_timeout_seconds)
        return deadline

    def _schedule(self) -> None:
        """One timer per connection, at its deadline at the latest; it checks again when it fires."""
        deadline = self._deadline()
        if deadline is None:
            self._cancel_timer()
        elif self._timer is None or self._timer_at > deadline:
            self._cancel_timer()
            self._timer = self.loop.call_at(deadline, self._on_timer)
            self._timer_at = deadline

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_timer(self) -> None:
        self._timer = None
        deadline = self._deadline()
        if deadline is not None and self.loop.time() >= deadline:
            self.give_up()
        else:
            self._schedule()

    def give_up(self) -> None:
        """Close the connection; a request whose body never came whole first gets a 408 (when nothing of
        an answer went out yet), and its handler sees a disconnect."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_started and self.conn.their_state is h11.SEND_BODY:
            message = "the request body did not arrive in time; send it faster or smaller"
            self.transport.write(_error_response(self.conn, 408, message, "request_timeout"))
            cycle.response_started = cycle.disconnected = True  # the handler's own answer goes nowhere
            cycle.message_event.set()
        self.transport.close()
        self.connections.discard(self)  # the room is made now, not once the close completes

    def _make_room(self) -> None:
        """Close a waiting connection to admit this one; when none may go, this one's request gets a 503."""
        address = self.client[0] if self.client else None
        mine = [c for c in _guarded(self.connections) if c.client and c.client[0] == address]
        if len(mine) > self.limits.max_connections_per_client and not _close_longest_waiting(mine, self):
            self.app = _refusal("too many connections from this address; reuse one or retry")
        elif len(self.connections) > self.limits.max_connections and not _close_longest_waiting(
            _guarded(self.connections), self
        ):
            self.app = _refusal("every connection of the worker is busy; retry")


def _guarded(connections: Iterable[Any]) -> list[GuardedH11Protocol]:
    return [c for c in connections if isinstance(c, GuardedH11Protocol)]


def _close_longest_waiting(connections: list[GuardedH11Protocol], keep: GuardedH11Protocol) -> bool:
    """Close the connection of `connections` (not `keep`) that has kept the server waiting longest;
    False when none is waiting for its client."""
    waiting = [(since, c) for c in connections if c is not keep and (since := c.waiting_since()) is not None]
    if not waiting:
        return False
    min(waiting, key=lambda item: item[0])[1].give_up()
    return True


def _framed_twice(headers: list[tuple[bytes, bytes]]) -> bool:
    return {b"content-length", b"transfer-encoding"}.issubset(name for name, _ in headers)


def _error_body(message: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()  # fmt: skip


def _error_response(conn: h11.Connection, status: int, message: str, code: str) -> bytes:
    body = _error_body(message, code)
    headers = [
        ("content-type", "application/json"),
        ("content-length", str(len(body))),
        ("connection", "close"),
    ]
    response = h11.Response(status_code=status, headers=headers, reason=HTTPStatus(status).phrase)
    events = (response, h11.Data(data=body), h11.EndOfMessage())
    return b"".join(conn.send(event) or b"" for event in events)


def _refusal(message: str) -> Any:
    """An app that answers 503 (OpenAI clients retry) with `message`, and closes the connection."""
    body = _error_body(message, "too_many_connections")
    headers = [(b"content-type", b"application/json"), (b"connection", b"close")]

    async def refuse(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return refuse


def protocol_for(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """GuardedH11Protocol bound to `limits` (uvicorn instantiates the class itself)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits})


class RepeatedLogFilter(logging.Filter):
    """Lets one record per message template through every `seconds`; the next one that passes says how many
    were held back. A flood of bad connections then costs a log line per template every few seconds."""

    def __init__(self, seconds: float = LOG_REPEAT_SECONDS) -> None:
        super().__init__()
        self.seconds = seconds
        self._last: dict[tuple[str, str], float] = {}
        self._held: dict[tuple[str, str], int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, str(record.msg))
        now = time.monotonic()
        if now - self._last.get(key, -self.seconds) < self.seconds:
            self._held[key] = self._held.get(key, 0) + 1
            return False
        self._last[key] = now
        if held := self._held.pop(key, 0):
            record.msg = f"{record.msg} ({held} more like this in the last {self.seconds:.0f} s)"
        return True


def quiet_connection_logs() -> None:
    """Rate-limit what uvicorn and asyncio log per bad connection (invalid requests, the concurrency limit,
    accept() out of descriptors)."""
    for name in ("uvicorn.error", "asyncio"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, RepeatedLogFilter) for f in logger.filters):
            logger.addFilter(RepeatedLogFilter())
