"""The weight stager's plan, its socket and its conversation with the engine, on any machine.

The stager really runs (`python -m warmstart.gpu.weight_stager`); without a GPU it fails at CUDA and
says so, which is what the engine must hear then. The GPU path: tests/engines/test_engine_gpu.py.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from warmstart.gpu.weight_stager.channel import listen
from warmstart.gpu.weight_stager.client import StagedWeightsUnavailable, receive_staged_weights
from warmstart.gpu.weight_stager.plan import MAX_SEGMENTS, RANGE_SLACK_BYTES, StagingPlan
from warmstart.gpu.weight_stager.stage import open_inside

REPO = Path(__file__).resolve().parents[2]


def _plan(tmp_path: Path, device_index: int = 0, device_uuid: str = "", name: str = "w.bin") -> StagingPlan:
    weights = tmp_path / "w.bin"
    weights.write_bytes(bytes(range(256)) * 64)
    copies = ((str(tmp_path / name), 0, 0, 8192), (str(tmp_path / name), 8192, 4096, 8192))
    return StagingPlan(device_index, 1 << 21, copies, device_uuid)


def _stager(plan_text: str, tmp_path: Path, socket_path: Path | None = None) -> tuple[subprocess.Popen, Path]:
    plan = tmp_path / "plan.json"
    plan.write_text(plan_text)
    socket_path = socket_path or tmp_path / "stager.sock"
    command = [sys.executable, "-m", "warmstart.gpu.weight_stager", "--plan", str(plan), "--socket"]
    return subprocess.Popen([*command, str(socket_path)], cwd=REPO, stderr=subprocess.PIPE), socket_path


def test_plan_round_trips_and_refuses_what_it_cannot_stage(tmp_path: Path) -> None:
    plan = _plan(tmp_path, device_uuid="GPU-1234")
    assert StagingPlan.from_json(plan.to_json()) == plan
    without_uuid = plan.to_dict()
    del without_uuid["device_uuid"]
    assert StagingPlan.from_dict(without_uuid).device_uuid == ""
    path = plan.copies[0][0]
    refused = {
        "out of range": StagingPlan(0, 4096, ((path, 0, 0, 8192),)),
        "not an absolute path": StagingPlan(0, 1 << 21, (("w.bin", 0, 0, 8192),)),
        "no copies": StagingPlan(0, 1 << 21, ()),
        "a range of": StagingPlan(
            0, 8192 + RANGE_SLACK_BYTES + 1, ((path, 0, 0, 8192),)
        ),  # memory for nothing
    }
    for reason, bad in refused.items():
        with pytest.raises(ValueError, match=reason):
            StagingPlan.from_json(bad.to_json())


def test_a_plan_of_segments_is_their_allocations_end_to_end(tmp_path: Path) -> None:
    """vLLM's KV cache as the block: its allocations may reach far past the copies (the engine keeps them),
    but must add up to the range, none empty, no more than one message's descriptors."""
    path = _plan(tmp_path).copies[0][0]
    copies = ((path, 0, 0, 8192),)
    segments = (1 << 30, 1 << 30)
    plan = StagingPlan(0, 2 << 30, copies, "GPU-1", segments)
    assert StagingPlan.from_json(plan.to_json()) == plan and plan.allocations == segments
    assert _plan(tmp_path).allocations == (1 << 21,)  # no segments: one allocation of the range
    refused = {
        "segments of": StagingPlan(0, 3 << 30, copies, "", segments),
        "none empty": StagingPlan(0, 1 << 30, copies, "", (1 << 30, 0)),
        f"1 to {MAX_SEGMENTS}": StagingPlan(
            0, (MAX_SEGMENTS + 1) << 21, copies, "", (2 << 20,) * (MAX_SEGMENTS + 1)
        ),
        "out of range": StagingPlan(0, 4096, copies, "", (4096,)),
    }
    for reason, bad in refused.items():
        with pytest.raises(ValueError, match=reason):
            StagingPlan.from_json(bad.to_json())


@pytest.mark.spawns
@pytest.mark.parametrize("device", [{"device_index": 4096}, {"device_uuid": "GPU-00000000-nowhere"}])
def test_engine_hears_why_the_stager_could_not_stage(tmp_path: Path, device: dict) -> None:
    # No such GPU on any machine: without CUDA the stager says so, with CUDA the device is missing.
    process, socket_path = _stager(_plan(tmp_path, **device).to_json(), tmp_path)
    with pytest.raises(StagedWeightsUnavailable, match="stager failed: Cuda"):
        receive_staged_weights(socket_path, timeout=60)
    assert process.wait(timeout=60) == 1
    assert not socket_path.exists(), "the stager removes the socket it made"


@pytest.mark.spawns
def test_files_are_opened_before_any_gpu_memory_is_taken(tmp_path: Path) -> None:
    process, socket_path = _stager(_plan(tmp_path, name="missing.bin").to_json(), tmp_path)
    with pytest.raises(StagedWeightsUnavailable, match="FileNotFoundError.*missing.bin"):
        receive_staged_weights(socket_path, timeout=60)
    assert process.wait(timeout=60) == 1


@pytest.mark.spawns
def test_a_socket_path_too_long_for_sun_path_still_works(tmp_path: Path) -> None:
    deep = tmp_path / ("pods-" + "x" * 60) / ("volumes-" + "y" * 60)  # like a kubelet's emptyDir
    deep.mkdir(parents=True)
    socket_path = deep / "weight-stager.sock"
    assert len(str(socket_path)) > 108
    process, _ = _stager(_plan(tmp_path, name="missing.bin").to_json(), tmp_path, socket_path)
    with pytest.raises(StagedWeightsUnavailable, match="missing.bin"):  # the conversation happened
        receive_staged_weights(socket_path, timeout=60)
    assert process.wait(timeout=60) == 1


@pytest.mark.spawns
def test_a_plan_it_cannot_read_is_reported_too(tmp_path: Path) -> None:
    process, socket_path = _stager("{not json", tmp_path)
    with pytest.raises(StagedWeightsUnavailable, match="JSONDecodeError"):
        receive_staged_weights(socket_path, timeout=60)
    assert process.wait(timeout=60) == 1


def test_no_stager_is_a_clear_error_after_the_timeout(tmp_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(StagedWeightsUnavailable, match="no weight stager at"):
        receive_staged_weights(tmp_path / "nobody.sock", timeout=0.3)
    assert time.monotonic() - started < 5


def test_a_stager_that_is_gone_is_noticed_at_once(tmp_path: Path) -> None:
    socket_path = tmp_path / "gone.sock"
    listen(socket_path).close()  # bound by its starter, then nobody listens any more
    assert stat.S_IMODE(socket_path.stat().st_mode) == 0o666, "an engine of any user may connect"
    started = time.monotonic()
    with pytest.raises(StagedWeightsUnavailable, match="cannot reach"):
        receive_staged_weights(socket_path, timeout=60)
    assert time.monotonic() - started < 5


def test_files_are_looked_up_inside_the_root_only(tmp_path: Path) -> None:
    root, secret = tmp_path / "root", tmp_path / "host-secret"
    (root / "models").mkdir(parents=True)
    (root / "models" / "w.bin").write_bytes(b"weights")
    secret.write_bytes(b"secret")
    (root / "models" / "escape").symlink_to(secret)  # an absolute link, as a hostile engine would plant
    (root / "models" / "relative").symlink_to("w.bin")
    os.mkfifo(root / "models" / "fifo")
    root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY)
    try:
        for inside in ("/models/w.bin", "/models/relative"):
            fd = open_inside(root_fd, inside)
            assert os.read(fd, 100) == b"weights"
            os.close(fd)
        for hostile in ("/models/escape", f"/../../{secret.relative_to('/')}", str(secret)):
            with pytest.raises(FileNotFoundError):  # the secret's path resolves within the root: absent
                open_inside(root_fd, hostile)
        with pytest.raises(OSError, match="not a regular file"):  # and a FIFO does not hang it
            open_inside(root_fd, "/models/fifo")
    finally:
        os.close(root_fd)


def test_cpu_engine_has_nothing_to_stage() -> None:
    pytest.importorskip("torch", reason="needs torch (the `engine` extra)")
    from warmstart.engines.builtin.engine import BuiltinEngine

    engine = BuiltinEngine(model="tiny", device="cpu", release_weights=True)
    engine.load()
    assert engine.weight_staging_plan() is None
