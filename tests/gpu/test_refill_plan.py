"""What a weight refill reads (no GPU needed): safetensors offsets, chunk plans, placement errors, O_DIRECT.

The CUDA arena is refilled by `warmstart.gpu.weights_io.refill`; these check its plan and its O_DIRECT
reads on CPU, where they run everywhere (the same read path stages chunks for the GPU copy on CUDA).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="needs torch (the `engine` extra)")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="needs safetensors (the `engine` extra)")

from warmstart.gpu.weights_io import (  # noqa: E402
    Chunk,
    TensorSlot,
    index_files,
    plan_chunks,
    plan_layout,
    read_header,
    refill,
    views,
)


@pytest.fixture
def st_file(tmp_path: Path) -> Path:
    path = tmp_path / "m.safetensors"
    safetensors_torch.save_file(
        {"a": torch.arange(6, dtype=torch.float32).view(2, 3), "b": torch.ones(5, dtype=torch.bfloat16)},
        str(path),
    )
    return path


def test_header_offsets_point_at_each_tensors_bytes(st_file: Path) -> None:
    raw = st_file.read_bytes()
    entries = {entry.name: entry for entry in read_header(st_file)}
    a = entries["a"]
    assert (a.dtype, a.shape, a.end - a.start) == ("F32", (2, 3), 24)
    assert raw[a.start : a.end] == torch.arange(6, dtype=torch.float32).numpy().tobytes()
    assert entries["b"].end - entries["b"].start == 10


def test_chunks_split_each_tensor_and_land_at_its_arena_offset(st_file: Path) -> None:
    entries = {entry.name: entry for entry in read_header(st_file)}
    # Reverse order with a gap, so file order and arena order differ.
    layout = {"b": TensorSlot("b", 0, (5,), "BF16"), "a": TensorSlot("a", 512, (2, 3), "F32")}
    chunks = plan_chunks(layout, [st_file], chunk_bytes=8)
    a, b = entries["a"], entries["b"]
    assert chunks == [
        Chunk(b.path, b.start, 0, 8),
        Chunk(b.path, b.start + 8, 8, 2),
        Chunk(a.path, a.start, 512, 8),
        Chunk(a.path, a.start + 8, 520, 8),
        Chunk(a.path, a.start + 16, 528, 8),
    ]


def test_missing_tensor_is_named(st_file: Path) -> None:
    layout = {"a": TensorSlot("a", 0, (2, 3), "F32"), "lm_head": TensorSlot("lm_head", 64, (4,), "F32")}
    with pytest.raises(ValueError, match="lm_head"):
        plan_chunks(layout, [st_file], chunk_bytes=1 << 20)


def test_tensor_in_two_files_is_refused(st_file: Path, tmp_path: Path) -> None:
    twin = tmp_path / "twin.safetensors"
    shutil.copy(st_file, twin)
    with pytest.raises(ValueError, match="appears in both"):
        index_files([st_file, twin])


def test_implausible_header_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"\xff" * 16)
    with pytest.raises(ValueError, match="bad.bin: safetensors header of .* implausible"):
        read_header(bad)


def _supports_direct_io(directory: Path) -> bool:
    probe = directory / "direct-io-probe"
    probe.write_bytes(b"\0" * 4096)
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        return False
    finally:
        probe.unlink()
    return True


@pytest.fixture
def odd_weights(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """Tensors of sizes that are not multiples of a block, so O_DIRECT reads start and end mid-block."""
    if not _supports_direct_io(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} does not support O_DIRECT")
    generator = torch.Generator().manual_seed(3)
    tensors = {
        "w": torch.randn(1001, 7, generator=generator),
        "ids": torch.randint(0, 256, (123457,), dtype=torch.uint8, generator=generator),
        "norm": torch.randn(3, generator=generator).to(torch.bfloat16),
    }
    path = tmp_path / "odd.safetensors"
    safetensors_torch.save_file(tensors, str(path))  # its data does not start on a block boundary
    return path, tensors


@pytest.mark.parametrize("threads,chunk_bytes", [(1, 1 << 20), (3, 4096), (4, 5000)])
def test_direct_io_refill_puts_every_tensor_at_its_offset(
    odd_weights: tuple[Path, dict[str, torch.Tensor]], threads: int, chunk_bytes: int
) -> None:
    path, tensors = odd_weights
    layout, nbytes = plan_layout([path])
    arena = torch.full((nbytes,), 0xAB, dtype=torch.uint8)
    stats = refill(arena, layout, [path], threads=threads, chunk_bytes=chunk_bytes, direct_io=True)
    assert stats.nbytes == sum(slot.nbytes for slot in layout.values())
    for name, view in views(arena, layout).items():
        assert torch.equal(view, tensors[name]), name


def test_direct_io_truncated_file_is_an_error(odd_weights: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, _tensors = odd_weights
    layout, nbytes = plan_layout([path])
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match="end of file"):
        refill(torch.empty(nbytes, dtype=torch.uint8), layout, [path], chunk_bytes=4096, direct_io=True)
