"""`warmstart prestage-weights` on a real model directory: the files dropped from the page cache are
resident again after one pass, found the way the worker's engine finds them."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import page_cache_kept

from warmstart.cli import build_parser
from warmstart.engines.builtin.model_dir import ensure_model
from warmstart.snapshot.residency import evict, resident_bytes
from warmstart.worker.prestage import model_files


@pytest.fixture
def model(tmp_path: Path) -> Path:
    if reason := page_cache_kept(tmp_path):
        pytest.skip(reason)
    return ensure_model(tmp_path / "tiny", "tiny")


def test_one_pass_makes_the_model_files_resident(model: Path) -> None:
    files = model_files(model)
    assert files[0].name.endswith(".safetensors") and any(p.name == "config.json" for p in files)
    for path in files:
        evict(path)
    weights = files[0]
    assert resident_bytes(weights) < weights.stat().st_size
    args = build_parser().parse_args(["prestage-weights", "--model-dir", str(model), "--once"])
    assert args.func(args) == 0
    assert all(resident_bytes(path) == path.stat().st_size for path in files)
