"""Page-cache residency and pre-staging on real files: dropped from the page cache with DONTNEED, measured
with mincore, staged back by reading."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from support import page_cache_kept

from warmstart.host.fileio import UnsafeInput, mapped_readonly
from warmstart.snapshot import SnapshotStore
from warmstart.snapshot.residency import (
    PAGE_SIZE,
    blob_paths,
    cgroup_memory_limit,
    evict,
    resident_bytes,
    stage,
)

MIB = 1 << 20


@pytest.fixture
def directory(tmp_path: Path) -> Path:
    if reason := page_cache_kept(tmp_path):
        pytest.skip(reason)
    return tmp_path


@pytest.fixture
def make_file(directory: Path) -> Callable[..., Path]:
    def make(name: str, size: int) -> Path:
        path = directory / name
        path.write_bytes(os.urandom(size))
        evict(path)
        return path

    return make


def test_residency_falls_when_dropped_and_staging_brings_it_back(make_file: Callable[..., Path]) -> None:
    size = 8 * MIB + 123  # a partial last page counts only its own bytes
    path = make_file("blob", size)
    assert resident_bytes(path) < size // 4
    assert stage([path], budget_bytes=1 << 40) >= size - resident_bytes(path) - PAGE_SIZE
    assert resident_bytes(path) == size
    assert stage([path], budget_bytes=1 << 40) == 0  # nothing left to read
    evict(path)
    assert resident_bytes(path) < size // 4


def test_an_empty_file_has_no_resident_bytes(make_file: Callable[..., Path]) -> None:
    path = make_file("empty", 0)
    assert resident_bytes(path) == 0
    assert stage([path], budget_bytes=MIB) == 0


def test_staging_stops_at_the_budget_in_the_order_given(make_file: Callable[..., Path]) -> None:
    first, second, third = (make_file(name, 4 * MIB) for name in ("first", "second", "third"))
    read = stage([first, second, third], budget_bytes=6 * MIB, threads=3)
    assert read <= 6 * MIB
    assert resident_bytes(first) == 4 * MIB
    assert 2 * MIB <= resident_bytes(second) < 4 * MIB
    assert resident_bytes(third) < MIB
    assert stage([first, second, third], budget_bytes=0) == 0


def test_a_symbolic_link_or_a_path_outside_the_root_is_refused(
    make_file: Callable[..., Path], directory: Path
) -> None:
    target = make_file("target", MIB)
    link = directory / "link"
    link.symlink_to(target)
    with pytest.raises(UnsafeInput):
        stage([link], budget_bytes=1 << 30)
    with pytest.raises(UnsafeInput):
        resident_bytes(link)
    assert resident_bytes(target) < MIB // 4, "the link's target was read"
    root = directory / "root"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "escape").symlink_to(target)
    (root / "linked").symlink_to(root / "sub", target_is_directory=True)
    for refused in (target, root / "sub" / "escape", root / "linked" / "escape"):
        with pytest.raises(UnsafeInput):
            stage([refused], budget_bytes=1 << 30, root=root)
    fifo = directory / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(UnsafeInput, match="not a regular file"):
        stage([fifo], budget_bytes=1 << 30)


def test_a_missing_file_is_skipped(make_file: Callable[..., Path], directory: Path) -> None:
    present = make_file("present", MIB)
    assert stage([directory / "gone", present], budget_bytes=1 << 30) >= MIB - PAGE_SIZE
    assert resident_bytes(present) == MIB


def test_a_snapshots_blobs_stage_inside_the_store(
    directory: Path, publish: Callable[..., object], store: SnapshotStore
) -> None:
    shared = os.urandom(3 * MIB)
    snapshot = publish({"criu/pages-1.img": os.urandom(2 * MIB), "criu/a.img": shared, "weights/b": shared})
    paths = blob_paths(store, [snapshot])  # type: ignore[list-item]
    assert len(paths) == 2
    for path in paths:
        evict(path)
    stage(paths, budget_bytes=1 << 30, root=store.blobs_dir)
    assert sum(resident_bytes(path, root=store.blobs_dir) for path in paths) == 5 * MIB


@pytest.mark.parametrize(
    ("proc", "files", "limit"),
    [
        ("0::/kubepods/agent\n", {"kubepods/agent/memory.max": "8589934592\n"}, 8 << 30),
        ("0::/kubepods/agent\n", {"kubepods/agent/memory.max": "max\n"}, None),
        ("4:memory:/pods/a\n0::/\n", {"memory/pods/a/memory.limit_in_bytes": "1073741824"}, 1 << 30),
        ("4:memory:/pods/a\n", {"memory/pods/a/memory.limit_in_bytes": "9223372036854771712"}, None),
        ("0::/gone\n", {}, None),
    ],
)
def test_the_memory_limit_that_page_cache_is_charged_against(
    tmp_path: Path, proc: str, files: dict[str, str], limit: int | None
) -> None:
    (tmp_path / "cgroup").write_text(proc)
    for relative, content in files.items():
        (tmp_path / "fs" / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fs" / relative).write_text(content)
    assert cgroup_memory_limit(tmp_path / "cgroup", tmp_path / "fs") == limit


def test_a_read_only_mapping_starts_at_any_byte_and_is_gone_after(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    data = os.urandom(3 * 4096 + 123)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        with mapped_readonly(fd, 5000, 3000) as address:  # neither end on a page boundary
            assert ctypes.string_at(address, 3000) == data[5000:8000]
            assert str(path) in Path("/proc/self/maps").read_text()
        assert str(path) not in Path("/proc/self/maps").read_text()
    finally:
        os.close(fd)
