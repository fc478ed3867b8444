"""The weights back from a weight stager (`warmstart.gpu.weight_stager`) after a level-2 wake.

The builtin engine maps the stager's memory at its weight arena's own addresses. vLLM's weights are not one
range: its sleep-mode allocator maps each of its segments on its own, and a CUDA mapping cannot start inside
another process's allocation. So the stager fills one block laid out here (every parameter's file ranges end
to end) while CRIU and the CUDA restore run, and the woken engine maps that block at a fresh address and
copies each range into place on the GPU, device to device, instead of reading the files after the wake.

The block needs as much free device memory as the weights, on top of them, until the copies are done, and
before the KV cache wakes: `fits` decides at capture whether a restore may count on that.
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
from warmstart.gpu.weight_stager.plan import StagingPlan

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


def staging(planned: Plan, model_dir: Path, device_index: int, device_uuid: str, granularity: int) -> Staging:
    """Lay every parameter's file ranges end to end in one block of the GPU with `device_index`."""
    copies, placements, at = [], [], 0
    for chunk in file_chunks(planned, WHOLE_PIECES):
        path = str(model_dir / planned.files[chunk.fd_index][0])
        copies.append((path, chunk.file_offset, at, chunk.length))
        placements.append(Placement(chunk.target, chunk.start, at, chunk.length))
        at = round_up(at + chunk.length, BLOCK_ALIGNMENT)
    plan = StagingPlan(device_index, round_up(at, granularity), tuple(copies), device_uuid)
    return Staging(plan, tuple(placements))


def fits(staged_bytes: int, free_bytes_asleep: int) -> bool:
    """Whether the block and the weights fit in what the sleeping engine leaves free on its GPU."""
    return 2 * staged_bytes + HEADROOM_BYTES <= free_bytes_asleep


def copy_in(model: Any, planned: Plan, staged: Staging, socket_path: str) -> dict[str, Any]:
    """Wait for the stager at `socket_path`, map its block and copy every range into the model's parameters
    (woken, at their addresses); `StagedWeightsUnavailable` or a CUDA error when there is nothing to copy."""
    from warmstart.gpu.cuda_arena import shared_memory_view

    started = time.perf_counter()
    fd, report = receive_staged_weights(socket_path)
    waited = time.perf_counter() - started
    try:
        with shared_memory_view(staged.plan.device_index, fd, staged.plan.range_bytes) as block:
            copied = place(model, planned, staged, block)
    finally:
        os.close(fd)
        acknowledge(report)
    return {
        "bytes": copied,
        "waited_s": round(waited, 3),
        "copied_s": round(time.perf_counter() - started - waited, 3),
        "stager_fill_s": report.get("seconds"),
        "stager_copy": report.get("copy"),
    }


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
