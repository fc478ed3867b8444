"""Huge pages asked for before a checkpoint: which mappings qualify, and the advice as the kernel sees it."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest

from warmstart.engines.hugepages import HUGE_PAGE, advise_hugepages, large_anonymous_regions, thp_mode

MAPS = """\
55d0c0000000-55d0c0a00000 rw-p 00000000 00:00 0                          [heap]
7f0000100000-7f0000900000 rw-p 00000000 00:00 0
7f0001000000-7f0001100000 rw-p 00000000 00:00 0
7f0002000000-7f0002800000 r--p 00000000 00:00 0
7f0003000000-7f0003800000 rw-p 00000000 fd:01 1234                       /usr/lib/libtorch.so
7f0004000000-7f0004800000 rw-s 00000000 00:05 99                         /dev/nvidiactl
7fff00000000-7fff00400000 rw-p 00000000 00:00 0                          [stack]
"""


def test_only_private_writable_anonymous_mappings_with_a_whole_huge_page_qualify() -> None:
    assert large_anonymous_regions(MAPS) == [
        (0x55D0C0000000, 0x55D0C0A00000),  # the heap
        (0x7F0000200000, 0x7F0000800000),  # trimmed to 2 MiB boundaries
    ]  # not: 1 MiB, read-only, file-backed, shared device, stack


def test_the_mode_is_read_from_the_bracketed_word(tmp_path: Path) -> None:
    (tmp_path / "enabled").write_text("always [madvise] never\n")
    assert thp_mode(tmp_path / "enabled") == "madvise"
    assert thp_mode(tmp_path / "missing") == ""


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding `address`, from /proc/self/smaps."""
    current = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            low, high = (int(bound, 16) for bound in head.split("-"))
            current = low <= address < high
        elif current and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


NO_THP = "this kernel gives no transparent huge pages"


@pytest.mark.skipif(thp_mode() not in ("always", "madvise"), reason=NO_THP)
def test_a_large_anonymous_mapping_of_this_process_is_advised() -> None:
    region = mmap.mmap(-1, 8 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    address = ctypes_address(region)
    assert "hg" not in vm_flags(address + 2 * HUGE_PAGE)
    assert advise_hugepages() >= 6 * HUGE_PAGE
    assert "hg" in vm_flags(address + 2 * HUGE_PAGE)  # what CRIU records and sets again at restore
    region.close()


def ctypes_address(region: mmap.mmap) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(region))
