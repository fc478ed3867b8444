"""Parsing OpenAI completion and chat completion requests into what the engine runs, within bounds.

Everything here is a pure function of the request body: an accepted request comes back as a ParsedRequest,
anything else raises ApiError (400, or 413 for a body over the size limit) naming the offending field. A
parameter the engines do not honour is refused rather than ignored; a few are accepted at their no-op value
(e.g. `logprobs: false`, `tool_choice: "none"`), which is what client libraries send by default.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from warmstart.engines.base import SamplingParams

DEFAULT_COMPLETION_TOKENS = 16
DEFAULT_CHAT_TOKENS = 256
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
SHARED_PARAMS = frozenset(
    {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
     "ignore_eos", "user", "return_token_ids"}
)  # fmt: skip
COMPLETION_PARAMS = SHARED_PARAMS | {"prompt"}
CHAT_PARAMS = SHARED_PARAMS | {"messages", "max_completion_tokens"}
MESSAGE_KEYS = frozenset({"role", "content", "name"})


@dataclass(frozen=True)
class RequestLimits:
    """Bounds on one request, so that no single request can hold the engine or the server for long."""

    max_body_bytes: int = 4 * 1024 * 1024  # a full 128k-token context as text or token ids fits
    max_json_depth: int = 32  # a chat body with content parts nests 5 deep
    max_n: int = 16
    max_prompts: int = 32
    max_choices: int = 64  # prompts x n: the generations one request may start
    max_messages: int = 1024
    max_stop_strings: int = 4
    max_stop_chars: int = 256
    max_tokens: int | None = None  # output tokens per choice; None: whatever the context leaves


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ParsedRequest:
    model: str
    prompts: list[dict[str, Any]]  # GenerationRequest fields: {"prompt": str} or {"prompt_token_ids": (...)}
    messages: list[dict[str, str]] | None  # chat: the turns the engine's template makes a prompt of
    sampling: SamplingParams  # max_tokens < 0: not given, -max_tokens is the default to fit
    max_tokens_param: str
    n: int
    stream: bool
    include_usage: bool
    return_token_ids: bool = False  # vLLM's extension: each choice carries the generated token ids


def _none_or(*values: Any) -> Callable[[Any], bool]:
    def is_noop(value: Any) -> bool:
        return value is None or any(type(value) is type(v) and value == v for v in values)

    return is_noop


# Parameters OpenAI defines that the engines do not implement: accepted only at a value that asks nothing.
COMPLETION_NOOPS: dict[str, Callable[[Any], bool]] = {
    "logprobs": _none_or(False),
    "echo": _none_or(False),
    "best_of": _none_or(1),
    "suffix": _none_or(""),
    "logit_bias": _none_or({}),
    "presence_penalty": _none_or(0, 0.0),
    "frequency_penalty": _none_or(0, 0.0),
}
CHAT_NOOPS: dict[str, Callable[[Any], bool]] = {
    "logprobs": _none_or(False),
    "top_logprobs": _none_or(0),
    "logit_bias": _none_or({}),
    "presence_penalty": _none_or(0, 0.0),
    "frequency_penalty": _none_or(0, 0.0),
    "tools": _none_or([]),
    "tool_choice": _none_or("none"),
    "parallel_tool_calls": _none_or(),
    "functions": _none_or([]),
    "function_call": _none_or("none"),
    "response_format": lambda value: value is None or value == {"type": "text"},
    "modalities": lambda value: value is None or value == ["text"],
    "audio": _none_or(),
    "prediction": _none_or(),
    "reasoning_effort": _none_or(),
    "web_search_options": _none_or(),
    "store": _none_or(False),
    "metadata": _none_or({}),
    "service_tier": _none_or("auto", "default"),
}


def parse_json_body(raw: bytes, limits: RequestLimits) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 (413 when too large) saying what is wrong with it."""
    if len(raw) > limits.max_body_bytes:
        raise body_too_large(limits)
    try:
        body = json.loads(raw or b"null", parse_constant=_refuse_constant)
    except RecursionError:
        raise ApiError(400, f"the request body nests deeper than {limits.max_json_depth} levels") from None
    except ValueError as exc:  # JSONDecodeError, bad UTF-8, an integer too long to convert
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    check_json_values(body, limits.max_json_depth)
    return body


def body_too_large(limits: RequestLimits) -> ApiError:
    return ApiError(
        413, f"the request body is larger than {limits.max_body_bytes} bytes", None, "body_too_large"
    )


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def check_json_values(body: Any, max_depth: int) -> None:
    """Refuse nesting deeper than `max_depth` and strings that are not valid Unicode text (a lone surrogate
    such as "\\ud800" decodes to a str that cannot be encoded, tokenized or echoed back)."""
    pending: list[tuple[Any, str, int]] = [(body, "", 0)]
    while pending:
        value, path, depth = pending.pop()
        if depth > max_depth:
            raise ApiError(400, f"the request body nests deeper than {max_depth} levels", path or None)
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, path)
                pending.append((item, f"{path}.{key}" if path else key, depth + 1))
        elif isinstance(value, list):
            pending.extend((item, f"{path}[{index}]", depth + 1) for index, item in enumerate(value))


def _check_text(text: str, path: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        where = _printable(path) or "the request body"
        raise ApiError(
            400, f"{where} contains a lone surrogate; strings must be valid Unicode", where
        ) from None


def _printable(path: str) -> str:
    return path.encode("utf-8", "backslashreplace").decode("utf-8")


def parse_request(body: dict[str, Any], chat: bool, limits: RequestLimits) -> ParsedRequest:
    """A completion (chat=False) or chat completion body as what to generate, or an ApiError."""
    model = _field(body, "model", str, required=True)
    _refuse_unsupported(body, chat)
    n = _field(body, "n", int, default=1)
    if n < 1:
        raise ApiError(400, f"n must be at least 1, got {_short(n)}", "n")
    if n > limits.max_n:
        raise ApiError(400, f"n must be at most {limits.max_n}, got {_short(n)}", "n")
    messages = _messages(body, limits) if chat else None
    prompts = [{"prompt": ""}] if chat else _prompts(body, limits)
    if len(prompts) * n > limits.max_choices:
        raise ApiError(
            400, f"{len(prompts)} prompts x n = {n} asks for more than {limits.max_choices} completions", "n"
        )
    stream = _field(body, "stream", bool, default=False)
    if stream and len(prompts) * n != 1:
        raise ApiError(400, "stream: true supports one prompt and n = 1", "stream")
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    return ParsedRequest(
        model=model,
        prompts=prompts,
        messages=messages,
        sampling=_sampling(body, chat, name, limits),
        max_tokens_param=name,
        n=n,
        stream=stream,
        include_usage=_include_usage(body, stream),
        return_token_ids=_field(body, "return_token_ids", bool, default=False),
    )


def _refuse_unsupported(body: dict[str, Any], chat: bool) -> None:
    known, noops = (CHAT_PARAMS, CHAT_NOOPS) if chat else (COMPLETION_PARAMS, COMPLETION_NOOPS)
    for name, value in body.items():
        if name in known:
            continue
        if name in noops:
            if noops[name](value):
                continue
            raise ApiError(
                400,
                f"{name} is not supported by this worker's engine; leave it out (got {_short(value)})",
                name,
                "unsupported_parameter",
            )
        raise ApiError(400, f"Unrecognized request argument supplied: {name}", name, "unsupported_parameter")


def _include_usage(body: dict[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise ApiError(400, "stream_options is only allowed when stream is true", "stream_options")
    if not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", "stream_options")
    for key in options:
        if key != "include_usage":
            raise ApiError(
                400,
                f"stream_options.{key} is not supported",
                f"stream_options.{key}",
                "unsupported_parameter",
            )
    return bool(_field(options, "include_usage", bool, default=False, where="stream_options."))


def _prompts(body: dict[str, Any], limits: RequestLimits) -> list[dict[str, Any]]:
    prompt = body.get("prompt")
    if prompt is None:
        raise ApiError(400, "prompt is required", "prompt")
    if isinstance(prompt, str):
        return [{"prompt": prompt}]
    if isinstance(prompt, list) and prompt and all(_is_int(p) for p in prompt):
        return [{"prompt_token_ids": tuple(prompt)}]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) > limits.max_prompts:
            raise ApiError(
                400, f"prompt takes at most {limits.max_prompts} strings, got {len(prompt)}", "prompt"
            )
        return [{"prompt": p} for p in prompt]
    raise ApiError(
        400, "prompt must be a non-empty string, a list of strings or a list of token ids", "prompt"
    )


def _messages(body: dict[str, Any], limits: RequestLimits) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    if len(messages) > limits.max_messages:
        raise ApiError(
            400, f"messages takes at most {limits.max_messages} messages, got {len(messages)}", "messages"
        )
    return [_chat_turn(message, index) for index, message in enumerate(messages)]


def _chat_turn(message: Any, index: int) -> dict[str, str]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise ApiError(400, f"{where} must be an object with role and content", where)
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise ApiError(
            400, f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {_short(role)}", f"{where}.role"
        )
    for key in message:
        if key not in MESSAGE_KEYS:  # tool_calls, audio, ...: nothing the engine could act on
            raise ApiError(400, f"{where}.{key} is not supported", f"{where}.{key}", "unsupported_parameter")
    content = message.get("content")
    if isinstance(content, list):  # content parts: text ones only
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


def _sampling(body: dict[str, Any], chat: bool, name: str, limits: RequestLimits) -> SamplingParams:
    default_tokens = DEFAULT_CHAT_TOKENS if chat else DEFAULT_COMPLETION_TOKENS
    max_tokens = _field(body, name, int, default=None)
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, f"{name} must be at least 1, got {max_tokens}", name)
    if max_tokens is not None and limits.max_tokens is not None and max_tokens > limits.max_tokens:
        raise ApiError(400, f"{name} must be at most {limits.max_tokens} here, got {max_tokens}", name)
    if limits.max_tokens is not None:
        default_tokens = min(default_tokens, limits.max_tokens)
    temperature = _number(body, "temperature", 1.0)
    top_p = _number(body, "top_p", 1.0)
    if not 0.0 <= temperature <= 2.0:
        raise ApiError(400, f"temperature must be between 0 and 2, got {temperature}", "temperature")
    if not 0.0 < top_p <= 1.0:
        raise ApiError(400, f"top_p must be in (0, 1], got {top_p}", "top_p")
    return SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else -default_tokens,  # negative: a default
        temperature=temperature,
        top_p=top_p,
        seed=_seed(body),
        stop=_stop_strings(body.get("stop"), limits),
        ignore_eos=_field(body, "ignore_eos", bool, default=False),
    )


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = _field(body, name, (int, float), default=default)
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    return number


def _seed(body: dict[str, Any]) -> int | None:
    seed = _field(body, "seed", int, default=None)
    if seed is not None and not 0 <= seed < 2**63:
        raise ApiError(400, f"seed must be between 0 and 2**63 - 1, got {_short(seed)}", "seed")
    return seed


def _stop_strings(stop: Any, limits: RequestLimits) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "stop must be a non-empty string or a list of non-empty strings", "stop")
    if len(stop) > limits.max_stop_strings:
        raise ApiError(400, f"stop takes at most {limits.max_stop_strings} strings, got {len(stop)}", "stop")
    if any(len(s) > limits.max_stop_chars for s in stop):
        raise ApiError(400, f"each stop string must be at most {limits.max_stop_chars} characters", "stop")
    return tuple(stop)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _type_name(kind: type | tuple[type, ...]) -> str:
    names = {str: "a string", int: "an integer", float: "a number", bool: "a boolean"}
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return "a number" if float in kinds else " or ".join(names.get(k, k.__name__) for k in kinds)


def _short(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):  # an integer too long to print
        text = type(value).__name__
    return text if len(text) <= 80 else text[:77] + "..."


def _field(
    body: dict[str, Any],
    name: str,
    kind: type | tuple[type, ...],
    required: bool = False,
    default: Any = None,
    where: str = "",
) -> Any:
    if name not in body or body[name] is None:
        if required:
            raise ApiError(400, f"{where}{name} is required", where + name)
        return default
    value = body[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    is_bool = isinstance(value, bool)
    if not isinstance(value, kinds) or (is_bool and bool not in kinds):
        raise ApiError(400, f"{where}{name} must be {_type_name(kind)}, got {_short(value)}", where + name)
    return value
