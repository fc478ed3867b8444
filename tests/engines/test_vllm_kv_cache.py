"""The KV cache's allocations as vLLM's sleep allocator keeps them, and its wake leaving adopted ones be.

Without a GPU: the allocator is vLLM's shape (`pointer_to_data` of `AllocationData`; the contract test holds
the real one to it), and the wake's `create_and_map` a stand-in module. `adopt` itself runs on the GPU
(`benchmarks/vllm_bench.py`: token ids identical after every restore).
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from typing import Any

import pytest

from warmstart.engines.vllm import kv_cache


@dataclass
class AllocationData:  # vLLM's, field for field
    handle: tuple[int, int, int, int]
    tag: str
    is_asleep: bool = True
    cpu_backup_tensor: Any = None


@dataclass
class Allocator:
    pointer_to_data: dict[int, AllocationData] = field(default_factory=dict)

    def add(self, address: int, size: int, tag: str) -> None:
        self.pointer_to_data[address] = AllocationData((0, size, address, 0x1000 + address), tag)


def test_the_kv_caches_allocations_are_its_sizes_in_address_order() -> None:
    allocator = Allocator()
    allocator.add(0x9000_0000, 6 << 20, "kv_cache")
    allocator.add(0x1000_0000, 4 << 20, "weights")
    allocator.add(0x5000_0000, 2 << 20, "kv_cache")
    assert [a.address for a in kv_cache.kv_allocations(allocator)] == [0x5000_0000, 0x9000_0000]
    assert kv_cache.segments(allocator) == (2 << 20, 6 << 20)
    assert kv_cache.kv_allocations(allocator)[0].slot == 0x1000 + 0x5000_0000
    assert kv_cache.segments(None) == ()


@pytest.fixture
def cumem(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """A stand-in for `vllm.device_allocator.cumem` whose wake maps every allocation of a tag it is given."""
    module = types.ModuleType("vllm.device_allocator.cumem")
    module.created = []

    def create_and_map(handle: tuple[int, int, int, int]) -> None:
        module.created.append(handle[2])

    module.create_and_map = create_and_map
    module.wake_up = lambda handles: [module.create_and_map(handle) for handle in handles]
    package = types.ModuleType("vllm.device_allocator")
    package.cumem = module
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.device_allocator", package)
    monkeypatch.setitem(sys.modules, "vllm.device_allocator.cumem", module)
    return module


def test_the_wake_creates_only_what_was_not_adopted_and_is_itself_again_after(
    cumem: types.ModuleType,
) -> None:
    handles = [(0, 1, address, 0) for address in (0x10, 0x20, 0x30)]
    original = cumem.create_and_map
    with kv_cache.mapped_ones_kept({0x20}):
        cumem.wake_up(handles)
    assert cumem.created == [0x10, 0x30]
    assert cumem.create_and_map is original
    cumem.wake_up(handles[1:2])
    assert cumem.created == [0x10, 0x30, 0x20]


def test_the_wake_is_restored_when_it_fails(cumem: types.ModuleType) -> None:
    original = cumem.create_and_map
    with pytest.raises(RuntimeError), kv_cache.mapped_ones_kept({0x20}):
        raise RuntimeError("the wake failed")
    assert cumem.create_and_map is original
    with kv_cache.mapped_ones_kept(set()):  # nothing adopted: vLLM's own wake, untouched
        assert cumem.create_and_map is original


def test_the_kv_cache_is_staged_unless_the_worker_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(kv_cache.KV_STAGED_ENV, raising=False)
    assert kv_cache.wanted()
    monkeypatch.setenv(kv_cache.KV_STAGED_ENV, "0")
    assert not kv_cache.wanted()
