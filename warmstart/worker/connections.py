"""How the worker's HTTP server treats connections: how many, how long idle, how big a request head, and a
log that a flood of bad connections cannot fill.

The defaults, and why:
- `max_connections` 1024: far more than the engine can batch (8-256 sequences), so real clients never
  meet it, yet a bounded number of file descriptors and buffers. Past it, the longest-idle connection is
  closed to make room for the new one; when none is idle, uvicorn's `limit_concurrency` (one more) answers
  a 503, which OpenAI clients retry.
- `keep_alive_seconds` 5 (uvicorn's own default): an idle connection, before its first request, between
  requests, or still sending its request head (slowloris), is closed after this long. Short enough that a
  flood of idle sockets drains in seconds, long enough for a client to reuse its connection for the next
  turn. uvicorn alone only times out idle time *between* requests; a socket that never sends a byte would
  be kept forever.
- `max_head_bytes` 16 KiB (h11's default, set explicitly): request line plus headers. OpenAI clients send
  about 1 KiB; 16 KiB leaves room for long bearer tokens. Larger heads get uvicorn's 400.
- `backlog` 1024: at most one more full set of connections waiting for accept(); under a SYN flood the
  kernel refuses beyond it rather than queueing without end (the kernel also caps it at somaxconn).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

LOG_REPEAT_SECONDS = 10.0


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = 1024
    keep_alive_seconds: float = 5.0
    max_head_bytes: int = 16 * 1024
    backlog: int = 1024


def uvicorn_options(limits: ConnectionLimits) -> dict[str, Any]:
    """The uvicorn.Config keyword arguments that enforce `limits`."""
    return {
        "http": protocol_for(limits),
        # uvicorn answers 503 once this many connections exist; eviction keeps at most max_connections.
        "limit_concurrency": limits.max_connections + 1,
        # uvicorn takes an int; the protocol below applies the exact value to every idle phase.
        "timeout_keep_alive": max(1, round(limits.keep_alive_seconds)),
        "h11_max_incomplete_event_size": limits.max_head_bytes,
        "backlog": limits.backlog,
        "access_log": False,
    }


class IdleClosingH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, plus: a connection with no complete request head in flight is closed after
    the keep-alive time (also before its first request, and while a head trickles in), and past
    `max_connections` the longest-idle connection is closed to admit a new one."""

    keep_alive_seconds: float = ConnectionLimits.keep_alive_seconds
    max_connections: int = ConnectionLimits.max_connections
    _idle_timer: asyncio.TimerHandle | None = None
    _idle_since: float = 0.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._idle_since = time.monotonic()
        self._arm_idle_timer()
        if len(self.connections) > self.max_connections:
            _close_longest_idle(self.connections, keep=self)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self._awaiting_head():
            self._disarm_idle_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self._awaiting_head():
            self._idle_since = time.monotonic()
            self._arm_idle_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_idle_timer()
        super().connection_lost(exc)

    def is_idle(self) -> bool:
        return self._awaiting_head() and not self.transport.is_closing()

    def _awaiting_head(self) -> bool:
        request_done = self.cycle is None or self.cycle.response_complete
        return request_done and self.conn.their_state in (h11.IDLE, h11.DONE)

    def _arm_idle_timer(self) -> None:
        self._disarm_idle_timer()
        self._idle_timer = self.loop.call_later(self.keep_alive_seconds, self._close_if_idle)

    def _disarm_idle_timer(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def _close_if_idle(self) -> None:
        self._idle_timer = None
        if self.is_idle():
            self.transport.close()


def _close_longest_idle(connections: set[Any], keep: Any) -> None:
    idle = [c for c in connections if c is not keep and isinstance(c, IdleClosingH11Protocol) and c.is_idle()]
    if idle:
        min(idle, key=lambda connection: connection._idle_since).transport.close()


def protocol_for(limits: ConnectionLimits) -> type[IdleClosingH11Protocol]:
    """IdleClosingH11Protocol bound to `limits` (uvicorn instantiates the class itself)."""
    return type(
        "IdleClosingH11Protocol",
        (IdleClosingH11Protocol,),
        {"keep_alive_seconds": limits.keep_alive_seconds, "max_connections": limits.max_connections},
    )


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
        held = self._held.pop(key, 0)
        if held:
            record.msg = f"{record.msg} ({held} more like this in the last {self.seconds:.0f} s)"
        return True


def quiet_connection_logs(seconds: float = LOG_REPEAT_SECONDS) -> None:
    """Rate-limit what uvicorn and asyncio log per bad connection (invalid requests, the concurrency limit,
    accept() out of descriptors)."""
    for name in ("uvicorn.error", "asyncio"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, RepeatedLogFilter) for f in logger.filters):
            logger.addFilter(RepeatedLogFilter(seconds))
