"""The GPU's local-memory reserve on a real GPU: lowered, the device holds less; restored, the limit is
back."""

from __future__ import annotations

import pytest

from warmstart.gpu.local_memory import CHECKPOINT_STACK_BYTES, SHRINK_ENV, LocalMemoryLimit
from warmstart.host.cuda_driver import check, driver

pytestmark = pytest.mark.gpu


def _stack_limit() -> int:
    cu = driver()
    return int(check(cu.cuCtxGetLimit(cu.CUlimit.CU_LIMIT_STACK_SIZE), "cuCtxGetLimit"))


def test_lowered_reserve_frees_device_memory_and_comes_back(gpu: None) -> None:
    import torch

    x = torch.ones(1 << 20, device="cuda")
    torch.cuda.synchronize()
    before, free_before = _stack_limit(), torch.cuda.mem_get_info()[0]
    limit = LocalMemoryLimit(torch.cuda.current_device())
    assert limit.lower() and limit.lowered
    assert _stack_limit() == CHECKPOINT_STACK_BYTES
    assert torch.cuda.mem_get_info()[0] > free_before  # the reserve went back to the free memory
    limit.restore()
    assert not limit.lowered and _stack_limit() == before
    assert float((x * 2).sum()) == 2.0 * (1 << 20)  # kernels run after the limit is back


def test_turned_off_keeps_the_limit(gpu: None, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    torch.ones(1, device="cuda")
    before = _stack_limit()
    monkeypatch.setenv(SHRINK_ENV, "0")
    limit = LocalMemoryLimit(torch.cuda.current_device())
    assert not limit.lower() and _stack_limit() == before
    limit.restore()
    assert _stack_limit() == before
