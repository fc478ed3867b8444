"""The one thread that owns vLLM's `LLMEngine` (not thread-safe): requests join the running batch between
engine steps, and each step's cumulative output becomes deltas for streaming."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator
from typing import Any

from warmstart.engines.base import EngineError, GenerationResult, RequestError, TokenDelta

log = logging.getLogger(__name__)


class _Submission:
    """One request in flight: the driver thread puts deltas (or an error) on its queue."""

    def __init__(self, request_id: str, prompt: dict[str, Any], params: Any, prompt_tokens: int) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.prompt_tokens = prompt_tokens
        self._events: queue.SimpleQueue[TokenDelta | Exception] = queue.SimpleQueue()
        self._text = ""
        self._token_count = 0
        self.done = False

    def deltas(self) -> Iterator[TokenDelta]:
        while True:
            event = self._events.get()
            if isinstance(event, Exception):
                self.done = True
                raise event
            if event.finish_reason is not None:
                self.done = True
            yield event
            if self.done:
                return

    def result(self) -> GenerationResult:
        text, ids, finish_reason = [], [], "stop"
        for delta in self.deltas():
            text.append(delta.text)
            ids.extend(delta.token_ids)
            finish_reason = delta.finish_reason or finish_reason
        return GenerationResult(self.request_id, "".join(text), tuple(ids), self.prompt_tokens, finish_reason)

    def fail(self, error: Exception) -> None:
        self._events.put(error)

    def publish(self, output: Any) -> bool:
        """Turn one cumulative `RequestOutput` into a delta; True when the request is finished."""
        completion = output.outputs[0]
        text = completion.text[len(self._text) :] if completion.text.startswith(self._text) else ""
        ids = tuple(completion.token_ids[self._token_count :])
        self._text, self._token_count = completion.text, len(completion.token_ids)
        if not output.finished:
            if text or ids:
                self._events.put(TokenDelta(text, ids))
            return False
        if completion.finish_reason not in ("stop", "length"):
            self.fail(EngineError(f"vLLM ended request {self.request_id}: {completion.finish_reason}"))
        else:
            self._events.put(TokenDelta(text, ids, completion.finish_reason, self.prompt_tokens))
        return True


_STOP = None  # in the driver's inbox: stop the thread; a str there: abort the request with that id


class _Driver:
    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._inbox: queue.SimpleQueue[_Submission | str | None] = queue.SimpleQueue()
        self._active: dict[str, _Submission] = {}
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, submission: _Submission) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="vllm-driver", daemon=True)
                self._thread.start()
            self._inbox.put(submission)

    def cancel(self, request_id: str) -> None:
        with self._lock:
            if self._thread is not None:
                self._inbox.put(request_id)

    def stop(self) -> None:
        with self._lock:
            if self._thread is None:
                return
            self._inbox.put(_STOP)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        try:
            while self._take_new(block=not self._active):
                if self._active:
                    self._step()
        except Exception as exc:  # noqa: BLE001 (a dead driver must not leave callers waiting forever)
            log.exception("the vLLM driver thread failed")
            self._abort_all(EngineError(f"the vLLM driver failed: {exc}"))
            self._fail_queued(EngineError(f"the vLLM driver failed: {exc}"))
            return
        self._abort_all(EngineError("the engine was released or closed while this request ran"))

    def _fail_queued(self, error: Exception) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _Submission):
                item.fail(error)

    def _take_new(self, block: bool) -> bool:
        """Add queued submissions to the engine; False once asked to stop."""
        try:
            item = self._inbox.get(block=block)
        except queue.Empty:
            return True
        while True:
            if item is _STOP:
                return False
            if isinstance(item, str):
                self._cancel(item)
            else:
                self._add(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _add(self, submission: _Submission) -> None:
        try:
            self._engine.add_request(submission.request_id, submission.prompt, submission.params)
        except ValueError as exc:  # vLLM's own request validation
            submission.fail(RequestError(str(exc), "prompt"))
            return
        except Exception as exc:  # noqa: BLE001 (reported to the caller, the driver carries on)
            submission.fail(EngineError(f"vLLM refused request {submission.request_id}: {exc}"))
            return
        self._active[submission.request_id] = submission

    def _cancel(self, request_id: str) -> None:
        submission = self._active.pop(request_id, None)
        if submission is None:
            return  # finished meanwhile
        self._engine.abort_request([request_id])
        submission.fail(EngineError(f"request {request_id} was cancelled"))

    def _step(self) -> None:
        try:
            outputs = self._engine.step()
        except Exception as exc:  # noqa: BLE001 (every request in the batch fails the same way)
            log.exception("vLLM engine step failed")
            self._abort_all(EngineError(f"the vLLM engine step failed: {exc}"))
            return
        for output in outputs:
            submission = self._active.get(output.request_id)
            if submission is not None and submission.publish(output):
                del self._active[output.request_id]

    def _abort_all(self, error: Exception) -> None:
        if not self._active:
            return
        try:
            self._engine.abort_request(list(self._active))
        except Exception:  # noqa: BLE001 (the callers learn of the failure below either way)
            log.exception("vLLM could not abort %d requests", len(self._active))
        for submission in self._active.values():
            submission.fail(error)
        self._active.clear()
