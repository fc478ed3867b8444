"""The GPU restore benchmark's orchestration, run on CPU with the tiny model and real CRIU.

The benchmark itself needs a GPU for its figures; this dry run keeps its capture/restore/report path working
between GPU runs: every mode is checkpointed, restored and compared token for token with its source.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]
MODES = ("optimised", "keep-scratch", "naive")


@pytest.mark.spawns
@pytest.mark.integration
def test_every_mode_restores_with_the_sources_outputs(criu_command: str, tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="needs torch (the `engine` extra)")
    out = tmp_path / "out"
    command = [
        sys.executable,
        "benchmarks/gpu_restore.py",
        "run",
        "--device=cpu",
        "--models=tiny",
        f"--modes={','.join(MODES)}",
        "--reps=1",
        "--caches=hot",
        "--floors-gib=0",
        f"--criu={criu_command}",
        f"--work={tmp_path / 'work'}",
        f"--out={out}",
        "--budget-s=600",
    ]
    finished = subprocess.run(command, cwd=REPO, timeout=900, capture_output=True, text=True)
    assert finished.returncode == 0, finished.stdout[-4000:] + finished.stderr[-4000:]
    result = json.loads((out / "gpu_restore_tiny.json").read_text())
    restores = result["restores"]
    assert sorted(run["mode"] for run in restores) == sorted(MODES)
    assert all(run["outputs_identical"] and run["first_token_identical"] for run in restores)
    table = (out / "gpu_restore.md").read_text()
    for mode in MODES:
        assert f"| {mode} restore | hot |" in table


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    return importlib.import_module("gpu_restore")


def test_capture_sizes_follow_vllms_default_list(bench: ModuleType) -> None:
    """1, 2, 4, every 8 below 256, every 16 from 256 to 512 (vLLM's default for max_num_seqs >= 256)."""
    vllm_like_graph_sizes = bench.vllm_like_graph_sizes

    sizes = vllm_like_graph_sizes(512)
    assert len(sizes) == 51 and sizes[:5] == [1, 2, 4, 8, 16] and sizes[-3:] == [480, 496, 512]
    assert 264 not in sizes and 272 in sizes
    assert vllm_like_graph_sizes(20) == [1, 2, 4, 8, 16]


def test_keep_scratch_differs_from_optimised_only_by_keeping_the_graph_scratch(bench: ModuleType) -> None:
    args = bench.parse_args(["run", "--device=cuda", "--compile-models=qwen3-8b"])
    options = {mode: bench.engine_options("qwen3-8b", Path("m"), mode, args) for mode in MODES}
    assert options["optimised"]["release_graph_scratch"] is True
    assert options["keep-scratch"] == {**options["optimised"], "release_graph_scratch": False}
    assert options["optimised"]["arena"] == "cuda-vmm" and options["optimised"]["release_weights"]
    assert options["naive"]["arena"] == "torch" and not options["naive"]["release_weights"]
