"""CUDA graphs of the decode step, one per batch size (like vLLM's capture sizes).

A batch is padded up to the next captured size; padding rows write into a scratch KV slot nobody reads.
The graphs read weights and KV cache at fixed addresses, so after those move they must be captured again.
Their intermediates live in one memory pool: torch's own, or a `CudaScratchPool` that can be released
before a checkpoint. Each graph is captured on the stream it was warmed up on, so per-stream state that
outlives a replay (cuBLAS's workspace) is allocated during the warm-up, outside that pool. With `compile`,
one layer's decode step is compiled (see `Transformer.compile_decode`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from warmstart.engines.builtin.model import Transformer

if TYPE_CHECKING:
    from warmstart.gpu.cuda_scratch import CudaScratchPool

WARMUP_RUNS = 2


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    logits: torch.Tensor


class DecodeGraphs:
    def __init__(
        self,
        model: Transformer,
        sizes: list[int],
        scratch_slot: int,
        compile: bool = False,
        pool: CudaScratchPool | None = None,
    ) -> None:
        if not sizes:
            raise ValueError("CUDA graph capture needs at least one batch size")
        self._model = model
        self._sizes = sorted(sizes)
        self._scratch_slot = scratch_slot
        self._compiled = compile
        if compile:
            model.compile_decode()
        self._pool = pool  # None: torch's own graph pool
        self._captured: dict[int, _Captured] = {}
        self.captures = 0  # how many times the whole set was captured

    def fits(self, batch: int) -> bool:
        return batch <= self._sizes[-1] and bool(self._captured)

    def capture(self) -> None:
        """(Re)capture every size, largest first, sharing one memory pool."""
        self._captured.clear()
        self.captures += 1
        pool = self._pool.id if self._pool is not None else torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self._model.device)  # one stream: one cuBLAS workspace for all graphs
        with torch.no_grad():
            for size in reversed(self._sizes):
                self._captured[size] = self._capture_one(size, pool, side)
        if self._compiled:
            _stop_compile_workers()

    def replay(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        batch = tokens.shape[0]
        captured = self._captured[self._sizes[bisect.bisect_left(self._sizes, batch)]]
        captured.tokens[:batch].copy_(tokens)
        captured.positions[:batch].copy_(positions)
        captured.slots[:batch].copy_(slots)
        captured.tokens[batch:].zero_()
        captured.positions[batch:].zero_()
        captured.slots[batch:].fill_(self._scratch_slot)
        captured.graph.replay()
        return captured.logits[:batch]

    def _capture_one(self, size: int, pool: object, side: torch.cuda.Stream) -> _Captured:
        device = self._model.device
        tokens = torch.zeros(size, dtype=torch.long, device=device)
        positions = torch.zeros(size, dtype=torch.long, device=device)
        slots = torch.full((size,), self._scratch_slot, dtype=torch.long, device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                self._model.decode(tokens, positions, slots)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=side):
            logits = self._model.decode(tokens, positions, slots)
        torch.cuda.current_stream(device).wait_stream(side)
        return _Captured(graph, tokens, positions, slots, logits)


def _stop_compile_workers() -> None:
    """torch.compile keeps a pool of compiler subprocesses; a process about to be checkpointed needs none."""
    from torch._inductor import async_compile

    shutdown = getattr(async_compile, "shutdown_compile_workers", None)
    if shutdown is not None:
        shutdown()
