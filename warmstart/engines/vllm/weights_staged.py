"""The weights back from a weight stager (`warmstart.gpu.weight_stager`) after a level-2 wake.

The builtin engine maps the stager's memory at its weight arena's own addresses. vLLM's weights are not one
range: its sleep-mode allocator maps each of its segments on its own, and a CUDA mapping cannot start inside
another process's allocation. So the stager fills one block laid out here (every parameter's file ranges end
to end) while CRIU and the CUDA restore run, and the woken engine maps that block at a fresh address and
copies each range into place on the GPU, device to device, instead of reading the files after the wake.

The block is the KV cache's own allocations where they can hold the weights (`kv_cache`): the engine keeps
them after the copies, so a restore needs no more device memory than the engine had. Otherwise it is one
allocation of its own, which needs as much free device memory as the weights, on top of them, until the
copies are done, and before the KV cache wakes: `fits` decides at capture whether a restore may count on it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from warmstart.engines.vllm.weights_files import Plan, file_chunks
from warmstart.engines.vllm.weights_image import parameters
from warmstart.gpu.arena import round_up
from warmstart.gpu.weight_stager.client import acknowledge, receive_staged_weights
from warmstart.gpu.weight_stager.plan import MAX_SEGMENTS, StagingPlan

BLOCK_ALIGNMENT = 4096  # each range starts on a page of the block
WHOLE_PIECES = 1 << 62  # one copy per file range
HEADROOM_BYTES = 2 << 30  # free device memory left over at the wake, beyond the weights and the block


@dataclass(frozen=True)
class Placement:
    """One file range of a parameter: `nbytes` at `block_offset` in the staged block go to byte `start` of
    parameter `target` (in `parameters()` order)."""

    target: int
    start: int
    block_offset: int
    nbytes: int


@dataclass(frozen=True)
class Staging:
    """The stager's plan and where each of its copies lands in the model."""

    plan: StagingPlan
    placements: tuple[Placement, ...]


def staging(
    planned: Plan,
    model_dir: Path,
    device_index: int,
    device_uuid: str,
    granularity: int,
    kv_segments: tuple[int, ...] = (),
) -> Staging:
    """Lay every parameter's file ranges end to end in one block of the GPU with `device_index`: the KV
    cache's allocations (`kv_segments`, their sizes in order) where they hold them all, else its own."""
    copies, placements, at = [], [], 0
    for chunk in file_chunks(planned, WHOLE_PIECES):
        path = str(model_dir / planned.files[chunk.fd_index][0])
        copies.append((path, chunk.file_offset, at, chunk.length))
        placements.append(Placement(chunk.target, chunk.start, at, chunk.length))
        at = round_up(at + chunk.length, BLOCK_ALIGNMENT)
    if holds(kv_segments, at):
        plan = StagingPlan(device_index, sum(kv_segments), tuple(copies), device_uuid, kv_segments)
    else:
        plan = StagingPlan(device_index, round_up(at, granularity), tuple(copies), device_uuid)
    return Staging(plan, tuple(placements))


def holds(kv_segments: tuple[int, ...], staged_bytes: int) -> bool:
    """Whether the KV cache's allocations can be the block: as many as one message carries, room enough."""
    return 0 < len(kv_segments) <= MAX_SEGMENTS and sum(kv_segments) >= staged_bytes


def fits(staged_bytes: int, free_bytes_asleep: int) -> bool:
    """Whether a block of its own and the weights fit in what the sleeping engine leaves free on its GPU."""
    return 2 * staged_bytes + HEADROOM_BYTES <= free_bytes_asleep


def copy_in(model: Any, planned: Plan, staged: Staging, socket_path: str) -> tuple[dict[str, Any], list[Any]]:
    """Wait for the stager at `socket_path`, map its block and copy every range into the model's parameters
    (woken, at their addresses); `StagedWeightsUnavailable` or a CUDA error when there is nothing to copy.

    With the KV cache's allocations as the block, the bytes the weights took are cleared and the
    allocations' handles returned, in order, for `kv_cache.adopt`; else no handles."""
    from warmstart.gpu.cuda_arena import imported_block

    started = time.perf_counter()
    fds, report = receive_staged_weights(socket_path)
    waited = time.perf_counter() - started
    handles: list[Any] = []
    try:
        with imported_block(staged.plan.device_index, fds, staged.plan.allocations) as block:
            view = block.tensor
            copied = place(model, planned, staged, view)
            if staged.plan.segments:
                view[: staged_end(staged)].zero_()  # the KV cache never sees the weights' bytes
                handles = block.take_handles()
    finally:
        for fd in fds:
            os.close(fd)
        acknowledge(report)
    stats = {
        "bytes": copied,
        "waited_s": round(waited, 3),
        "copied_s": round(time.perf_counter() - started - waited, 3),
        "stager_fill_s": report.get("seconds"),
        "stager_copy": report.get("copy"),
        "kv_cache_allocations": len(handles),
    }
    return stats, handles


def staged_end(staged: Staging) -> int:
    return max(at.block_offset + at.nbytes for at in staged.placements)


def place(model: Any, planned: Plan, staged: Staging, block: Any) -> int:
    """Copy every range of the filled block (a flat uint8 tensor) into its parameter; the bytes copied."""
    import torch

    tensors = parameters(model)
    if tuple(name for name, _ in tensors) != planned.names:
        raise ValueError("the model's parameters are not the staged ones")
    targets = [tensor.reshape(-1).view(torch.uint8) for _, tensor in tensors]
    with torch.no_grad():
        for at in staged.placements:
            source = block[at.block_offset : at.block_offset + at.nbytes]
            targets[at.target][at.start : at.start + at.nbytes].copy_(source)
    return sum(at.nbytes for at in staged.placements)
