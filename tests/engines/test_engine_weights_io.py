"""Safetensors writing, layouts and parallel refills into an arena, checked with safetensors' reader."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="needs torch (the `engine` extra)")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="needs safetensors (the `engine` extra)")

from warmstart.gpu.arena import ArenaReleasedError, TorchArena, create_arena  # noqa: E402
from warmstart.gpu.weights_io import (  # noqa: E402
    ARENA_ALIGNMENT,
    TensorSlot,
    dtype_code,
    plan_layout,
    read_header,
    refill,
    views,
    write_safetensors,
)


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return {
        "a.weight": torch.randn(33, 17, generator=generator),
        "b.bias": torch.randn(5, generator=generator).to(torch.bfloat16),
        "c.big": torch.randn(1000, 300, generator=generator).to(torch.float16),
        "d.ids": torch.arange(11, dtype=torch.int64),
    }


def _write(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    sources = [(name, dtype_code(t.dtype), tuple(t.shape), lambda t=t: t) for name, t in tensors.items()]
    write_safetensors(path, sources, metadata={"format": "pt"})
    return path


def test_written_file_reads_back_with_safetensors(tmp_path: Path) -> None:
    tensors = _tensors()
    path = _write(tmp_path / "w.safetensors", tensors)
    loaded = safetensors_torch.load_file(path)
    assert sorted(loaded) == sorted(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name], tensor), name


@pytest.mark.parametrize("threads,chunk_bytes", [(1, 1 << 20), (4, 4096), (8, 1000)])
def test_refill_puts_every_tensor_at_its_offset(tmp_path: Path, threads: int, chunk_bytes: int) -> None:
    tensors = _tensors()
    first = _write(tmp_path / "one.safetensors", dict(list(tensors.items())[:2]))
    second = _write(tmp_path / "two.safetensors", dict(list(tensors.items())[2:]))
    layout, nbytes = plan_layout([first, second])
    assert all(slot.offset % ARENA_ALIGNMENT == 0 for slot in layout.values())
    arena = TorchArena("cpu")
    arena.allocate(nbytes).fill_(0xAB)
    stats = refill(arena.tensor, layout, [first, second], threads=threads, chunk_bytes=chunk_bytes)
    assert stats.nbytes == sum(slot.nbytes for slot in layout.values())
    for name, view in views(arena.tensor, layout).items():
        assert torch.equal(view, tensors[name]), name


def test_refill_after_release_restores_the_same_values(tmp_path: Path) -> None:
    path = _write(tmp_path / "w.safetensors", _tensors())
    layout, nbytes = plan_layout([path])
    arena = TorchArena("cpu")
    refill(arena.allocate(nbytes), layout, [path])
    before = {name: view.clone() for name, view in views(arena.tensor, layout).items()}
    arena.release()
    assert arena.released
    with pytest.raises(ArenaReleasedError):
        _ = arena.tensor
    refill(arena.reacquire(), layout, [path])
    for name, view in views(arena.tensor, layout).items():
        assert torch.equal(view, before[name]), name


def test_layout_that_disagrees_with_the_file_names_the_tensor(tmp_path: Path) -> None:
    path = _write(tmp_path / "w.safetensors", _tensors())
    layout, nbytes = plan_layout([path])
    layout["a.weight"] = TensorSlot("a.weight", layout["a.weight"].offset, (17, 33), "F32")
    with pytest.raises(ValueError, match="a.weight"):
        refill(torch.empty(nbytes, dtype=torch.uint8), layout, [path])
    layout["missing"] = TensorSlot("missing", 0, (1,), "F32")
    del layout["a.weight"]
    with pytest.raises(ValueError, match="missing"):
        refill(torch.empty(nbytes, dtype=torch.uint8), layout, [path])


def test_truncated_file_is_an_error(tmp_path: Path) -> None:
    path = _write(tmp_path / "w.safetensors", _tensors())
    layout, nbytes = plan_layout([path])
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match="end of file"):
        refill(torch.empty(nbytes, dtype=torch.uint8), layout, [path])


def test_header_data_starts_page_aligned(tmp_path: Path) -> None:
    path = _write(tmp_path / "w.safetensors", _tensors())
    assert min(entry.start for entry in read_header(path)) % 4096 == 0


def test_not_a_safetensors_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(b"abc")
    with pytest.raises(ValueError, match="not a safetensors file"):
        read_header(path)


def test_arena_backends_by_name() -> None:
    assert isinstance(create_arena("torch", "cpu"), TorchArena)
    with pytest.raises(ValueError, match="unknown arena"):
        create_arena("nope", "cpu")
    arena = TorchArena("cpu")
    arena.allocate(10)
    with pytest.raises(RuntimeError, match="already allocated"):
        arena.allocate(10)
