"""GPU test fixtures: skip without an NVIDIA GPU, tiny safetensors weights, CRIU 4 when present."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("gpu_child.py")


def _gpu_skip_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed (pip install 'warmstart[engine]')"
    from warmstart.engines.cuda_arena import cuda_device_count

    if cuda_device_count() == 0 or not torch.cuda.is_available():
        return "no NVIDIA GPU with a CUDA driver on this machine (GPU tests run on a GPU host)"
    return None


@pytest.fixture(scope="session")
def gpu() -> None:
    reason = _gpu_skip_reason()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def weights_file(tmp_path_factory: pytest.TempPathFactory, gpu: None) -> Path:
    """A safetensors file of 8 bf16 2048x2048 layers plus an input `x` (about 64 MiB)."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator(device="cuda").manual_seed(7)
    dim = 2048
    tensors = {
        f"w{i}": (torch.randn(dim, dim, generator=gen, device="cuda") / 40).bfloat16().cpu() for i in range(8)
    }
    tensors["x"] = torch.randn(16, dim, generator=gen, device="cuda").bfloat16().cpu()
    path = tmp_path_factory.mktemp("weights") / "tiny.safetensors"
    save_file(tensors, str(path))
    return path


def _criu_command() -> str | None:
    if os.environ.get("WARMSTART_CRIU"):
        return os.environ["WARMSTART_CRIU"]
    portable = REPO / ".dev" / "criu"
    if (portable / "criu").exists():
        return f"{portable}/ld-linux-x86-64.so.2 --library-path {portable} {portable}/criu"
    return shutil.which("criu")


@pytest.fixture(scope="session")
def criu_command(gpu: None) -> str:
    if os.geteuid() != 0:
        pytest.skip("CRIU dump/restore needs root")
    command = _criu_command()
    if command is None:
        pytest.skip("no CRIU 4 here: set WARMSTART_CRIU or run hack/criu-setup and copy its portable folder")
    return command


class DriverCheckpoint:
    """The CUDA driver's process checkpoint calls on another process, by pid (for tests)."""

    def __init__(self) -> None:
        from cuda.bindings import driver

        self.driver = driver
        self._ok(driver.cuInit(0), "cuInit")

    @staticmethod
    def _ok(result: object, call: str) -> object:
        error = result[0] if isinstance(result, tuple) else result
        if int(error) != 0:
            raise RuntimeError(f"{call} failed: {error!r}")
        return result[1] if isinstance(result, tuple) and len(result) > 1 else None

    def state(self, pid: int) -> str:
        value = self._ok(self.driver.cuCheckpointProcessGetState(pid), "cuCheckpointProcessGetState")
        return str(getattr(value, "name", value)).rsplit("_", 1)[-1]

    def lock(self, pid: int, timeout_ms: int = 20000) -> None:
        args = self.driver.CUcheckpointLockArgs()
        args.timeoutMs = timeout_ms
        self._ok(self.driver.cuCheckpointProcessLock(pid, args), "cuCheckpointProcessLock")

    def checkpoint(self, pid: int) -> None:
        args = self.driver.CUcheckpointCheckpointArgs()
        self._ok(self.driver.cuCheckpointProcessCheckpoint(pid, args), "cuCheckpointProcessCheckpoint")

    def restore(self, pid: int) -> None:
        args = self.driver.CUcheckpointRestoreArgs()
        self._ok(self.driver.cuCheckpointProcessRestore(pid, args), "cuCheckpointProcessRestore")

    def unlock(self, pid: int) -> None:
        args = self.driver.CUcheckpointUnlockArgs()
        self._ok(self.driver.cuCheckpointProcessUnlock(pid, args), "cuCheckpointProcessUnlock")


@pytest.fixture(scope="session")
def cuda_checkpoint(gpu: None) -> DriverCheckpoint:
    return DriverCheckpoint()
