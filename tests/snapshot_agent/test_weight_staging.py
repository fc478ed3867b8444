"""Starting a weight stager for a restore: which snapshots get one, and what the restored engine hears.

The stager really runs; without a GPU it fails and says why, which is what the engine must hear then.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from warmstart.engines.weight_stager import (
    StagedWeightsUnavailable,
    StagingPlan,
    open_inside,
    receive_staged_weights,
)
from warmstart.protocol import ControlDir
from warmstart.snapshot_agent.weight_staging import STAGER_SOCKET, staging_plan, start_stager


@dataclass
class _Snapshot:  # the two fields of `Snapshot` that staging reads
    meta: dict[str, Any] = field(default_factory=dict)
    id: str = "snap-1"


def _plan(tmp_path: Path) -> StagingPlan:
    weights = tmp_path / "w.bin"
    weights.write_bytes(b"\1" * 8192)
    return StagingPlan(4096, 1 << 21, ((str(weights), 0, 0, 8192),))  # no machine has device 4096


def test_only_cuda_snapshots_with_a_readable_plan_get_a_stager(tmp_path: Path) -> None:
    plan = _plan(tmp_path).to_dict()
    assert staging_plan(_Snapshot({"uses_cuda": True, "worker": {"weight_staging": plan}})) is not None
    assert staging_plan(_Snapshot({"uses_cuda": False, "worker": {"weight_staging": plan}})) is None
    assert staging_plan(_Snapshot({"uses_cuda": True, "worker": {}})) is None
    assert staging_plan(_Snapshot({"uses_cuda": True, "worker": {"weight_staging": {"copies": 3}}})) is None


def test_plan_paths_are_read_inside_the_sandbox_root(tmp_path: Path) -> None:
    plan = _plan(tmp_path).under_root("/proc/42/root")
    assert plan.root == "/proc/42/root" and plan.copies == _plan(tmp_path).copies
    assert StagingPlan.from_json(plan.to_json()) == plan


def test_nothing_outside_the_sandbox_root_can_be_read(tmp_path: Path) -> None:
    root, secret = tmp_path / "root", tmp_path / "host-secret"
    (root / "models").mkdir(parents=True)
    (root / "models" / "w.bin").write_bytes(b"weights")
    secret.write_bytes(b"secret")
    (root / "models" / "escape").symlink_to(secret)  # an absolute link, as a hostile engine would plant
    (root / "models" / "relative").symlink_to("w.bin")
    for inside, expected in (("/models/w.bin", b"weights"), ("/models/relative", b"weights")):
        fd = open_inside(str(root), inside)
        assert os.read(fd, 100) == expected
        os.close(fd)
    fd = open_inside(f"/proc/{os.getpid()}/root", str(secret))  # a process's root, as restores use
    assert os.read(fd, 100) == b"secret"
    os.close(fd)
    for hostile in ("/models/escape", f"/../../{secret.relative_to('/')}", str(secret)):
        with pytest.raises(OSError, match="inside"):  # the secret's path resolves within the root: absent
            open_inside(str(root), hostile)


def test_the_engine_hears_from_the_stager_started_for_its_restore(tmp_path: Path) -> None:
    control = ControlDir(tmp_path / "control")
    control.path.mkdir()
    snapshot = _Snapshot({"uses_cuda": True, "worker": {"weight_staging": _plan(tmp_path).to_dict()}})
    # our own root stands for the sandbox's: the stager reads the files through /proc/<pid>/root
    stager = start_stager(snapshot, os.getpid(), control)
    assert stager is not None and stager.payload() == {"weight_stager_socket": STAGER_SOCKET}
    with pytest.raises(StagedWeightsUnavailable, match="stager failed: Cuda"):
        receive_staged_weights(control.path / STAGER_SOCKET, timeout=60)
    assert stager.process.wait(timeout=60) == 1


def test_a_stopped_stager_leaves_no_socket(tmp_path: Path) -> None:
    control = ControlDir(tmp_path / "control")
    control.path.mkdir()
    snapshot = _Snapshot({"uses_cuda": True, "worker": {"weight_staging": _plan(tmp_path).to_dict()}})
    stager = start_stager(snapshot, os.getpid(), control)
    stager.stop()
    assert stager.process.wait(timeout=30) != 0
    assert not (control.path / STAGER_SOCKET).exists()
