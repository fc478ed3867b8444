"""The builtin engine: the Qwen3-shaped transformer of `model.py` behind the `Engine` interface.

The model's weights and KV cache are views of arenas (`memory.EngineMemory`) that `release()` gives back
and `reacquire()` takes again, binding the model to them. On CUDA the KV cache is sized to fit the GPU's
memory (`gpu_memory_utilization`).
Requests are batched continuously by a scheduler thread: each new sequence is prefilled into a free KV slot
and then joins the running decode batch. On CUDA the decode step is captured as CUDA graphs for a set of
batch sizes (and optionally compiled).
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import warmstart
from warmstart.api.identity import SnapshotIdentity
from warmstart.engines.base import (
    Engine,
    EngineError,
    GenerationRequest,
    GenerationResult,
    RequestError,
    TokenDelta,
    check_fits,
    check_token_ids,
)
from warmstart.engines.builtin.graphs import DecodeGraphs
from warmstart.engines.builtin.memory import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    EngineMemory,
    graph_scratch_per_sequence,
    kv_slots_that_fit,
)
from warmstart.engines.builtin.model import KVCache, Transformer, kv_nbytes
from warmstart.engines.builtin.model_dir import ensure_model, model_directory
from warmstart.engines.builtin.parallel import ParallelModel, RankSpec, rank_device, shard_config
from warmstart.engines.builtin.scheduler import Scheduler, Sequence
from warmstart.engines.builtin.shapes import PRESETS, ModelConfig
from warmstart.engines.builtin.tokenizer import ByteTokenizer
from warmstart.engines.digest import model_digest, weight_files
from warmstart.engines.machine import gpu_facts, runtime_image
from warmstart.gpu.weight_stager.plan import StagingPlan
from warmstart.gpu.weights_io import views

log = logging.getLogger(__name__)

DEFAULT_GRAPH_SIZES = (1, 2, 4, 8, 16, 32)


class BuiltinEngine(Engine):
    kind = "builtin"

    def __init__(
        self,
        model: str = "tiny",
        model_dir: str | os.PathLike[str] | None = None,
        device: str = "cpu",
        seed: int = 0,
        dtype: str | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        cuda_graph_sizes: list[int] | tuple[int, ...] | None = None,
        compile: bool = False,
        release_weights: bool | None = None,
        release_graph_scratch: bool = True,
        arena: str = "auto",
        refill_threads: int = 8,
        gpu_memory_utilization: float | None = None,
        overrides: dict[str, Any] | None = None,
        served_model_name: str | None = None,
        tensor_parallel_size: int = 1,
    ) -> None:
        self._preset = model if model in PRESETS else None
        if self._preset is None and model_dir is None and not Path(model).is_dir():
            raise EngineError(f"--model {model!r} is neither a preset ({', '.join(PRESETS)}) nor a directory")
        self._overrides = dict(overrides or {})
        if dtype:
            self._overrides["torch_dtype"] = dtype
        self._seed = seed
        self._model_dir = model_directory(model, model_dir, seed, self._overrides)
        self._device = _parse_device(device)
        self._tp = _check_tensor_parallel(tensor_parallel_size, compile, self._device)
        self._requested_max_len = max_model_len
        self._max_num_seqs = max_num_seqs or (16 if self._device.type == "cuda" else 8)
        self._graph_sizes = tuple(sorted(set(cuda_graph_sizes or DEFAULT_GRAPH_SIZES)))
        self._compile = compile
        self._gpu_memory_utilization = gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
        # CUDA graphs survive a weight release only if the weights come back at the same address.
        arena_kind = ("cuda-vmm" if self._device.type == "cuda" else "torch") if arena == "auto" else arena
        # Released weights come back from the files; worth it where they return at the same addresses.
        self._memory = EngineMemory(
            self._device,
            arena_kind,
            # With tensor parallelism the other ranks hold their own weights: none are released.
            releases_weights=(arena_kind == "cuda-vmm" if release_weights is None else release_weights)
            and self._tp == 1,
            releases_graph_scratch=release_graph_scratch,
            refill_threads=refill_threads,
        )
        self._name = served_model_name or (self._preset or self._model_dir.name)
        self.tokenizer = ByteTokenizer()
        self.config: ModelConfig | None = None
        self._max_len = 0
        self._model: Transformer | None = None
        self._graphs: DecodeGraphs | None = None
        self._scheduler: Scheduler | None = None
        self._digest: str | None = None
        self.last_reacquire_stats: dict[str, float] | None = None
        self._addresses_at_release: tuple[int, ...] = ()

    @property
    def model_dir(self) -> Path:
        return self._model_dir

    def load(self) -> None:
        if self._preset is not None:  # its weights drawn on this device (a GPU draws 8B weights much faster)
            ensure_model(self._model_dir, self._preset, self._seed, self._overrides, device=self._device.type)
            if self._device.type == "cuda":
                # Drawing the weights leaves large cached blocks; a small tensor placed in one later would
                # pin it (1.2 GiB seen on an H200) through every checkpoint.
                torch.cuda.empty_cache()
        config = ModelConfig.load(self._model_dir)
        self._max_len = self._check_config(config)
        self.config = config
        local = shard_config(config, self._tp) if self._tp > 1 else config  # what rank 0 computes
        self._memory.load_weights(weight_files(self._model_dir))
        self._fit_kv_cache(local)
        # One slot more than sequences: the scratch slot that padded CUDA-graph rows write into.
        self._memory.allocate_kv(kv_nbytes(local, self._max_num_seqs + 1, self._max_len))
        self._model = self._build_model(local)
        self._bind_all()
        if isinstance(self._model, ParallelModel):
            self._model.start()
        self._scheduler = Scheduler(
            self._model, self.tokenizer, self._max_num_seqs, self._max_len, self._decode
        )
        log.info(
            "loaded %s from %s: %.1f M parameters, %s, %s, max_model_len %d",
            self._name,
            self._model_dir,
            config.parameter_count / 1e6,
            config.torch_dtype,
            self._device,
            self._max_len,
        )

    def warm_up(self) -> None:
        scheduler = self._require_scheduler()
        prompt = GenerationRequest(prompt="warm up", request_id="warm-up")
        scheduler.run_inline([self._sequence(prompt)])
        if self._device.type == "cuda" and self._tp == 1:  # no CUDA graphs over collectives (yet)
            self._graphs = DecodeGraphs(
                self._model,
                self._graph_sizes_within_limit(),
                self._max_num_seqs,
                compile=self._compile,
                pool=self._memory.graph_pool(),
            )
            self._graphs.capture()
            torch.cuda.synchronize(self._device)

    def release(self) -> bool:
        self._require_scheduler().stop()
        if isinstance(self._model, ParallelModel):
            self._model.leave()  # no communicator or socket of the ranks' group in the checkpoint
        self._addresses_at_release = self._memory.addresses()
        self._model.bind_kv(None)
        if self._memory.releases_weights:
            self._model.unbind()
        return self._memory.release()

    def reacquire(self) -> None:
        if isinstance(self._model, ParallelModel) and not self._model.joined:
            self._model.rejoin()
        if not self._memory.released:
            return  # nothing was released, or an earlier reacquire finished
        started = time.perf_counter()
        stats = self._memory.reacquire()
        self._bind_all()
        if self._graphs is not None and self._memory.addresses() != self._addresses_at_release:
            log.info("arena addresses moved across the release; capturing CUDA graphs again")
            self._graphs.capture()
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        self.last_reacquire_stats = {**stats, "total_s": round(time.perf_counter() - started, 3)}
        waited = (self.last_refill_stats or {}).get("waited_s")
        log.info("reacquired in %.3f s (map KV and scratch %.3f s, waited for staged weights %s s)",
                 self.last_reacquire_stats["total_s"], stats["map_kv_and_scratch_s"], waited)  # fmt: skip

    def weight_staging_plan(self) -> StagingPlan | None:
        """What a `weight_stager` must copy for this engine's next `reacquire()`; None where none can help."""
        return self._memory.staging_plan()

    def expect_staged_weights(self, socket_path: str | os.PathLike[str] | None) -> None:
        """Have the next `reacquire()` map the weights a `weight_stager` prepared at `socket_path`."""
        self._memory.staged_weights_socket = None if socket_path is None else str(socket_path)

    @property
    def last_refill_stats(self) -> dict[str, Any] | None:
        return self._memory.last_refill_stats

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        sequences = [self._sequence(request) for request in requests]
        scheduler = self._require_scheduler()
        for sequence in sequences:
            scheduler.submit(sequence)
        return [sequence.result() for sequence in sequences]

    def stream(self, request: GenerationRequest) -> Iterator[TokenDelta]:
        sequence = self._sequence(request, streaming=True)
        scheduler = self._require_scheduler()
        scheduler.submit(sequence)
        try:
            yield from sequence.deltas()
        finally:  # closed early: nobody reads the rest
            scheduler.cancel(sequence)

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        return self.tokenizer.apply_chat_template(messages)

    def count_prompt_tokens(self, request: GenerationRequest) -> int:
        return len(self._prompt_ids(request))

    def identity(self) -> SnapshotIdentity:
        if self._digest is None:
            self._digest = model_digest(self._model_dir)
        gpu_product, capability, driver = gpu_facts(self._device)
        return SnapshotIdentity(
            model_digest=self._digest,
            engine=self.kind,
            engine_version=f"warmstart-{warmstart.__version__}/torch-{torch.__version__}",
            engine_args=self._engine_args(),
            dtype=self.config.torch_dtype if self.config else "",
            parallelism=self._tp,
            device=self._device.type,
            gpu_product=gpu_product,
            compute_capability=capability,
            driver_major=driver,
            image=runtime_image(),
        )

    def close(self) -> None:
        if self._scheduler is not None:
            self._scheduler.stop()
        if isinstance(self._model, ParallelModel):
            self._model.close()

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "device": str(self._device),
            "model_dir": str(self._model_dir),
            "max_num_seqs": self._max_num_seqs,
            "tensor_parallel_size": self._tp,
            "weights_bytes": self._memory.weights.nbytes if self._memory.weights else 0,
            "kv_bytes": self._memory.kv.nbytes if self._memory.kv else 0,
            "graph_scratch_bytes": self._memory.scratch.nbytes if self._memory.scratch is not None else 0,
            "weight_files": [str(path) for path in self._memory.files],
            "at_release": self._memory.last_release_stats or {},
        }

    def _check_config(self, config: ModelConfig) -> int:
        """Refuse a model the options or the tokenizer do not fit; returns the max_model_len to serve."""
        dtype = self._overrides.get("torch_dtype")
        if dtype and dtype != config.torch_dtype:
            raise EngineError(
                f"{self._model_dir} holds {config.torch_dtype} weights; --dtype {dtype} differs"
            )
        if config.vocab_size < self.tokenizer.vocab_size:
            raise EngineError(
                f"vocab_size {config.vocab_size} is below the tokenizer's {self.tokenizer.vocab_size}"
            )
        limit = config.max_position_embeddings
        max_len = self._requested_max_len or min(limit, 4096)
        if not 1 < max_len <= limit:
            raise EngineError(f"max_model_len must be between 2 and {limit} for this model, got {max_len}")
        return max_len

    def _fit_kv_cache(self, config: ModelConfig) -> None:
        """Cut --max-num-seqs to the KV slots that fit in the GPU's memory budget (CUDA only)."""
        if self._device.type != "cuda":
            return
        free, total = torch.cuda.mem_get_info(self._device)
        per_slot = kv_nbytes(config, 1, self._max_len)
        scratch = graph_scratch_per_sequence(per_slot, config.num_hidden_layers, config.vocab_size)
        fit = kv_slots_that_fit(total, total - free, self._gpu_memory_utilization, per_slot, scratch)
        sequences = fit.slots - 1  # one slot is the padded graph rows' scratch slot
        if sequences >= self._max_num_seqs:
            return
        if sequences < 1:
            raise EngineError(
                f"no KV cache fits: {fit.budget_bytes / 2**30:.2f} GiB left under gpu memory utilization "
                f"{self._gpu_memory_utilization}, one sequence of {self._max_len} tokens needs "
                f"{fit.per_slot_bytes / 2**30:.2f} GiB (lower --max-model-len)"
            )
        log.warning(
            "max_num_seqs %d x %d tokens does not fit in %.1f GiB (gpu memory utilization %.2f): serving %d "
            "sequences", self._max_num_seqs, self._max_len, fit.budget_bytes / 2**30,
            self._gpu_memory_utilization, sequences,
        )  # fmt: skip
        self._max_num_seqs = sequences

    def _bind_all(self) -> None:
        self._model.bind(views(self._memory.weights.tensor, self._memory.layout))
        self._model.bind_kv(
            KVCache(self._memory.kv.tensor, self._model.config, self._max_num_seqs + 1, self._max_len)
        )

    def _build_model(self, config: ModelConfig) -> Transformer:
        if self._tp == 1:
            return Transformer(config, self._device, self._max_len)
        spec = RankSpec(
            str(self._model_dir), 0, self._tp, self._device.type, self._max_len, self._max_num_seqs + 1
        )
        return ParallelModel(config, rank_device(self._device, 0), self._max_len, spec)

    def _decode(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        if self._graphs is not None and self._graphs.fits(tokens.shape[0]):
            return self._graphs.replay(tokens, positions, slots)
        return self._model.decode(tokens, positions, slots, context=int(positions.max()) + 1)

    def _graph_sizes_within_limit(self) -> list[int]:
        sizes = {size for size in self._graph_sizes if size <= self._max_num_seqs} | {self._max_num_seqs}
        return sorted(sizes)

    def _prompt_ids(self, request: GenerationRequest) -> list[int]:
        if request.prompt_token_ids is not None:
            return check_token_ids(request.prompt_token_ids, self.tokenizer.vocab_size)
        if request.prompt is None:
            raise RequestError("a request needs a prompt or prompt_token_ids", "prompt")
        return self.tokenizer.encode(request.prompt)

    def _sequence(self, request: GenerationRequest, streaming: bool = False) -> Sequence:
        ids = self._prompt_ids(request)
        prompt_tokens = 0 if ids == [self.tokenizer.bos_id] else len(ids)  # a lone BOS is an empty prompt
        check_fits(prompt_tokens, request.sampling.max_tokens, self._max_len)
        return Sequence(request, ids, streaming=streaming)

    def _require_scheduler(self) -> Scheduler:
        if self._scheduler is None:
            raise EngineError("the engine is not loaded; call load() first")
        if self._model.kv is None:
            raise EngineError("the engine is released; call reacquire() first")
        return self._scheduler

    def _engine_args(self) -> dict[str, Any]:
        return {
            "model": self._preset or "",
            "overrides": self._overrides,
            "max_model_len": self._max_len,
            "max_num_seqs": self._max_num_seqs,
            "cuda_graph_sizes": self._graph_sizes_within_limit() if self._device.type == "cuda" else [],
            "compile": self._compile,
            "release_weights": self._memory.releases_weights,
            "release_graph_scratch": self._memory.releases_graph_scratch,
            "arena": self._memory.arena_kind,
            **({"tensor_parallel_size": self._tp} if self._tp > 1 else {}),
        }


def _check_tensor_parallel(size: int, compile: bool, device: torch.device) -> int:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise EngineError(f"tensor_parallel_size must be a positive integer, got {size!r}")
    if size > 1 and compile:
        raise EngineError("--compile is not supported with --tensor-parallel-size above 1")
    if size > 1 and device.type == "cuda" and (device.index or 0) != 0:
        raise EngineError(
            f"with --tensor-parallel-size {size} rank r runs on cuda:r: pass --device cuda and choose the "
            "GPUs with CUDA_VISIBLE_DEVICES"
        )
    return size


def _parse_device(device: str) -> torch.device:
    if device not in ("cpu", "cuda") and not re.fullmatch(r"cuda:\d+", device):
        raise EngineError(f"--device must be cpu, cuda or cuda:N, got {device!r}")
    parsed = torch.device(device)
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise EngineError("--device cuda was asked for, but torch sees no CUDA device here")
        if parsed.index is None:
            parsed = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(parsed)
    return parsed
