"""How the worker's HTTP API answers an engine that fails part-way through a generation."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from warmstart.api.identity import SnapshotIdentity
from warmstart.engines.base import (
    Engine,
    EngineError,
    GenerationRequest,
    GenerationResult,
    RequestError,
    TokenDelta,
)
from warmstart.worker.metrics import WorkerMetrics
from warmstart.worker.server import ServerState, build_app


class FailingEngine(Engine):
    """Streams `good_tokens` tokens, then raises `error`."""

    kind = "failing"

    def __init__(self, error: Exception, good_tokens: int) -> None:
        self.error = error
        self.good_tokens = good_tokens

    @property
    def served_model_name(self) -> str:
        return "tiny"

    @property
    def max_model_len(self) -> int:
        return 64

    def load(self) -> None: ...

    def warm_up(self) -> None: ...

    def release(self) -> bool:
        return False

    def reacquire(self) -> None: ...

    def identity(self) -> SnapshotIdentity:
        raise NotImplementedError

    def count_prompt_tokens(self, request: GenerationRequest) -> int:
        return len((request.prompt or "").split())

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        raise self.error

    def stream(self, request: GenerationRequest) -> Iterator[TokenDelta]:
        for index in range(self.good_tokens):
            yield TokenDelta(f" t{index}", (index,), prompt_tokens=2)
        raise self.error


ENGINE_FAILURES = [
    pytest.param(EngineError("the device is gone"), 503, id="engine-error"),
    pytest.param(RequestError("token 9 is out of range", "prompt"), 400, id="request-error"),
]
BODY = {"model": "tiny", "prompt": "once upon", "max_tokens": 8}


def client(error: Exception, good_tokens: int) -> TestClient:
    return TestClient(build_app(FailingEngine(error, good_tokens), WorkerMetrics(), ServerState(ready=True)))


def error_body(error: Exception) -> dict:
    """The OpenAI-style error body the worker answers `error` with."""
    kind = "invalid_request_error" if isinstance(error, RequestError) else "server_error"
    param = getattr(error, "param", None)
    return {"error": {"message": str(error), "type": kind, "param": param, "code": None}}


@pytest.mark.parametrize("good_tokens", [0, 3])
@pytest.mark.parametrize(("error", "status"), ENGINE_FAILURES)
def test_an_engine_failure_on_any_token_is_answered_like_the_first(error, status, good_tokens):
    response = client(error, good_tokens).post("/v1/completions", json=BODY)
    assert response.status_code == status
    assert response.json() == error_body(error)


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("error", [p.values[0] for p in ENGINE_FAILURES], ids=[p.id for p in ENGINE_FAILURES])
def test_a_stream_that_fails_after_its_first_token_ends_with_an_error_event(error, chat):
    path, body = "/v1/completions", {**BODY, "stream": True}
    if chat:
        chat_body = {key: value for key, value in body.items() if key != "prompt"}  # chat takes no prompt
        path, body = "/v1/chat/completions", {**chat_body, "messages": [{"role": "user", "content": "hi"}]}
    with client(error, good_tokens=2).stream("POST", path, json=body) as response:
        assert response.status_code == 200  # the headers went out with the first token
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2]) == error_body(error)  # the error type tells a 400 from a 503
    chunks = [json.loads(event) for event in events[:-2]]
    texts = [c["choices"][0].get("text", c["choices"][0].get("delta", {}).get("content")) for c in chunks]
    assert [text for text in texts if text] == [" t0", " t1"]


@pytest.mark.parametrize(("error", "status"), ENGINE_FAILURES)
def test_a_stream_refused_on_its_first_token_is_still_an_http_error(error, status):
    response = client(error, good_tokens=0).post("/v1/completions", json={**BODY, "stream": True})
    assert response.status_code == status
    assert response.json() == error_body(error)
