"""Restore facts: what a restore pod's worker measures without its engine and what the node agent compares
before CRIU runs (the pod's model files, engine, flags; the node's GPU and driver)."""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from warmstart.agent.node_facts import FactsUnavailable, GpuFacts, pod_gpu_facts
from warmstart.agent.restore import Refused, RestorePhase
from warmstart.api.capture_record import CaptureRecord
from warmstart.api.identity import SnapshotIdentity
from warmstart.api.restore_facts import FactsInvalid, RestoreFacts
from warmstart.api.worker_options import add_worker_arguments
from warmstart.checkpoint.restore import PodUnfit
from warmstart.engines.digest import SAMPLE_HEAD_BYTES, sampled_digest
from warmstart.host.cuda_driver import GpuDevice
from warmstart.worker.facts import measure_restore_facts

H200 = GpuDevice("GPU-aaaa", "NVIDIA H200", "9.0")
H100 = GpuDevice("GPU-bbbb", "NVIDIA H100 80GB HBM3", "9.0")


def worker_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    return parser.parse_args(list(argv))


def model_dir(path: Path, weights: bytes) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "model.safetensors").write_bytes(weights)
    (path / "config.json").write_text('{"layers": 2}')
    return path


def facts(**changes: Any) -> RestoreFacts:
    base = RestoreFacts("builtin", "warmstart-0.1.0/torch-2.11.0", ("--engine", "builtin"), "/m",
                        {"model.safetensors": (10, "ab"), "config.json": (3, "cd")})  # fmt: skip
    return dataclasses.replace(base, **changes)


# --- the contract ----------------------------------------------------------------------------------------


def test_facts_round_trip_and_identical_facts_have_no_mismatch() -> None:
    again = RestoreFacts.from_dict(facts().to_dict())
    assert again == facts()
    assert facts().mismatches(again) == []


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"engine_version": "warmstart-0.1.0/torch-2.12.0"}, "engine version"),
        ({"worker_args": ("--engine", "builtin", "--dtype", "float16")}, "worker flags"),
        ({"model_files": {"model.safetensors": (10, "ff"), "config.json": (3, "cd")}},
         "model.safetensors changed content"),
        ({"model_files": {"model.safetensors": (11, "ab"), "config.json": (3, "cd")}},
         "model.safetensors changed size"),
        ({"model_files": {"config.json": (3, "cd")}}, "model.safetensors is missing"),
        ({"error": "no model files in /m"}, "could not measure its model files: no model files in /m"),
    ],
)  # fmt: skip
def test_each_difference_is_named(changes: dict[str, Any], named: str) -> None:
    problems = facts().mismatches(facts(**changes))
    assert len(problems) == 1 and named in problems[0], problems


@pytest.mark.parametrize(
    "data",
    [
        [],
        {"engine": 1, "worker_args": [], "model_files": {}},
        {"worker_args": "--engine", "model_files": {}},
        {"worker_args": [], "model_files": {"w": [-1, "ab"]}},
        {"worker_args": [], "model_files": {"w": [True, "ab"]}},
        {"worker_args": [], "model_files": {"w": [1, "a" * 10_000]}},
    ],
)
def test_facts_that_no_worker_writes_are_refused(data: Any) -> None:
    with pytest.raises(FactsInvalid):
        RestoreFacts.from_dict(data)


# --- the worker's measurement ----------------------------------------------------------------------------


def test_sampled_digest_follows_size_and_sampled_bytes(tmp_path: Path) -> None:
    path = tmp_path / "w"
    content = bytearray(range(256)) * (40 << 12)  # 40 MiB
    path.write_bytes(content)
    first = sampled_digest(path)
    assert first[0] == len(content)
    content[100] ^= 1  # in the head: sampled
    path.write_bytes(content)
    assert sampled_digest(path) != first
    path.write_bytes(bytes(content) + b"x")
    assert sampled_digest(path)[0] == len(content) + 1
    # The stated limit: a same-size change between the sampled windows goes unseen (the full digest at
    # capture covers every byte; a restore re-reads only the samples).
    content[100] ^= 1
    path.write_bytes(content)
    content[SAMPLE_HEAD_BYTES + 100_000] ^= 1
    path.write_bytes(content)
    assert sampled_digest(path) == first


def test_a_worker_measures_its_model_files_and_flags_without_an_engine(tmp_path: Path) -> None:
    directory = model_dir(tmp_path / "m", b"weights-1" * 1000)
    argv = ("--engine", "builtin", "--model-dir", str(directory), "--control-dir", str(tmp_path / "c"))
    capture = measure_restore_facts(worker_args(*argv, "--mode", "capture"))
    restore = measure_restore_facts(worker_args(*argv, "--mode", "restore"))
    assert capture.error == "" and set(capture.model_files) == {"model.safetensors", "config.json"}
    assert capture.mismatches(restore) == []  # --mode and --control-dir differ by role: left out
    assert restore.worker_args == (f"--model-dir={directory}",)  # the defaults (builtin) need no flag
    spelled_out = worker_args(
        *argv, "--mode", "restore", "--engine=builtin", "--seed", "0", "--dtype", "auto"
    )
    assert measure_restore_facts(spelled_out).worker_args == restore.worker_args  # the same options
    (directory / "model.safetensors").write_bytes(b"weights-2" * 1000)  # overwritten in place
    changed = capture.mismatches(measure_restore_facts(worker_args(*argv, "--mode", "restore")))
    assert changed == [f"model {directory}: model.safetensors changed content since the snapshot"]
    other_flags = measure_restore_facts(worker_args(*argv, "--mode", "restore", "--max-num-seqs", "4"))
    named = [problem.split(":")[0] for problem in capture.mismatches(other_flags)]
    assert named == ["worker flags", f"model {directory}"]


def test_missing_model_files_are_reported_not_raised(tmp_path: Path) -> None:
    absent = str(tmp_path / "absent")
    measured = measure_restore_facts(worker_args("--model-dir", absent, "--mode", "restore"))
    assert "no model files" in measured.error
    assert "could not measure" in facts().mismatches(measured)[0]


# --- the node's GPUs -------------------------------------------------------------------------------------


def test_the_pods_gpus_are_those_it_was_given() -> None:
    both = [H200, H100]
    assert pod_gpu_facts([H200], 580, None) == GpuFacts("NVIDIA H200", "9.0", 580)
    assert pod_gpu_facts(both, 580, ["GPU-bbbb"]).product == "NVIDIA H100 80GB HBM3"
    assert pod_gpu_facts(both, 580, ["0"]).product == "NVIDIA H200"
    assert pod_gpu_facts(both, 580, None).product == "NVIDIA H100 80GB HBM3 + NVIDIA H200"
    with pytest.raises(FactsUnavailable, match="given GPUs"):
        pod_gpu_facts(both, 580, ["GPU-cccc"])
    with pytest.raises(FactsUnavailable, match="no GPU"):
        pod_gpu_facts(both, 580, ["none"])


def gpu_identity() -> SnapshotIdentity:
    return SnapshotIdentity(
        model_digest="sha256:m", engine="builtin", engine_version="v", device="cuda",
        gpu_product="NVIDIA H200", compute_capability="9.0", driver_major=580, image="sha256:img",
    )  # fmt: skip


def restore_phase(gpus: Any, image: str = "sha256:img") -> RestorePhase:
    node = SimpleNamespace(config=SimpleNamespace(max_restores=1), gpus=gpus, worker_image=lambda pod: image)
    return RestorePhase(node)  # type: ignore[arg-type]


@pytest.fixture
def pod_given_h100() -> Any:
    """A process started as a container's first process is: NVIDIA_VISIBLE_DEVICES names its GPU."""
    process = subprocess.Popen(["sleep", "60"], env={"NVIDIA_VISIBLE_DEVICES": "GPU-bbbb"})
    yield SimpleNamespace(init_pid=process.pid)
    process.kill()
    process.wait()


@pytest.mark.spawns
@pytest.mark.parametrize(
    ("driver", "named"),
    [(580, "gpu_product: snapshot has 'NVIDIA H200', here is 'NVIDIA H100 80GB HBM3'"),
     (590, "driver_major: snapshot has 580, here is 590")],
)  # fmt: skip
def test_a_gpu_snapshot_is_refused_on_another_gpu_or_driver(pod_given_h100: Any, driver: int, named: str):
    phase = restore_phase(lambda: ([H200, H100], driver))
    with pytest.raises(Refused, match="captured for another pod or node") as refused:
        phase.expected_identity(gpu_identity(), pod_given_h100)
    assert named in str(refused.value)
    if driver == 580:  # the same product on the GPU it was given: restorable
        phase = restore_phase(lambda: ([H100, H200], 580))
        sandbox = SimpleNamespace(init_pid=pod_given_h100.init_pid)
        identity = dataclasses.replace(gpu_identity(), gpu_product="NVIDIA H100 80GB HBM3")
        assert phase.expected_identity(identity, sandbox) == identity


@pytest.mark.spawns
def test_a_gpu_snapshot_is_refused_where_the_agent_has_no_cuda(pod_given_h100: Any) -> None:
    def no_cuda() -> Any:
        raise FactsUnavailable("this node agent cannot reach the CUDA driver: no libcuda")

    with pytest.raises(Refused, match="cannot be checked here: .*no libcuda"):
        restore_phase(no_cuda).expected_identity(gpu_identity(), pod_given_h100)


@pytest.mark.parametrize(
    ("image", "why"),
    [("sha256:other", "image: snapshot has 'sha256:img', here is 'sha256:other'"),
     ("", "neither the container runtime nor the kubelet reports")],
)  # fmt: skip
def test_a_pod_running_another_image_is_unfit_and_the_snapshot_not_at_fault(image: str, why: str) -> None:
    """The image is the runtime's word, checked once the snapshot is verified: PodUnfit (a refusal that
    counts nothing against the snapshot), naming the difference."""
    snapshot = SimpleNamespace(id="s", identity=gpu_identity(), record=CaptureRecord())
    with pytest.raises(PodUnfit, match=re.escape(why)):
        restore_phase(lambda: ([H200], 580), image).pod_checks(snapshot, {}, None)  # type: ignore[arg-type]
    restore_phase(lambda: ([H200], 580)).pod_checks(snapshot, {}, None)  # type: ignore[arg-type]
