"""Facts about the machine an engine runs on that a snapshot identity records (shared by the engines)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import warmstart

if TYPE_CHECKING:
    import torch


def gpu_facts(device: torch.device) -> tuple[str, str, int]:
    """(product name, compute capability "major.minor", driver major) of a CUDA device; empty for CPU."""
    if device.type != "cuda":
        return "", "", 0
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return torch.cuda.get_device_name(device), f"{major}.{minor}", driver_major()


def driver_major() -> int:
    """The NVIDIA kernel driver's major version, 0 where there is none."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return 0
    match = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+)\.", text)
    return int(match.group(1)) if match else 0


def runtime_image() -> str:
    """The image this process runs in: $WARMSTART_IMAGE, else (outside a cluster) the Python runtime and
    warmstart version."""
    if image := os.environ.get("WARMSTART_IMAGE"):
        return image
    return f"python-{sys.version_info.major}.{sys.version_info.minor}/warmstart-{warmstart.__version__}"
