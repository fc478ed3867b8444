"""Property-based tests: the HTTP API fuzzed from its own OpenAPI schema (schemathesis), and the request
parsing functions driven directly (hypothesis). No input may give a 5xx, and every response is counted."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

schemathesis = pytest.importorskip("schemathesis", reason="the fuzzing tests need schemathesis (`dev`)")

import httpx  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from reliability_helpers import InProcessWorker, responses_counted, wait_until  # noqa: E402

from warmstart.engines.base import Engine  # noqa: E402
from warmstart.engines.builtin.engine import BuiltinEngine  # noqa: E402
from warmstart.worker.metrics import WorkerMetrics  # noqa: E402
from warmstart.worker.openai_requests import (  # noqa: E402
    ApiError,
    ParsedRequest,
    RequestLimits,
    parse_json_body,
    parse_request,
    request_models,
)
from warmstart.worker.server import ServerState, build_app  # noqa: E402

pytestmark = pytest.mark.reliability

# Small outputs keep every generated request cheap on a CPU; the schema carries the same bounds.
LIMITS = RequestLimits(max_tokens=4, max_n=2, max_prompts=3, max_choices=4, max_messages=6)
EXAMPLES_PER_OPERATION = 75  # the 2 POST operations and GET /v1/models/{model} take 75 each
FUZZ = settings(
    max_examples=EXAMPLES_PER_OPERATION,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
# The worker app's OpenAPI document as FastAPI generates it from the request models; an engine that is not
# loaded is enough, the document depends on the limits only (the served one must be the same).
API_DOCUMENT = build_app(BuiltinEngine("tiny"), WorkerMetrics(), ServerState(), LIMITS).openapi()
schema = schemathesis.openapi.from_dict(API_DOCUMENT)


@pytest.fixture(scope="module")
def fuzzed(tiny_engine: Engine) -> Iterator[InProcessWorker]:
    server = InProcessWorker(tiny_engine, request_limits=LIMITS)
    yield server
    server.stop()


def test_the_served_schema_is_the_fuzzed_one(fuzzed: InProcessWorker) -> None:
    served = httpx.get(f"{fuzzed.base_url}/openapi.json", timeout=30).json()
    assert served == json.loads(json.dumps(API_DOCUMENT))


@schema.parametrize()
@FUZZ
def test_no_input_from_the_schema_gives_a_5xx_and_all_are_counted(case: Any, fuzzed: InProcessWorker) -> None:
    before = responses_counted(fuzzed.port)  # this /metrics answer is counted once it is sent
    response = case.call(base_url=fuzzed.base_url, timeout=120)
    assert response.status_code < 500, (case.path, case.body, response.text[:500])
    wait_until(lambda: responses_counted(fuzzed.port) == before + 2, "both responses to be counted", 60)


JSON_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.characters(codec=None, categories=None), max_size=12)  # surrogates included
)
JSON_VALUES = st.recursive(
    JSON_LEAVES,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)
PARAM_NAMES = sorted({name for model in request_models(LIMITS) for name in model.model_fields}) + ["top_k"]
BODIES = st.dictionaries(st.sampled_from(PARAM_NAMES) | st.text(max_size=6), JSON_VALUES, max_size=8)


def _parse(raw: bytes, chat: bool) -> ParsedRequest | ApiError:
    try:
        return parse_request(parse_json_body(raw, LIMITS), chat, LIMITS)
    except ApiError as error:
        json.dumps(error.body(), ensure_ascii=False).encode("utf-8")  # the answer itself can be sent
        return error


@settings(max_examples=300, derandomize=True, deadline=None, database=None)
@given(body=BODIES, chat=st.booleans())
def test_parsing_any_json_body_accepts_it_or_names_a_field(body: dict, chat: bool) -> None:
    raw = json.dumps(body).encode()  # ensure_ascii: lone surrogates travel as \ud800 escapes, as on the wire
    outcome = _parse(raw, chat)
    if isinstance(outcome, ApiError):
        assert outcome.status == 400 and outcome.param, outcome.body()
    else:
        assert 1 <= outcome.n <= LIMITS.max_n and len(outcome.prompts) * outcome.n <= LIMITS.max_choices
        assert outcome.sampling.max_tokens <= LIMITS.max_tokens
        assert all(isinstance(p.get("prompt", ""), str) for p in outcome.prompts)


@settings(max_examples=300, derandomize=True, deadline=None, database=None)
@given(raw=st.binary(max_size=512) | st.text(max_size=200).map(str.encode), chat=st.booleans())
def test_parsing_any_bytes_is_a_request_or_a_400(raw: bytes, chat: bool) -> None:
    outcome = _parse(raw, chat)
    assert isinstance(outcome, ParsedRequest) or outcome.status == 400


@settings(max_examples=50, derandomize=True, deadline=None, database=None)
@given(depth=st.integers(min_value=LIMITS.max_json_depth + 1, max_value=200_000))
def test_nesting_past_the_limit_is_a_400(depth: int) -> None:
    raw = b'{"model": "tiny", "prompt": ' + b"[" * depth + b"]" * depth + b"}"
    outcome = _parse(raw, chat=False)
    assert isinstance(outcome, ApiError) and outcome.status == 400
    assert "nests deeper" in outcome.message


def test_a_body_past_the_size_limit_is_a_413() -> None:
    with pytest.raises(ApiError) as raised:
        parse_json_body(b" " * (LIMITS.max_body_bytes + 1), LIMITS)
    assert raised.value.status == 413
