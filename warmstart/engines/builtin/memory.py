"""The builtin engine's memory across a checkpoint: weights, KV cache, graph scratch, and what rides along.

`EngineMemory` owns the weight arena, the KV arena and the CUDA graphs' scratch pool. `release()` gives
them back before a checkpoint (weights only where they come back at the same addresses), then sheds what
a checkpoint would otherwise copy for nothing: cached device blocks, pinned host blocks and the GPU's
per-thread local memory (`warmstart.gpu.local_memory`). `reacquire()` takes it all back: the KV cache
and scratch are mapped on a second thread while the weights come back, mapped from a weight stager when
one was announced (`staged_weights_socket`), else refilled from the files.

`kv_slots_that_fit` sizes the KV cache from GPU memory (as vLLM's gpu_memory_utilization does), so a
--max-num-seqs x --max-model-len that does not fit is cut to what does instead of failing with CUDA OOM.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from warmstart.gpu.arena import Arena, create_arena
from warmstart.gpu.cuda_arena import CudaVmmArena, cuda_ordinal
from warmstart.gpu.local_memory import LocalMemoryLimit
from warmstart.gpu.weight_stager.client import StagedWeightsUnavailable, acknowledge, receive_staged_weights
from warmstart.gpu.weight_stager.plan import StagingPlan
from warmstart.gpu.weights_io import Layout, plan_chunks, plan_layout, refill, release_pinned_cache
from warmstart.host.cuda_driver import device_uuid
from warmstart.host.procinfo import anonymous_memory_by_mapping, memory_counters

if TYPE_CHECKING:
    from warmstart.gpu.cuda_scratch import CudaScratchPool

log = logging.getLogger(__name__)

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


@dataclass(frozen=True)
class KvFit:
    slots: int  # KV slots the budget holds (sequences + the one scratch slot of padded graph rows)
    budget_bytes: int  # what was left for the KV cache and the graphs' scratch
    per_slot_bytes: int  # one slot's KV bytes plus its share of the graphs' scratch


def graph_scratch_per_sequence(kv_bytes_per_slot: int, layers: int, vocab_size: int) -> int:
    """Bytes of CUDA-graph intermediates one more decode row costs (an upper estimate).

    Decode gathers each row's keys and values of one layer (a slot's KV over `layers`); the graph pool
    holds a few such gathers at once (measured on an H200: 2.68 GiB for 256 rows x 1024 tokens of Qwen3-8B,
    where one gather is 1.0 GiB), plus float32 and bf16 logits per row.
    """
    return 3 * kv_bytes_per_slot // max(layers, 1) + vocab_size * 8


def kv_slots_that_fit(
    total_bytes: int, used_bytes: int, utilization: float, kv_bytes_per_slot: int, scratch_per_slot: int
) -> KvFit:
    """How many KV slots fit in `utilization` of the GPU's memory once `used_bytes` are taken."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu memory utilization must be in (0, 1], got {utilization}")
    budget = int(total_bytes * utilization) - used_bytes
    per_slot = kv_bytes_per_slot + scratch_per_slot
    return KvFit(max(budget, 0) // per_slot if per_slot > 0 else 0, budget, per_slot)


@dataclass(eq=False)
class EngineMemory:
    device: torch.device
    arena_kind: str
    releases_weights: bool
    releases_graph_scratch: bool
    refill_threads: int
    files: list[Path] = field(default_factory=list)
    layout: Layout = field(default_factory=dict)
    weights: Arena | None = None
    kv: Arena | None = None
    scratch: CudaScratchPool | None = None
    weights_released: bool = False
    last_refill_stats: dict[str, Any] | None = None
    last_release_stats: dict[str, Any] | None = None
    staged_weights_socket: str | None = None  # where a weight stager holds the next reacquire()'s weights

    def __post_init__(self) -> None:
        self._local_memory = LocalMemoryLimit(cuda_ordinal(self.device)) if self.on_cuda else None

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def released(self) -> bool:
        return bool(self.kv is not None and self.kv.released) or self.weights_released

    def load_weights(self, files: list[Path]) -> None:
        self.files = files
        self.layout, nbytes = plan_layout(files)
        self.weights = create_arena(self.arena_kind, self.device)
        self.weights.allocate(nbytes)
        self.fill_weights()

    def allocate_kv(self, nbytes: int) -> None:
        self.kv = create_arena(self.arena_kind, self.device)
        self.kv.allocate(nbytes)
        self.clear_kv()

    def clear_kv(self) -> None:
        """Zero the KV cache: decode attends over whole cache rows under a mask, and a masked-out value
        is still multiplied by its zero weight, so NaN bytes left in fresh memory would poison the output."""
        self.kv.tensor.zero_()

    def graph_pool(self) -> CudaScratchPool | None:
        """A releasable pool for the CUDA graphs' intermediates (None: torch's own, kept in checkpoints)."""
        if self.scratch is None and self.arena_kind == "cuda-vmm" and self.releases_graph_scratch:
            from warmstart.gpu.cuda_scratch import CudaScratchPool

            if CudaScratchPool.supported():
                self.scratch = CudaScratchPool(self.device)
            else:
                log.warning(
                    "torch %s has no MemPool: CUDA graph scratch stays in checkpoints", torch.__version__
                )
        return self.scratch

    def fill_weights(self) -> None:
        stats = refill(self.weights.tensor, self.layout, self.files, threads=self.refill_threads)
        self.last_refill_stats = {"bytes": stats.nbytes, "seconds": round(stats.seconds, 3)}
        if self.on_cuda:
            release_pinned_cache()
        log.info("weights: %.1f MB in %.3f s (%.2f GB/s, %d threads)",
                 stats.nbytes / 1e6, stats.seconds, stats.gb_per_s, stats.threads)  # fmt: skip

    def addresses(self) -> tuple[int, ...]:
        """Where the weights and the KV cache are (0: not there)."""
        return tuple(0 if a is None or a.released else a.tensor.data_ptr() for a in (self.weights, self.kv))

    def release(self) -> bool:
        """Give back the KV cache, the scratch (and the weights where they return in place); True when the
        weights went too. The caller unbound the model's views first."""
        self.kv.release()
        if self.releases_weights:
            self.weights.release()
            self.weights_released = True
        stats: dict[str, Any] = {}
        if self.on_cuda:
            torch.cuda.synchronize(self.device)
            if self.scratch is not None:
                self.scratch.release()  # the graphs rewrite their intermediates on every replay
            torch.cuda.empty_cache()  # cached blocks would otherwise travel in the checkpoint
            release_pinned_cache()
            stats["local_memory_lowered"] = self._local_memory.lower()
        stats["host_anon_bytes"] = memory_counters().get("RssAnon_kib", 0) * 1024
        stats["host_anon_largest"] = anonymous_memory_by_mapping()
        if self.on_cuda:
            free, total = torch.cuda.mem_get_info(self.device)
            stats["gpu_used_bytes"] = total - free  # the whole GPU's: this process's when it is alone there
            stats["torch_reserved_bytes"] = torch.cuda.memory_reserved(self.device)
            stats["torch_allocated_bytes"] = torch.cuda.memory_allocated(self.device)
        self.last_release_stats = stats
        return self.weights_released

    def reacquire(self) -> dict[str, float]:
        """Take everything back (the model is bound again by the caller); seconds per step."""
        started = time.perf_counter()
        if self._local_memory is not None:
            self._local_memory.restore()
        # Mapping the KV cache and graph scratch (tens of GB of driver work) overlaps the weights.
        with ThreadPoolExecutor(1, thread_name_prefix="warmstart-map") as background:
            mapped = background.submit(self._map_kv_and_scratch)
            try:
                if self.weights_released:
                    self._take_back_weights()
                    self.weights_released = False
            finally:
                map_seconds = mapped.result()  # a mapping error is raised even when the refill failed too
        return {"map_kv_and_scratch_s": map_seconds, "map_and_refill_s": _since(started)}

    def staging_plan(self) -> StagingPlan | None:
        """Only weights that leave the GPU at `release()` and come back at the same addresses are staged."""
        if not isinstance(self.weights, CudaVmmArena) or not self.releases_weights:
            return None
        copies = plan_chunks(self.layout, self.files, chunk_bytes=1 << 62)  # one copy per tensor
        index = self.weights.device_index
        return StagingPlan(
            index,
            self.weights.range_bytes,
            tuple((str(c.path), c.file_offset, c.arena_offset, c.nbytes) for c in copies),
            device_uuid(index),
        )

    def _take_back_weights(self) -> None:
        socket_path, self.staged_weights_socket = self.staged_weights_socket, None
        if socket_path is not None and isinstance(self.weights, CudaVmmArena):
            started = time.perf_counter()
            try:
                self._map_staged_weights(socket_path)
                self.last_refill_stats["waited_s"] = _since(started)
                return
            except Exception as exc:  # whatever went wrong with the stager, the files are still there
                log.warning("no staged weights (%s); refilling them from the files", exc)
        self.weights.reacquire()
        self.fill_weights()

    def _map_staged_weights(self, socket_path: str) -> None:
        fds, report = receive_staged_weights(socket_path)
        try:
            if len(fds) != 1:
                raise StagedWeightsUnavailable(f"the weight stager sent {len(fds)} allocations for one arena")
            self.weights.reacquire_shared(fds[0])
        finally:
            for fd in fds:
                os.close(fd)
            acknowledge(report)
        stats = {"bytes": report["bytes"], "seconds": report.get("seconds"), "copy": report.get("copy")}
        self.last_refill_stats = {**stats, "staged": True}
        log.info("weights: %.1f MB mapped from the weight stager (it filled them in %s s, copying %s)",
                 report["bytes"] / 1e6, report.get("seconds"), report.get("copy", "?"))  # fmt: skip

    def _map_kv_and_scratch(self) -> float:
        started = time.perf_counter()
        if self.on_cuda:
            torch.cuda.set_device(self.device)
        if self.scratch is not None:
            self.scratch.reacquire()
        self.kv.reacquire()
        self.clear_kv()
        return _since(started)


def _since(started: float) -> float:
    return round(time.perf_counter() - started, 3)
