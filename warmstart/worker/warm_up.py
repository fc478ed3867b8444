"""Requests through the worker's own HTTP app before the process serves or is captured.

A process pays some costs on its first request only: the async backend's modules are imported then, the
app builds its middleware stack, the request thread pool starts. A worker captured before its first
request carries that debt into every restore (on the H200 the first one-token completion after a restore
took 0.13 s longer than the next one, BENCHMARKS.md). These requests pay it before the checkpoint.

The requests go to a twin of the app with metrics of its own, so the worker's counters start at zero.
`WARMSTART_WARM_UP_ROUTES=0` turns them off (to measure them: what they load also travels in the image).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from typing import Any

log = logging.getLogger(__name__)

WARM_UP_REQUESTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("/v1/completions", {"prompt": "warm up", "max_tokens": 2, "temperature": 0}),
    ("/v1/completions", {"prompt": "warm up", "max_tokens": 2, "temperature": 0, "stream": True}),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "warm up"}], "max_tokens": 2, "temperature": 0},
    ),
)


WARM_UP_ENV = "WARMSTART_WARM_UP_ROUTES"


def enabled() -> bool:
    return os.environ.get(WARM_UP_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def warm_up_app(app: Any, model: str) -> float:
    """Send each of WARM_UP_REQUESTS to the ASGI `app` in a loop of its own; the seconds it took.

    A failure is logged and the worker goes on: a warm-up never stops one from serving.
    """
    started = time.perf_counter()
    for path, body in WARM_UP_REQUESTS:
        try:
            status, reply = asyncio.run(asgi_post(app, path, {"model": model, **body}))
        except Exception as exc:  # the app's own error handling answered 500 and raised it again
            status, reply = 500, repr(exc)
        if status != 200:
            log.warning("warm-up request to %s answered %d: %s", path, status, reply[:200])
    return time.perf_counter() - started


async def asgi_post(app: Any, path: str, body: dict[str, Any]) -> tuple[int, str]:
    """POST `body` as JSON to `path` of the ASGI `app`: (status, response body)."""
    payload = json.dumps(body).encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
        "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
    }  # fmt: skip
    pending = [{"type": "http.request", "body": payload, "more_body": False}]
    answered = asyncio.Event()
    status: list[int] = []
    chunks: list[bytes] = []

    async def receive() -> dict[str, Any]:
        if pending:
            return pending.pop()
        await answered.wait()  # the client stays until the whole answer came
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                answered.set()

    await app(scope, receive, send)
    return (status[0] if status else 500), b"".join(chunks).decode(errors="replace")
