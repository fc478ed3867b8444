"""The request models at their edges: no type coercion, the same answer whichever way a body is validated,
and the limits in the OpenAPI document that FastAPI generates from them."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient
from test_worker_errors import FailingEngine

from warmstart.engines.base import EngineError
from warmstart.worker.metrics import WorkerMetrics
from warmstart.worker.openai_requests import ApiError, RequestLimits, parse_json_body, parse_request
from warmstart.worker.server import ServerState, build_app

LIMITS = RequestLimits(
    max_n=3, max_prompts=5, max_messages=7, max_stop_strings=2, max_stop_chars=9, max_tokens=11
)
COMPLETION = {"model": "tiny", "prompt": "once upon"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def client(limits: RequestLimits = LIMITS) -> TestClient:
    engine = FailingEngine(EngineError("the engine is not under test"), good_tokens=0)
    return TestClient(build_app(engine, WorkerMetrics(), ServerState(ready=True), limits))


def refused(body: dict[str, Any], chat: bool = False) -> ApiError:
    with pytest.raises(ApiError) as raised:
        parse_request(body, chat, LIMITS)
    assert raised.value.status == 400
    return raised.value


@pytest.mark.parametrize(
    "field,value",
    [
        ("n", "1"), ("n", 1.0), ("n", True), ("max_tokens", "5"), ("max_tokens", 5.0), ("seed", "7"),
        ("temperature", "0.5"), ("temperature", False), ("top_p", "1"), ("stream", 1), ("stream", "true"),
        ("ignore_eos", 0), ("return_token_ids", "yes"), ("model", 5), ("user", 5), ("stop", 5),
    ],
)  # fmt: skip
def test_no_value_is_coerced_to_the_type_of_its_field(field: str, value: Any) -> None:
    assert refused({**COMPLETION, field: value}).param == field


@pytest.mark.parametrize(
    "field,value",
    [("logprobs", 0), ("echo", 0.0), ("best_of", True), ("best_of", 1.0), ("presence_penalty", False)],
)
def test_a_no_op_parameter_is_accepted_only_at_its_value_and_type(field: str, value: Any) -> None:
    error = refused({**COMPLETION, field: value})
    assert (error.param, error.code) == (field, "unsupported_parameter")


def test_no_op_values_of_either_number_type_are_accepted() -> None:
    for value in (0, 0.0):
        parse_request({**COMPLETION, "presence_penalty": value, "frequency_penalty": value}, False, LIMITS)
    parse_request(
        {**COMPLETION, "temperature": 1, "top_p": 1, "best_of": 1, "logprobs": False}, False, LIMITS
    )


@pytest.mark.parametrize(
    "body,chat,param",
    [
        pytest.param({**COMPLETION, "prompt": [-1]}, False, "prompt", id="negative-token-id"),
        pytest.param(
            {**CHAT, "messages": [{"role": "user", "content": "hi", "name": 5}]}, True, "messages[0].name",
            id="message-name-not-a-string",
        ),
        pytest.param(
            {**CHAT, "max_tokens": "x", "max_completion_tokens": 4}, True, "max_tokens", id="both-limits"
        ),
    ],
)  # fmt: skip
def test_what_the_schema_always_said_is_now_enforced(body: dict[str, Any], chat: bool, param: str) -> None:
    """Values the hand-written checks let through although the document refused them (the engine refused
    a negative token id later; a message's name and the unused max_tokens were never read)."""
    assert refused(body, chat).param == param


BAD_BODIES = [
    (False, {**COMPLETION, "n": 4}),
    (False, {**COMPLETION, "prompt": ["a"] * 6}),
    (False, {**COMPLETION, "stop": "s" * 10}),
    (False, {**COMPLETION, "max_tokens": 12}),
    (False, {**COMPLETION, "temperature": "hot"}),
    (False, {**COMPLETION, "top_k": 3}),
    (False, {"prompt": "x"}),
    (True, {**CHAT, "messages": [{"role": "user", "content": "x"}] * 8}),
    (True, {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}),
    (True, {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
    (True, {**CHAT, "tools": [{"type": "function"}]}),
    (True, {**CHAT, "stream": True, "stream_options": {"include_usage": True, "other": 1}}),
]


@pytest.mark.parametrize("chat,body", BAD_BODIES)
def test_the_server_answers_a_bad_body_as_parsing_it_does(chat: bool, body: dict[str, Any]) -> None:
    """FastAPI validates the served routes' bodies, parse_request the same models: the same error."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    response = client().post(path, json=body)
    assert (response.status_code, response.json()) == (400, refused(body, chat).body())


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_json_body_is_read_whatever_its_content_type(content_type: str | None) -> None:
    headers = {"content-type": content_type} if content_type else {}
    api = client()
    wrong_model = api.post("/v1/completions", content=b'{"model": "gpt", "prompt": "x"}', headers=headers)
    assert wrong_model.status_code == 404  # validated as JSON, and past validation to the model check
    bad_field = api.post(
        "/v1/completions", content=b'{"model": "tiny", "prompt": "x", "n": 0}', headers=headers
    )
    assert (bad_field.status_code, bad_field.json()["error"]["param"]) == (400, "n")


def test_the_served_document_carries_the_limits() -> None:
    document = client().get("/openapi.json").json()
    schemas = document["components"]["schemas"]
    completion, chat = (
        schemas["CompletionRequest"]["properties"],
        schemas["ChatCompletionRequest"]["properties"],
    )

    def bounds(field: dict[str, Any]) -> list[Any]:
        return [branch for branch in field.get("anyOf", [field]) if branch.get("type") != "null"]

    assert bounds(completion["n"])[0]["maximum"] == LIMITS.max_n
    assert bounds(completion["max_tokens"])[0]["maximum"] == LIMITS.max_tokens
    assert bounds(chat["max_completion_tokens"])[0]["maximum"] == LIMITS.max_tokens
    assert [b.get("maxItems") for b in bounds(completion["prompt"])] == [None, LIMITS.max_prompts, None]
    assert [b.get("maxItems") for b in bounds(completion["stop"])] == [None, LIMITS.max_stop_strings]
    assert bounds(completion["stop"])[0]["maxLength"] == LIMITS.max_stop_chars
    assert chat["messages"]["maxItems"] == LIMITS.max_messages
    assert schemas["CompletionRequest"]["additionalProperties"] is False
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = document["paths"][path]["post"]["responses"]
        assert "422" not in responses  # a bad body is a 400, as documented
        assert responses["4XX"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorBody"
        }


def test_each_app_documents_its_own_limits() -> None:
    default = client(RequestLimits()).get("/openapi.json").json()["components"]["schemas"]
    n = default["CompletionRequest"]["properties"]["n"]["anyOf"][0]
    assert n["maximum"] == RequestLimits().max_n != LIMITS.max_n


def json_refused(body: object, limits: RequestLimits) -> ApiError:
    with pytest.raises(ApiError) as raised:
        parse_json_body(json.dumps(body).encode(), limits)
    assert raised.value.status == 400
    return raised.value


def test_a_body_of_too_many_strings_lists_and_objects_is_refused() -> None:
    limits = RequestLimits(max_json_values=10)
    assert "more than 10" in json_refused({"model": "tiny", "prompt": ["a"] * 9}, limits).message
    parse_json_body(json.dumps({"model": "tiny", "prompt": [7] * 10_000}).encode(), limits)  # numbers


def test_numbers_are_not_counted_yet_nest_no_deeper_than_the_limit() -> None:
    limits = RequestLimits(max_json_depth=3)
    assert json_refused({"prompt": [[[1]]]}, limits).param == "prompt[0][0][0]"
