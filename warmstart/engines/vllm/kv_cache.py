"""vLLM's KV cache woken on device memory the weight stager allocated, instead of memory created at the wake.

At the wake vLLM's sleep allocator backs each KV cache allocation with fresh memory (`cuMemCreate`), and the
driver clears memory freed in the same process before it hands it out again: 0.28-0.35 s for the 102 GiB of
an H200's KV cache at Qwen3-8B shapes after every restore, the largest step of the wake
(`benchmarks/cumem_wake.py`: 0.17-0.20 s after a free in the same process, 0.01 s for memory a process
that exited had). So the stager allocates the KV cache's allocations itself, by their sizes, while CRIU
restores the engine, fills the weights into them as into one block, and hands them over; the woken engine
copies the weights out, clears the bytes they took, and maps each allocation at its KV cache address, where
vLLM's allocator then finds it mapped.

Private to vLLM, checked by the contract test: the allocator's `pointer_to_data` of `AllocationData(handle,
tag, is_asleep)`, `handle` = (device, size, address, address of the `CUmemGenericAllocationHandle` that
vLLM's C extension creates into and releases from), and `wake_up` calling the module's `create_and_map`.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from warmstart.gpu.cuda_arena import read_write_access
from warmstart.host.cuda_driver import CudaError, check, driver
from warmstart.host.env import env_flag

log = logging.getLogger(__name__)

KV_TAG = "kv_cache"
# At capture, in the worker: the stager's block is the KV cache's own allocations unless this is "0" (on the
# H200 at Qwen3-8B shapes it took the KV cache's wake from 0.30 s to 0.01 s, BENCHMARKS.md).
KV_STAGED_ENV = "WARMSTART_VLLM_KV_STAGED"


def wanted() -> bool:
    return env_flag(KV_STAGED_ENV, True)


@dataclass(frozen=True)
class KvAllocation:
    address: int
    size: int
    slot: int  # where vLLM keeps the allocation's handle
    data: Any  # vLLM's AllocationData


def kv_allocations(allocator: Any) -> list[KvAllocation]:
    """The allocator's KV cache allocations in address order (the order the stager allocates them in)."""
    found = [
        KvAllocation(int(data.handle[2]), int(data.handle[1]), int(data.handle[3]), data)
        for data in getattr(allocator, "pointer_to_data", {}).values()
        if getattr(data, "tag", None) == KV_TAG
    ]
    return sorted(found, key=lambda allocation: allocation.address)


def segments(allocator: Any) -> tuple[int, ...]:
    """The sizes a stager allocates for the KV cache, in address order; () with no allocator."""
    return tuple(allocation.size for allocation in kv_allocations(allocator))


def adopt(allocator: Any, handles: list[Any], device_index: int) -> set[int]:
    """Map each handle (the stager's allocations, in `segments` order) at its sleeping KV cache allocation
    and record it where vLLM keeps that allocation's handle; the addresses mapped. A handle that cannot be
    adopted is released, and vLLM creates that allocation's memory itself at the wake."""
    cu, access = driver(), read_write_access(device_index)
    allocations = kv_allocations(allocator)
    if len(allocations) != len(handles):
        log.warning(
            "%d staged KV cache allocations for %d in vLLM's allocator", len(handles), len(allocations)
        )
    adopted: set[int] = set()
    for index, handle in enumerate(handles):
        allocation = allocations[index] if index < len(allocations) else None
        try:
            if allocation is None or not allocation.data.is_asleep:
                raise CudaError("no sleeping KV cache allocation for it")
            _map_at(cu, handle, allocation, access)
        except CudaError as exc:
            log.warning("staged KV cache allocation %d not adopted: %s", index, exc)
            cu.cuMemRelease(handle)
            continue
        ctypes.c_uint64.from_address(allocation.slot).value = int(handle)
        adopted.add(allocation.address)
    return adopted


def _map_at(cu: Any, handle: Any, allocation: KvAllocation, access: Any) -> None:
    check(cu.cuMemMap(allocation.address, allocation.size, 0, handle, 0), "cuMemMap")
    try:
        check(cu.cuMemSetAccess(allocation.address, allocation.size, [access], 1), "cuMemSetAccess")
    except CudaError:
        cu.cuMemUnmap(allocation.address, allocation.size)
        raise


@contextlib.contextmanager
def mapped_ones_kept(adopted: set[int]) -> Iterator[None]:
    """vLLM's wake, for as long as the block runs, leaves the allocations at `adopted` addresses as they are
    mapped (the rest of its wake runs as ever)."""
    if not adopted:
        yield
        return
    from vllm.device_allocator import cumem

    create_and_map = cumem.create_and_map

    def create_unless_adopted(handle: Any) -> None:
        if int(handle[2]) not in adopted:
            create_and_map(handle)

    cumem.create_and_map = create_unless_adopted
    try:
        yield
    finally:
        cumem.create_and_map = create_and_map
