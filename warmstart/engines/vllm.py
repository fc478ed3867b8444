"""The vLLM engine behind the `Engine` interface (the optional `warmstart[vllm]` extra).

vLLM is imported only in `load()`, so naming this engine, translating its options and checking requests work
where vLLM is not installed. The engine is built with `enable_sleep_mode=True`: `release()` puts it to sleep
before a checkpoint (level 2 by default: weights and KV cache are discarded, so neither travels in the
snapshot; level 1 keeps the weights in CPU memory, inside the snapshot) and `reacquire()` wakes it, reloading
the weights from the model files after a level-2 sleep. vLLM's sleep-mode allocator keeps the virtual
addresses of what it frees, so captured CUDA graphs stay valid across a sleep.

Requests are served continuously by one driver thread that owns the `LLMEngine` (it is not thread-safe): new
requests join the running batch between engine steps, and each step's cumulative output is turned into
deltas for streaming. The thread starts with the first request and stops in `release()`, so a process about
to be checkpointed runs no thread of ours.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
from warmstart.engines.digest import files_digest
from warmstart.engines.host import gpu_facts, runtime_image
from warmstart.identity import SnapshotIdentity

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'warmstart[vllm]'"
SLEEP_LEVELS = (1, 2)
DTYPES = ("auto", "float32", "bfloat16", "float16")
# Options with a first-class argument; passing them as extra engine args would bypass its checks.
OWN_ARGS = {
    "model": "--model or --model-dir",
    "enable_sleep_mode": "nothing (it is always on: release() needs it)",
    "dtype": "--dtype",
    "tensor_parallel_size": "--tensor-parallel-size",
    "max_model_len": "--max-model-len",
    "max_num_seqs": "--max-num-seqs",
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "enforce_eager": "--enforce-eager",
    "seed": "--seed",
}
# Besides the weights, the files that change what a model computes or how its text is tokenized.
DIGESTED_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)


@dataclass(frozen=True)
class VllmOptions:
    """The validated options of a vLLM engine; `llm_kwargs()` is what `vllm.LLM(...)` receives."""

    model: str
    dtype: str = "auto"
    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    seed: int = 0
    cuda_graph_sizes: tuple[int, ...] = ()
    sleep_level: int = 2
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.model:
            raise EngineError("--model must name a model directory or a Hugging Face model id")
        if self.dtype not in DTYPES:
            raise EngineError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        _require_positive("tensor_parallel_size", self.tensor_parallel_size)
        _require_positive("max_model_len", self.max_model_len)
        _require_positive("max_num_seqs", self.max_num_seqs)
        for size in self.cuda_graph_sizes:
            _require_positive("cuda_graph_sizes", size)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise EngineError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.sleep_level not in SLEEP_LEVELS:
            raise EngineError(f"sleep_level must be 1 or 2, got {self.sleep_level!r}")
        _check_extra(self.extra)

    def llm_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "model": self.model,
            "enable_sleep_mode": True,
            "dtype": self.dtype,
            "tensor_parallel_size": self.tensor_parallel_size,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "enforce_eager": self.enforce_eager,
            "seed": self.seed,
        }
        if self.max_model_len is not None:
            kwargs["max_model_len"] = self.max_model_len
        if self.max_num_seqs is not None:
            kwargs["max_num_seqs"] = self.max_num_seqs
        if self.cuda_graph_sizes:
            compilation = dict(self.extra.get("compilation_config") or {})
            compilation["cudagraph_capture_sizes"] = sorted(set(self.cuda_graph_sizes))
            kwargs["compilation_config"] = compilation
        return {**self.extra, **kwargs}

    def identity_args(self, max_model_len: int) -> dict[str, Any]:
        """The engine args a snapshot depends on: the model is covered by its digest, not its path."""
        args = {key: value for key, value in self.llm_kwargs().items() if key != "model"}
        args["max_model_len"] = max_model_len
        args["sleep_level"] = self.sleep_level
        return args


def sampling_kwargs(sampling: SamplingParams) -> dict[str, Any]:
    """Keyword arguments for `vllm.SamplingParams`, or a RequestError naming the bad field."""
    if sampling.max_tokens < 1:
        raise RequestError(f"max_tokens must be at least 1, got {sampling.max_tokens}", "max_tokens")
    if sampling.temperature < 0:
        raise RequestError(f"temperature must be at least 0, got {sampling.temperature}", "temperature")
    if not 0.0 < sampling.top_p <= 1.0:
        raise RequestError(f"top_p must be in (0, 1], got {sampling.top_p}", "top_p")
    if sampling.seed is not None and not 0 <= sampling.seed < 2**63:
        raise RequestError(f"seed must be between 0 and 2**63 - 1, got {sampling.seed}", "seed")
    if any(not isinstance(stop, str) or not stop for stop in sampling.stop):
        raise RequestError("stop strings must be non-empty strings", "stop")
    return {
        "n": 1,
        "max_tokens": sampling.max_tokens,
        # vLLM is greedy at temperature 0; below GREEDY_BELOW the builtin engine is greedy too.
        "temperature": 0.0 if sampling.greedy else sampling.temperature,
        "top_p": 1.0 if sampling.greedy else sampling.top_p,
        "seed": sampling.seed,
        "stop": list(sampling.stop),
        "ignore_eos": sampling.ignore_eos,
    }


def import_vllm() -> Any:
    try:
        import vllm
    except ImportError as exc:
        raise EngineError(f"the vllm engine needs vLLM, which is not installed here: {INSTALL_HINT}") from exc
    return vllm


class VllmEngine(Engine):
    kind = "vllm"

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
        )
        self._name = served_model_name or (Path(source).name if Path(source).is_dir() else model)
        self._in_process = in_process
        self._llm: Any = None
        self._vllm: Any = None
        self._tokenizer: Any = None
        self._tokenizer_lock = threading.Lock()
        self._driver: _Driver | None = None
        self._max_len = max_model_len or 0
        self._dtype = "" if self.options.dtype == "auto" else self.options.dtype
        self._model_dir: Path | None = Path(source) if Path(source).is_dir() else None
        self._digest: str | None = None
        self._asleep_level = 0
        self._ids = itertools.count()

    # --- Engine interface ----------------------------------------------------------------------------

    @property
    def served_model_name(self) -> str:
        return self._name

    @property
    def max_model_len(self) -> int:
        return self._max_len

    @property
    def model_dir(self) -> Path | str:
        return self._model_dir or ""

    def load(self) -> None:
        if self._in_process:
            # One process holding the CUDA context is what a process checkpoint can capture.
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        vllm = import_vllm()
        try:
            llm = vllm.LLM(**self.options.llm_kwargs())
        except (ValueError, TypeError, OSError, RuntimeError) as exc:
            raise EngineError(f"vLLM could not load {self.options.model!r}: {exc}") from exc
        self._vllm, self._llm = vllm, llm
        self._tokenizer = llm.get_tokenizer()
        model_config = llm.llm_engine.model_config
        self._max_len = int(model_config.max_model_len)
        self._dtype = str(model_config.dtype).removeprefix("torch.")
        self._driver = _Driver(llm.llm_engine)
        log.info(
            "loaded %s with vLLM %s: %s, tensor parallel %d, max_model_len %d",
            self._name,
            vllm.__version__,
            self._dtype,
            self.options.tensor_parallel_size,
            self._max_len,
        )

    def warm_up(self) -> None:
        request = GenerationRequest(
            prompt="warm up", sampling=SamplingParams(max_tokens=4), request_id="warm-up"
        )
        self.generate([request])

    def release(self) -> bool:
        llm = self._require_llm()
        self._require_driver().stop()
        llm.sleep(level=self.options.sleep_level)
        self._asleep_level = self.options.sleep_level
        return self.options.sleep_level == 2

    def reacquire(self) -> None:
        llm = self._require_llm()
        if self._asleep_level == 0:
            return  # nothing was released
        if self._asleep_level == 2:
            llm.wake_up(tags=["weights"])
            try:
                llm.collective_rpc("reload_weights")
            except (AttributeError, NotImplementedError, RuntimeError) as exc:
                raise EngineError(
                    f"this vLLM ({self._vllm.__version__}) cannot reload weights after a level-2 sleep: "
                    f"{exc}; use sleep level 1"
                ) from exc
            llm.wake_up(tags=["kv_cache"])
        else:
            llm.wake_up()
        llm.reset_prefix_cache()  # cached prefixes pointed into the discarded KV cache
        self._asleep_level = 0

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        submissions = [self._submit(request) for request in requests]
        return [submission.result() for submission in submissions]

    def stream(self, request: GenerationRequest) -> Iterator[TokenDelta]:
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

    def close(self) -> None:
        if self._driver is not None:
            self._driver.stop()

    def describe(self) -> dict[str, Any]:
        facts = super().describe()
        facts.update(
            device="cuda",
            model_dir=str(self.model_dir),
            vllm_version=self._vllm.__version__ if self._vllm else "",
            tensor_parallel_size=self.options.tensor_parallel_size,
            sleep_level=self.options.sleep_level,
        )
        return facts

    # --- internals -----------------------------------------------------------------------------------

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
            self._model_dir = _hub_snapshot_dir(self.options.model, self.options.extra.get("revision"))
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
        self._require_llm()
        if self._asleep_level:
            raise EngineError("the engine is released; call reacquire() first")
        return self._driver


def snapshot_identity(
    options: VllmOptions,
    model_digest: str,
    vllm_version: str,
    max_model_len: int,
    dtype: str,
    gpu: tuple[str, str, int],
) -> SnapshotIdentity:
    """What a snapshot of a vLLM engine with these options, model files, version and GPU is valid for."""
    gpu_product, capability, driver = gpu
    return SnapshotIdentity(
        model_digest=model_digest,
        engine=VllmEngine.kind,
        engine_version=vllm_version,
        engine_args=options.identity_args(max_model_len),
        dtype=dtype,
        parallelism=options.tensor_parallel_size,
        device="cuda",
        gpu_product=gpu_product,
        compute_capability=capability,
        driver_major=driver,
        image=runtime_image(),
    )


def model_files_digest(model_dir: Path) -> str:
    """The digest over a model directory's weights plus its config and tokenizer files."""
    weights = sorted(model_dir.glob("*.safetensors")) or sorted(model_dir.glob("*.bin"))
    if not weights:
        raise EngineError(f"{model_dir} holds no *.safetensors or *.bin weight files to digest")
    side = [model_dir / name for name in DIGESTED_SIDE_FILES if (model_dir / name).is_file()]
    return files_digest(model_dir, weights + side)


def _hub_snapshot_dir(model: str, revision: str | None) -> Path:
    """The local copy vLLM downloaded for a Hugging Face model id."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception as exc:  # noqa: BLE001 (any failure means the same: no local copy to digest)
        raise EngineError(
            f"cannot find the local files of {model!r} to digest them ({exc}); pass a model directory"
        ) from exc


def _require_positive(name: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise EngineError(f"{name} must be a positive integer, got {value!r}")


def _check_extra(extra: dict[str, Any]) -> None:
    for key in extra:
        if key in OWN_ARGS:
            raise EngineError(f"engine arg {key!r} is set by its own option: use {OWN_ARGS[key]}")
    try:
        json.dumps(extra, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise EngineError(
            f"engine args must be JSON values (they enter the snapshot identity): {exc}"
        ) from exc


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
    """Steps vLLM's `LLMEngine` on one thread; requests join the running batch between steps."""

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
