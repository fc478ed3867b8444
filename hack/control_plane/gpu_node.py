"""What makes the real node a GPU node: NVIDIA's device plugin as one of its daemons, and the labels GPU
Feature Discovery puts on a GPU node.

The plugin runs beside kubelet in the node's namespaces (as a host process; on a cluster it is a DaemonSet
pod) and hands a pod its GPU the way clusters without NVIDIA's container runtime do: the device nodes in the
allocation (`--pass-device-specs`, which containerd creates in the container and allows in its device
cgroup) and `NVIDIA_VISIBLE_DEVICES` naming the GPU. It finds NVML through LD_LIBRARY_PATH: the directory
holding the driver's `libnvidia-ml.so.1`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from . import node_build

RESOURCE = "nvidia.com/gpu"
# Where drivers keep their libraries: a distribution's own, and the read-only folder some GPU machines (and
# GKE's nodes, inside containers) mount.
DRIVER_LIBRARY_DIRS = ("/usr/local/nvidia/lib64", "/usr/lib/x86_64-linux-gnu", "/usr/lib64")
NVML = "libnvidia-ml.so.1"


def driver_library_dir() -> Path | None:
    """The directory holding the driver's NVML library (WARMSTART_NVIDIA_LIBRARY_DIR, else the usual ones)."""
    candidates = [os.environ.get("WARMSTART_NVIDIA_LIBRARY_DIR", ""), *DRIVER_LIBRARY_DIRS]
    return next((Path(d) for d in candidates if d and (Path(d) / NVML).exists()), None)


def missing_parts() -> list[str]:
    reasons = []
    if shutil.which("nvidia-smi") is None or not Path("/dev/nvidiactl").exists():
        reasons.append("no NVIDIA GPU here (nvidia-smi, /dev/nvidiactl)")
    elif driver_library_dir() is None:
        reasons.append(f"the driver's {NVML} is in none of {', '.join(DRIVER_LIBRARY_DIRS)}")
    if not node_build.gpu_plugin_is_cached():
        reasons.append("NVIDIA's device plugin is not built: run `hack/control-plane build --gpu`")
    return reasons


def plugin_argv() -> list[str]:
    return [
        str(node_build.gpu_plugin_path()),
        "--pass-device-specs=true",
        "--device-list-strategy=envvar",
        "--device-id-strategy=uuid",
        "--driver-root=/",
        "--driver-root-ctr-path=/",  # a host process: the driver's files are where the host has them
        "--fail-on-init-error=true",
    ]


def plugin_env() -> dict[str, str]:
    paths = [str(driver_library_dir() or ""), os.environ.get("LD_LIBRARY_PATH", "")]
    return {**os.environ, "LD_LIBRARY_PATH": ":".join(path for path in paths if path)}


def node_labels() -> dict[str, str]:
    """The labels GPU Feature Discovery puts on a GPU node (those a scheduling rule or the chart reads)."""
    result = subprocess.run(
        [
            "nvidia-smi",
            "--query-gpu=name,driver_version,compute_cap,memory.total",
            "--format=csv,noheader,nounits",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    rows = [[field.strip() for field in line.split(",")] for line in lines]
    name, driver, capability, memory = rows[0]
    major, minor = capability.split(".", 1)
    return {
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.product": name.replace(" ", "-"),
        "nvidia.com/gpu.count": str(len(rows)),
        "nvidia.com/gpu.memory": memory,
        "nvidia.com/gpu.compute.major": major,
        "nvidia.com/gpu.compute.minor": minor,
        "nvidia.com/cuda.driver.major": driver.split(".")[0],
    }
