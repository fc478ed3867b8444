"""What `/proc/<pid>/stat` says about a process: its state, parent, session and start time.

The start time tells a pid apart from a later process that reuses it. The command name in the stat line is
in parentheses and may itself hold spaces and parentheses, so the fields after it are found from the last
')' of the line (the fields that follow are numbers and a state letter, never a parenthesis).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
GONE_STATES = ("Z", "X")  # zombie, dead: the process no longer runs


@dataclass(frozen=True)
class ProcStat:
    pid: int
    comm: str  # the command name (at most 15 bytes, as the kernel keeps it)
    state: str  # R, S, D, Z, T, ... (see proc(5))
    ppid: int
    session: int
    start_ticks: int  # clock ticks after boot when the process started

    @property
    def running(self) -> bool:
        return self.state not in GONE_STATES


def parse_stat(text: str) -> ProcStat:
    """One `/proc/<pid>/stat` line as a ProcStat; ValueError when it is not one."""
    opening, closing = text.find("("), text.rfind(")")
    if opening < 0 or closing < opening:
        raise ValueError(f"not a /proc/<pid>/stat line (no parenthesised command name): {text[:80]!r}")
    fields = text[closing + 1 :].split()
    if len(fields) < 20:
        raise ValueError(f"a /proc/<pid>/stat line has at least 22 fields, this one {len(fields) + 2}")
    return ProcStat(
        pid=int(text[:opening]),
        comm=text[opening + 1 : closing],
        state=fields[0],
        ppid=int(fields[1]),
        session=int(fields[3]),
        start_ticks=int(fields[19]),
    )


def read_stat(pid: int | str = "self", proc: Path = PROC) -> ProcStat | None:
    """Process `pid`'s stat, None when there is no such process (or its entry cannot be read)."""
    try:
        text = (proc / str(pid) / "stat").read_text(errors="replace")
    except OSError:
        return None
    return parse_stat(text)


def start_ticks(pid: int | str = "self", proc: Path = PROC) -> int | None:
    """When process `pid` started, in clock ticks after boot; None when there is no such process."""
    stat = read_stat(pid, proc)
    return stat.start_ticks if stat is not None else None


def same_process(pid: int, started: int | None, proc: Path = PROC) -> bool:
    """True while `pid` is the process that started `started` ticks after boot (None: whichever has it).

    An entry that exists but cannot be read counts as that process: from here it cannot be told apart.
    """
    try:
        text = (proc / str(pid) / "stat").read_text(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return False
    except OSError:
        return True
    return started is None or parse_stat(text).start_ticks == started


def is_running(pid: int, proc: Path = PROC) -> bool:
    """True when process `pid` exists and is neither a zombie nor dead."""
    stat = read_stat(pid, proc)
    return stat is not None and stat.running


def process_start_time() -> float:
    """When this process started, in epoch seconds (now when /proc cannot say)."""
    return start_time() or time.time()


def start_time(pid: int | str = "self", proc: Path = PROC) -> float | None:
    """When process `pid` started, in epoch seconds; None when that cannot be read."""
    ticks = start_ticks(pid, proc)
    if ticks is None:
        return None
    # The start is counted in clock ticks after boot; the boot's epoch time in /proc/stat (`btime`) is whole
    # seconds, which would put the start up to a second early. The process's age on the boot clock is exact.
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - age


def anonymous_memory_by_mapping(
    pid: int | str = "self", top: int = 8, proc: Path = PROC
) -> list[tuple[str, int]]:
    """(mapping, bytes of anonymous memory) of the `top` mappings holding most, largest first, then the
    rest summed as `other`: what a checkpoint copies of the process's memory.

    A mapping is named by its path (a file's privately written pages), `[heap]`, `[stack]`, or for an
    unnamed one `anon <start address>` (the address tells them apart).
    """
    sizes: dict[str, int] = {}
    name = ""
    for line in (proc / str(pid) / "smaps").read_text(errors="replace").splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) >= 5 and "-" in fields[0] and not fields[0].endswith(":"):
            name = fields[5] if len(fields) == 6 else f"anon {fields[0].split('-')[0]}"
        elif fields and fields[0] == "Anonymous:":
            sizes[name] = sizes.get(name, 0) + int(fields[1]) * 1024
    ranked = sorted(sizes.items(), key=lambda item: item[1], reverse=True)
    largest = [(mapping, size) for mapping, size in ranked[:top] if size]
    rest = sum(size for _, size in ranked[top:])
    return [*largest, ("other", rest)] if rest else largest


def anonymous_memory(pid: int | str = "self", proc: Path = PROC) -> tuple[int, int]:
    """(bytes of anonymous memory, bytes of it in transparent huge pages) of a process, from smaps_rollup."""
    fields = {}
    for line in (proc / str(pid) / "smaps_rollup").read_text(errors="replace").splitlines():
        name, _, rest = line.partition(":")
        if name in ("Anonymous", "AnonHugePages"):
            fields[name] = int(rest.split()[0]) * 1024
    return fields.get("Anonymous", 0), fields.get("AnonHugePages", 0)


def memory_counters(pid: int | str = "self", proc: Path = PROC) -> dict[str, int]:
    """Page faults so far (minor, major) and resident, anonymous and pinned KiB of a process (empty when it
    cannot be read): taken before and after a step, they say how much memory the step touched or pinned."""
    counters: dict[str, int] = {}
    try:
        stat = (proc / str(pid) / "stat").read_text(errors="replace")
        status = (proc / str(pid) / "status").read_text(errors="replace")
    except OSError:
        return counters
    fields = stat[stat.rfind(")") + 1 :].split()
    if len(fields) > 9:
        counters["minflt"], counters["majflt"] = int(fields[7]), int(fields[9])
    for line in status.splitlines():
        name, _, rest = line.partition(":")
        if name in ("VmRSS", "RssAnon", "VmPin", "VmLck"):
            counters[f"{name}_kib"] = int(rest.split()[0])
    return counters


def counters_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {name: after[name] - before[name] for name in after if name in before}
