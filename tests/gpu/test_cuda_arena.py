"""The CUDA arena on a real GPU: release + reacquire keeps the address, refill restores data and graphs."""

from __future__ import annotations

from pathlib import Path

import pytest

from warmstart.gpu.arena import ArenaReleasedError
from warmstart.gpu.cuda_arena import CudaVmmArena
from warmstart.gpu.weights_io import Layout, TensorSlot, plan_layout, read_header, refill, views

pytestmark = pytest.mark.gpu


def _free_device_bytes() -> int:
    import torch

    free, _total = torch.cuda.mem_get_info()
    return free


@pytest.fixture
def arena(gpu: None):
    arena = CudaVmmArena()
    yield arena
    arena.close()


def _random_blob(path: Path, nbytes: int, seed: int) -> bytes:
    """A safetensors file holding one uint8 tensor `blob` of `nbytes` random bytes; returns those bytes."""
    import torch
    from safetensors.torch import save_file

    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    save_file({"blob": data}, str(path))  # its data does not start on a page boundary
    return data.numpy().tobytes()


@pytest.mark.parametrize("direct_io", [False, True])
def test_release_reacquire_keeps_address_and_refill_restores_bytes(
    arena: CudaVmmArena, tmp_path: Path, direct_io: bool
) -> None:
    import torch

    nbytes = (48 << 20) + 12345  # not a multiple of the chunk or of the page size
    blob = tmp_path / "blob.safetensors"
    raw = _random_blob(blob, nbytes, seed=1)
    layout, size = plan_layout([blob])
    flat = arena.allocate(size)
    address = arena.address
    refill(arena.tensor, layout, [blob], threads=3, chunk_bytes=8 << 20, direct_io=direct_io)
    assert flat[:nbytes].cpu().numpy().tobytes() == raw

    free_mapped = _free_device_bytes()
    arena.release()
    assert arena.released
    assert _free_device_bytes() - free_mapped >= nbytes  # the physical memory really went back

    arena.reacquire()
    assert arena.address == address and flat.data_ptr() == address
    flat.zero_()  # refill waits for this before it copies
    stats = refill(arena.tensor, layout, [blob], threads=4, chunk_bytes=4 << 20, direct_io=direct_io)
    torch.cuda.synchronize()
    assert stats.nbytes == nbytes
    assert flat[:nbytes].cpu().numpy().tobytes() == raw


def test_refill_from_safetensors_places_each_tensor(arena: CudaVmmArena, weights_file: Path) -> None:
    import torch
    from safetensors.torch import load_file

    expected = load_file(str(weights_file))
    # Place tensors in reverse order with gaps, so file order and arena order differ.
    layout: Layout = {}
    offset = 0
    for entry in reversed(read_header(weights_file)):
        layout[entry.name] = TensorSlot(entry.name, offset, entry.shape, entry.dtype)
        offset += layout[entry.name].nbytes + 4096
    flat = arena.allocate(offset)
    refill(flat, layout, [weights_file], threads=2, chunk_bytes=1 << 20, direct_io=True)
    for name, view in views(flat, layout).items():
        assert view.dtype == torch.bfloat16
        assert torch.equal(view.cpu(), expected[name]), name


def test_cuda_graph_over_arena_replays_identically_after_release_and_refill(
    arena: CudaVmmArena, weights_file: Path
) -> None:
    import torch

    layout, size = plan_layout([weights_file])
    flat = arena.allocate(size)
    refill(flat, layout, [weights_file])
    tensors = views(flat, layout)
    weights = [tensors[f"w{i}"] for i in range(8)]
    x = tensors["x"].clone()

    def forward(inp: torch.Tensor) -> torch.Tensor:
        for w in weights:
            inp = torch.tanh(inp @ w)
        return inp

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        forward(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = forward(x)
    graph.replay()
    before = y.clone()

    arena.release()
    arena.reacquire()
    flat.fill_(0x7F)  # garbage where the weights were: a replay without refill would differ
    graph.replay()
    assert not torch.equal(y, before)

    refill(arena.tensor, layout, [weights_file])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, before)


def test_allocate_twice_and_refill_while_released_are_refused(arena: CudaVmmArena, tmp_path: Path) -> None:
    blob = tmp_path / "blob.safetensors"
    _random_blob(blob, 1 << 20, seed=2)
    layout, size = plan_layout([blob])
    arena.allocate(size)
    with pytest.raises(RuntimeError, match="allocate once"):
        arena.allocate(size)
    arena.release()
    with pytest.raises(ArenaReleasedError, match="reacquire"):
        refill(arena.tensor, layout, [blob])
    assert arena.reacquire().data_ptr() == arena.address
    assert refill(arena.tensor, layout, [blob]).nbytes == 1 << 20
