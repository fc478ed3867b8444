"""The CUDA checkpoint wrapper on a machine with or without CUDA."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from warmstart import cuda_driver
from warmstart.checkpoint import cuda


def _has_libcuda() -> bool:
    try:
        cuda.driver()
    except cuda.CudaUnavailable:
        return False
    return True


def test_cpu_process_does_not_use_cuda() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        use = cuda.process_uses_cuda(child.pid)
    finally:
        child.kill()
        child.wait()
    assert not use.uses_cuda
    assert "CPU process" in use.reason


def test_missing_process_is_reported() -> None:
    use = cuda.process_uses_cuda(2**22 + 7)
    assert not use.uses_cuda and "does not exist" in use.reason


def test_no_libcuda_is_unavailable_not_a_crash() -> None:
    if _has_libcuda():
        pytest.skip("this machine has a CUDA driver")
    with pytest.raises(cuda.CudaUnavailable, match="no CUDA driver here|cuInit failed"):
        cuda.state(os.getpid())


def test_no_libcuda_means_no_devices() -> None:
    if _has_libcuda():
        pytest.skip("this machine has a CUDA driver")
    assert cuda_driver.device_count() == 0


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
