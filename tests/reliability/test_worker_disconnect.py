"""A client that leaves mid-generation: the worker closes the engine's stream (the engines' way of being told
to stop), for streamed and non-streamed requests alike, and the engine frees the slot."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import pytest
from reliability_helpers import connect, wait_until

from warmstart.engines.base import Engine, GenerationRequest, SamplingParams, TokenDelta

pytestmark = pytest.mark.reliability

MAX_TOKENS = 500


class ClosingRecorder(Engine):
    """The tiny engine, recording which of its streams were closed before they finished."""

    kind = "recording"

    def __init__(self, inner: Engine) -> None:
        self.inner = inner
        self.closed_early = threading.Event()
        self.tokens = 0

    served_model_name = property(lambda self: self.inner.served_model_name)
    max_model_len = property(lambda self: self.inner.max_model_len)

    def load(self) -> None: ...

    def warm_up(self) -> None: ...

    def release(self) -> bool:
        return False

    def reacquire(self) -> None: ...

    def identity(self):
        return self.inner.identity()

    def count_prompt_tokens(self, request: GenerationRequest) -> int:
        return self.inner.count_prompt_tokens(request)

    def generate(self, requests):
        return self.inner.generate(requests)

    def stream(self, request: GenerationRequest) -> Iterator[TokenDelta]:
        finished = False
        try:
            for delta in self.inner.stream(request):
                self.tokens += len(delta.token_ids)
                finished = delta.finish_reason is not None
                yield delta
        finally:
            if not finished:
                self.closed_early.set()


def _send(port: int, body: dict) -> object:
    payload = json.dumps(body).encode()
    sock = connect(port)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    return sock


@pytest.mark.spawns
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_engine_stream_is_closed_when_the_client_leaves(serve_in_process, tiny_engine, stream) -> None:
    recorder = ClosingRecorder(tiny_engine)
    server = serve_in_process(engine=recorder)
    body = {"model": "tiny", "prompt": "x", "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": stream}
    sock = _send(server.port, body)
    wait_until(lambda: recorder.tokens >= 2, "the first tokens")
    sock.close()
    assert recorder.closed_early.wait(timeout=120), "the engine stream was read to its end"
    wait_until(lambda: server.metrics.requests_running._value.get() == 0, "the running gauge to drop")
    assert server.metrics.requests_cancelled._value.get() == 1


def test_closing_a_builtin_stream_stops_its_sequence_and_frees_the_slot(tiny_engine, monkeypatch) -> None:
    sequences = []
    make_sequence = tiny_engine._sequence

    def recording_sequence(*args, **kwargs):
        sequences.append(make_sequence(*args, **kwargs))
        return sequences[-1]

    monkeypatch.setattr(tiny_engine, "_sequence", recording_sequence)
    sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    stream = tiny_engine.stream(GenerationRequest(prompt="x", sampling=sampling))
    next(stream), next(stream)
    stream.close()
    scheduler = tiny_engine._scheduler
    wait_until(lambda: not scheduler._active and not scheduler._pending, "the scheduler to go idle")
    assert len(sequences[0].output_ids) < MAX_TOKENS
