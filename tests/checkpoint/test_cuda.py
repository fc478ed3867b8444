"""The CUDA checkpoint wrapper on a machine with or without CUDA."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from warmstart.api.capture_record import CaptureRecord
from warmstart.checkpoint import cuda
from warmstart.host import cuda_driver


def _has_libcuda() -> bool:
    try:
        cuda.driver()
    except cuda.CudaUnavailable:
        return False
    return True


@pytest.mark.spawns
def test_cpu_process_does_not_use_cuda() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        uses = cuda.process_uses_cuda(child.pid)
    finally:
        child.kill()
        child.wait()
    assert not uses


def test_missing_process_uses_no_cuda() -> None:
    assert not cuda.process_uses_cuda(2**22 + 7)


@pytest.mark.spawns  # looking the driver up the first time in a process runs `ldconfig -p` (ctypes)
def test_no_libcuda_is_unavailable_not_a_crash() -> None:
    if _has_libcuda():
        pytest.skip("this machine has a CUDA driver")
    with pytest.raises(cuda.CudaUnavailable, match="no CUDA driver here|cuInit failed"):
        cuda.state(os.getpid())


@pytest.mark.spawns  # the same lookup, when this test is the first to make it
def test_no_libcuda_means_no_devices() -> None:
    if _has_libcuda():
        pytest.skip("this machine has a CUDA driver")
    assert cuda_driver.device_count() == 0


def _warm_up_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "cuda-driver-warm-up"]


def test_the_driver_warm_up_initialises_it_on_a_thread_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    called_on: list[str] = []
    monkeypatch.setattr(cuda_driver, "_initialised", None)
    monkeypatch.setattr(cuda_driver, "driver", lambda: called_on.append(threading.current_thread().name))
    cuda_driver.warm_up()
    for thread in _warm_up_threads():
        thread.join(timeout=30)
    assert called_on == ["cuda-driver-warm-up"]
    monkeypatch.setattr(cuda_driver, "_initialised", object())  # initialised already: nothing to warm
    cuda_driver.warm_up()
    assert called_on == ["cuda-driver-warm-up"] and not _warm_up_threads()


def test_a_driver_warm_up_without_a_driver_says_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    def unavailable() -> None:
        raise cuda_driver.CudaUnavailable("no CUDA driver here")

    escaped: list[BaseException | None] = []
    monkeypatch.setattr(cuda_driver, "_initialised", None)
    monkeypatch.setattr(cuda_driver, "driver", unavailable)
    monkeypatch.setattr(threading, "excepthook", lambda hook: escaped.append(hook.exc_value))
    cuda_driver.warm_up()
    for thread in _warm_up_threads():
        thread.join(timeout=30)
    assert escaped == []  # the restore's own driver call reports it, when it needs the driver


def test_driver_results_are_unpacked_and_errors_name_the_call() -> None:
    # cuda-python returns (error, values...); error codes convert with int().
    assert cuda_driver.check((0,), "cuMemUnmap") is None
    assert cuda_driver.check((0, 7), "cuDeviceGetCount") == 7
    assert cuda_driver.check((0, 1, 2), "cuTwo") == (1, 2)
    with pytest.raises(cuda_driver.CudaError, match="cuMemMap failed"):
        cuda_driver.check((2,), "cuMemMap")
    with pytest.raises(cuda.CudaCheckpointError, match=r"cuCheckpointProcessLock\(pid 42\) failed"):
        cuda._check((1,), "cuCheckpointProcessLock", 42)
    assert issubclass(cuda.CudaCheckpointError, cuda_driver.CudaError)
    assert cuda.CudaUnavailable is cuda_driver.CudaUnavailable


@pytest.mark.gpu
def test_state_of_a_process_without_cuda_context_is_reported() -> None:
    if not _has_libcuda():
        pytest.skip("needs an NVIDIA driver (libcuda) and a GPU")
    # This test process never creates a context: the driver reports an error or RUNNING, never crashes.
    try:
        assert cuda.state(os.getpid()) in set(cuda.CheckpointState)
    except cuda.CudaCheckpointError as exc:
        assert "cuCheckpointProcessGetState" in str(exc)


TREE = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"])
print(child.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.spawns
def test_the_process_tree_holds_every_descendant_parents_first_and_no_stranger() -> None:
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    root = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True)
    try:
        child = int(root.stdout.readline())
        tree: list[int] = []
        for _ in range(200):  # the grandchild starts a moment after its parent printed
            tree = cuda.process_tree(root.pid)
            if len(tree) == 3:
                break
            time.sleep(0.05)
        assert tree[:2] == [root.pid, child] and len(tree) == 3
        assert stranger.pid not in tree
        assert cuda.cuda_processes(root.pid) == []  # CPU processes: nothing to checkpoint
    finally:
        for pid in reversed(cuda.process_tree(root.pid)):
            os.kill(pid, 9)
        stranger.kill()
        root.wait()
        stranger.wait()
    assert cuda.process_tree(root.pid) == []


class DriverCalls:
    """The four per-process calls of the checkpoint API, recorded; `failing` names one that fails."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, failing: tuple[str, int] | None = None) -> None:
        self.calls: list[tuple[str, int]] = []
        self.failing = failing
        self.states: dict[int, str] = {}
        for name in ("lock", "checkpoint", "restore", "unlock"):
            monkeypatch.setattr(cuda, name, self._recorder(name))
        monkeypatch.setattr(cuda, "state", lambda pid: cuda.CheckpointState(self.states.get(pid, "running")))

    def _recorder(self, name: str) -> Any:
        after = {"lock": "locked", "checkpoint": "checkpointed", "restore": "locked", "unlock": "running"}

        def call(pid: int, *_args: object) -> None:
            self.calls.append((name, pid))
            if self.failing == (name, pid):
                raise cuda.CudaCheckpointError(f"{name}(pid {pid}) failed: CUDA_ERROR_TEST")
            self.states[pid] = after[name]

        return call


def test_suspend_all_locks_every_process_before_checkpointing_any(monkeypatch: pytest.MonkeyPatch) -> None:
    driver = DriverCalls(monkeypatch)
    cuda.suspend_all([11, 12, 13])
    assert driver.calls == [("lock", 11), ("lock", 12), ("lock", 13),
                            ("checkpoint", 11), ("checkpoint", 12), ("checkpoint", 13)]  # fmt: skip
    driver.calls.clear()
    cuda.resume_all([11, 12, 13])
    assert driver.calls == [("restore", 11), ("unlock", 11), ("restore", 12), ("unlock", 12),
                            ("restore", 13), ("unlock", 13)]  # fmt: skip


def test_a_rank_that_fails_to_checkpoint_leaves_every_rank_running(monkeypatch: pytest.MonkeyPatch) -> None:
    driver = DriverCalls(monkeypatch, failing=("checkpoint", 12))
    with pytest.raises(cuda.CudaCheckpointError, match=r"checkpoint\(pid 12\)"):
        cuda.suspend_all([11, 12, 13])
    assert driver.calls[-4:] == [("restore", 11), ("unlock", 11), ("unlock", 12), ("unlock", 13)]
    assert set(driver.states.values()) == {"running"}


def test_a_rank_that_fails_to_resume_is_named_and_the_others_still_resume(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    driver = DriverCalls(monkeypatch, failing=("restore", 12))
    driver.states = {11: "checkpointed", 12: "checkpointed", 13: "checkpointed"}
    named = r"1 of 3 CUDA processes did not resume: restore\(pid 12"
    with pytest.raises(cuda.CudaCheckpointError, match=named):
        cuda.resume_all([11, 12, 13])
    assert (driver.states[11], driver.states[13]) == ("running", "running")


def test_a_restore_missing_one_of_its_cuda_processes_fails_naming_it() -> None:
    from types import SimpleNamespace

    from warmstart.checkpoint.criu import CriuError
    from warmstart.checkpoint.restore import _restored_cuda_pids

    restored = {7: 1007, 8: 1008}  # namespace PID -> host PID of what CRIU brought back
    sandbox = SimpleNamespace(host_pid=restored.get)
    snapshot = SimpleNamespace(record=CaptureRecord(cuda_pids=[7, 8]))
    assert _restored_cuda_pids(snapshot, sandbox, 7) == [1007, 1008]
    with pytest.raises(CriuError, match=r"no process with pid \[9\] of the CUDA processes \[7, 9\]"):
        _restored_cuda_pids(SimpleNamespace(record=CaptureRecord(cuda_pids=[7, 9])), sandbox, 7)
    # A snapshot from before the tree was recorded: the engine alone.
    assert _restored_cuda_pids(SimpleNamespace(record=CaptureRecord()), sandbox, 8) == [1008]
