"""Starting a weight stager for a restore: which snapshots get one, as whom, and what the engine hears.

The stager really runs; without a GPU it fails at CUDA (after opening the plan's files) and says why,
which is what the engine must hear then.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from support import wait_until

from warmstart.api.capture_record import CaptureRecord
from warmstart.api.control_dir import ControlDir
from warmstart.checkpoint import weight_staging
from warmstart.checkpoint.weight_staging import (
    StagerProcess,
    give_plan,
    sandbox_gpus,
    spawn_stager_early,
    staging_plan,
)
from warmstart.gpu.weight_stager.client import StagedWeightsUnavailable, receive_staged_weights
from warmstart.gpu.weight_stager.plan import StagingPlan
from warmstart.gpu.weight_stager.stage import STAGING_THREADS, open_inside

NOBODY = 65534


@dataclass
class _Snapshot:  # the two fields of `Snapshot` that staging reads
    meta: dict[str, Any] = field(default_factory=dict)
    id: str = "snap-1"

    @property
    def record(self) -> CaptureRecord:
        return CaptureRecord.of(self.meta)


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory any user can look into (pytest's own are private to root)."""
    path = Path(tempfile.mkdtemp(prefix="ws-staging-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _plan(directory: Path, name: str = "w.bin", device_uuid: str = "") -> StagingPlan:
    weights = directory / "w.bin"
    weights.write_bytes(b"\1" * 8192)
    weights.chmod(0o644)
    return StagingPlan(4096, 1 << 21, ((str(directory / name), 0, 0, 8192),), device_uuid)  # no device 4096


def _snapshot(plan: StagingPlan) -> _Snapshot:
    return _Snapshot({"uses_cuda": True, "worker": {"weight_staging": plan.to_dict()}})


def _sandbox_process(user: int | None = None, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """A process standing for a sandbox's first one (its root is ours: the plan's paths resolve alike).

    Returned once it runs `sleep`: before its exec, /proc shows the forked test process's user and env.
    """
    process = subprocess.Popen(["sleep", "60"], user=user, env=env)
    deadline = time.monotonic() + 60
    while Path(f"/proc/{process.pid}/comm").read_text().strip() != "sleep":
        if time.monotonic() > deadline or process.poll() is not None:
            process.kill()
            raise RuntimeError("the stand-in sandbox process never ran sleep")
        time.sleep(0.01)
    return process


def wait_until_idle_for_its_plan(stager: StagerProcess) -> None:
    """Until the stager blocks reading its plan pipe with its CUDA start over: the thread that starts CUDA
    runs before the plan is read, and here it ends (failing) while the read waits, leaving one thread."""
    proc = Path(f"/proc/{stager.process.pid}")

    def idle() -> bool:
        assert stager.process.poll() is None, "the stager ended before its plan came"
        one_thread = "\nThreads:\t1\n" in (proc / "status").read_text()
        return one_thread and "pipe_read" in (proc / "wchan").read_text()

    wait_until(idle, "the stager waiting for its plan with its CUDA start over", timeout=60)


def start_stager(snapshot: _Snapshot, sandbox_init_pid: int, control: ControlDir) -> StagerProcess | None:
    """A stager as a restore starts one: spawned, then given the (verified) snapshot's plan."""
    stager = spawn_stager_early(_Store(snapshot), "snap-1", sandbox_init_pid, control)  # type: ignore[arg-type]
    return give_plan(stager, snapshot, sandbox_init_pid)  # type: ignore[arg-type]


@pytest.fixture
def control(tmp_path: Path) -> ControlDir:
    control = ControlDir(tmp_path / "control")
    control.path.mkdir()
    return control


def test_only_cuda_snapshots_with_a_readable_plan_get_a_stager(shared_dir: Path) -> None:
    plan = _plan(shared_dir).to_dict()
    assert staging_plan(_Snapshot({"uses_cuda": True, "worker": {"weight_staging": plan}})) is not None
    assert staging_plan(_Snapshot({"uses_cuda": False, "worker": {"weight_staging": plan}})) is None
    assert staging_plan(_Snapshot({"uses_cuda": True, "worker": {}})) is None
    assert staging_plan(_Snapshot({"uses_cuda": True, "worker": {"weight_staging": {"copies": 3}}})) is None


@pytest.mark.spawns
def test_the_engine_hears_from_the_stager_started_for_its_restore(
    shared_dir: Path, control: ControlDir
) -> None:
    sandbox = _sandbox_process()
    try:
        stager = start_stager(_snapshot(_plan(shared_dir)), sandbox.pid, control)
        assert stager is not None
        socket_path = control.path / stager.payload()["weight_stager_socket"]
        assert socket_path.exists(), "bound before the restore goes on: the engine never waits for it"
        # the files were found through the sandbox's root; only the GPU is missing
        with pytest.raises(StagedWeightsUnavailable, match="stager failed: Cuda"):
            receive_staged_weights(socket_path, timeout=60)
        assert stager.process.wait(timeout=60) == 1
        stager.stop()
        assert not socket_path.exists()
    finally:
        sandbox.kill()


@pytest.mark.spawns
def test_the_stager_runs_as_the_sandbox_user(shared_dir: Path) -> None:
    sandbox = _sandbox_process(user=NOBODY)
    try:
        assert weight_staging._as_owner_of(sandbox.pid) == {
            "user": NOBODY,
            "group": _gid_of(sandbox.pid),
            "extra_groups": [],
        }
        assert weight_staging._as_owner_of(os.getpid()) == {}  # a root sandbox: nothing to drop
    finally:
        sandbox.kill()
    secret = shared_dir / "root-only.bin"
    secret.write_bytes(b"secret")
    secret.chmod(0o600)
    # what a stager dropped to that user meets when a plan names a file only root may read
    assert _open_as(NOBODY, str(secret)) == "PermissionError"
    _plan(shared_dir)
    assert _open_as(NOBODY, str(shared_dir / "w.bin")) == "ok"  # the engine's own weights, readable


@pytest.mark.spawns
def test_a_gpu_the_sandbox_was_not_given_gets_no_stager(shared_dir: Path, control: ControlDir) -> None:
    env = {"NVIDIA_VISIBLE_DEVICES": "GPU-aaaa,GPU-bbbb", "PATH": os.environ["PATH"]}
    sandbox = _sandbox_process(env=env)
    try:
        assert sandbox_gpus(sandbox.pid) == {"GPU-aaaa", "GPU-bbbb"}
        assert (
            start_stager(_snapshot(_plan(shared_dir, device_uuid="GPU-cccc")), sandbox.pid, control) is None
        )
        stager = start_stager(_snapshot(_plan(shared_dir, device_uuid="GPU-bbbb")), sandbox.pid, control)
        assert stager is not None
        stager.stop()
    finally:
        sandbox.kill()
    unnamed = _sandbox_process(env={"NVIDIA_VISIBLE_DEVICES": "all", "PATH": os.environ["PATH"]})
    try:
        assert sandbox_gpus(unnamed.pid) is None  # nothing to hold a plan to: any GPU may be the one
    finally:
        unnamed.kill()


@pytest.mark.spawns
def test_a_stager_past_its_deadline_is_killed_and_its_socket_removed(
    shared_dir: Path, control: ControlDir, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(weight_staging, "STAGER_DEADLINE_SECONDS", 0.5)
    sandbox = _sandbox_process()
    try:
        # nobody connects: after failing it would wait a minute for an engine to tell
        stager = start_stager(_snapshot(_plan(shared_dir)), sandbox.pid, control)
        assert stager is not None
        assert stager._reaped.wait(timeout=30)
        assert stager.process.returncode < 0, "killed, not exited"
        assert not (control.path / stager.socket_name).exists()
    finally:
        sandbox.kill()


def _gid_of(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("Gid:")).split()[1])


def _open_as(uid: int, path: str) -> str:
    """Open `path` with `open_inside` in a child that dropped to `uid`; the outcome's name."""
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        outcome = "ok"
        try:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            os.close(open_inside(None, path))
        except OSError as exc:
            outcome = type(exc).__name__
        os.write(write, outcome.encode())
        os._exit(0)
    os.close(write)
    os.waitpid(child, 0)
    with os.fdopen(read) as result:
        return result.read()


@pytest.mark.spawns
def test_the_stager_can_be_switched_off_or_told_how_to_copy_and_with_how_many_threads(
    shared_dir: Path, control: ControlDir, monkeypatch: pytest.MonkeyPatch
) -> None:
    sandbox = _sandbox_process()
    try:
        monkeypatch.setenv(weight_staging.STAGER_ENV, "0")
        assert start_stager(_snapshot(_plan(shared_dir)), sandbox.pid, control) is None
        monkeypatch.setenv(weight_staging.STAGER_ENV, "1")
        monkeypatch.setenv(weight_staging.STAGER_COPY_ENV, "sideways")
        assert start_stager(_snapshot(_plan(shared_dir)), sandbox.pid, control) is None  # refused, logged
        monkeypatch.setenv(weight_staging.STAGER_COPY_ENV, "mapped")
        stager = start_stager(_snapshot(_plan(shared_dir)), sandbox.pid, control)
        assert stager is not None
        assert stager.process.args[-4:] == ["--copy", "mapped", "--threads", str(STAGING_THREADS)]
        stager.stop()
        for refused in ("0", "65", "many"):
            monkeypatch.setenv(weight_staging.STAGER_THREADS_ENV, refused)
            assert start_stager(_snapshot(_plan(shared_dir)), sandbox.pid, control) is None
        monkeypatch.setenv(weight_staging.STAGER_THREADS_ENV, "12")
        stager = start_stager(_snapshot(_plan(shared_dir)), sandbox.pid, control)
        assert stager is not None and stager.process.args[-2:] == ["--threads", "12"]
        stager.stop()
    finally:
        sandbox.kill()


@dataclass
class _Store:  # what `spawn_stager_early` reads of a store: the manifest as stored
    snapshot: _Snapshot

    def get(self, snapshot_id: str) -> _Snapshot:
        return self.snapshot


@pytest.mark.spawns
def test_a_stager_started_before_verification_waits_for_the_verified_plan(
    shared_dir: Path, control: ControlDir
) -> None:
    sandbox = _sandbox_process()
    try:
        snapshot = _snapshot(_plan(shared_dir))
        stager = spawn_stager_early(_Store(snapshot), "snap-1", sandbox.pid, control)  # type: ignore[arg-type]
        assert stager is not None
        wait_until_idle_for_its_plan(stager)
        assert stager.process.poll() is None, "it waits for its plan, whatever its CUDA did meanwhile"
        assert give_plan(stager, snapshot, sandbox.pid) is stager
        socket_path = control.path / stager.socket_name
        with pytest.raises(StagedWeightsUnavailable, match="stager failed: Cuda"):
            receive_staged_weights(socket_path, timeout=60)  # it followed the plan up to the GPU
        assert stager.process.wait(timeout=60) == 1
        stager.stop()
    finally:
        sandbox.kill()


@pytest.mark.spawns
def test_a_stager_whose_verified_snapshot_has_no_plan_is_stopped(
    shared_dir: Path, control: ControlDir
) -> None:
    sandbox = _sandbox_process()
    try:
        stored = _Store(_snapshot(_plan(shared_dir)))
        assert (
            spawn_stager_early(_Store(_Snapshot({"uses_cuda": True})), "snap-1", sandbox.pid, control) is None
        )
        stager = spawn_stager_early(stored, "snap-1", sandbox.pid, control)  # type: ignore[arg-type]
        assert stager is not None
        verified = _Snapshot({"uses_cuda": True, "worker": {}})  # what the signed manifest really says
        assert give_plan(stager, verified, sandbox.pid) is None
        assert stager.process.returncode is not None and stager.process.returncode < 0, "killed"
        assert stager._reaped.is_set() and not (control.path / stager.socket_name).exists()
    finally:
        sandbox.kill()
