"""vLLM's asynchronous engine (`AsyncLLM`, under its OpenAI server) with the engine core in this process.

vLLM builds `AsyncLLM` on a client that runs the engine core in a second process and talks to it over ZMQ;
in-process it supports only the synchronous `LLMEngine`. A checkpoint wants one process holding the CUDA
context, so `InprocAsyncClient` gives `AsyncLLM` the async client interface over an engine core in this
process. Every call into the core (adding and aborting requests, steps, sleep, wake, RPCs) runs on one
thread, in order: the core is not thread-safe (the event loop only reads whether the scheduler has
requests, to know whether to step). Outputs are stepped only while the core has requests. With tensor
parallelism vLLM's executor still runs a process per rank, which the agent checkpoints with this one.

The client works from any event loop, one at a time: the engine is warmed up in a short-lived loop before
the checkpoint and serves in uvicorn's loop after resume. `quiesce()` stops its thread before a checkpoint.

It wraps anything with the engine core's methods (`step_fn`, `post_step`, `preprocess_add_request`,
`add_request`, `abort_requests`, `sleep`, `wake_up`, `collective_rpc`, ...; `scheduler.has_requests()`),
so the tests drive it with a fake core.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any


@dataclass
class _Resources:
    """What `AsyncLLM` reads of the multi-process client's resources."""

    engine_dead: bool = False


class InprocAsyncClient:
    """The async engine-core client `AsyncLLM` expects, over an engine core in this process."""

    def __init__(self, core: Any) -> None:
        self.engine_core = core
        self.engine_ranks_managed = [0]
        self.resources = _Resources()
        self._executor: ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._has_work: asyncio.Event | None = None

    # --- on the core's thread ------------------------------------------------------------------------

    async def _run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with self._executor_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-core")
            future = self._executor.submit(fn, *args, **kwargs)
        return await asyncio.wrap_future(future)

    def quiesce(self) -> None:
        """Stop the core's thread (a later call starts a new one): nothing of ours runs in a checkpoint."""
        with self._executor_lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)

    def _step(self) -> tuple[Any, bool]:
        core = self.engine_core
        outputs, executed = core.step_fn()
        core.post_step(model_executed=executed)
        return (outputs or {}).get(0), core.scheduler.has_requests()

    def _add(self, request: Any) -> None:
        prepared, wave = self.engine_core.preprocess_add_request(request)
        self.engine_core.add_request(prepared, wave)

    def _abort(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    # --- the event loop side -------------------------------------------------------------------------

    def _work_event(self) -> asyncio.Event:
        """The event that says the core has requests, for the running loop (a new loop gets a new one)."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._has_work is None:
            self._loop, self._has_work = loop, asyncio.Event()
            if self.engine_core.scheduler.has_requests():
                self._has_work.set()
        return self._has_work

    async def get_output_async(self) -> Any:
        """The next step's outputs; waits while the core has nothing to do."""
        while True:
            has_work = self._work_event()
            await has_work.wait()
            outputs, more = await self._run(self._step)
            if not more:
                has_work.clear()
            if outputs is not None and (outputs.outputs or outputs.scheduler_stats is not None):
                return outputs

    async def add_request_async(self, request: Any) -> None:
        await self._run(self._add, request)
        self._work_event().set()

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        await self._run(self._abort, list(request_ids))

    async def sleep_async(self, level: int = 1, mode: str = "abort") -> None:
        if mode == "wait":
            raise ValueError("an in-process engine core cannot wait for running requests: use 'abort'")
        await self._run(self.engine_core.sleep, level, mode)

    async def collective_rpc_async(
        self, method: Any, timeout: float | None = None, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        return await self._run(self.engine_core.collective_rpc, method, timeout, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        # The other `<method>_async` calls of vLLM's client (wake_up, is_sleeping, reset_prefix_cache,
        # get_supported_tasks, profile, loras, pause/resume scheduler, ...) are the core's `<method>`.
        if name.endswith("_async") and not name.startswith("_"):
            target = getattr(self.engine_core, name.removesuffix("_async"))

            async def call_on_core(*args: Any, **kwargs: Any) -> Any:
                return await self._run(target, *args, **kwargs)

            return call_on_core
        raise AttributeError(name)

    def dp_engines_running(self) -> bool:
        return False

    def shutdown(self, timeout: float | None = None) -> None:
        self.quiesce()
        self.resources.engine_dead = True
        self.engine_core.shutdown()


@contextlib.contextmanager
def inproc_engine_core() -> Iterator[None]:
    """While active, `AsyncLLM(...)` builds its engine core in this process, on an `InprocAsyncClient`."""
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.engine.core_client import EngineCoreClient

    original = EngineCoreClient.__dict__["make_async_mp_client"]  # the staticmethod itself

    def make_inproc(vllm_config: Any, executor_class: Any, log_stats: bool, *_args: Any, **_kw: Any) -> Any:
        return InprocAsyncClient(EngineCore(vllm_config, executor_class, log_stats))

    EngineCoreClient.make_async_mp_client = staticmethod(make_inproc)
    try:
        yield
    finally:
        setattr(EngineCoreClient, "make_async_mp_client", original)  # noqa: B010 (a descriptor, not a value)
