"""The weight stager's plan and its conversation with the engine, on any machine (GPU: test_engine_gpu)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from warmstart.engines.weight_stager import StagedWeightsUnavailable, StagingPlan, receive_staged_weights

REPO = Path(__file__).resolve().parents[2]


def _plan(tmp_path: Path, device_index: int = 0, device_uuid: str = "") -> StagingPlan:
    weights = tmp_path / "w.bin"
    weights.write_bytes(bytes(range(256)) * 64)
    copies = ((str(weights), 0, 0, 8192), (str(weights), 8192, 4096, 8192))
    return StagingPlan(device_index, 1 << 21, copies, device_uuid)


def _stager(tmp_path: Path, plan_text: str) -> tuple[subprocess.Popen[bytes], Path]:
    plan = tmp_path / "plan.json"
    plan.write_text(plan_text)
    socket_path = tmp_path / "stager.sock"
    command = [sys.executable, "-m", "warmstart.engines.weight_stager", "--plan", str(plan), "--socket"]
    process = subprocess.Popen([*command, str(socket_path)], cwd=REPO, stderr=subprocess.PIPE)
    return process, socket_path


def test_plan_round_trips_and_refuses_copies_outside_the_range(tmp_path: Path) -> None:
    plan = _plan(tmp_path, device_uuid="GPU-1234")
    assert StagingPlan.from_json(plan.to_json()) == plan
    without_uuid = plan.to_dict()
    del without_uuid["device_uuid"]
    assert StagingPlan.from_dict(without_uuid).device_uuid == ""
    outside = StagingPlan(0, 4096, ((plan.copies[0][0], 0, 0, 8192),))
    with pytest.raises(ValueError, match="out of range"):
        StagingPlan.from_json(outside.to_json())


@pytest.mark.parametrize("device", [{"device_index": 4096}, {"device_uuid": "GPU-00000000-nowhere"}])
def test_engine_hears_why_the_stager_could_not_stage(tmp_path: Path, device: dict) -> None:
    # No such GPU on any machine: without CUDA the stager says so, with CUDA the device is missing.
    process, socket_path = _stager(tmp_path, _plan(tmp_path, **device).to_json())
    with pytest.raises(StagedWeightsUnavailable, match="stager failed: Cuda"):
        receive_staged_weights(socket_path, timeout=60)
    assert process.wait(timeout=60) == 1
    assert not socket_path.exists(), "the stager removes its socket"


def test_a_plan_it_cannot_read_is_reported_too(tmp_path: Path) -> None:
    process, socket_path = _stager(tmp_path, "{not json")
    with pytest.raises(StagedWeightsUnavailable, match="JSONDecodeError"):
        receive_staged_weights(socket_path, timeout=60)
    assert process.wait(timeout=60) == 1


def test_no_stager_is_a_clear_error_after_the_timeout(tmp_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(StagedWeightsUnavailable, match="no weight stager at"):
        receive_staged_weights(tmp_path / "nobody.sock", timeout=0.3)
    assert time.monotonic() - started < 5


def test_cpu_engine_has_nothing_to_stage() -> None:
    pytest.importorskip("torch", reason="needs torch (the `engine` extra)")
    from warmstart.engines.builtin.engine import BuiltinEngine

    engine = BuiltinEngine(model="tiny", device="cpu", release_weights=True)
    engine.load()
    assert engine.weight_staging_plan() is None
