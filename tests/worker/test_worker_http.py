"""A cold `warmstart worker` on CPU: the OpenAI-compatible API, its errors, batching, streaming, metrics."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support import free_port
from worker_helpers import Worker, post

pytestmark = pytest.mark.spawns

GREEDY = {
    "model": "tiny",
    "prompt": "Once upon a time",
    "max_tokens": 24,
    "temperature": 0,
    "ignore_eos": True,
}


@pytest.fixture(scope="module")
def server(worker_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    port = free_port()
    worker = Worker(
        worker_cache,
        tmp_path_factory.mktemp("cold"),
        "--mode",
        "cold",
        "--port",
        str(port),
        "--log-dir",
        str(tmp_path_factory.mktemp("cold-logs")),
    )
    worker.wait_ready(port)
    yield port
    assert worker.stop() == 0, worker.logs()


def test_greedy_output_is_identical_across_two_cold_starts(server: int, start_worker) -> None:
    first = post(server, "/v1/completions", GREEDY).json()["choices"][0]["text"]
    port = free_port()
    other = start_worker("--mode", "cold", "--port", str(port))
    other.wait_ready(port)
    second = post(port, "/v1/completions", GREEDY).json()["choices"][0]["text"]
    assert second == first
    assert other.stop() == 0


def test_completion_response_shape(server: int) -> None:
    body = post(server, "/v1/completions", GREEDY).json()
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 17, "completion_tokens": 24, "total_tokens": 41}


def test_token_ids_come_back_when_asked_as_vllm_returns_them(server: int) -> None:
    plain = post(server, "/v1/completions", GREEDY).json()["choices"][0]
    choice = post(server, "/v1/completions", {**GREEDY, "return_token_ids": True}).json()["choices"][0]
    assert "token_ids" not in plain and choice["text"] == plain["text"]
    assert len(choice["token_ids"]) == 24 and all(isinstance(token, int) for token in choice["token_ids"])
    refused = post(server, "/v1/completions", {**GREEDY, "return_token_ids": "yes"})
    assert refused.status_code == 400 and "return_token_ids" in refused.text


def test_chat_completion(server: int) -> None:
    request = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 5,
        "temperature": 0,
    }
    body = post(server, "/v1/chat/completions", request).json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] <= 5


def test_curl_gets_a_completion(server: int) -> None:
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed here")
    output = subprocess.run(
        [curl, "-sf", f"http://127.0.0.1:{server}/v1/completions", "-H", "Content-Type: application/json",
         "-d", json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 4})],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert json.loads(output)["choices"][0]["text"] is not None


@pytest.mark.parametrize(
    "body,param,message",
    [
        ({"prompt": "x"}, "model", "model is required"),
        ({"model": "tiny"}, "prompt", "prompt is required"),
        ({"model": "tiny", "prompt": ""}, "prompt", "must not be empty"),
        ({"model": "tiny", "prompt": 5}, "prompt", "prompt must be"),
        (
            {"model": "tiny", "prompt": "x", "max_tokens": "ten"},
            "max_tokens",
            "max_tokens must be an integer",
        ),
        (
            {"model": "tiny", "prompt": "x", "max_tokens": 100000},
            "max_tokens",
            "at most 510 can be generated",
        ),
        ({"model": "tiny", "prompt": "x", "max_tokens": 0}, "max_tokens", "at least 1"),
        (
            {"model": "tiny", "prompt": "x", "temperature": "hot"},
            "temperature",
            "temperature must be a number",
        ),
        ({"model": "tiny", "prompt": "x", "temperature": 3}, "temperature", "between 0 and 2"),
        ({"model": "tiny", "prompt": "x", "stream": "yes"}, "stream", "stream must be a boolean"),
        ({"model": "tiny", "prompt": "x", "stop": [1]}, "stop", "stop must be"),
        ({"model": "tiny", "prompt": "x", "seed": -1}, "seed", "seed must be between"),
        ({"model": "tiny", "prompt": "x", "n": 0}, "n", "n must be at least 1"),
        ({"model": "tiny", "prompt": "x" * 600}, "prompt", "context is 512 tokens"),
    ],
)
def test_bad_completion_requests_get_400_naming_the_field(
    server: int, body: dict, param: str, message: str
) -> None:
    response = post(server, "/v1/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert message in error["message"]
    assert error["type"] == "invalid_request_error"
    assert set(error) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    "body,param",
    [
        ({"model": "tiny"}, "messages"),
        ({"model": "tiny", "messages": []}, "messages"),
        ({"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"model": "tiny", "messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 9999},
            "max_completion_tokens",
        ),
    ],
)
def test_bad_chat_requests_get_400_naming_the_field(server: int, body: dict, param: str) -> None:
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_body_that_is_not_json_is_a_400(server: int) -> None:
    response = httpx.post(f"http://127.0.0.1:{server}/v1/completions", content=b"{nope", timeout=30)
    assert response.status_code == 400
    assert "not valid JSON" in response.json()["error"]["message"]


def test_unknown_model_is_404(server: int) -> None:
    response = post(server, "/v1/completions", {"model": "gpt-9", "prompt": "x"})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"


def test_concurrent_requests_are_all_answered(server: int) -> None:
    results: dict[int, httpx.Response] = {}

    def call(index: int) -> None:
        body = {**GREEDY, "prompt": f"request {index}", "max_tokens": 8 + index}
        results[index] = post(server, "/v1/completions", body, timeout=120)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == list(range(8))
    for index, response in results.items():
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 8 + index


def _events(port: int, path: str, body: dict) -> list[str]:
    with httpx.stream("POST", f"http://127.0.0.1:{port}{path}", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]


def test_streamed_completion_matches_the_whole_one(server: int) -> None:
    whole = post(server, "/v1/completions", GREEDY).json()["choices"][0]["text"]
    events = _events(server, "/v1/completions", {**GREEDY, "stream": True})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert len(chunks) > 1
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == whole
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_streamed_chat_completion(server: int) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    events = _events(server, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_streaming_request_that_is_too_long_is_still_a_400(server: int) -> None:
    response = post(server, "/v1/completions", {**GREEDY, "max_tokens": 5000, "stream": True})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "max_tokens"


def test_health_ready_models_and_metrics(server: int) -> None:
    base = f"http://127.0.0.1:{server}"
    assert httpx.get(f"{base}/health").json() == {"status": "ok"}
    assert httpx.get(f"{base}/ready").status_code == 200
    models = httpx.get(f"{base}/v1/models").json()
    assert [model["id"] for model in models["data"]] == ["tiny"]
    post(server, "/v1/completions", GREEDY)
    post(server, "/v1/completions", {"model": "tiny"})
    metrics = httpx.get(f"{base}/metrics").text
    assert 'warmstart_worker_start_seconds{mode="cold"}' in metrics
    assert 'warmstart_worker_requests_total{route="/v1/completions",status="200"}' in metrics
    assert 'warmstart_worker_requests_total{route="/v1/completions",status="400"}' in metrics
    assert "warmstart_worker_time_to_first_token_seconds_count" in metrics
    assert "warmstart_worker_prompt_tokens_total" in metrics
    assert "warmstart_worker_request_duration_seconds_bucket" in metrics


def _prompt_tokens_total(port: int) -> float:
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics").text.splitlines():
        if line.startswith("warmstart_worker_prompt_tokens_total "):
            return float(line.split()[1])
    raise AssertionError("no warmstart_worker_prompt_tokens_total sample")


def test_a_refused_stream_request_counts_no_prompt_tokens(server: int) -> None:
    before = _prompt_tokens_total(server)
    response = post(server, "/v1/completions", {**GREEDY, "stream": True, "n": 2})
    assert response.status_code == 400 and response.json()["error"]["param"] == "stream"
    assert _prompt_tokens_total(server) == before
    post(server, "/v1/completions", GREEDY)
    assert _prompt_tokens_total(server) == before + 17  # the counter itself moves
