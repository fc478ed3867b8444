"""OpenAI completion and chat completion requests: their bodies as pydantic models, which are the API's
schema (FastAPI validates bodies with them and documents them at /openapi.json), and what no model says.

The models are built per `RequestLimits`, so the document carries the bounds the worker enforces. Beside
them stay explicit checks: on the raw body (its size, 413; its nesting; lone surrogates in its strings; JSON
that only Python reads, such as NaN) and across fields (prompts x n, streaming one choice, stream_options).
Every refusal is an ApiError (400, or 413 for a body over the size limit) naming the offending field. A
parameter the engines do not honour is refused rather than ignored; a few are accepted at their no-op value
(e.g. `logprobs: false`, `tool_choice: "none"`), which is what client libraries send by default.
"""

# No `from __future__ import annotations`: the models are built inside a function, from its locals.
import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, NamedTuple, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
)
from pydantic_core import ErrorDetails, PydanticCustomError

from warmstart.api.worker_options import DEFAULTS
from warmstart.engines.base import SamplingParams

DEFAULT_COMPLETION_TOKENS = 16
DEFAULT_CHAT_TOKENS = 256
OUT_OF_RANGE = frozenset({"greater_than", "greater_than_equal", "less_than", "less_than_equal"})
UNSUPPORTED = "unsupported_parameter"


@dataclass(frozen=True)
class RequestLimits:
    """Bounds on one request, so that no single request can hold the engine or the server for long."""

    # Where the worker has a flag for a bound, the flag's default is the bound's (declared with the options).
    max_body_bytes: int = DEFAULTS["max_request_bytes"]  # a full 128k-token context as text or token ids fits
    max_json_depth: int = 32  # a chat body with content parts nests 5 deep
    # Strings, lists and objects in a body (numbers are not counted: a prompt of token ids holds only those).
    # Validating one costs about a microsecond in a call that holds the GIL throughout; a chat body with 1024
    # messages of a few content parts each has some 20000.
    max_json_values: int = 65536
    max_n: int = DEFAULTS["max_n"]
    max_prompts: int = 32
    max_choices: int = 64  # prompts x n: the generations one request may start
    max_messages: int = 1024
    max_stop_strings: int = 4
    max_stop_chars: int = 256
    max_tokens: int | None = DEFAULTS["max_output_tokens"]  # per choice; None: whatever the context leaves


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """An OpenAI-style error; `param` names the request field at fault."""

    error: ErrorDetail


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        detail = ErrorDetail(message=self.message, type=kind, param=self.param, code=self.code)
        return ErrorBody(error=detail).model_dump()


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


def _refused(phrase: str, only: frozenset[str] | None = None, kind: str = "invalid_value") -> WrapValidator:
    """The field's validation errors (or those of the types in `only`) as one that says `phrase`: what the
    value must be, for a field whose parts (a union's members, one bound of a range) say too little alone."""

    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError as error:
            if only is not None and error.errors()[0]["type"] not in only:
                raise
            raise PydanticCustomError(kind, phrase + ", got {got}", {"got": _short(value)}) from None

    return WrapValidator(validate)


def _only_as_is(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """A no-op value exactly: a Literal lets 0 pass for false (0 == False in Python)."""
    result = handler(value)
    if isinstance(result, bool) is not isinstance(value, bool):
        raise PydanticCustomError("bool_type", "a boolean, not a number")
    return result


T = TypeVar("T")
# A parameter OpenAI defines that the engines do not implement: accepted only at a value that asks nothing.
NoOp = Annotated[
    Annotated[T, WrapValidator(_only_as_is)] | None,
    _refused("is not supported by this worker's engine (leave it out)", kind=UNSUPPORTED),
]
Nothing = Annotated[T, Field(max_length=0)]
STRICT = ConfigDict(strict=True, extra="forbid")


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)  # other keys of a part are ignored

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = STRICT

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Annotated[
        str | list[TextPart], _refused("must be a string or a list of {type: text, text} parts")
    ]
    name: str | None = None


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool | None = None


class TextFormat(BaseModel):
    model_config = STRICT

    type: Literal["text"]


class RequestModels(NamedTuple):
    completion: type[BaseModel]
    chat: type[BaseModel]


@functools.cache
def request_models(limits: RequestLimits) -> RequestModels:
    """The /v1/completions and /v1/chat/completions body models, bounded by `limits`."""
    output_tokens = Annotated[int | None, Field(ge=1, le=limits.max_tokens)]
    stop_string = Annotated[str, Field(min_length=1, max_length=limits.max_stop_chars)]
    stop_phrase = f"must be a non-empty string or a list of at most {limits.max_stop_strings} such strings"
    prompt_phrase = (
        f"must be a non-empty string, a list of at most {limits.max_prompts} strings or a list of token ids"
    )

    class SharedFields(BaseModel):
        model_config = STRICT

        model: str
        max_tokens: output_tokens = None
        temperature: Annotated[
            float | None, Field(ge=0, le=2), _refused("must be between 0 and 2", OUT_OF_RANGE)
        ] = None
        top_p: Annotated[float | None, Field(gt=0, le=1), _refused("must be in (0, 1]", OUT_OF_RANGE)] = None
        n: Annotated[int | None, Field(ge=1, le=limits.max_n)] = None
        stream: bool | None = None
        stream_options: StreamOptions | None = None
        stop: Annotated[
            stop_string | Annotated[list[stop_string], Field(max_length=limits.max_stop_strings)] | None,
            _refused(stop_phrase),
        ] = None
        seed: Annotated[
            int | None, Field(ge=0, le=2**63 - 1), _refused("must be between 0 and 2**63 - 1", OUT_OF_RANGE)
        ] = None
        ignore_eos: bool | None = None
        user: str | None = None
        return_token_ids: bool | None = None  # vLLM's extension
        logprobs: NoOp[Literal[False]] = None
        logit_bias: NoOp[Nothing[dict[str, Any]]] = None
        presence_penalty: NoOp[Annotated[float, Field(ge=0, le=0)]] = None
        frequency_penalty: NoOp[Annotated[float, Field(ge=0, le=0)]] = None

    class CompletionRequest(SharedFields):
        prompt: Annotated[
            str
            | Annotated[list[str], Field(min_length=1, max_length=limits.max_prompts, fail_fast=True)]
            | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1, fail_fast=True)],
            _refused(prompt_phrase),
        ]
        echo: NoOp[Literal[False]] = None
        best_of: NoOp[Annotated[int, Field(ge=1, le=1)]] = None
        suffix: NoOp[Literal[""]] = None

    class ChatCompletionRequest(SharedFields):
        messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=limits.max_messages)]
        max_completion_tokens: output_tokens = None
        top_logprobs: NoOp[Annotated[int, Field(ge=0, le=0)]] = None
        tools: NoOp[Nothing[list[Any]]] = None
        tool_choice: NoOp[Literal["none"]] = None
        parallel_tool_calls: NoOp[None] = None
        functions: NoOp[Nothing[list[Any]]] = None
        function_call: NoOp[Literal["none"]] = None
        response_format: NoOp[TextFormat] = None
        modalities: NoOp[Annotated[list[Literal["text"]], Field(min_length=1, max_length=1)]] = None
        audio: NoOp[None] = None
        prediction: NoOp[None] = None
        reasoning_effort: NoOp[None] = None
        web_search_options: NoOp[None] = None
        store: NoOp[Literal[False]] = None
        metadata: NoOp[Nothing[dict[str, Any]]] = None
        service_tier: NoOp[Literal["auto", "default"]] = None

    return RequestModels(CompletionRequest, ChatCompletionRequest)


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
    check_json_values(body, limits.max_json_depth, limits.max_json_values)
    return body


def parse_body(raw: bytes, model: type[BaseModel], limits: RequestLimits) -> BaseModel:
    """A raw request body as an instance of `model`, or the ApiError saying what is wrong with it."""
    return _validated(parse_json_body(raw, limits), model)


def _validated(body: dict[str, Any], model: type[BaseModel]) -> BaseModel:
    try:
        return model.model_validate(body)
    except ValidationError as error:
        raise invalid_request(error.errors()) from None


def body_too_large(limits: RequestLimits) -> ApiError:
    return ApiError(
        413, f"the request body is larger than {limits.max_body_bytes} bytes", None, "body_too_large"
    )


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def check_json_values(body: Any, max_depth: int, max_values: int = RequestLimits.max_json_values) -> None:
    """Refuse nesting deeper than `max_depth`, more than `max_values` strings, lists and objects, and strings
    that are not valid Unicode text (a lone surrogate such as "\\ud800" decodes to a str that cannot be
    encoded, tokenized or echoed back)."""
    pending: list[tuple[Any, str, int]] = [(body, "", 0)]
    values = 0
    while pending:
        value, path, depth = pending.pop()
        if depth > max_depth:
            raise ApiError(400, f"the request body nests deeper than {max_depth} levels", path or None)
        values += 1
        if values > max_values:
            raise ApiError(400, f"the request body holds more than {max_values} strings, lists and objects")
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, path)
                pending.append((item, f"{path}.{key}" if path else key, depth + 1))
        elif isinstance(value, list):
            pending.extend(_list_items(value, path, depth + 1, max_depth))


NUMBERS = frozenset({int, float, bool, type(None)})  # JSON values with no text in them and nothing nested


def _list_items(items: list[Any], path: str, depth: int, max_depth: int) -> list[tuple[Any, str, int]]:
    """The items of a list that need checking, with their paths: not numbers (a prompt of token ids is a
    million of them, skipped in one pass in C), unless they are too deep already."""
    if depth <= max_depth and NUMBERS.issuperset(map(type, items)):
        return []
    return [
        (item, f"{path}[{index}]", depth)
        for index, item in enumerate(items)
        if depth > max_depth or type(item) not in NUMBERS
    ]


def _check_text(text: str, path: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        where = path.encode("utf-8", "backslashreplace").decode("utf-8") or "the request body"
        raise ApiError(
            400, f"{where} contains a lone surrogate; strings must be valid Unicode", where
        ) from None


def parse_request(body: dict[str, Any], chat: bool, limits: RequestLimits) -> ParsedRequest:
    """A completion (chat=False) or chat completion body as what to generate, or an ApiError."""
    models = request_models(limits)
    return parsed_request(_validated(body, models.chat if chat else models.completion), chat, limits)


def parsed_request(request: Any, chat: bool, limits: RequestLimits) -> ParsedRequest:
    """A body its model accepted as what to generate, or an ApiError for what spans fields."""
    n = 1 if request.n is None else request.n
    prompts = [{"prompt": ""}] if chat else _prompts(request.prompt)
    if len(prompts) * n > limits.max_choices:
        raise ApiError(
            400, f"{len(prompts)} prompts x n = {n} asks for more than {limits.max_choices} completions", "n"
        )
    stream = bool(request.stream)
    if stream and len(prompts) * n != 1:
        raise ApiError(400, "stream: true supports one prompt and n = 1", "stream")
    if request.stream_options is not None and not stream:
        raise ApiError(400, "stream_options is only allowed when stream is true", "stream_options")
    name = "max_completion_tokens" if chat and request.max_completion_tokens is not None else "max_tokens"
    return ParsedRequest(
        model=request.model,
        prompts=prompts,
        messages=[_chat_turn(message) for message in request.messages] if chat else None,
        sampling=_sampling(request, getattr(request, name), chat, limits),
        max_tokens_param=name,
        n=n,
        stream=stream,
        include_usage=bool(request.stream_options and request.stream_options.include_usage),
        return_token_ids=bool(request.return_token_ids),
    )


def _prompts(prompt: str | list[str] | list[int]) -> list[dict[str, Any]]:
    if isinstance(prompt, str):
        return [{"prompt": prompt}]
    if isinstance(prompt[0], int):
        return [{"prompt_token_ids": tuple(prompt)}]
    return [{"prompt": text} for text in prompt]


def _chat_turn(message: ChatMessage) -> dict[str, str]:
    content = message.content
    text = content if isinstance(content, str) else "".join(part.text for part in content)
    return {"role": message.role, "content": text}


def _sampling(request: Any, max_tokens: int | None, chat: bool, limits: RequestLimits) -> SamplingParams:
    default_tokens = DEFAULT_CHAT_TOKENS if chat else DEFAULT_COMPLETION_TOKENS
    if limits.max_tokens is not None:
        default_tokens = min(default_tokens, limits.max_tokens)
    return SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else -default_tokens,  # negative: a default
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        seed=request.seed,
        stop=(request.stop,) if isinstance(request.stop, str) else tuple(request.stop or ()),
        ignore_eos=bool(request.ignore_eos),
    )


PHRASES = {
    "missing": "is required",
    "extra_forbidden": "is not supported",
    "int_type": "must be an integer",
    "float_type": "must be a number",
    "bool_type": "must be a boolean",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "model_type": "must be an object",
    "dict_type": "must be an object",
    "literal_error": "must be {expected}",
    "greater_than": "must be greater than {gt}",
    "greater_than_equal": "must be at least {ge}",
    "less_than_equal": "must be at most {le}",
    "too_short": "must have at least {min_length} items",
    "too_long": "takes at most {max_length} items",
    "string_too_short": "must be at least {min_length} characters long",
    "string_too_long": "must be at most {max_length} characters long",
}


def invalid_request(errors: Sequence[ErrorDetails], skip: int = 0) -> ApiError:
    """The first of a model's validation errors as a 400 naming the field (`skip`: leading loc items that
    are not the body's, e.g. FastAPI's "body")."""
    error = errors[0]
    loc = error["loc"][skip:]
    param = "".join(f"[{item}]" if isinstance(item, int) else f".{item}" for item in loc).lstrip(".")
    kind = error["type"]
    code = UNSUPPORTED if kind in (UNSUPPORTED, "extra_forbidden") else None
    if kind == "extra_forbidden" and len(loc) == 1:
        return ApiError(400, f"Unrecognized request argument supplied: {param}", param, code)
    if kind not in PHRASES:  # the field's own message (_refused), or pydantic's
        return ApiError(400, f"{param} {error['msg']}", param or None, code)
    message = f"{param} {PHRASES[kind].format(**error.get('ctx', {}))}"
    if kind not in ("missing", "extra_forbidden"):
        message += f", got {_short(error.get('input'))}"
    return ApiError(400, message, param or None, code)


def _short(value: Any) -> str:
    """`value` as JSON, cut to 80 characters; encoded only as far as needed (it may be a body's 4 MiB)."""
    text = ""
    try:
        for chunk in json.JSONEncoder().iterencode(value):
            text += chunk
            if len(text) > 80:
                break
    except (TypeError, ValueError):  # an integer too long to print
        text = type(value).__name__
    return text if len(text) <= 80 else text[:77] + "..."
