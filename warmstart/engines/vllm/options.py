"""The vLLM engine's options, validated before vLLM is imported, and the translation of sampling params."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from warmstart.engines.base import EngineError, RequestError, SamplingParams

INSTALL_HINT = "pip install 'warmstart[vllm]'"
SLEEP_LEVELS = (1, 2)
# Who answers HTTP after resume: vLLM's own OpenAI server, in this process (frontend.py), or warmstart's.
APIS = ("vllm", "warmstart")
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
    api: str = "vllm"
    server_args: tuple[str, ...] = ()  # for vLLM's server (`vllm serve` flags), with api "vllm"

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
        if self.api not in APIS:
            raise EngineError(f"api must be one of {', '.join(APIS)}, got {self.api!r}")
        if self.server_args and self.api != "vllm":
            raise EngineError("vLLM server args need api 'vllm' (warmstart's server does not read them)")
        if any(not isinstance(arg, str) for arg in self.server_args):
            raise EngineError(f"vLLM server args must be strings, got {list(self.server_args)!r}")

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
        # The server is part of the captured process: a snapshot serves what it was captured with.
        args["api"] = self.api
        if self.server_args:
            args["server_args"] = list(self.server_args)
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
