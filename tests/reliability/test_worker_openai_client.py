"""The real `openai` client library against a real worker: what works keeps working, and every parameter the
engine does not honour is refused with a 400 that names it instead of being silently ignored."""

from __future__ import annotations

from typing import Any

import pytest

openai = pytest.importorskip("openai", reason="these tests drive the worker with the openai client (`dev`)")

pytestmark = [pytest.mark.reliability, pytest.mark.spawns]

MESSAGES = [{"role": "user", "content": "Hi"}]
TOOL = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def client(worker) -> Any:
    _, port = worker
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)


def refused_param(call: Any) -> tuple[str | None, str]:
    """Run `call`, expect a 400 and return the param it names, and its message."""
    with pytest.raises(openai.BadRequestError) as raised:
        call()
    body = raised.value.body
    error = body.get("error", body) if isinstance(body, dict) else {}
    return error.get("param"), error.get("message", "")


def test_a_completion_through_the_client(client) -> None:
    completion = client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=5, temperature=0
    )
    assert completion.usage.completion_tokens == 5
    assert isinstance(completion.choices[0].text, str)


def test_a_chat_completion_through_the_client(client) -> None:
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=4, n=2)
    assert len(reply.choices) == 2 and reply.choices[0].message.role == "assistant"


def test_no_op_values_that_client_code_commonly_sends_are_accepted(client) -> None:
    reply = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=2,
        logprobs=False,
        presence_penalty=0,
        frequency_penalty=0,
        response_format={"type": "text"},
        tool_choice="none",
        user="someone",
    )
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_stream_options_include_usage_is_honoured(client) -> None:
    stream = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 6
    assert all(chunk.usage is None for chunk in chunks[:-1])


def test_a_completion_stream_with_usage(client) -> None:
    chunks = list(
        client.completions.create(
            model="tiny", prompt="Hello", max_tokens=3, stream=True, stream_options={"include_usage": True}
        )
    )
    usage = chunks[-1].usage
    assert usage is not None and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


CHAT_UNSUPPORTED = [
    pytest.param({"logprobs": True}, "logprobs", id="logprobs"),
    pytest.param({"top_logprobs": 3}, "top_logprobs", id="top_logprobs"),
    pytest.param({"tools": [TOOL]}, "tools", id="tools"),
    pytest.param({"tool_choice": "auto"}, "tool_choice", id="tool_choice"),
    pytest.param({"parallel_tool_calls": True}, "parallel_tool_calls", id="parallel_tool_calls"),
    pytest.param({"response_format": {"type": "json_object"}}, "response_format", id="response_format"),
    pytest.param({"logit_bias": {"65": 10}}, "logit_bias", id="logit_bias"),
    pytest.param({"presence_penalty": 0.5}, "presence_penalty", id="presence_penalty"),
    pytest.param({"frequency_penalty": 1.0}, "frequency_penalty", id="frequency_penalty"),
    pytest.param({"modalities": ["text", "audio"]}, "modalities", id="modalities"),
    pytest.param({"reasoning_effort": "high"}, "reasoning_effort", id="reasoning_effort"),
    pytest.param({"store": True}, "store", id="store"),
    pytest.param({"service_tier": "flex"}, "service_tier", id="service_tier"),
    pytest.param({"extra_body": {"top_k": 5}}, "top_k", id="top_k"),
    pytest.param({"extra_body": {"min_tokens": 5}}, "min_tokens", id="min_tokens"),
    pytest.param(
        {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        "stream_options.continuous_usage_stats",
        id="stream_options-other",
    ),
]


@pytest.mark.parametrize("extra,param", CHAT_UNSUPPORTED)
def test_unsupported_chat_parameters_get_a_400_naming_them(client, extra: dict, param: str) -> None:
    named, message = refused_param(
        lambda: client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, **extra)
    )
    assert named == param, message
    assert param.split(".")[-1] in message


COMPLETION_UNSUPPORTED = [
    pytest.param({"logprobs": 2}, "logprobs", id="logprobs"),
    pytest.param({"echo": True}, "echo", id="echo"),
    pytest.param({"best_of": 3}, "best_of", id="best_of"),
    pytest.param({"suffix": " the end"}, "suffix", id="suffix"),
    pytest.param({"logit_bias": {"65": -100}}, "logit_bias", id="logit_bias"),
    pytest.param({"presence_penalty": 1.0}, "presence_penalty", id="presence_penalty"),
    pytest.param({"frequency_penalty": -1.0}, "frequency_penalty", id="frequency_penalty"),
    pytest.param({"extra_body": {"top_k": 1}}, "top_k", id="top_k"),
    pytest.param({"extra_body": {"tools": [TOOL]}}, "tools", id="tools-on-completions"),
]


@pytest.mark.parametrize("extra,param", COMPLETION_UNSUPPORTED)
def test_unsupported_completion_parameters_get_a_400_naming_them(client, extra: dict, param: str) -> None:
    named, message = refused_param(
        lambda: client.completions.create(model="tiny", prompt="Hello", max_tokens=2, **extra)
    )
    assert named == param, message


def test_a_tool_call_message_is_refused_rather_than_dropped(client) -> None:
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "now", "arguments": "{}"}}],
        },
    ]
    named, _ = refused_param(lambda: client.chat.completions.create(model="tiny", messages=messages))
    assert named == "messages[1].tool_calls"


def test_the_responses_api_is_a_clear_400_not_a_404(client) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(model="tiny", input="Hi")
    assert raised.value.code == "unsupported_endpoint"
    assert "/v1/chat/completions" in raised.value.message


def test_the_models_list_through_the_client(client) -> None:
    assert [model.id for model in client.models.list()] == ["tiny"]
