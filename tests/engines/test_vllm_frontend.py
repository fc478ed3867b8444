"""The glue that puts vLLM's own server in front of a checkpointable engine, on CPU without vLLM.

`InprocAsyncClient` is driven the way vLLM's `AsyncLLM` drives its engine-core client (requests added
from the event loop, an output loop awaiting `get_output_async`) over a fake engine core with the core's
interface; `ServingApp` is served over ASGI with a fake frontend whose app stands for vLLM's.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client import CollectorRegistry, Gauge

from warmstart.engines.vllm.frontend import ServingApp, VllmFrontend
from warmstart.engines.vllm.inproc_client import InprocAsyncClient
from warmstart.engines.vllm.options import VllmOptions
from warmstart.worker.engine_process import _HttpRunner
from warmstart.worker.metrics import WorkerMetrics
from warmstart.worker.openai_requests import RequestLimits


@dataclass
class Request:
    request_id: str
    tokens: int


@dataclass
class Output:
    request_id: str
    token: int
    finished: bool


@dataclass
class Outputs:
    outputs: list[Output]
    scheduler_stats: Any = None


@dataclass
class FakeCore:
    """The engine core's interface: every step emits one token per running request."""

    running: dict[str, list[int]] = field(default_factory=dict)
    threads: set[str] = field(default_factory=set)
    steps: int = 0
    calls: list[tuple[str, tuple]] = field(default_factory=list)
    shut: bool = False

    @property
    def scheduler(self) -> FakeCore:
        return self

    def has_requests(self) -> bool:
        return bool(self.running)

    def _on_thread(self, name: str, *args: Any) -> None:
        self.threads.add(threading.current_thread().name)
        self.calls.append((name, args))

    def preprocess_add_request(self, request: Request) -> tuple[Request, int]:
        self._on_thread("preprocess", request.request_id)
        return request, 0

    def add_request(self, request: Request, wave: int) -> None:
        self._on_thread("add", request.request_id)
        self.running[request.request_id] = [request.tokens, 0]

    def abort_requests(self, request_ids: list[str]) -> None:
        self._on_thread("abort", *request_ids)
        for request_id in request_ids:
            self.running.pop(request_id, None)

    def step_fn(self) -> tuple[dict[int, Outputs], bool]:
        self._on_thread("step")
        self.steps += 1
        outputs = []
        for request_id, progress in list(self.running.items()):
            progress[1] += 1
            finished = progress[1] == progress[0]
            outputs.append(Output(request_id, progress[1], finished))
            if finished:
                del self.running[request_id]
        return {0: Outputs(outputs)}, bool(outputs)

    def post_step(self, model_executed: bool) -> None:
        self._on_thread("post_step", model_executed)

    def sleep(self, level: int, mode: str) -> None:
        self._on_thread("sleep", level, mode)

    def wake_up(self, tags: list[str] | None) -> None:
        self._on_thread("wake_up", tags)

    def shutdown(self) -> None:
        self.shut = True


async def serve_requests(client: InprocAsyncClient, requests: dict[str, int]) -> dict[str, list[int]]:
    """Add requests and collect their tokens the way AsyncLLM's output handler does."""
    tokens: dict[str, list[int]] = {request_id: [] for request_id in requests}
    for request_id, count in requests.items():
        await client.add_request_async(Request(request_id, count))
    unfinished = set(requests)
    while unfinished:
        outputs = await asyncio.wait_for(client.get_output_async(), timeout=10)
        for output in outputs.outputs:
            tokens[output.request_id].append(output.token)
            if output.finished:
                unfinished.discard(output.request_id)
    return tokens


def core_threads() -> list[str]:
    return [thread.name for thread in threading.enumerate() if thread.name.startswith("vllm-core")]


def test_requests_from_two_event_loops_in_turn_run_on_one_core_thread() -> None:
    core = FakeCore()
    client = InprocAsyncClient(core)
    # Warm-up in a loop of its own, then serving in the next one, as before and after a checkpoint.
    assert asyncio.run(serve_requests(client, {"warm-up": 2})) == {"warm-up": [1, 2]}
    served = asyncio.run(serve_requests(client, {"a": 3, "b": 1}))
    assert served == {"a": [1, 2, 3], "b": [1]}
    assert len(core.threads) == 1 and next(iter(core.threads)).startswith("vllm-core")
    assert core.steps == 2 + 3  # stepped only while requests ran: the longest of each batch
    client.quiesce()
    assert core_threads() == []


def test_the_output_loop_waits_while_idle_and_wakes_for_a_new_request() -> None:
    core = FakeCore()
    client = InprocAsyncClient(core)

    async def scenario() -> list[int]:
        waiting = asyncio.ensure_future(client.get_output_async())
        await asyncio.sleep(0.05)  # an idle while: the claim is that nothing runs in it
        assert not waiting.done() and core.steps == 0  # no request: no step, no busy loop
        await client.add_request_async(Request("late", 1))
        outputs = await asyncio.wait_for(waiting, timeout=10)
        return [output.token for output in outputs.outputs]

    assert asyncio.run(scenario()) == [1]
    assert core.steps == 1  # the one step the request needed, none while idle
    client.quiesce()


def test_an_aborted_request_leaves_the_core_and_the_loop_idles() -> None:
    core = FakeCore()
    client = InprocAsyncClient(core)

    async def scenario() -> None:
        await client.add_request_async(Request("long", 100))
        first = await client.get_output_async()
        assert [output.token for output in first.outputs] == [1]
        await client.abort_requests_async(["long"])
        await client.abort_requests_async([])  # nothing to abort: the core is not called
        assert not core.has_requests()

    asyncio.run(scenario())
    assert [call for call in core.calls if call[0] == "abort"] == [("abort", ("long",))]
    client.quiesce()


def test_other_client_calls_are_the_core_methods_on_its_thread() -> None:
    core = FakeCore()
    client = InprocAsyncClient(core)
    asyncio.run(client.wake_up_async(["weights"]))
    asyncio.run(client.sleep_async(2, "abort"))
    asyncio.run(client.wake_up_async(tags=["kv_cache"]))  # keywords reach the core too
    assert core.calls == [("wake_up", (["weights"],)), ("sleep", (2, "abort")), ("wake_up", (["kv_cache"],))]
    assert len(core.threads) == 1
    with pytest.raises(ValueError, match="use 'abort'"):
        asyncio.run(client.sleep_async(1, "wait"))
    with pytest.raises(AttributeError):
        client.no_such_method  # noqa: B018
    assert client.engine_ranks_managed == [0] and client.dp_engines_running() is False
    client.shutdown()
    assert core.shut and client.resources.engine_dead
    assert core_threads() == []


class FakeFrontend:
    served_model_name = "tiny"

    def __init__(self) -> None:
        self.timings: dict[str, float] = {}
        self.registry = CollectorRegistry()
        Gauge("vllm:num_requests_running", "running", registry=self.registry).set(3)
        self.waiting = Gauge("vllm:num_requests_waiting", "waiting", ["engine"], registry=self.registry)
        self.waiting.labels("0").set(2)
        self.waiting.labels("1").set(5)
        self.builds = 0

    async def build_app(self) -> FastAPI:
        self.builds += 1
        self.timings["build_app_s"] = 0.0
        app = FastAPI()

        @app.get("/v1/models")
        async def models() -> dict[str, str]:
            return {"served_by": "the engine's own server"}

        return app

    async def app_for_serving(self) -> FastAPI:
        return await self.build_app()

    def metrics_registry(self) -> CollectorRegistry:
        return self.registry


def test_the_app_built_at_warm_up_is_the_one_served_and_only_once() -> None:
    """A restored copy serves the app built before the capture (nothing to build after the wake); a second
    serving loop in the same process gets a fresh app, never one an earlier loop has served."""
    loops: list[asyncio.AbstractEventLoop] = []

    class Frontend(VllmFrontend):
        async def _warm_up(self) -> None:
            loops.append(asyncio.get_running_loop())

        async def build_app(self) -> str:
            loops.append(asyncio.get_running_loop())
            return f"app {len(loops)}"

    frontend = Frontend(VllmOptions(model="tiny"), "tiny")
    frontend.llm = type("AsyncLLM", (), {"output_handler": None})()
    frontend.warm_up()
    assert len(loops) == 2 and loops[0] is not loops[1]  # warmed up, then built apart from the warm-up

    assert asyncio.run(frontend.app_for_serving()) == "app 2"
    assert len(loops) == 2
    assert asyncio.run(frontend.app_for_serving()) == "app 3"


@pytest.mark.parametrize(
    ("max_logprobs", "asked"), [(20, [0, 1, 2, 15, 20]), (2, [0, 1, 2]), (-1, [0, 1, 2, 15, 20])]
)
def test_the_warm_up_asks_each_logprobs_count_the_server_takes(max_logprobs: int, asked: list[int]) -> None:
    """A first request asking logprobs after a restore must not compile a kernel the captured process never
    ran: the warm-up asks each count vLLM compiles for, within the server's `max_logprobs`."""
    bodies: list[dict[str, Any]] = []
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(body: dict[str, Any]) -> dict[str, Any]:
        bodies.append(body)
        return {"choices": [{"token_ids": [7], "text": "x"}]}

    @app.post("/v1/chat/completions")
    async def chat(body: dict[str, Any]) -> dict[str, Any]:
        return {"choices": []}

    class Frontend(VllmFrontend):
        async def build_app(self) -> FastAPI:
            return app

    frontend = Frontend(VllmOptions(model="tiny"), "tiny")
    config = type("ModelConfig", (), {"max_logprobs": max_logprobs})()
    frontend.llm = type("AsyncLLM", (), {"output_handler": None, "model_config": config})()
    frontend.warm_up()
    assert [body.get("logprobs") for body in bodies] == [None, *asked]
    assert frontend.warm_up_answer == {"token_ids": [7], "text": "x"}  # the recorded answer is the plain one


def test_the_worker_load_gauges_follow_the_engine_scheduler_at_every_scrape() -> None:
    frontend, metrics = FakeFrontend(), WorkerMetrics()
    app = ServingApp(frontend, lambda: True, metrics)  # type: ignore[arg-type]

    async def scrape() -> str:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://worker") as http:
            return (await http.get("/metrics")).text

    text = asyncio.run(scrape())
    assert "warmstart_worker_requests_waiting 7.0" in text and "warmstart_worker_requests_running 3.0" in text
    frontend.waiting.labels("1").set(0)
    assert "warmstart_worker_requests_waiting 2.0" in asyncio.run(scrape())


def worker_metrics() -> WorkerMetrics:
    metrics = WorkerMetrics()
    metrics.start_seconds.labels("restore").set(1.5)
    return metrics


def test_the_serving_app_answers_ready_and_metrics_and_hands_the_rest_to_the_engine_server() -> None:
    frontend, ready = FakeFrontend(), threading.Event()
    app = ServingApp(frontend, ready.is_set, worker_metrics())  # type: ignore[arg-type]

    async def scenario() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://worker") as http:
            assert (await http.get("/ready")).status_code == 503
            assert (await http.get("/v1/models")).status_code == 503  # not built yet
            metrics = (await http.get("/metrics")).text
            assert 'warmstart_worker_start_seconds{mode="restore"} 1.5' in metrics
            assert "vllm:num_requests_running 3.0" in metrics
            await app.prepare()
            assert (await http.get("/ready")).status_code == 503  # built, but the worker is not serving
            ready.set()
            answer = await http.get("/ready")
            assert (answer.status_code, answer.json()) == (200, {"status": "ready", "model": "tiny"})
            assert (await http.get("/v1/models")).json() == {"served_by": "the engine's own server"}

    asyncio.run(scenario())
    assert frontend.builds == 1


def test_the_worker_serves_an_engine_own_app_when_it_has_one(caplog: pytest.LogCaptureFixture) -> None:
    built: list[Any] = []

    class EngineWithServer:
        served_model_name = "tiny"
        max_model_len = 64

        def serving_app(self, ready: Any, metrics: Any) -> Any:
            built.append(ServingApp(FakeFrontend(), ready, metrics))  # type: ignore[arg-type]
            return built[-1]

    runner = _HttpRunner(EngineWithServer())
    assert runner.app.app is built[0] and runner.prepare == built[0].prepare
    with caplog.at_level(logging.WARNING, "warmstart.worker.engine"):
        _HttpRunner(EngineWithServer(), request_limits=RequestLimits())  # the flags' defaults: nothing to say
        assert "do not apply" not in caplog.text
        _HttpRunner(EngineWithServer(), request_limits=RequestLimits(max_n=2))
    assert "--max-n" in caplog.text and "do not apply" in caplog.text

    class EngineWithout(EngineWithServer):
        def serving_app(self, ready: Any, metrics: Any) -> Any:
            return None

    assert isinstance(_HttpRunner(EngineWithout()).app, FastAPI)


def test_the_worker_counts_the_responses_of_an_engine_own_app() -> None:
    class EngineWithServer:
        served_model_name = "tiny"
        max_model_len = 64

        def serving_app(self, ready: Any, metrics: Any) -> Any:
            return ServingApp(FakeFrontend(), ready, metrics)  # type: ignore[arg-type]

    runner = _HttpRunner(EngineWithServer())
    runner.state.ready = True

    async def scenario() -> str:
        assert runner.prepare is not None
        await runner.prepare()
        transport = httpx.ASGITransport(app=runner.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://worker") as http:
            assert (await http.get("/v1/models")).status_code == 200
            assert (await http.get("/no/such/route")).status_code == 404
            assert (await http.get("/ready")).status_code == 200
            await http.get("/metrics")
            return (await http.get("/metrics")).text

    text = asyncio.run(scenario())
    for route, status in (("/v1/models", 200), ("unmatched", 404), ("/ready", 200), ("/metrics", 200)):
        assert f'warmstart_worker_requests_total{{route="{route}",status="{status}"}} 1.0' in text, route
    assert 'warmstart_worker_request_duration_seconds_count{route="/v1/models"} 1.0' in text
