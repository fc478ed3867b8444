"""What this node and a restore pod are, as the agent measures them: the facts a snapshot identity records
about where it ran (the container image, the GPU's product and compute capability, the driver), compared
before a restore; and the pod's own restore facts (`warmstart.api.restore_facts`), read from its control
directory."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from warmstart.agent.pods import read_environ
from warmstart.api.control_dir import RESTORE_FACTS, ControlDir, SignalError
from warmstart.api.restore_facts import FactsInvalid, RestoreFacts
from warmstart.engines.machine import driver_major
from warmstart.host.cuda_driver import CudaError, CudaUnavailable, GpuDevice, gpu_devices

VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"  # what NVIDIA's device plugin (and container runtime) sets
POLL_SECONDS = 0.02


class FactsUnavailable(RuntimeError):
    """The agent cannot measure what a restore needs compared; the message says why."""


@dataclass(frozen=True)
class GpuFacts:
    product: str
    compute_capability: str
    driver_major: int


def node_gpus() -> tuple[list[GpuDevice], int]:
    """The node's GPUs and its driver's major version; FactsUnavailable when the agent has no CUDA."""
    try:
        return gpu_devices(), driver_major()
    except (CudaUnavailable, CudaError) as exc:
        raise FactsUnavailable(f"this node agent cannot reach the CUDA driver: {exc}") from exc


def visible_devices(init_pid: int) -> list[str] | None:
    """The GPUs a container was given (`NVIDIA_VISIBLE_DEVICES` of its first process: UUIDs or ordinals);
    None when it names none in particular (unset or `all`)."""
    text = read_environ(init_pid).get(VISIBLE_DEVICES, "").strip()
    return None if text in ("", "all") else [item.strip() for item in text.split(",") if item.strip()]


def pod_gpu_facts(devices: list[GpuDevice], driver: int, visible: list[str] | None) -> GpuFacts:
    """The product and compute capability of the GPUs a pod was given (all of the node's when it names
    none); FactsUnavailable when it names GPUs the node lacks or none at all."""
    chosen = devices
    if visible is not None:
        wanted = [item for item in visible if item not in ("none", "void")]
        chosen = [device for index, device in enumerate(devices) if {device.uuid, str(index)} & set(wanted)]
        if len(chosen) != len(wanted):
            node = [device.uuid for device in devices]
            raise FactsUnavailable(f"the pod was given GPUs {wanted}; the node has {node}")
    if not chosen:
        raise FactsUnavailable("the pod was given no GPU")
    products = sorted({device.name for device in chosen})
    capabilities = sorted({device.compute_capability for device in chosen})
    return GpuFacts(" + ".join(products), " + ".join(capabilities), driver)


def pod_restore_facts(
    control: ControlDir, timeout: float, stopping: Callable[[], bool] = lambda: False
) -> RestoreFacts:
    """The facts the pod's worker wrote as it started (it does within a second); FactsUnavailable when it
    wrote none in time or wrote something else."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            signal = control.read(RESTORE_FACTS)
        except (SignalError, FileNotFoundError) as exc:
            raise FactsUnavailable(f"the pod's {RESTORE_FACTS} cannot be read: {exc}") from exc
        if signal is not None:
            try:
                return RestoreFacts.from_dict(signal.payload)
            except FactsInvalid as exc:
                raise FactsUnavailable(f"the pod's {RESTORE_FACTS} is not a worker's: {exc}") from exc
        if time.monotonic() >= deadline or stopping():
            raise FactsUnavailable(
                f"the pod's worker wrote no {RESTORE_FACTS} within {timeout:.0f} s (older than the agent?)"
            )
        time.sleep(POLL_SECONDS)
