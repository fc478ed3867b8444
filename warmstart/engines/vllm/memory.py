"""What a sleeping vLLM process still holds in GPU and host memory, and giving back what nobody uses.

The CUDA checkpoint copies every device allocation left at `ready-for-snapshot` into host memory, and CRIU
dumps the process's anonymous host memory: both land in the snapshot image and are read back at every
restore. `breakdown` says what is left, by owner: the GPU's view (`mem_get_info`), the torch caching
allocator (allocated and reserved, per memory pool: the default pool, CUDA-graph pools, vLLM's
CuMemAllocator pool), the CuMemAllocator's allocations by tag and whether they are asleep, this process's
resident host memory. `trim` releases what is cached but unused and is re-made on demand after resume:
the caching allocator's free blocks, torch's pinned host-memory cache, and glibc's
free heap pages (`malloc_trim`).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import subprocess
from collections import defaultdict
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

GIB = float(1 << 30)


def host_memory(status: Path = Path("/proc/self/status")) -> dict[str, float]:
    """This process's resident memory in GiB: VmRSS, RssAnon (what a CRIU image mostly holds), RssFile."""
    found: dict[str, float] = {}
    try:
        lines = status.read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
            fields = value.split()
            if fields and fields[0].isdigit():
                found[key] = round(int(fields[0]) * 1024 / GIB, 3)
    return found


def cumem_tags(allocator: Any) -> dict[str, dict[str, float]]:
    """CuMemAllocator's allocations by tag: {'tag': {'gib': ..., 'asleep_gib': ...}}."""
    tags: dict[str, dict[str, float]] = defaultdict(lambda: {"gib": 0.0, "asleep_gib": 0.0})
    for data in getattr(allocator, "pointer_to_data", {}).values():
        size = float(data.handle[1]) / GIB
        entry = tags[str(getattr(data, "tag", "?"))]
        entry["gib"] += size
        if getattr(data, "is_asleep", False):
            entry["asleep_gib"] += size
    return {tag: {k: round(v, 3) for k, v in entry.items()} for tag, entry in tags.items()}


def pools(segments: list[dict[str, Any]], names: dict[tuple[int, int], str]) -> dict[str, Any]:
    """torch's memory snapshot segments summed per pool: reserved and allocated GiB, segment count.

    Pool (0, 0) is the default pool; CUDA graphs' private pools and MemPools have other ids; `names` names
    some of them (vLLM's sleep allocator has one MemPool per tag: 'cumem:weights', 'cumem:kv_cache')."""
    out: dict[str, dict[str, float]] = {}
    for segment in segments:
        pool = tuple(segment.get("segment_pool_id", (0, 0)))
        name = "default" if pool == (0, 0) else names.get(pool, f"pool{pool[0]}.{pool[1]}")  # type: ignore
        entry = out.setdefault(name, {"reserved_gib": 0.0, "allocated_gib": 0.0, "segments": 0})
        entry["reserved_gib"] += segment.get("total_size", 0) / GIB
        entry["allocated_gib"] += segment.get("allocated_size", 0) / GIB
        entry["segments"] += 1
    return {name: {k: round(v, 3) for k, v in entry.items()} for name, entry in out.items()}


def breakdown() -> dict[str, Any]:
    """What the process holds now (best effort: every part that cannot be read is left out)."""
    import torch

    facts: dict[str, Any] = {"host": host_memory()}
    if not torch.cuda.is_available():
        return facts
    with contextlib.suppress(RuntimeError):
        free, total = torch.cuda.mem_get_info()
        facts["gpu_used_gib"] = round((total - free) / GIB, 3)
    facts["gpu_processes_gib"] = gpu_processes()
    facts["torch_allocated_gib"] = round(torch.cuda.memory_allocated() / GIB, 3)
    facts["torch_reserved_gib"] = round(torch.cuda.memory_reserved() / GIB, 3)
    allocator = cumem_allocator()
    if allocator is not None:
        facts["cumem_tags"] = cumem_tags(allocator)
    with contextlib.suppress(Exception):  # a private torch API: its shape may change
        names = {}
        for tag, data in getattr(allocator, "allocator_and_pools", {}).items():
            names[tuple(data[0].id)] = f"cumem:{tag}"
        facts["pools"] = pools(torch.cuda.memory._snapshot().get("segments", []), names)
    return facts


def gpu_processes() -> list[float]:
    """GiB used by each process on the GPUs, as nvidia-smi sees them (empty when it cannot tell)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [round(float(x) / 1024, 3) for x in out.split() if x.replace(".", "", 1).isdigit()]


def trim() -> dict[str, float]:
    """Give back cached memory that nothing uses; returns GiB freed on the GPU and in resident host memory."""
    import torch

    before_host = host_memory().get("RssAnon", 0.0)
    free_before = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        # Not torch._C._cuda_clearCublasWorkspaces(): vLLM's CUDA graphs replay into workspaces allocated
        # before their capture (seen on the H200: freeing them made the next replay an illegal access).
        torch.cuda.empty_cache()
    with contextlib.suppress(AttributeError, RuntimeError):
        torch._C._host_emptyCache()
    malloc_trim()
    free_after = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0
    return {
        "gpu_freed_gib": round((free_after - free_before) / GIB, 3),
        "host_anon_freed_gib": round(before_host - host_memory().get("RssAnon", 0.0), 3),
    }


def malloc_trim() -> bool:
    """glibc's free heap pages back to the kernel (CRIU would dump them otherwise)."""
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


def cumem_allocator() -> Any:
    """vLLM's sleep allocator of this process, None without one."""
    try:
        from vllm.device_allocator.cumem import CuMemAllocator
    except ImportError:
        return None
    return getattr(CuMemAllocator, "instance", None)
