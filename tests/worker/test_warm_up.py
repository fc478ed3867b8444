"""The warm-up requests' ASGI client: what an app answers comes back, and a failing app stops nothing."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from warmstart.worker.warm_up import WARM_UP_REQUESTS, asgi_post, warm_up_app


async def echo_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answers 201 with the request body, reading it the way a server does."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    assert scope["method"] == "POST" and dict(scope["headers"])[b"content-type"] == b"application/json"
    await send({"type": "http.response.start", "status": 201, "headers": []})
    await send({"type": "http.response.body", "body": scope["path"].encode() + b" " + body})


def test_a_post_reaches_the_app_and_its_answer_comes_back() -> None:
    status, reply = asyncio.run(asgi_post(echo_app, "/v1/completions", {"prompt": "x"}))
    assert (status, reply) == (201, '/v1/completions {"prompt": "x"}')


def test_a_failing_app_is_logged_and_the_warm_up_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[str] = []

    async def broken_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        calls.append(scope["path"])
        raise RuntimeError("engine not loaded")

    with caplog.at_level(logging.WARNING):
        warm_up_app(broken_app, "tiny")
    assert calls == [path for path, _ in WARM_UP_REQUESTS]
    assert caplog.text.count("engine not loaded") == len(WARM_UP_REQUESTS)
