"""Continuous batching: sequences join the running decode batch as KV slots free up.

One thread drives the model. A new sequence is prefilled alone into a free slot, then decoded together with
every other running sequence one token per step; a finished sequence frees its slot for the next waiting
one. `run_inline()` drives the same loop in the caller's thread (warm-up, before any thread exists).
"""

from __future__ import annotations

import collections
import logging
import queue
import random
import threading
from collections.abc import Callable, Iterator

import torch

from warmstart.engines.base import EngineError, GenerationRequest, GenerationResult, TokenDelta
from warmstart.engines.builtin.model import Transformer
from warmstart.engines.builtin.tokenizer import ByteTokenizer, IncrementalDecoder

log = logging.getLogger(__name__)

DecodeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Sequence:
    """One request in flight: its prompt, output so far, and how its caller is told about progress."""

    def __init__(self, request: GenerationRequest, prompt_ids: list[int], streaming: bool = False) -> None:
        self.request = request
        self.sampling = request.sampling
        self.prompt_ids = prompt_ids
        self.output_ids: list[int] = []
        self.slot = -1
        self.finish_reason: str | None = None
        self._decoder = IncrementalDecoder()
        self._text = ""
        self._emitted_chars = 0
        self._emitted_tokens = 0
        self._deltas: queue.SimpleQueue[TokenDelta | BaseException] | None = (
            queue.SimpleQueue() if streaming else None
        )
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._generator: torch.Generator | None = None
        if not self.sampling.greedy:
            seed = self.sampling.seed if self.sampling.seed is not None else random.getrandbits(62)
            self._generator = torch.Generator().manual_seed(seed)

    @property
    def next_position(self) -> int:
        """Where the last sampled token goes in the KV cache when it is fed back."""
        return len(self.prompt_ids) + len(self.output_ids) - 1

    def accept(self, token: int, eos_id: int, max_len: int) -> bool:
        """Take a sampled token; returns True when the sequence is finished."""
        if token == eos_id and not self.sampling.ignore_eos:
            return self._finish("stop")
        self.output_ids.append(token)
        self._text += self._decoder.push(token)
        cut = self._stop_position()
        if cut is not None:
            self._text = self._text[:cut]
            return self._finish("stop", flush=False)
        if len(self.output_ids) >= self.sampling.max_tokens or self.next_position + 1 >= max_len:
            return self._finish("length")
        self._emit(final=False)
        return False

    def sample(self, logits: torch.Tensor) -> int:
        probs = torch.softmax(logits.float().cpu() / self.sampling.temperature, dim=-1)
        if self.sampling.top_p < 1.0:
            ordered, order = probs.sort(descending=True)
            outside = ordered.cumsum(-1) - ordered > self.sampling.top_p
            ordered[outside] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, ordered)
        return int(torch.multinomial(probs, 1, generator=self._generator))

    def fail(self, error: BaseException) -> None:
        self._error = error
        if self._deltas is not None:
            self._deltas.put(error)
        self._done.set()

    def result(self) -> GenerationResult:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return GenerationResult(
            request_id=self.request.request_id,
            text=self._text,
            token_ids=tuple(self.output_ids),
            prompt_tokens=len(self.prompt_ids),
            finish_reason=self.finish_reason or "length",
        )

    def deltas(self) -> Iterator[TokenDelta]:
        while True:
            item = self._deltas.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finish_reason is not None:
                return

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def _finish(self, reason: str, flush: bool = True) -> bool:
        if flush:
            self._text += self._decoder.flush()
        self.finish_reason = reason
        self._emit(final=True)
        self._done.set()
        return True

    def _stop_position(self) -> int | None:
        found = (self._text.find(stop) for stop in self.sampling.stop if stop)
        return min((index for index in found if index >= 0), default=None)

    def _emit(self, final: bool) -> None:
        if self._deltas is None:
            return
        # Hold back text that could still turn out to be the start of a stop string.
        holdback = 0 if final else max((len(stop) - 1 for stop in self.sampling.stop), default=0)
        upto = max(self._emitted_chars, len(self._text) - holdback)
        if upto == self._emitted_chars and not final:
            return
        tokens = tuple(self.output_ids[self._emitted_tokens :])
        reason = self.finish_reason if final else None
        delta = TokenDelta(self._text[self._emitted_chars : upto], tokens, reason, len(self.prompt_ids))
        self._emitted_chars, self._emitted_tokens = upto, len(self.output_ids)
        self._deltas.put(delta)


class Scheduler:
    """Owns the KV slots and the driving thread."""

    def __init__(
        self, model: Transformer, tokenizer: ByteTokenizer, max_seqs: int, max_len: int, decode: DecodeFn
    ) -> None:
        self._model = model
        self._tokenizer = tokenizer
        self._max_len = max_len
        self._decode = decode
        self._free_slots = list(range(max_seqs - 1, -1, -1))
        self._pending: collections.deque[Sequence] = collections.deque()
        self._active: list[Sequence] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, sequence: Sequence) -> None:
        with self._cond:
            if self._stopping:
                raise EngineError("the engine is releasing its memory; retry after it resumes")
            self._pending.append(sequence)
            if not self.running:
                self._thread = threading.Thread(target=self._loop, name="warmstart-scheduler", daemon=True)
                self._thread.start()
            self._cond.notify()

    def stop(self) -> None:
        """Stop the thread; sequences still waiting or running fail with an EngineError."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join()
        with self._cond:
            self._thread = None
            self._stopping = False
            for sequence in [*self._pending, *self._active]:
                self._retire(sequence, EngineError("the engine stopped before this request finished"))
            self._pending.clear()

    def cancel(self, sequence: Sequence) -> None:
        """Stop generating for `sequence` (its client left): its KV slot goes back at once."""
        with self._cond:
            if sequence.done:
                return
            if sequence in self._pending:
                self._pending.remove(sequence)
            self._retire(sequence, EngineError("cancelled: the client went away"))

    def run_inline(self, sequences: list[Sequence]) -> None:
        """Drive the loop in this thread until `sequences` are finished (no scheduler thread may run)."""
        if self.running:
            raise EngineError("run_inline() while the scheduler thread runs")
        self._pending.extend(sequences)
        while not all(sequence.done for sequence in sequences):
            self._iteration()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._active and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
            self._iteration()

    def _iteration(self) -> None:
        with torch.no_grad():
            self._admit()
            self._step()

    def _admit(self) -> None:
        while True:
            with self._cond:
                if not self._pending or not self._free_slots:
                    return
                sequence = self._pending.popleft()
                sequence.slot = self._free_slots.pop()
            try:
                ids = torch.tensor(sequence.prompt_ids, dtype=torch.long, device=self._model.device)
                logits = self._model.prefill(ids, sequence.slot)[None]
                self._take(sequence, self._pick([sequence], logits)[0])
            except Exception as exc:  # the request fails, the engine keeps serving
                log.exception("prefill failed for request %s", sequence.request.request_id)
                self._retire(sequence, exc)

    def _step(self) -> None:
        batch = list(self._active)
        if not batch:
            return
        device = self._model.device
        try:
            tokens = torch.tensor([s.output_ids[-1] for s in batch], dtype=torch.long, device=device)
            positions = torch.tensor([s.next_position for s in batch], dtype=torch.long, device=device)
            slots = torch.tensor([s.slot for s in batch], dtype=torch.long, device=device)
            picked = self._pick(batch, self._decode(tokens, positions, slots))
        except Exception as exc:
            log.exception("decode step failed; failing %d running requests", len(batch))
            for sequence in batch:
                self._retire(sequence, exc)
            return
        for sequence, token in zip(batch, picked, strict=True):
            self._take(sequence, token)

    def _take(self, sequence: Sequence, token: int | Exception) -> None:
        if sequence.done:  # cancelled while its token was computed: its slot is free already
            return
        if isinstance(token, Exception):  # this request's sampling failed; the others carry on
            log.error("sampling failed for request %s: %s", sequence.request.request_id, token)
            self._retire(sequence, token)
        elif sequence.accept(token, self._tokenizer.eos_id, self._max_len):
            self._retire(sequence)
        elif sequence not in self._active:
            self._active.append(sequence)

    def _pick(self, batch: list[Sequence], logits: torch.Tensor) -> list[int | Exception]:
        logits = logits[:, : self._tokenizer.vocab_size]
        tokens: list[int | Exception] = logits.argmax(dim=-1).tolist()
        for row, sequence in enumerate(batch):
            if not sequence.sampling.greedy:
                try:
                    tokens[row] = sequence.sample(logits[row])
                except (RuntimeError, ValueError) as exc:
                    tokens[row] = exc
        return tokens

    def _retire(self, sequence: Sequence, error: BaseException | None = None) -> None:
        """Take `sequence` out of the running batch and give its KV slot back; fail it with `error`."""
        if sequence in self._active:
            self._active.remove(sequence)
        if sequence.slot >= 0:
            with self._cond:
                self._free_slots.append(sequence.slot)
            sequence.slot = -1
        if error is not None:
            sequence.fail(error)
