"""GPU test fixtures: skip without an NVIDIA GPU, tiny safetensors weights, CRIU 4 when present."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
from support import criu_command_or_skip

REPO = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("gpu_child.py")


def _gpu_skip_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed (pip install 'warmstart[engine]')"
    from warmstart.host.cuda_driver import device_count

    if device_count() == 0 or not torch.cuda.is_available():
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


@pytest.fixture(scope="session")
def criu_command(gpu: None) -> str:
    return criu_command_or_skip()


@pytest.fixture(scope="session")
def cuda_checkpoint(gpu: None) -> ModuleType:
    """The project's CUDA checkpoint API module (lock/checkpoint/restore/unlock/state by pid)."""
    from warmstart.checkpoint import cuda

    cuda.driver()  # CudaUnavailable here would mean the GPU host lacks the driver API: fail loudly
    return cuda
