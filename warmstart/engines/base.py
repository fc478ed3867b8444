"""The engine interface the worker drives: small enough for the builtin engine and for vLLM.

Lifecycle: `load()` -> `warm_up()` -> [`release()` -> checkpoint -> restore -> `reacquire()`] -> serve with
`generate()` / `stream()`. `release()` frees what a checkpoint should not carry (KV cache, and weights where
the engine can re-create them); `reacquire()` brings it back after a resume.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from warmstart.api.identity import SnapshotIdentity

GREEDY_BELOW = 1e-5


class EngineError(RuntimeError):
    """The engine cannot do what was asked (bad options, missing model, wrong state)."""


class RequestError(ValueError):
    """A generation request is invalid; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. `temperature == 0` is greedy; `seed` makes sampled output reproducible."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        # Below this, sampling is greedy in all but name and dividing logits by it overflows.
        return self.temperature < GREEDY_BELOW


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt to complete: either text or already-tokenized ids."""

    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = ""


@dataclass(frozen=True)
class GenerationResult:
    request_id: str
    text: str
    token_ids: tuple[int, ...]
    prompt_tokens: int
    finish_reason: str  # "stop" (EOS or a stop string) or "length"


@dataclass(frozen=True)
class TokenDelta:
    """A piece of streamed output; the last one carries `finish_reason`."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    prompt_tokens: int = 0


class Engine(abc.ABC):
    """What the worker needs from an inference engine; engines set `_name` and `_max_len`."""

    kind: str = ""
    _name: str
    _max_len: int

    @property
    def served_model_name(self) -> str:
        return self._name

    @property
    def max_model_len(self) -> int:
        return self._max_len

    @abc.abstractmethod
    def load(self) -> None:
        """Read the model and allocate what inference needs."""

    @abc.abstractmethod
    def warm_up(self) -> None:
        """Run the code paths once (and capture CUDA graphs) so the first real request is fast."""

    @abc.abstractmethod
    def release(self) -> bool:
        """Free memory a checkpoint should not carry; return True when the weights were released too."""

    @abc.abstractmethod
    def reacquire(self) -> None:
        """Undo `release()` after a resume: re-create the KV cache and reload released weights."""

    @abc.abstractmethod
    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Complete all `requests` (batched together); results are in request order."""

    @abc.abstractmethod
    def identity(self) -> SnapshotIdentity:
        """What a snapshot of this engine is valid for."""

    def count_prompt_tokens(self, request: GenerationRequest) -> int:
        """How many tokens the prompt takes; engines with a tokenizer override this."""
        return len(request.prompt_token_ids or ())

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        """The prompt text for chat `messages` ({role, content}); engines apply their model's template."""
        return "".join(f"{message['role']}: {message['content']}\n" for message in messages) + "assistant: "

    def stream(self, request: GenerationRequest) -> Iterator[TokenDelta]:
        """Stream one request; engines without incremental output yield the whole result once."""
        result = self.generate([request])[0]
        yield TokenDelta(result.text, result.token_ids, result.finish_reason, result.prompt_tokens)

    def close(self) -> None:  # noqa: B027 (optional hook, not abstract)
        """Stop background work; the default has none."""

    def describe(self) -> dict[str, Any]:
        """Facts for logs and the `ready-for-snapshot` payload."""
        return {"engine": self.kind, "model": self.served_model_name, "max_model_len": self.max_model_len}


def check_fits(prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """A RequestError unless the prompt plus `max_tokens` (at least 1) fits the context."""
    if prompt_tokens == 0:
        raise RequestError("the prompt is empty", "prompt")
    if prompt_tokens >= max_model_len:
        raise RequestError(
            f"the prompt has {prompt_tokens} tokens; this model takes at most {max_model_len - 1}", "prompt"
        )
    if max_tokens < 1 or prompt_tokens + max_tokens > max_model_len:
        room = max_model_len - prompt_tokens
        raise RequestError(
            f"max_tokens must be between 1 and {room} for this prompt ({prompt_tokens} tokens, "
            f"max_model_len {max_model_len}), got {max_tokens}",
            "max_tokens",
        )


def check_token_ids(ids: tuple[int, ...], vocab_size: int) -> list[int]:
    """The prompt's token ids as a list, or a RequestError naming the first one outside the vocabulary."""
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise RequestError(f"token id {bad[0]} is outside 0..{vocab_size - 1}", "prompt")
    return list(ids)
