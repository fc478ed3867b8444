"""`warmstart prestage-weights` on a real model directory: the files dropped from the page cache are
resident again after one pass, found the way the worker's engine finds them."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from warmstart.cli import build_parser
from warmstart.engines.builtin.model_dir import ensure_model
from warmstart.snapshot.residency import resident_bytes
from warmstart.worker.prestage import model_files


def _dropped(path: Path) -> None:
    with path.open("rb") as stream:
        os.fsync(stream.fileno())
        os.posix_fadvise(stream.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


@pytest.fixture
def model(tmp_path: Path) -> Path:
    kind = subprocess.run(["stat", "-f", "-c", "%T", str(tmp_path)], capture_output=True, text=True).stdout
    if kind.strip() in ("tmpfs", "ramfs"):
        pytest.skip(f"{tmp_path} is on {kind.strip()}, whose pages cannot leave the page cache")
    return ensure_model(tmp_path / "tiny", "tiny")


def test_one_pass_makes_the_model_files_resident(model: Path) -> None:
    files = model_files(model)
    assert files[0].name.endswith(".safetensors") and any(p.name == "config.json" for p in files)
    for path in files:
        _dropped(path)
    weights = files[0]
    assert resident_bytes(weights) < weights.stat().st_size
    args = build_parser().parse_args(["prestage-weights", "--model-dir", str(model), "--once"])
    assert args.func(args) == 0
    assert all(resident_bytes(path) == path.stat().st_size for path in files)

