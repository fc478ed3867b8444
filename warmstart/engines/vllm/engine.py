"""The vLLM engine behind the `Engine` interface (the optional `warmstart[vllm]` extra).

vLLM is imported only in `load()`, so naming this engine, translating its options and checking requests work
where vLLM is not installed. The engine is built with `enable_sleep_mode=True`: `release()` puts it to sleep
before a checkpoint (level 2 by default: weights and KV cache are discarded, so neither travels in the
snapshot; level 1 keeps the weights in CPU memory, inside the snapshot) and `reacquire()` wakes it, reloading
the weights from the model files after a level-2 sleep. vLLM's sleep-mode allocator keeps the virtual
addresses of what it frees, so captured CUDA graphs stay valid across a sleep.

With warmstart's server, requests are served by one thread that owns the `LLMEngine` (`driver`); it starts
with the first request and stops in `release()`, so a process about to be checkpointed runs no thread of ours.

Before vLLM is imported the engine sets what makes its process dumpable (`quiesce`): the engine core in
this process, torch.distributed's rendezvous through a file instead of a TCP store on libuv (whose io_uring
CRIU cannot dump). After a level-2 sleep the weights come back, fastest first: copied on the GPU from the
block a weight stager filled while the process was being restored (`weights_staged`: the restore starts a
stager when the snapshot carries the engine's `weight_staging_plan()`; `WARMSTART_VLLM_STAGED_WEIGHTS=0` at
capture gives none), read from the model's own files (`weights_files`), or through vLLM's
`reload_weights`. When `WARMSTART_VLLM_WEIGHTS_IMAGE` names a directory, an image of the loaded parameters
is written there at release and read back instead (`weights_image`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from warmstart.api.identity import SnapshotIdentity
from warmstart.engines.base import (
    Engine,
    EngineError,
    GenerationRequest,
    GenerationResult,
    RequestError,
    SamplingParams,
    TokenDelta,
    check_fits,
    check_token_ids,
)
from warmstart.engines.machine import gpu_facts
from warmstart.engines.vllm import kv_cache, memory, weights_files, weights_staged
from warmstart.engines.vllm.driver import _Driver, _Submission
from warmstart.engines.vllm.frontend import WARM_UP_COMPLETION, ServingApp, VllmFrontend
from warmstart.engines.vllm.identity import (
    ENGINE_KIND,
    model_files_digest,
    resolve_model_dir,
    snapshot_identity,
)
from warmstart.engines.vllm.options import VllmOptions, import_vllm, sampling_kwargs
from warmstart.engines.vllm.quiesce import apply_env_defaults, open_resources, undumpable, use_file_rendezvous
from warmstart.gpu.local_memory import LocalMemoryLimit
from warmstart.gpu.weight_stager.plan import StagingPlan
from warmstart.host.env import env_flag

log = logging.getLogger(__name__)

WEIGHTS_IMAGE_ENV = "WARMSTART_VLLM_WEIGHTS_IMAGE"  # a directory: write an image of the weights at release
# A file in that directory naming how a resumed engine gets its weights back: "image" (the default when an
# image exists) or "reload" (vLLM's reload_weights); read at resume: one snapshot is measured both ways.
REFILL_CHOICE_FILE = "refill"
TRIM_ENV = "WARMSTART_VLLM_TRIM"  # "0": leave cached GPU and host memory in place at release
# "0" at capture: no staging plan (the weights come back from the model's files after the wake); by default
# a weight stager fills them while the process is restored (`weights_staged`).
STAGED_WEIGHTS_ENV = "WARMSTART_VLLM_STAGED_WEIGHTS"
# Refill defaults: on the H200, 16 MiB pinned chunks on 8 threads beat 64 MiB ones (smaller pinned
# allocations at resume, more copies in flight).
REFILL_THREADS = 8
REFILL_CHUNK_MIB = 16


def staging_wanted(tensor_parallel_size: int) -> bool:
    return tensor_parallel_size == 1 and env_flag(STAGED_WEIGHTS_ENV, True)


class VllmEngine(Engine):
    kind = ENGINE_KIND

    def __init__(
        self,
        model: str,
        model_dir: str | os.PathLike[str] | None = None,
        device: str = "cuda",
        served_model_name: str | None = None,
        dtype: str | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        cuda_graph_sizes: list[int] | tuple[int, ...] | None = None,
        seed: int = 0,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.9,
        enforce_eager: bool = False,
        sleep_level: int = 2,
        engine_args: dict[str, Any] | None = None,
        in_process: bool = True,
        api: str = "vllm",
        server_args: Sequence[str] = (),
    ) -> None:
        if device != "cuda":
            raise EngineError(
                f"the vllm engine runs on CUDA GPUs: pass --device cuda (got {device!r}); "
                "choose GPUs with CUDA_VISIBLE_DEVICES"
            )
        source = str(model_dir) if model_dir else model
        self.options = VllmOptions(
            model=source,
            dtype=dtype or "auto",
            tensor_parallel_size=tensor_parallel_size,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            seed=seed,
            cuda_graph_sizes=tuple(cuda_graph_sizes or ()),
            sleep_level=sleep_level,
            extra=dict(engine_args or {}),
            api=api,
            server_args=tuple(server_args),
        )
        self._name = served_model_name or (Path(source).name if Path(source).is_dir() else model)
        self._in_process = in_process
        self._llm: Any = None
        self._vllm: Any = None
        self._tokenizer: Any = None
        self._tokenizer_lock = threading.Lock()
        self._driver: _Driver | None = None
        self._frontend: VllmFrontend | None = None
        self._max_len = max_model_len or 0
        self._dtype = "" if self.options.dtype == "auto" else self.options.dtype
        self._model_dir: Path | None = Path(source) if Path(source).is_dir() else None
        self._digest: str | None = None
        self._asleep_level = 0
        self._ids = itertools.count()
        self._rendezvous: str | None = None
        self._held: dict[str, int] = {}
        self._weights_image: Path | None = None
        self._weights_plan: weights_files.Plan | None = None
        self._staging: weights_staged.Staging | None = None
        self._staged_socket: str | None = None
        self._kv_adopted: set[int] = set()  # KV cache allocations mapped on the stager's memory
        self._memory: dict[str, Any] = {}
        self._local_memory: LocalMemoryLimit | None = None
        self._kv_error: BaseException | None = None
        self.timings: dict[str, float] = {}

    @property
    def model_dir(self) -> Path | str:
        return self._model_dir or ""

    def load(self) -> None:
        if self._in_process:
            # One process holding the CUDA context, and nothing in it CRIU cannot dump (quiesce.py).
            apply_env_defaults()
        vllm = import_vllm()
        if self._in_process and self.options.tensor_parallel_size == 1:
            self._rendezvous = use_file_rendezvous(vllm)
        try:
            if self.options.api == "vllm":
                self._frontend = VllmFrontend(self.options, self._name, self.options.server_args)
                self._frontend.load()
                llm, model_config = self._frontend, self._frontend.model_config
            else:
                llm = vllm.LLM(**self.options.llm_kwargs())
                model_config = llm.llm_engine.model_config
                self._driver = _Driver(llm.llm_engine)
        except (ValueError, TypeError, OSError, RuntimeError) as exc:
            raise EngineError(f"vLLM could not load {self.options.model!r}: {exc}") from exc
        self._vllm, self._llm = vllm, llm
        self._tokenizer = llm.get_tokenizer()
        self._max_len = int(model_config.max_model_len)
        self._dtype = str(model_config.dtype).removeprefix("torch.")
        log.info(
            "loaded %s with vLLM %s (%s server): %s, tensor parallel %d, max_model_len %d",
            self._name,
            vllm.__version__,
            self.options.api,
            self._dtype,
            self.options.tensor_parallel_size,
            self._max_len,
        )

    def warm_up(self) -> None:
        if self._frontend is not None:
            self._frontend.warm_up()
            return
        request = GenerationRequest(
            prompt="warm up", sampling=SamplingParams(max_tokens=4), request_id="warm-up"
        )
        self.generate([request])

    def release(self) -> bool:
        llm = self._require_llm()
        if self._driver is not None:
            self._require_driver().stop()
        level = self.options.sleep_level
        image_dir = os.environ.get(WEIGHTS_IMAGE_ENV)
        if level == 2 and image_dir:
            self._save_weights_image(Path(image_dir))
        elif level == 2:
            self._plan_weights()
        awake = memory.breakdown()
        started = time.perf_counter()
        llm.sleep(level=level)
        self.timings["sleep_s"] = time.perf_counter() - started
        self._asleep_level = level
        self._memory = {"awake": awake, "asleep": memory.breakdown()}
        if os.environ.get(TRIM_ENV, "1") != "0":
            mark = time.perf_counter()
            self._memory["trimmed"] = memory.trim()
            self._memory["local_memory_lowered"] = self._lower_local_memory()
            self._memory["after_trim"] = memory.breakdown()
            self.timings["trim_s"] = time.perf_counter() - mark
        log.info("memory at release: %s", self._memory)
        self._held = open_resources()
        log.info("asleep (level %d) in %.2f s; the process holds %s", level, self.timings["sleep_s"],
                 self._held)  # fmt: skip
        bad = undumpable(self._held)
        if bad:
            log.warning("the process holds what CRIU cannot dump: %s; the capture will fail", ", ".join(bad))
        return level == 2

    def reacquire(self) -> None:
        llm = self._require_llm()
        if self._asleep_level == 0:
            return  # nothing was released
        started = time.perf_counter()
        if self._local_memory is not None:
            self._local_memory.restore()  # before any kernel runs
        if self._asleep_level == 2:
            llm.wake_up(tags=["weights"])
            self.timings["wake_weights_s"] = time.perf_counter() - started
            model = self._model()
            if self._take_staged_weights(model):
                self._wake_kv_cache(llm)  # only now: the staged block held the KV cache's room till here
            else:
                self._refill_weights_and_wake_kv_cache(llm, model)
        else:
            llm.wake_up()
        llm.reset_prefix_cache()  # cached prefixes pointed into the discarded KV cache
        self.timings["reacquire_s"] = time.perf_counter() - started
        self._asleep_level = 0
        log.info("awake: %s", ", ".join(f"{key} {value:.3f}" for key, value in self.timings.items()))

    def weight_staging_plan(self) -> StagingPlan | None:
        """What a weight stager puts on the GPU for the next `reacquire()`: the weights' file ranges in one
        block (`weights_staged`); None where it cannot help, or where the GPU has no room for the block."""
        self._staging = None
        if self._weights_plan is None or not staging_wanted(self.options.tensor_parallel_size):
            return None
        import torch

        from warmstart.gpu.cuda_arena import allocation_granularity
        from warmstart.host.cuda_driver import device_uuid

        index = torch.cuda.current_device()
        free, _total = torch.cuda.mem_get_info(index)
        kv_segments = kv_cache.segments(memory.cumem_allocator()) if kv_cache.wanted() else ()
        if not weights_staged.holds(kv_segments, self._weights_plan.nbytes) and not weights_staged.fits(
            self._weights_plan.nbytes, free
        ):
            log.info("no weight stager: %.1f GB free asleep, too little for the weights twice", free / 1e9)
            return None
        model_dir = self._resolve_model_dir().absolute()
        self._staging = weights_staged.staging(
            self._weights_plan,
            model_dir,
            index,
            device_uuid(index),
            allocation_granularity(index),
            kv_segments,
        )
        return self._staging.plan

    def expect_staged_weights(self, socket_path: str | os.PathLike[str] | None) -> None:
        """Have the next `reacquire()` copy the weights a weight stager prepared at `socket_path`."""
        self._staged_socket = None if socket_path is None else str(socket_path)

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        if self._frontend is not None:
            self._require_awake()
            return self._frontend.run(self._generate_async(requests))
        submissions = [self._submit(request) for request in requests]
        return [submission.result() for submission in submissions]

    def stream(self, request: GenerationRequest) -> Iterator[TokenDelta]:
        if self._frontend is not None:  # vLLM's server streams for HTTP clients; here the whole result once
            yield from super().stream(request)
            return
        submission = self._submit(request)
        try:
            yield from submission.deltas()
        finally:
            if not submission.done and self._driver is not None:  # the reader went away: stop its work
                self._driver.cancel(submission.request_id)

    def count_prompt_tokens(self, request: GenerationRequest) -> int:
        return len(self._prompt_ids(request))

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        tokenizer = self._require_tokenizer()
        if not getattr(tokenizer, "chat_template", None):
            return super().chat_prompt(messages)
        with self._tokenizer_lock:
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def identity(self) -> SnapshotIdentity:
        vllm = self._vllm or import_vllm()
        if self._digest is None:
            self._digest = model_files_digest(self._resolve_model_dir())
        return snapshot_identity(
            self.options, self._digest, vllm.__version__, self._max_len, self._dtype, self._gpu_facts()
        )

    def serving_app(self, ready: Callable[[], bool], metrics: Any) -> Any:
        """vLLM's own server (with /ready and the worker's metrics beside it), or None for warmstart's."""
        if self._frontend is None:
            return None
        return ServingApp(self._frontend, ready, metrics)

    def close(self) -> None:
        if self._driver is not None:
            self._driver.stop()
        if self._frontend is not None:
            self._frontend.shutdown()

    def describe(self) -> dict[str, Any]:
        facts = super().describe()
        facts.update(
            device="cuda",
            model_dir=str(self.model_dir),
            vllm_version=self._vllm.__version__ if self._vllm else "",
            tensor_parallel_size=self.options.tensor_parallel_size,
            sleep_level=self.options.sleep_level,
            api=self.options.api,
            rendezvous=self._rendezvous or "",
            held_at_release=self._held,
            weights_image=str(self._weights_image or ""),
            weights_from_files=self._weights_plan.nbytes if self._weights_plan else 0,
            weights_staged=self._staging.plan.copied_bytes if self._staging else 0,
            weights_staged_in_kv_cache=bool(self._staging and self._staging.plan.segments),
            warm_up=self._warm_up_record(),
            memory_at_release=self._memory,
            timings={key: round(value, 4) for key, value in self._all_timings().items()},
        )
        return facts

    def _warm_up_record(self) -> dict[str, Any]:
        """The warm-up completion and what the engine answered (vLLM's server only): what the process a
        snapshot holds answered, for a restored replica to be asked again."""
        if self._frontend is None or not self._frontend.warm_up_answer:
            return {}
        return {"request": dict(WARM_UP_COMPLETION), **self._frontend.warm_up_answer}

    def _all_timings(self) -> dict[str, float]:
        return {**self.timings, **(self._frontend.timings if self._frontend is not None else {})}

    def _model(self) -> Any:
        return self._require_llm().collective_rpc(_worker_model)[0]

    def _save_weights_image(self, directory: Path) -> None:
        from warmstart.engines.vllm import weights_image

        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{self.identity().digest()}.weights"
        try:
            model = self._model()
            if weights_image.reusable(model, path):
                # Named by the identity (the weights' digest, the engine args): the same bytes again.
                self._weights_image = path
                self.timings["weights_image_write_s"] = 0.0
                log.info("weights image %s already written; kept", path)
                return
            stats = weights_image.save(model, path)
        except (OSError, ValueError, RuntimeError) as exc:
            log.warning("no weights image (%s); the weights will be reloaded after resume", exc)
            return
        self._weights_image = path
        self.timings["weights_image_write_s"] = stats["seconds"]
        log.info("weights image %s: %.2f GB in %.2f s", path, stats["bytes"] / 1e9, stats["seconds"])

    def _plan_weights(self) -> None:
        """Where the weights' bytes are in the model's files, for the refill after the wake (none: reload)."""
        started = time.perf_counter()
        try:
            self._weights_plan = weights_files.plan(self._model(), self._resolve_model_dir())
        except (weights_files.NoPlan, OSError, RuntimeError) as exc:
            log.info("the weights will be reloaded through vLLM after resume: %s", exc)
            self._weights_plan = None
            return
        self.timings["weights_plan_s"] = time.perf_counter() - started
        log.info("weights planned from the model's files: %.2f GB, proven in %.2f s",
                 self._weights_plan.nbytes / 1e9, self.timings["weights_plan_s"])  # fmt: skip

    def _lower_local_memory(self) -> bool:
        """The driver's local-memory reserve out of the checkpoint (`gpu/local_memory.py`), where this
        process holds the engine's CUDA context (not a multiprocess engine's, nor tensor parallelism's)."""
        import torch

        if self.options.tensor_parallel_size != 1 or not torch.cuda.is_initialized():
            return False
        self._local_memory = LocalMemoryLimit(torch.cuda.current_device())
        return self._local_memory.lower()

    def _take_staged_weights(self, model: Any) -> bool:
        """The weights copied from the stager's block, when a stager was started; False: refill them."""
        socket_path, self._staged_socket = self._staged_socket, None
        if socket_path is None or self._staging is None or self._weights_plan is None:
            return False
        mark = time.perf_counter()
        try:
            stats, handles = weights_staged.copy_in(model, self._weights_plan, self._staging, socket_path)
        except Exception as exc:  # noqa: BLE001 (whatever went wrong with the stager, the files are there)
            log.warning("no staged weights (%s); refilling them from the model's files", exc)
            return False
        self.timings["weights_staged_s"] = time.perf_counter() - mark
        if handles:
            mark = time.perf_counter()
            allocator = memory.cumem_allocator()
            self._kv_adopted = kv_cache.adopt(allocator, handles, self._staging.plan.device_index)
            self.timings["kv_cache_adopted_s"] = time.perf_counter() - mark
        log.info("weights copied from the weight stager's block: %s", stats)
        return True

    def _refill_weights_and_wake_kv_cache(self, llm: Any, model: Any) -> None:
        choice = _refill_choice(self._weights_image.parent) if self._weights_image else RefillChoice()
        kv_thread = None
        refilled = self._weights_image is not None or self._weights_plan is not None
        if choice.overlap and choice.how != "reload" and refilled:
            # Mapping the KV cache (cuMemCreate + cuMemMap, ~0.25 s for 100 GiB) needs none of the
            # weights: it runs beside the refill, whose threads spend their time in preadv and copies.
            kv_thread = threading.Thread(target=self._wake_kv_cache, args=(llm,), name="vllm-kv-wake")
            kv_thread.start()
        mark = time.perf_counter()
        try:
            how = self._refill_weights(llm, model, choice)
        finally:
            if kv_thread is not None:
                kv_thread.join()
        self.timings[f"weights_{how}_s"] = time.perf_counter() - mark
        if kv_thread is None:
            self._wake_kv_cache(llm)
        elif self._kv_error is not None:
            raise EngineError(f"vLLM could not wake its KV cache: {self._kv_error}") from self._kv_error

    def _wake_kv_cache(self, llm: Any) -> None:
        mark = time.perf_counter()
        self._kv_error = None
        adopted, self._kv_adopted = self._kv_adopted, set()
        try:
            with kv_cache.mapped_ones_kept(adopted):
                llm.wake_up(tags=["kv_cache"])
        except Exception as exc:  # noqa: BLE001 (re-raised by reacquire in its own thread)
            self._kv_error = exc
            if threading.current_thread() is threading.main_thread():
                raise
        self.timings["wake_kv_cache_s"] = time.perf_counter() - mark

    def _refill_weights(self, llm: Any, model: Any, choice: RefillChoice) -> str:
        """Put the weights back after a level-2 wake; returns how ("image", "files" or "reload")."""
        image = self._weights_image
        if image is not None and image.exists() and choice.how != "reload":
            from warmstart.engines.vllm import weights_image

            try:
                stats = weights_image.refill(
                    model, image, threads=choice.threads, chunk_bytes=choice.chunk_bytes
                )
                log.info("weights refilled from %s at %.1f GB/s (%d threads, %d MiB chunks)", image,
                         stats["gb_per_s"], choice.threads, choice.chunk_bytes >> 20)  # fmt: skip
                return "image"
            except (OSError, ValueError, RuntimeError) as exc:
                log.warning("weights image unusable (%s); reloading from the model files", exc)
        elif self._weights_plan is not None and choice.how != "reload":
            try:
                stats = weights_files.refill(
                    model, self._resolve_model_dir(), self._weights_plan, choice.threads, choice.chunk_bytes
                )
                log.info("weights refilled from the model's files at %.1f GB/s", stats["gb_per_s"])
                return "files"
            except (OSError, ValueError, RuntimeError) as exc:
                log.warning("weights not refilled from the model's files (%s); reloading them", exc)
        try:
            llm.collective_rpc("reload_weights")
        except (AttributeError, NotImplementedError, RuntimeError) as exc:
            raise EngineError(
                f"this vLLM ({self._vllm.__version__}) cannot reload weights after a level-2 sleep: "
                f"{exc}; use sleep level 1"
            ) from exc
        return "reload"

    async def _generate_async(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        return list(await asyncio.gather(*(self._generate_one(request) for request in requests)))

    async def _generate_one(self, request: GenerationRequest) -> GenerationResult:
        ids = self._prompt_ids(request)
        check_fits(len(ids), request.sampling.max_tokens, self._max_len)
        params = self._vllm.SamplingParams(**sampling_kwargs(request.sampling))
        request_id = f"{request.request_id or 'request'}-{next(self._ids)}"
        final = None
        async for output in self._frontend.llm.generate({"prompt_token_ids": ids}, params, request_id):
            final = output
        if final is None or not final.outputs:
            raise EngineError(f"vLLM returned nothing for request {request_id}")
        completion = final.outputs[0]
        return GenerationResult(
            request_id,
            completion.text,
            tuple(completion.token_ids),
            len(ids),
            completion.finish_reason or "stop",
        )

    def _submit(self, request: GenerationRequest) -> _Submission:
        driver = self._require_driver()
        ids = self._prompt_ids(request)
        check_fits(len(ids), request.sampling.max_tokens, self._max_len)
        params = self._vllm.SamplingParams(**sampling_kwargs(request.sampling))
        request_id = f"{request.request_id or 'request'}-{next(self._ids)}"
        submission = _Submission(request_id, {"prompt_token_ids": ids}, params, len(ids))
        driver.submit(submission)
        return submission

    def _prompt_ids(self, request: GenerationRequest) -> list[int]:
        tokenizer = self._require_tokenizer()
        if request.prompt_token_ids is not None:
            return check_token_ids(request.prompt_token_ids, len(tokenizer))
        if request.prompt is None:
            raise RequestError("a request needs a prompt or prompt_token_ids", "prompt")
        if not request.prompt:
            return []
        # A chat template may already start with the BOS token; adding another would change the output.
        bos = getattr(tokenizer, "bos_token", None)
        add_special = not (bos and request.prompt.startswith(bos))
        with self._tokenizer_lock:
            return list(tokenizer.encode(request.prompt, add_special_tokens=add_special))

    def _resolve_model_dir(self) -> Path:
        if self._model_dir is None:
            self._model_dir = resolve_model_dir(self.options.model, self.options.extra.get("revision"))
        return self._model_dir

    def _gpu_facts(self) -> tuple[str, str, int]:
        import torch

        if not torch.cuda.is_available():
            return "", "", 0
        return gpu_facts(torch.device("cuda", torch.cuda.current_device()))

    def _require_llm(self) -> Any:
        if self._llm is None:
            raise EngineError("the engine is not loaded; call load() first")
        return self._llm

    def _require_tokenizer(self) -> Any:
        self._require_llm()
        return self._tokenizer

    def _require_driver(self) -> _Driver:
        self._require_awake()
        return self._driver

    def _require_awake(self) -> None:
        self._require_llm()
        if self._asleep_level:
            raise EngineError("the engine is released; call reacquire() first")


def _worker_model(worker: Any) -> Any:
    """Run by vLLM's executor on its worker: the model whose parameters the weights live in."""
    runner = worker.model_runner
    return runner.get_model() if hasattr(runner, "get_model") else runner.model


@dataclass(frozen=True)
class RefillChoice:
    """How a resumed engine gets its weights back, read from the refill file at resume (so one snapshot
    can be measured several ways): ``image`` or ``reload``, then optional ``threads=N``, ``chunk=MiB``,
    ``overlap=0|1`` (map the KV cache while the weights are refilled)."""

    how: str = "image"
    threads: int = REFILL_THREADS
    chunk_bytes: int = REFILL_CHUNK_MIB << 20
    overlap: bool = True

    @classmethod
    def parse(cls, text: str) -> RefillChoice:
        words = text.split()
        how = words[0] if words and "=" not in words[0] else "image"
        values = dict(word.split("=", 1) for word in words if "=" in word)
        try:
            return cls(
                how=how,
                threads=max(1, int(values.get("threads", REFILL_THREADS))),
                chunk_bytes=max(1, int(values.get("chunk", REFILL_CHUNK_MIB))) << 20,
                overlap=values.get("overlap", "1") != "0",
            )
        except ValueError:
            log.warning("ignoring a refill file that does not parse: %r", text)
            return cls(how=how)


def _refill_choice(directory: Path) -> RefillChoice:
    try:
        return RefillChoice.parse((directory / REFILL_CHOICE_FILE).read_text())
    except OSError:
        return RefillChoice()
