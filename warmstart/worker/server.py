"""The worker's OpenAI-compatible HTTP API (FastAPI), started only after the engine is resumed.

Routes: /v1/models, /v1/completions, /v1/chat/completions (both with `stream: true` as server-sent events),
/health (process alive), /ready (engine serving), /metrics (Prometheus). Bad requests get 400 with an
OpenAI-style error body naming the field; an unknown model gets 404.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool

from warmstart.engines.base import (
    Engine,
    EngineError,
    GenerationRequest,
    GenerationResult,
    RequestError,
    SamplingParams,
    TokenDelta,
)
from warmstart.worker.metrics import WorkerMetrics

DEFAULT_COMPLETION_TOKENS = 16
DEFAULT_CHAT_TOKENS = 256
MAX_STOP_STRINGS = 4
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


@contextlib.contextmanager
def _engine_errors() -> Iterator[None]:
    """Engine failures as API errors: a request the engine refuses is a 400, an engine that fails a 503."""
    try:
        yield
    except RequestError as exc:
        raise ApiError(400, str(exc), exc.param) from None
    except EngineError as exc:
        raise ApiError(503, str(exc)) from None


@dataclass
class ServerState:
    ready: bool = False


def build_app(engine: Engine, metrics: WorkerMetrics, state: ServerState) -> FastAPI:
    app = FastAPI(title="warmstart worker", docs_url=None, redoc_url=None, openapi_url=None)
    api = _Api(engine, metrics)

    @app.middleware("http")
    async def count_requests(request: Request, call_next: Callable[..., Any]) -> Response:
        started = time.perf_counter()
        response = await call_next(request)
        route = request.scope.get("route")
        path = getattr(route, "path", "unmatched")
        metrics.requests.labels(path, str(response.status_code)).inc()
        metrics.latency.labels(path).observe(time.perf_counter() - started)
        return response

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, error: ApiError) -> JSONResponse:
        return error.response()

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

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": engine.served_model_name,
            "object": "model",
            "created": api.created,
            "owned_by": "warmstart",
            "max_model_len": engine.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await api.complete(await _json_body(request), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await api.complete(await _json_body(request), chat=True)

    return app


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body() or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


class _Api:
    def __init__(self, engine: Engine, metrics: WorkerMetrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self.created = int(time.time())

    async def complete(self, body: dict[str, Any], chat: bool) -> Response:
        model = _field(body, "model", str, required=True)
        if model != self.engine.served_model_name:
            raise ApiError(
                404,
                f"The model `{model}` does not exist; this worker serves `{self.engine.served_model_name}`.",
                "model",
                "model_not_found",
            )
        prompts = self._chat_prompt(body) if chat else self._prompts(body)
        sampling = self._sampling(body, chat)
        n = _field(body, "n", int, default=1)
        if n < 1:
            raise ApiError(400, f"n must be at least 1, got {n}", "n")
        stream = _field(body, "stream", bool, default=False)
        if stream and len(prompts) * n != 1:
            raise ApiError(400, "stream: true supports one prompt and n = 1", "stream")
        requests: list[GenerationRequest] = []
        prompt_tokens = 0
        for prompt in prompts:
            count, fitted = self._fit(GenerationRequest(sampling=sampling, **prompt), body, chat)
            prompt_tokens += count
            requests += [dataclasses.replace(fitted, request_id=uuid.uuid4().hex) for _ in range(n)]
        self.metrics.prompt_tokens.inc(prompt_tokens)
        reply = _Reply(chat, self.engine.served_model_name)
        if stream:
            return await self._stream(requests[0], reply)
        results = await run_in_threadpool(self._generate, requests)
        self.metrics.completion_tokens.inc(sum(len(result.token_ids) for result in results))
        return JSONResponse(reply.full(results, prompt_tokens))

    def _generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        with _engine_errors():
            if len(requests) == 1:  # through stream() so the first token's time is known
                started = time.perf_counter()
                deltas = list(self._timed(self.engine.stream(requests[0]), started))
                return [_merge(requests[0].request_id, deltas)]
            return self.engine.generate(requests)

    def _timed(self, deltas: Iterator[TokenDelta], started: float) -> Iterator[TokenDelta]:
        with _engine_errors():
            first = next(deltas)
        self.metrics.time_to_first_token.observe(time.perf_counter() - started)
        return itertools.chain([first], deltas)

    async def _stream(self, request: GenerationRequest, reply: _Reply) -> StreamingResponse:
        started = time.perf_counter()
        # Pull the first token before answering, so a request the engine refuses still gets a 400.
        deltas = await run_in_threadpool(self._timed, self.engine.stream(request), started)

        def events() -> Iterator[str]:
            yield from reply.stream_start()
            try:
                with _engine_errors():
                    for delta in deltas:
                        self.metrics.completion_tokens.inc(len(delta.token_ids))
                        yield reply.chunk(delta)
            except ApiError as error:  # the 200 went out with the first token: the error is the last event
                yield _sse(error.body())
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    def _prompts(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        prompt = body.get("prompt")
        if prompt is None:
            raise ApiError(400, "prompt is required", "prompt")
        if isinstance(prompt, str):
            return [{"prompt": prompt}]
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            return [{"prompt": p} for p in prompt]
        if isinstance(prompt, list) and prompt and all(_is_int(p) for p in prompt):
            return [{"prompt_token_ids": tuple(prompt)}]
        raise ApiError(
            400, "prompt must be a non-empty string, a list of strings or a list of token ids", "prompt"
        )

    def _chat_prompt(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages must be a non-empty list of {role, content} objects", "messages")
        turns = [_chat_turn(message, index) for index, message in enumerate(messages)]
        return [{"prompt": self.engine.chat_prompt(turns)}]

    def _sampling(self, body: dict[str, Any], chat: bool) -> SamplingParams:
        default_tokens = DEFAULT_CHAT_TOKENS if chat else DEFAULT_COMPLETION_TOKENS
        name = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
        max_tokens = _field(body, name, int, default=None)
        temperature = float(_field(body, "temperature", (int, float), default=1.0))
        top_p = float(_field(body, "top_p", (int, float), default=1.0))
        if not 0.0 <= temperature <= 2.0:
            raise ApiError(400, f"temperature must be between 0 and 2, got {temperature}", "temperature")
        if not 0.0 < top_p <= 1.0:
            raise ApiError(400, f"top_p must be in (0, 1], got {top_p}", "top_p")
        if max_tokens is not None and max_tokens < 1:
            raise ApiError(400, f"{name} must be at least 1, got {max_tokens}", name)
        return SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else -default_tokens,  # negative: a default
            temperature=temperature,
            top_p=top_p,
            seed=_seed(body),
            stop=_stop_strings(body.get("stop")),
            ignore_eos=_field(body, "ignore_eos", bool, default=False),
        )

    def _fit(
        self, request: GenerationRequest, body: dict[str, Any], chat: bool
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
            name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
            message = (
                f"{name} is {wanted}, but the prompt has {count} tokens and this model's context is {limit}: "
                f"at most {room} can be generated"
            )
            raise ApiError(400, message, name)
        return count, request


class _Reply:
    """Builds OpenAI response bodies and stream chunks for completions or chat completions."""

    def __init__(self, chat: bool, model: str) -> None:
        self.chat = chat
        self.model = model
        self.created = int(time.time())
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex

    def full(self, results: list[GenerationResult], prompt_tokens: int) -> dict[str, Any]:
        completion_tokens = sum(len(result.token_ids) for result in results)
        choices = [
            self._choice(index, result.text, result.finish_reason) for index, result in enumerate(results)
        ]
        return {
            **self._head("chat.completion" if self.chat else "text_completion"),
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }

    def stream_start(self) -> Iterator[str]:
        if self.chat:
            choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            yield _sse({**self._head("chat.completion.chunk"), "choices": [choice]})

    def chunk(self, delta: TokenDelta) -> str:
        if self.chat:
            content = {"content": delta.text} if delta.text or delta.finish_reason is None else {}
            choice = {"index": 0, "delta": content, "finish_reason": delta.finish_reason}
            return _sse({**self._head("chat.completion.chunk"), "choices": [choice]})
        choice = {"index": 0, "text": delta.text, "logprobs": None, "finish_reason": delta.finish_reason}
        return _sse({**self._head("text_completion"), "choices": [choice]})

    def _choice(self, index: int, text: str, finish_reason: str) -> dict[str, Any]:
        if self.chat:
            message = {"role": "assistant", "content": text}
            return {"index": index, "message": message, "finish_reason": finish_reason}
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}

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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _type_name(kind: type | tuple[type, ...]) -> str:
    names = {str: "a string", int: "an integer", float: "a number", bool: "a boolean"}
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return "a number" if float in kinds else " or ".join(names.get(k, k.__name__) for k in kinds)


def _field(
    body: dict[str, Any],
    name: str,
    kind: type | tuple[type, ...],
    required: bool = False,
    default: Any = None,
) -> Any:
    if name not in body or body[name] is None:
        if required:
            raise ApiError(400, f"{name} is required", name)
        return default
    value = body[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    is_bool = isinstance(value, bool)
    if not isinstance(value, kinds) or (is_bool and bool not in kinds):
        raise ApiError(400, f"{name} must be {_type_name(kind)}, got {json.dumps(value)[:80]}", name)
    return value


def _chat_turn(message: Any, index: int) -> dict[str, str]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise ApiError(400, f"{where} must be an object with role and content", where)
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise ApiError(
            400, f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {role!r}", f"{where}.role"
        )
    content = message.get("content")
    if isinstance(content, list):  # content parts: keep the text ones
        texts = [
            part.get("text") for part in content if isinstance(part, dict) and part.get("type") == "text"
        ]
        if len(texts) != len(content) or not all(isinstance(text, str) for text in texts):
            raise ApiError(
                400, f"{where}.content parts must all be {{type: text, text: string}}", f"{where}.content"
            )
        content = "".join(texts)
    if not isinstance(content, str):
        raise ApiError(400, f"{where}.content must be a string", f"{where}.content")
    return {"role": role, "content": content}


def _seed(body: dict[str, Any]) -> int | None:
    seed = _field(body, "seed", int, default=None)
    if seed is not None and not 0 <= seed < 2**63:
        raise ApiError(400, f"seed must be between 0 and 2**63 - 1, got {seed}", "seed")
    return seed


def _stop_strings(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "stop must be a non-empty string or a list of non-empty strings", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise ApiError(400, f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}", "stop")
    return tuple(stop)
