"""vLLM's own OpenAI-compatible server in front of a checkpointable vLLM engine.

`VllmFrontend` builds what `vllm serve` builds (its argument namespace, `AsyncLLM`, the FastAPI app and
its state) with the engine core in this process (`inproc_client`), so the whole server is inside the one
process a checkpoint captures: every route vLLM serves (completions and chat with tools, logprobs,
`response_format`, `/v1/responses`, tokenize, `/metrics` with the `vllm:*` series) answers after a
restore, with the engine state it had at the capture.

Around a checkpoint the engine drives it synchronously (`sleep`, `wake_up`, `collective_rpc`: they run on
the core's thread); it warms up through its own app in a short-lived event loop before the capture, then
builds a second app for serving, which answers nothing before the capture, so nothing in it is bound to
that loop: a restored copy serves it from uvicorn's loop without building anything (`ServingApp.prepare`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from warmstart.engines.base import EngineError
from warmstart.engines.vllm.options import VllmOptions

log = logging.getLogger(__name__)

WARM_UP_ROUTES = ("/v1/completions", "/v1/chat/completions")
# The warm-up's completion; its answer travels in the snapshot (`describe()["warm_up"]`), so a restored
# replica can be asked the same and shown to answer as the process it was captured from did.
WARM_UP_COMPLETION = {
    "prompt": "warm up", "max_tokens": 16, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
}  # fmt: skip
# Top-logprobs counts asked once at warm-up: vLLM compiles its log-softmax kernel for each power of two of
# the count + 1 on first use (its own warm-up covers 5), and a restored engine compiled only what its
# captured process had; without these every restore's first request asking 2 compiled it (H200 logs).
LOGPROB_WARM_UPS = (0, 1, 2, 15, 20)
VLLM_WAITING = "vllm:num_requests_waiting"  # requests in vLLM's scheduler queue, per engine
VLLM_RUNNING = "vllm:num_requests_running"


class VllmFrontend:
    def __init__(self, options: VllmOptions, served_model_name: str, server_args: Sequence[str] = ()) -> None:
        self.options = options
        self.served_model_name = served_model_name
        self.server_args = tuple(server_args)
        self.args: Any = None
        self.llm: Any = None  # vLLM's AsyncLLM
        self.timings: dict[str, float] = {}
        self.warm_up_answer: dict[str, Any] = {}
        self._serving_app: Any = None  # built before the capture, taken by the serving loop

    def load(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        from warmstart.engines.vllm.inproc_client import inproc_engine_core

        _import_server()
        self.args = server_namespace(self.options, self.served_model_name, self.server_args)
        engine_args = AsyncEngineArgs.from_cli_args(self.args)
        config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
        with inproc_engine_core():
            self.llm = AsyncLLM.from_vllm_config(
                vllm_config=config,
                usage_context=UsageContext.OPENAI_API_SERVER,
                enable_log_requests=engine_args.enable_log_requests,
                disable_log_stats=engine_args.disable_log_stats,
            )

    # --- what the engine calls around a checkpoint (no event loop running) ---------------------------

    @property
    def model_config(self) -> Any:
        return self.llm.model_config

    def get_tokenizer(self) -> Any:
        return self.llm.get_tokenizer()

    def sleep(self, level: int) -> None:
        self.run(self.llm.sleep(level))
        self.llm.engine_core.quiesce()

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.run(self.llm.wake_up(tags))

    def collective_rpc(self, method: Any) -> list[Any]:
        return self.run(self.llm.collective_rpc(method))

    def reset_prefix_cache(self) -> None:
        self.run(self.llm.reset_prefix_cache())

    def run(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        """Run `coroutine` in a loop of its own; the engine then serves from whichever loop comes next."""
        try:
            return asyncio.run(coroutine)
        finally:
            self.llm.output_handler = None  # its task died with that loop; the next request starts one

    def warm_up(self) -> None:
        """Build the app and answer one request on each generation route, through vLLM's own code; then
        build the app the worker will serve (after a restore, too)."""
        started = time.perf_counter()
        self.run(self._warm_up())
        self.timings["warm_up_s"] = time.perf_counter() - started
        self._serving_app = self.run(self.build_app())

    async def app_for_serving(self) -> Any:
        """The app built for serving at warm-up (once); an app built now when there is none."""
        app, self._serving_app = self._serving_app, None
        return app if app is not None else await self.build_app()

    async def _warm_up(self) -> None:
        import httpx

        app = await self.build_app()
        body = {"model": self.served_model_name, "max_tokens": 4, "temperature": 0}
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://warm-up") as client:
            for route in WARM_UP_ROUTES:
                payload = {**body, "messages": [{"role": "user", "content": "warm up"}]} if "chat" in route \
                    else {**WARM_UP_COMPLETION, "model": self.served_model_name}  # fmt: skip
                answer = await client.post(route, json=payload)
                if answer.status_code != 200 and route == WARM_UP_ROUTES[0]:
                    raise EngineError(f"vLLM's server failed its warm-up on {route}: {answer.text[:500]}")
                if answer.status_code != 200:  # a model without a chat template serves no chat
                    log.info("warm-up: %s answered %d: %s", route, answer.status_code, answer.text[:200])
                elif route == WARM_UP_ROUTES[0]:
                    choice = answer.json()["choices"][0]
                    self.warm_up_answer = {"token_ids": choice.get("token_ids"), "text": choice.get("text")}
            for count in logprob_warm_ups(self.llm.model_config.max_logprobs):
                payload = {**body, "prompt": "warm up", "max_tokens": 1, "logprobs": count}
                answer = await client.post(WARM_UP_ROUTES[0], json=payload)
                if answer.status_code != 200:
                    log.info(
                        "warm-up: logprobs=%d answered %d: %s", count, answer.status_code, answer.text[:200]
                    )

    async def build_app(self) -> Any:
        """vLLM's FastAPI app with its state initialised in the running loop."""
        from vllm.entrypoints.openai.api_server import build_app, init_app_state

        started = time.perf_counter()
        tasks = await self.llm.get_supported_tasks()
        app = build_app(self.args, tasks, self.llm.model_config)
        await init_app_state(self.llm, app.state, self.args, tasks)
        self.timings["build_app_s"] = time.perf_counter() - started
        return app

    def shutdown(self) -> None:
        if self.llm is not None:
            self.llm.output_handler = None  # its loop (uvicorn's) has ended by now
            self.llm.shutdown()

    def metrics_registry(self) -> Any:
        from vllm.v1.metrics.prometheus import get_prometheus_registry

        return get_prometheus_registry()


def logprob_warm_ups(max_logprobs: int) -> list[int]:
    """The warm-up's logprobs counts the server takes (`max_logprobs` -1: any)."""
    return [count for count in LOGPROB_WARM_UPS if max_logprobs < 0 or count <= max_logprobs]


def _import_server() -> None:
    """Import vLLM's server now (before a checkpoint, not after resume), keeping the logging set-up:
    a package it imports sets the root logger to ERROR at import (SageMaker's container standards)."""
    root = logging.getLogger()
    levels = root.level, [(handler, handler.level) for handler in root.handlers]
    import vllm.entrypoints.openai.api_server  # noqa: F401

    root.setLevel(levels[0])
    for handler, level in levels[1]:
        handler.setLevel(level)


def server_namespace(options: VllmOptions, served_model_name: str, server_args: Sequence[str]) -> Any:
    """The argument namespace `vllm serve` would parse, with the engine options as warmstart set them."""
    from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve (in warmstart)"))
    try:
        args = parser.parse_args(["--model", options.model, *server_args])
    except SystemExit as exc:
        raise EngineError(f"vLLM's server refused its arguments {list(server_args)}") from exc
    for key, value in engine_overrides(options).items():
        setattr(args, key, value)
    args.served_model_name = [served_model_name]
    validate_parsed_serve_args(args)
    return args


def engine_overrides(options: VllmOptions) -> dict[str, Any]:
    """Engine args warmstart owns, over anything the server args said (vLLM's `EngineArgs` turns the JSON
    ones, `compilation_config`, into its config objects itself)."""
    return {**options.llm_kwargs(), "disable_log_stats": False}  # log stats: the vllm:* series


class ServingApp:
    """The ASGI app a worker serves: `/ready` and `/metrics` (the worker's series, then vLLM's) answered
    here, everything else by vLLM's app, which `prepare()` builds in the serving loop.

    `metrics` is the worker's (its `registry`, its load gauges): the gauges autoscalers read follow vLLM's
    scheduler (`vllm:num_requests_waiting`, `vllm:num_requests_running`) at every scrape."""

    def __init__(self, frontend: VllmFrontend, ready: Callable[[], bool], metrics: Any) -> None:
        self._frontend = frontend
        self._ready = ready
        self._metrics = metrics
        self._inner: Any = None

    async def prepare(self) -> None:
        started = time.perf_counter()
        self._inner = await self._frontend.app_for_serving()
        log.info("vLLM's server ready to bind in %.3f s", time.perf_counter() - started)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path == "/ready":
            await self._answer(send, *self._ready_answer())
        elif path == "/metrics":
            await self._answer(send, 200, self._metrics_text(), b"text/plain; version=0.0.4; charset=utf-8")
        elif self._inner is None:
            await self._answer(send, 503, b'{"status": "starting"}')
        else:
            await self._inner(scope, receive, send)

    def _ready_answer(self) -> tuple[int, bytes]:
        if self._ready() and self._inner is not None:
            return 200, json.dumps({"status": "ready", "model": self._frontend.served_model_name}).encode()
        return 503, b'{"status": "starting"}'

    def _metrics_text(self) -> bytes:
        from prometheus_client import generate_latest

        engine_registry = self._frontend.metrics_registry()
        self._metrics.requests_waiting.set(_sample_sum(engine_registry, VLLM_WAITING))
        self._metrics.requests_running.set(_sample_sum(engine_registry, VLLM_RUNNING))
        return generate_latest(self._metrics.registry) + generate_latest(engine_registry)

    @staticmethod
    async def _answer(send: Any, status: int, body: bytes, content_type: bytes = b"application/json") -> None:
        headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _sample_sum(registry: Any, name: str) -> float:
    """The sum of a series' samples over its labels (0 when the registry has none)."""
    return sum(
        sample.value for metric in registry.collect() for sample in metric.samples if sample.name == name
    )
