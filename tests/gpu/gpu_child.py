"""A small GPU process for checkpoint/restore tests, run as its own program.

It loads weights from a safetensors file (into plain torch tensors, or into a CUDA arena), captures a CUDA
graph over them, records output hashes, signals `ready-for-snapshot` (with its pid) in the control directory,
and waits for `restore-complete`. Then it re-maps and refills the arena when it released it, replays the graph
and runs eagerly again, and writes both hashes to `<control>/after.json`.

    python gpu_child.py CONTROL_DIR WEIGHTS.safetensors {plain,arena,arena-release}
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import torch

from warmstart.api.control_dir import READY_FOR_SNAPSHOT, RESTORE_COMPLETE, ControlDir
from warmstart.gpu.cuda_arena import CudaVmmArena
from warmstart.gpu.weights_io import Layout, plan_layout, refill, release_pinned_cache, views


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.float().cpu().numpy().tobytes()).hexdigest()[:16]


def load_plain(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path, device="cuda")


def refill_arena(arena: CudaVmmArena, layout: Layout, path: str) -> None:
    refill(arena.tensor, layout, [path])
    release_pinned_cache()  # the staging buffers must not sit in the process (and its checkpoint)


def load_into_arena(path: str) -> tuple[CudaVmmArena, dict[str, torch.Tensor], Layout]:
    layout, nbytes = plan_layout([path])  # 256-byte aligned tensors, as cuBLAS likes
    arena = CudaVmmArena()
    flat = arena.allocate(nbytes)
    refill_arena(arena, layout, path)
    return arena, views(flat, layout), layout


def main() -> int:
    control, weights, mode = ControlDir(sys.argv[1]), sys.argv[2], sys.argv[3]
    arena = None
    if mode == "plain":
        tensors = load_plain(weights)
    else:
        arena, tensors, layout = load_into_arena(weights)
    layers = [tensors[k] for k in sorted(tensors) if k.startswith("w")]
    x = tensors["x"].clone()

    def forward(inp: torch.Tensor) -> torch.Tensor:
        for w in layers:
            inp = torch.tanh(inp @ w)
        return inp

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for _ in range(2):
            forward(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = forward(x)
    graph.replay()
    torch.cuda.synchronize()
    before = {"graph": digest(y), "eager": digest(forward(x))}
    if mode == "arena-release":
        assert arena is not None
        arena.release()
    control.send(READY_FOR_SNAPSHOT, {"pid": os.getpid(), "before": before})
    control.wait(RESTORE_COMPLETE, timeout=600)
    if mode == "arena-release":
        assert arena is not None
        arena.reacquire()
        refill_arena(arena, layout, weights)
    y.zero_()
    graph.replay()
    torch.cuda.synchronize()
    after = {"graph": digest(y), "eager": digest(forward(x)), "arena_address": arena.address if arena else 0}
    (Path(sys.argv[1]) / "after.json").write_text(json.dumps(after))
    return 0


if __name__ == "__main__":
    sys.exit(main())
