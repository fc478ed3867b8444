"""warmstart.host.procinfo: /proc/<pid>/stat (also for command names with spaces and parentheses), smaps."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from warmstart.host import procinfo

AWKWARD_NAME = "a) (b c) d"  # what a naive split on spaces or on the first ')' gets wrong


@pytest.fixture
def awkward_child(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A sleeping child whose command name (its executable's file name) holds spaces and parentheses."""
    sleep = shutil.which("sleep")
    if sleep is None:
        pytest.skip("no `sleep` executable on PATH to start a child process with")
    program = tmp_path / AWKWARD_NAME
    program.symlink_to(sleep)
    child = subprocess.Popen([str(program), "600"])
    yield child
    child.kill()
    child.wait()


@pytest.mark.spawns
def test_a_command_name_with_spaces_and_parentheses_is_read_whole(awkward_child) -> None:
    stat = procinfo.read_stat(awkward_child.pid)
    assert stat is not None
    assert stat.pid == awkward_child.pid and stat.comm == AWKWARD_NAME
    assert stat.ppid == os.getpid() and stat.running
    assert stat.start_ticks >= procinfo.start_ticks() > 0  # started after this test process


@pytest.mark.spawns
def test_a_reaped_process_is_gone_and_a_zombie_is_not_running(awkward_child) -> None:
    awkward_child.kill()
    os.waitid(os.P_PID, awkward_child.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped yet: a zombie
    zombie = procinfo.read_stat(awkward_child.pid)
    assert zombie is not None and zombie.state == "Z" and not zombie.running
    assert not procinfo.is_running(awkward_child.pid)
    awkward_child.wait()
    assert procinfo.read_stat(awkward_child.pid) is None and procinfo.start_ticks(awkward_child.pid) is None


@pytest.mark.spawns
def test_a_start_time_is_exact_to_a_clock_tick() -> None:
    # Counted from the boot's whole-second epoch time (`btime`), it could be up to a second early.
    tick = 1 / os.sysconf("SC_CLK_TCK")
    before = time.time()
    child = subprocess.Popen(["sleep", "5"])
    after = time.time()
    try:
        started = procinfo.start_time(child.pid)
        assert started is not None
        assert before - tick <= started <= after + tick, (before, started, after)
    finally:
        child.kill()
        child.wait()


def test_a_stat_line_is_parsed_from_the_last_parenthesis() -> None:
    fields = ["S", "7", "8", "9"] + [str(n) for n in range(10, 25)] + ["123456", "0", "0"]
    stat = procinfo.parse_stat(f"42 (x) (y z)) {' '.join(fields)}\n")
    assert (stat.pid, stat.comm, stat.state, stat.ppid, stat.session) == (42, "x) (y z)", "S", 7, 9)
    assert stat.start_ticks == 123456


@pytest.mark.parametrize("text", ["", "42 no name here", "42 (x) S 1 2"])
def test_what_is_not_a_stat_line_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="stat"):
        procinfo.parse_stat(text)


def test_a_missing_proc_reads_as_no_process(tmp_path: Path) -> None:
    assert procinfo.read_stat(1, proc=tmp_path) is None
    assert procinfo.start_time(1, proc=tmp_path) is None


@pytest.mark.spawns
def test_anonymous_memory_is_ranked_by_mapping_with_the_rest_summed() -> None:
    # A real process holding a 64 MiB anonymous mapping it wrote, read through its own /proc entry.
    script = (
        "import mmap, sys\n"
        "m = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)\n"
        "m.write(b'x' * (64 << 20))\n"
        "print('ready', flush=True)\n"
        "sys.stdin.read()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        ranked = procinfo.anonymous_memory_by_mapping(child.pid, top=3)
    finally:
        child.communicate("", timeout=30)
    assert len(ranked) == 4 and ranked[-1][0] == "other"
    (name, size), *_ = ranked
    assert name.startswith("anon ") and size >= 64 << 20  # the largest: the written mapping
    assert [s for _, s in ranked[:3]] == sorted((s for _, s in ranked[:3]), reverse=True)


def test_anonymous_memory_and_its_huge_pages_are_read_from_smaps_rollup(tmp_path: Path) -> None:
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "smaps_rollup").write_text(
        "55d0-7ffd ---p 00000000 00:00 0 [rollup]\nRss: 900 kB\nAnonymous: 800 kB\nAnonHugePages: 512 kB\n"
    )
    assert procinfo.anonymous_memory(7, proc=tmp_path) == (800 << 10, 512 << 10)
    anonymous, huge = procinfo.anonymous_memory()  # this process's own
    assert anonymous > 0 and 0 <= huge <= anonymous


def test_memory_counters_see_the_pages_a_step_touches() -> None:
    before = procinfo.memory_counters()
    touched = bytearray(32 << 20)  # zero-filled: every page faulted in by the allocation's writes
    delta = procinfo.counters_delta(before, procinfo.memory_counters())
    assert len(touched) == 32 << 20
    assert delta["minflt"] >= (32 << 20) // (2 << 20)  # at least one fault per huge page
    assert delta["RssAnon_kib"] >= 30 << 10 and delta["majflt"] >= 0
    assert {"VmPin_kib", "VmLck_kib", "VmRSS_kib"} <= set(delta)


def test_memory_counters_of_no_process_are_empty(tmp_path: Path) -> None:
    assert procinfo.memory_counters(1, proc=tmp_path) == {}
    assert procinfo.counters_delta({"minflt": 1}, {}) == {}
