"""`GET /ready?wait=S`: the answer is held until the engine is ready (the startup probe's way of answering
the moment a restored engine resumes), and bounded. vLLM's front end: `test_vllm_frontend.py`."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from test_worker_errors import FailingEngine

from warmstart.engines.base import EngineError
from warmstart.worker.metrics import WorkerMetrics
from warmstart.worker.server import ServerState, build_app
from warmstart.worker_flags import READY_WAIT_MAX_SECONDS


async def held_until_ready(app: Any, make_ready: Any) -> None:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://worker") as http:
        assert (await http.get("/ready")).status_code == 503
        assert (await http.get("/ready?wait=0.05")).status_code == 503  # still not ready when it ends
        waiting = asyncio.create_task(http.get(f"/ready?wait={READY_WAIT_MAX_SECONDS}"))
        await asyncio.sleep(0.05)
        assert not waiting.done(), "a probe asked to wait was answered before the engine was ready"
        make_ready()
        answer = await waiting
        assert answer.status_code == 200 and answer.json()["status"] == "ready"


def test_warmstart_server_holds_a_ready_probe_until_the_engine_is_ready() -> None:
    state = ServerState(ready=False)
    engine = FailingEngine(EngineError("the engine is not under test"), good_tokens=0)
    app = build_app(engine, WorkerMetrics(), state)
    asyncio.run(held_until_ready(app, lambda: setattr(state, "ready", True)))

    async def too_long() -> int:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://worker") as http:
            return (await http.get(f"/ready?wait={READY_WAIT_MAX_SECONDS + 1}")).status_code

    assert asyncio.run(too_long()) == 400  # refused, named, never held longer than the bound
