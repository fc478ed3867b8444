"""The worker's OpenAI-compatible HTTP API (FastAPI), started only after the engine is resumed.

Routes: /v1/models and /v1/models/{id}, /v1/completions, /v1/chat/completions (both with `stream: true` as
server-sent events, `stream_options.include_usage` honoured), /health (process alive), /ready (engine
serving), /metrics (Prometheus), /openapi.json (FastAPI's, from the request models). Bad requests get 400
with an OpenAI-style error body naming the field (413 for an oversized body), a parameter the engine does not
honour included; an unknown model gets 404; /v1/responses gets a 400 saying it is not implemented. Every
response, errors included, is counted in the metrics. A client that disconnects stops its generation: the
engine stream is closed. Request bodies are parsed and validated in a thread, never on the event loop that
answers /health and /ready (`_off_loop`).
"""

# No `from __future__ import annotations`: FastAPI reads the routes' annotations, and the request models
# they name are built per app (their bounds are the app's RequestLimits).
import asyncio
import contextlib
import dataclasses
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import anyio.to_thread
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from warmstart.engines.base import (
    Engine,
    EngineError,
    GenerationRequest,
    GenerationResult,
    RequestError,
    TokenDelta,
)
from warmstart.worker.metrics import GenerationTracker, WorkerMetrics
from warmstart.worker.openai_requests import (
    ApiError,
    ErrorBody,
    ParsedRequest,
    RequestLimits,
    body_too_large,
    invalid_request,
    parse_body,
    parsed_request,
    request_models,
)

log = logging.getLogger("warmstart.worker.server")

CLIENT_GONE = 499  # the status a request is counted with when its client left before the answer
WORKER_PATHS = ("/ready", "/metrics")
T = TypeVar("T")


def _error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


@dataclass
class ServerState:
    ready: bool = False


class CountResponses:
    """Counts every response by route and status, and answers an unexpected exception with an OpenAI-style
    500 (still counted) instead of a bare one."""

    def __init__(self, app: ASGIApp, metrics: WorkerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status: int | None = None

        async def send_counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        except Exception:
            log.exception("unexpected error answering %s %s", scope.get("method"), scope.get("path"))
            if status is None:
                await _error_response(ApiError(500, "internal error in the worker"))(scope, receive, send)
                status = 500
        finally:
            # A request no route matched: the worker's own paths, answered beside an engine's app, by name;
            # anything else as one label, so unknown paths cannot grow the series.
            unrouted = scope.get("path") if scope.get("path") in WORKER_PATHS else "unmatched"
            path = getattr(scope.get("route"), "path", None) or unrouted
            self.metrics.requests.labels(path, str(status or CLIENT_GONE)).inc()
            self.metrics.latency.labels(path).observe(time.perf_counter() - started)


def build_app(
    engine: Engine, metrics: WorkerMetrics, state: ServerState, limits: RequestLimits | None = None
) -> FastAPI:
    limits = limits or RequestLimits()
    app = FastAPI(title="warmstart worker", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.request_limits = limits
    app.state.parsing = parsing = anyio.CapacityLimiter(1)
    app.add_middleware(CountResponses, metrics=metrics)
    api = _Api(engine, metrics, limits, parsing)
    models = request_models(limits)

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, error: ApiError) -> JSONResponse:
        return _error_response(error)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_request: Request, error: RequestValidationError) -> JSONResponse:
        return _error_response(invalid_request(error.errors(), skip=1))  # skip FastAPI's "body"

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, error: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if error.status_code == 404 else None
        return _error_response(ApiError(error.status_code, str(error.detail), None, code))

    generation = APIRouter(route_class=_CheckedJsonRoute, responses=ERROR_RESPONSES)

    @generation.post("/v1/completions")
    async def completions(request: Request, body: models.completion) -> Response:
        return await api.complete(request, body, chat=False)

    @generation.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: models.chat) -> Response:
        return await api.complete(request, body, chat=True)

    app.include_router(generation)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        if state.ready:
            return JSONResponse({"status": "ready", "model": engine.served_model_name})
        return JSONResponse({"status": "starting"}, status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict[str, Any]:
        return {
            "id": engine.served_model_name,
            "object": "model",
            "created": api.created,
            "owned_by": "warmstart",
            "max_model_len": engine.max_model_len,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get(
        "/v1/models/{model:path}", responses={"4XX": {"model": ErrorBody, "description": "an unknown model"}}
    )
    async def model(model: str) -> dict[str, Any]:
        if model != engine.served_model_name:
            raise _model_not_found(model, engine.served_model_name)
        return model_card()

    @app.api_route("/v1/responses", methods=["GET", "POST", "DELETE"], include_in_schema=False)
    @app.api_route("/v1/responses/{rest:path}", methods=["GET", "POST", "DELETE"], include_in_schema=False)
    async def responses() -> Response:
        # A 400, not a 501: OpenAI clients retry 5xx answers, and retrying cannot help here.
        raise ApiError(
            400,
            "this worker does not implement the Responses API (/v1/responses); use /v1/chat/completions",
            code="unsupported_endpoint",
        )

    return app


CLIENT_ERRORS = (
    "400: a bad request (error.param names the field); "
    "404: an unknown model; 408, 413: a body too slow, too big"
)
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": ErrorBody, "description": CLIENT_ERRORS},
    "5XX": {"model": ErrorBody, "description": "the engine failed"},
}


async def _off_loop(parsing: anyio.CapacityLimiter, work: Callable[..., T], *args: Any) -> T:
    """Run `work` (parsing or validating a request) in a thread, one at a time.

    Never on the event loop: that loop answers /health and /ready, and a body at the size limit takes up to
    a second to parse and validate; a few clients sending such bodies kept every probe waiting past its
    timeout. One at a time: a parse holds the GIL through each of its C calls (json.loads, pydantic), and
    the loop would wait behind every parsing thread to get it back. Clients then queue for parsing, not the
    probes."""
    return await anyio.to_thread.run_sync(work, *args, limiter=parsing)


class _CheckedJsonRoute(APIRoute):
    """A route whose body the worker reads, parses and validates against the route's model itself, off the
    event loop (`_off_loop`): its size, its nesting, lone surrogates, a client that leaves mid-body. FastAPI
    is handed the model instance, which it takes as it is."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        answer = super().get_route_handler()
        assert self.body_field is not None, "a checked route takes a body"
        model: type[BaseModel] = self.body_field.field_info.annotation  # type: ignore[assignment]

        async def handler(request: Request) -> Response:
            limits: RequestLimits = request.app.state.request_limits
            try:
                raw = await _read_body(request, limits)
            except ClientDisconnect:  # the client left, or its body was too slow and the connection closed
                return Response(status_code=CLIENT_GONE)
            body = await _off_loop(request.app.state.parsing, parse_body, raw, model, limits)
            return await answer(_ReadRequest(request, raw, body))

        return handler


class _ReadRequest(Request):
    """A request whose body is read and validated already: FastAPI takes it from here, whatever
    Content-Type the client sent (the API never required one)."""

    def __init__(self, request: Request, raw: bytes, parsed: BaseModel) -> None:
        headers = [(name, value) for name, value in request.scope["headers"] if name != b"content-type"]
        headers.append((b"content-type", b"application/json"))
        super().__init__({**request.scope, "headers": headers}, request.receive)
        self._raw, self._parsed = raw, parsed

    async def body(self) -> bytes:
        return self._raw

    async def json(self) -> Any:
        return self._parsed


async def _read_body(request: Request, limits: RequestLimits) -> bytes:
    """The body, refused with a 413 as soon as it is known to exceed the limit (before reading it, when its
    Content-Length says so). The connection bounds how long it may take to arrive (`connections`)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limits.max_body_bytes:
        raise body_too_large(limits)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limits.max_body_bytes:
            raise body_too_large(limits)
    return bytes(body)


def _model_not_found(model: str, served: str) -> ApiError:
    return ApiError(
        404, f"The model `{model}` does not exist; this worker serves `{served}`.", "model", "model_not_found"
    )


async def _client_gone(request: Request) -> None:
    """Returns once the client has disconnected (the body must have been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Cancelled(Exception):
    """The client went away; the generation was stopped."""


@dataclass
class _Api:
    engine: Engine
    metrics: WorkerMetrics
    limits: RequestLimits
    parsing: anyio.CapacityLimiter
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    async def complete(self, http_request: Request, body: BaseModel, chat: bool) -> Response:
        parsed, requests, prompt_tokens = await _off_loop(self.parsing, self._prepare, body, chat)
        reply = _Reply(chat, self.engine.served_model_name)
        if parsed.stream:
            return await self._stream(http_request, requests[0], reply, parsed.include_usage, prompt_tokens)
        self.metrics.prompt_tokens.inc(prompt_tokens)
        stop = threading.Event()
        work = asyncio.ensure_future(run_in_threadpool(self._generate, requests, stop))
        gone = asyncio.ensure_future(_client_gone(http_request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            stop.set()  # no-op once the work is done; after a disconnect, stops it at its next token
        try:
            results = await work
        except _Cancelled:
            return Response(status_code=CLIENT_GONE)
        return JSONResponse(reply.full(results, prompt_tokens, parsed.return_token_ids))

    def _prepare(self, body: BaseModel, chat: bool) -> tuple[ParsedRequest, list[GenerationRequest], int]:
        """What to generate for a validated body (its prompts tokenized and fitted to the context)."""
        parsed = parsed_request(body, chat, self.limits)
        if parsed.model != self.engine.served_model_name:
            raise _model_not_found(parsed.model, self.engine.served_model_name)
        prompts = (
            [{"prompt": self.engine.chat_prompt(parsed.messages)}] if parsed.messages else parsed.prompts
        )
        requests: list[GenerationRequest] = []
        prompt_tokens = 0
        for prompt in prompts:
            request = GenerationRequest(sampling=parsed.sampling, **prompt)
            count, fitted = self._fit(request, parsed.max_tokens_param, chat)
            prompt_tokens += count
            requests += [dataclasses.replace(fitted, request_id=uuid.uuid4().hex) for _ in range(parsed.n)]
        return parsed, requests, prompt_tokens

    def _generate(self, requests: list[GenerationRequest], stop: threading.Event) -> list[GenerationResult]:
        """Run every choice through engine.stream() (so it can be stopped between tokens), all submitted
        before any is read to the end so they batch together."""
        started = time.perf_counter()
        with contextlib.ExitStack() as stack:
            trackers = [stack.enter_context(self.metrics.generation()) for _ in requests]
            streams = [stack.enter_context(contextlib.closing(self.engine.stream(r))) for r in requests]
            firsts = [
                self._first_delta(stream, tracker, stop)
                for stream, tracker in zip(streams, trackers, strict=True)
            ]
            self.metrics.time_to_first_token.observe(time.perf_counter() - started)
            return [
                _merge(request.request_id, self._drain(first, stream, stop))
                for request, first, stream in zip(requests, firsts, streams, strict=True)
            ]

    def _first_delta(
        self, stream: Iterator[TokenDelta], tracker: GenerationTracker, stop: threading.Event
    ) -> TokenDelta:
        delta = self._next(stream, stop)
        if delta is None:
            raise ApiError(503, "the engine ended a generation without output")
        tracker.started()
        return delta

    def _drain(
        self, first: TokenDelta, stream: Iterator[TokenDelta], stop: threading.Event
    ) -> list[TokenDelta]:
        deltas = [first]
        while deltas[-1].finish_reason is None and (delta := self._next(stream, stop)) is not None:
            deltas.append(delta)
        return deltas

    def _next(self, stream: Iterator[TokenDelta], stop: threading.Event) -> TokenDelta | None:
        if stop.is_set():
            self.metrics.requests_cancelled.inc()
            raise _Cancelled()
        try:
            delta = next(stream, None)
        except RequestError as exc:
            raise ApiError(400, str(exc), exc.param) from None
        except EngineError as exc:
            raise ApiError(503, str(exc)) from None
        if delta is not None:
            self.metrics.completion_tokens.inc(len(delta.token_ids))
        return delta

    async def _stream(
        self,
        http_request: Request,
        request: GenerationRequest,
        reply: "_Reply",
        include_usage: bool,
        prompt_tokens: int,
    ) -> StreamingResponse:
        started = time.perf_counter()
        never = threading.Event()
        with contextlib.ExitStack() as setup:
            tracker = setup.enter_context(self.metrics.generation())
            stream = setup.enter_context(contextlib.closing(self.engine.stream(request)))
            # The first token before answering, so a request the engine refuses still gets an HTTP error.
            first = await run_in_threadpool(self._first_delta, stream, tracker, never)
            self.metrics.time_to_first_token.observe(time.perf_counter() - started)
            self.metrics.prompt_tokens.inc(prompt_tokens)
            owned = setup.pop_all()  # from here the event stream closes the engine stream and the tracker

        async def events() -> AsyncIterator[str]:
            completion_tokens = 0
            with owned:
                try:
                    for text in reply.stream_start():
                        yield text
                    delta: TokenDelta | None = first
                    while delta is not None:
                        completion_tokens += len(delta.token_ids)
                        yield reply.chunk(delta)
                        if delta.finish_reason is not None:
                            break
                        delta = await run_in_threadpool(self._next, stream, never)
                except ApiError as error:  # the 200 is out: the error is the last event
                    yield _sse(error.body())
                except asyncio.CancelledError:  # the client went away
                    self.metrics.requests_cancelled.inc()
                    raise
                if include_usage:
                    yield reply.usage_chunk(prompt_tokens, completion_tokens)
                yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    def _fit(
        self, request: GenerationRequest, max_tokens_param: str, chat: bool
    ) -> tuple[int, GenerationRequest]:
        """Check the prompt plus output fits the model, resolving a defaulted max_tokens to what fits."""
        try:
            count = self.engine.count_prompt_tokens(request)
        except RequestError as exc:
            raise ApiError(400, str(exc), exc.param) from None
        prompt_param = "messages" if chat else "prompt"
        limit = self.engine.max_model_len
        if count == 0 or (request.prompt is not None and not request.prompt):
            raise ApiError(400, f"{prompt_param} must not be empty", prompt_param)
        if count >= limit:
            raise ApiError(
                400,
                f"{prompt_param} has {count} tokens; this model's context is {limit} tokens "
                f"(the prompt must leave room for at least one output token)",
                prompt_param,
            )
        room = limit - count
        wanted = request.sampling.max_tokens
        if wanted < 0:  # defaulted: as many as asked by default, at most what fits
            sampling = dataclasses.replace(request.sampling, max_tokens=min(-wanted, room))
            return count, dataclasses.replace(request, sampling=sampling)
        if wanted > room:
            message = (
                f"{max_tokens_param} is {wanted}, but the prompt has {count} tokens and this model's context "
                f"is {limit}: at most {room} can be generated"
            )
            raise ApiError(400, message, max_tokens_param)
        return count, request


class _Reply:
    """Builds OpenAI response bodies and stream chunks for completions or chat completions."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.model = model
        self.created = int(time.time())
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.chunk_kind = "chat.completion.chunk" if chat else "text_completion"

    def full(self, results: list[GenerationResult], prompt_tokens: int, token_ids: bool) -> dict[str, Any]:
        completion_tokens = sum(len(result.token_ids) for result in results)
        choices = [self._choice(index, result, token_ids) for index, result in enumerate(results)]
        return {
            **self._head("chat.completion" if self.chat else "text_completion"),
            "choices": choices,
            "usage": _usage(prompt_tokens, completion_tokens),
        }

    def stream_start(self) -> Iterator[str]:
        if self.chat:
            choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            yield _sse({**self._head(self.chunk_kind), "choices": [choice]})

    def chunk(self, delta: TokenDelta) -> str:
        if self.chat:
            content = {"content": delta.text} if delta.text or delta.finish_reason is None else {}
            choice = {"index": 0, "delta": content, "finish_reason": delta.finish_reason}
        else:
            choice = {"index": 0, "text": delta.text, "logprobs": None, "finish_reason": delta.finish_reason}
        return _sse({**self._head(self.chunk_kind), "choices": [choice]})

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> str:
        """The last chunk of a stream asked for with stream_options.include_usage: no choices, the usage."""
        usage = _usage(prompt_tokens, completion_tokens)
        return _sse({**self._head(self.chunk_kind), "choices": [], "usage": usage})

    def _choice(self, index: int, result: GenerationResult, token_ids: bool) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": result.text}
        else:
            choice.update(text=result.text, logprobs=None)
        choice["finish_reason"] = result.finish_reason
        if token_ids:
            choice["token_ids"] = list(result.token_ids)
        return choice

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _merge(request_id: str, deltas: list[TokenDelta]) -> GenerationResult:
    last = deltas[-1]
    return GenerationResult(
        request_id=request_id,
        text="".join(delta.text for delta in deltas),
        token_ids=tuple(token for delta in deltas for token in delta.token_ids),
        prompt_tokens=last.prompt_tokens,
        finish_reason=last.finish_reason or "length",
    )


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    total = prompt_tokens + completion_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": total}
