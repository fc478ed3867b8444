"""The CUDA arena on a real GPU: release + reacquire keeps the address, refill restores data and graphs."""

from __future__ import annotations

from pathlib import Path

import pytest

from warmstart.engines.arena import ArenaReleasedError
from warmstart.engines.cuda_arena import CudaVmmArena, file_segments, refill, safetensors_layout, segments_for

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


def _random_file(path: Path, nbytes: int, seed: int) -> bytes:
    import torch

    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    raw = data.numpy().tobytes()
    path.write_bytes(raw)
    return raw


@pytest.mark.parametrize("direct_io", [False, True])
def test_release_reacquire_keeps_address_and_refill_restores_bytes(
    arena: CudaVmmArena, tmp_path: Path, direct_io: bool
) -> None:
    import torch

    nbytes = (48 << 20) + 12345  # not a multiple of the chunk or of the page size
    raw = _random_file(tmp_path / "blob", nbytes, seed=1)
    flat = arena.allocate(nbytes)
    address = arena.address
    refill(arena, file_segments(tmp_path / "blob"), threads=3, chunk_bytes=8 << 20, direct_io=direct_io)
    assert flat.cpu().numpy().tobytes() == raw

    free_mapped = _free_device_bytes()
    arena.release()
    assert arena.released
    assert _free_device_bytes() - free_mapped >= nbytes  # the physical memory really went back

    arena.reacquire()
    assert arena.address == address and flat.data_ptr() == address
    flat.zero_()
    stats = refill(
        arena, file_segments(tmp_path / "blob"), threads=4, chunk_bytes=4 << 20, direct_io=direct_io
    )
    torch.cuda.synchronize()
    assert stats.nbytes == nbytes
    assert flat.cpu().numpy().tobytes() == raw


def test_refill_from_safetensors_places_each_tensor(arena: CudaVmmArena, weights_file: Path) -> None:
    import torch
    from safetensors.torch import load_file

    expected = load_file(str(weights_file))
    layout = safetensors_layout(weights_file)
    # Place tensors in reverse order with gaps, so file order and arena order differ.
    placement, offset = {}, 0
    for t in reversed(layout):
        placement[t.name] = offset
        offset += t.nbytes + 4096
    flat = arena.allocate(offset)
    refill(arena, segments_for(placement, [weights_file]), threads=2, chunk_bytes=1 << 20, direct_io=True)
    for t in layout:
        view = flat[placement[t.name] : placement[t.name] + t.nbytes].view(torch.bfloat16).view(*t.shape)
        assert torch.equal(view.cpu(), expected[t.name]), t.name


def test_cuda_graph_over_arena_replays_identically_after_release_and_refill(
    arena: CudaVmmArena, weights_file: Path
) -> None:
    import torch

    layout = {t.name: t for t in safetensors_layout(weights_file)}
    placement, offset = {}, 0
    for name, t in layout.items():
        placement[name] = offset
        offset += (t.nbytes + 255) // 256 * 256
    flat = arena.allocate(offset)
    segments = segments_for(placement, [weights_file])
    refill(arena, segments)

    def view(name: str) -> torch.Tensor:
        t = layout[name]
        return flat[placement[name] : placement[name] + t.nbytes].view(torch.bfloat16).view(*t.shape)

    weights = [view(f"w{i}") for i in range(8)]
    x = view("x").clone()

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

    refill(arena, segments)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, before)


def test_allocate_twice_and_refill_while_released_are_refused(arena: CudaVmmArena, tmp_path: Path) -> None:
    _random_file(tmp_path / "blob", 1 << 20, seed=2)
    arena.allocate(1 << 20)
    with pytest.raises(RuntimeError, match="allocate once"):
        arena.allocate(1 << 20)
    arena.release()
    with pytest.raises(RuntimeError, match="reacquire"):
        refill(arena, file_segments(tmp_path / "blob"))
    with pytest.raises(ArenaReleasedError):
        _ = arena.tensor
    assert arena.reacquire().data_ptr() == arena.address
