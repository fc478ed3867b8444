"""Copy plans for the CUDA arena (no GPU needed): safetensors layout, merging, placement errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from warmstart.engines.cuda_arena import Segment, merge_segments, safetensors_layout, segments_for


@pytest.fixture
def st_file(tmp_path: Path) -> Path:
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    path = tmp_path / "m.safetensors"
    save_file(
        {"a": torch.arange(6, dtype=torch.float32).view(2, 3), "b": torch.ones(5, dtype=torch.bfloat16)},
        str(path),
    )
    return path


def test_layout_offsets_point_at_each_tensors_bytes(st_file: Path) -> None:
    import torch

    raw = st_file.read_bytes()
    layout = {t.name: t for t in safetensors_layout(st_file)}
    a = layout["a"]
    assert (a.dtype, a.shape, a.nbytes) == ("F32", (2, 3), 24)
    assert (
        raw[a.file_offset : a.file_offset + a.nbytes]
        == torch.arange(6, dtype=torch.float32).numpy().tobytes()
    )
    assert layout["b"].nbytes == 10


def test_adjacent_tensors_placed_adjacently_merge_into_one_read(st_file: Path) -> None:
    layout = safetensors_layout(st_file)
    base = layout[0].file_offset
    placement = {t.name: t.file_offset - base for t in layout}  # the arena mirrors the file
    assert segments_for(placement, [st_file]) == [
        Segment(str(st_file), base, 0, sum(t.nbytes for t in layout))
    ]


def test_gaps_in_the_arena_keep_segments_apart() -> None:
    segs = [Segment("f", 100, 0, 10), Segment("f", 110, 20, 10), Segment("f", 120, 30, 5)]
    assert merge_segments(segs) == [Segment("f", 100, 0, 10), Segment("f", 110, 20, 15)]


def test_missing_tensor_is_named(st_file: Path) -> None:
    with pytest.raises(ValueError, match="lm_head"):
        segments_for({"a": 0, "lm_head": 64}, [st_file])


def test_not_a_safetensors_file_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"\xff" * 16)
    with pytest.raises(ValueError, match="not a safetensors file"):
        safetensors_layout(bad)
