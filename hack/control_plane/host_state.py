"""What the real node may change on the machine, and how it is put back: cgroups, global sysctls, mount
points, namespaces, links and nft tables. `HostSnapshot` + `leftovers()` find anything a node left behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

CGROUP_MOUNT_ROOT = Path("/sys/fs/cgroup")
PROC_SYS = Path("/proc/sys")
# Global (not per network namespace) sysctls kubelet sets to its own values at start.
KUBELET_SYSCTLS = {
    "vm/overcommit_memory": "1",
    "vm/panic_on_oom": "0",
    "kernel/panic": "10",
    "kernel/panic_on_oops": "1",
    "kernel/keys/root_maxkeys": "1000000",
    "kernel/keys/root_maxbytes": "25000000",
}
KILL_ROUNDS = 100
KILL_INTERVAL_SECONDS = 0.05


# -- cgroups -------------------------------------------------------------------------------------------------


def cgroup_hierarchies() -> list[Path]:
    """Mount points of every cgroup hierarchy (v1 controllers, the v2 unified one) on this machine."""
    hierarchies = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        before, _, after = line.partition(" - ")
        fstype = after.split(" ", 1)[0]
        mount_point = Path(before.split(" ")[4])
        if fstype in ("cgroup", "cgroup2") and mount_point.is_relative_to(CGROUP_MOUNT_ROOT):
            hierarchies.append(mount_point)
    return sorted(set(hierarchies))


def process_hierarchy() -> Path:
    """One hierarchy where every process of the node is found (runc puts containers in all of them)."""
    hierarchies = cgroup_hierarchies()
    for preferred in ("pids", "memory"):
        for hierarchy in hierarchies:
            if hierarchy.name == preferred:
                return hierarchy
    if not hierarchies:
        raise RuntimeError("no cgroup hierarchy is mounted under /sys/fs/cgroup")
    return hierarchies[0]


def make_cgroup(relative: str) -> list[Path]:
    """Create `relative` (e.g. "warmstart-node/daemons") in every hierarchy; returns the directories."""
    made = []
    for hierarchy in cgroup_hierarchies():
        path = hierarchy
        for part in Path(relative).parts:
            parent, path = path, path / part
            if not path.is_dir():
                path.mkdir()
                inherit_cpuset(parent, path)
        made.append(path)
    return made


def inherit_cpuset(parent: Path, child: Path) -> None:
    """A new v1 cpuset cgroup starts with no CPUs and no memory nodes: give it its parent's."""
    for name in ("cpuset.cpus", "cpuset.mems"):
        source = parent / name
        if source.is_file() and (child / name).is_file() and not (child / name).read_text().strip():
            (child / name).write_text(source.read_text())


def cgroup_tree(root: Path) -> list[Path]:
    """`root` and every cgroup under it. The kubelet removes a pod's cgroups while we look: a directory gone
    between listing and reading is skipped, never an error (os.walk ignores what it cannot list)."""
    return [Path(directory) for directory, _subdirectories, _files in os.walk(root)]


def cgroup_pids(root: Path) -> set[int]:
    pids: set[int] = set()
    for directory in cgroup_tree(root):
        with contextlib.suppress(OSError):
            pids.update(int(line) for line in (directory / "cgroup.procs").read_text().split())
    return pids


def kill_cgroup_tree(root: Path) -> set[int]:
    """SIGKILL every process under `root` until none is left; returns those that would not die."""
    for _ in range(KILL_ROUNDS):
        pids = cgroup_pids(root)
        if not pids:
            return set()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(KILL_INTERVAL_SECONDS)
    return cgroup_pids(root)


def remove_cgroup_tree(relative: str) -> list[Path]:
    """rmdir `relative` and everything under it in every hierarchy (leaves first); returns what remains."""
    remaining = []
    for hierarchy in cgroup_hierarchies():
        top = hierarchy / relative
        if not top.is_dir():
            continue
        for directory, _subdirectories, _files in os.walk(top, topdown=False):
            with contextlib.suppress(OSError):
                Path(directory).rmdir()
        if top.exists():
            remaining.append(top)
    return remaining


# -- sysctls -------------------------------------------------------------------------------------------------


def read_sysctls(names: tuple[str, ...] = tuple(KUBELET_SYSCTLS)) -> dict[str, str]:
    return {name: (PROC_SYS / name).read_text().strip() for name in names if (PROC_SYS / name).is_file()}


def restore_sysctls(saved: dict[str, str]) -> list[str]:
    """Write back every saved value that differs now; returns the names it had to restore."""
    restored = []
    for name, value in saved.items():
        path = PROC_SYS / name
        if path.is_file() and path.read_text().strip() != value:
            path.write_text(f"{value}\n")
            restored.append(name)
    return restored


# -- namespaces ----------------------------------------------------------------------------------------------


def namespace_inode(pid: int, kind: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/{kind}").st_ino
    except OSError:
        return None


def namespace_kind(name: str) -> str:
    """ "node-net" -> "net": records name each namespace by whose it is and its kind."""
    return name.rsplit("-", 1)[-1]


def boottime() -> float:
    """Seconds since boot, the clock of a process's start time in /proc."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def stat_fields(pid: int) -> list[str] | None:
    """The fields of `/proc/PID/stat` after the command name (which may itself hold spaces and parentheses):
    [0] is the state letter, [19] the start time in clock ticks after boot. None once the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def started_at(pid: int) -> float | None:
    """When `pid` started, in `boottime()` seconds (to the clock tick, rounded down); None once it is gone."""
    fields = stat_fields(pid)
    return None if fields is None else int(fields[19]) / os.sysconf("SC_CLK_TCK")


def pids_in_namespace(kind: str, inode: int, started_before: float | None = None) -> set[int]:
    """The processes in the namespace of `kind` numbered `inode`. Once nothing pins a namespace the kernel
    gives its number to the next one made, so `started_before` (the moment it was last pinned) leaves out
    processes that can only be in a newer namespace of that number."""
    found = {
        int(entry.name)
        for entry in Path("/proc").iterdir()
        if entry.name.isdigit() and namespace_inode(int(entry.name), kind) == inode
    }
    if started_before is None:
        return found
    # A start time is rounded down to the tick: one a tick short of the moment may still be after it.
    latest = started_before - 1 / os.sysconf("SC_CLK_TCK")
    return {pid for pid in found if (start := started_at(pid)) is not None and start <= latest}


# -- the machine as the node found it ------------------------------------------------------------------------


def _command_lines(argv: list[str]) -> list[str]:
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return []
    return sorted(line.strip() for line in result.stdout.splitlines() if line.strip())


def host_links() -> list[str]:
    return sorted(line.split(":")[1].strip().split("@")[0] for line in _command_lines(["ip", "-o", "link"]))


def host_nft_tables() -> list[str]:
    return _command_lines(["nft", "list", "tables"])


def host_netns() -> list[str]:
    return _command_lines(["ip", "netns", "list"])


def host_mount_points() -> list[str]:
    return sorted(line.split(" ")[4] for line in Path("/proc/self/mountinfo").read_text().splitlines())


@dataclass
class HostSnapshot:
    """The machine's own network and mounts as they were before the node started."""

    links: list[str] = field(default_factory=list)
    nft_tables: list[str] = field(default_factory=list)
    netns: list[str] = field(default_factory=list)
    mount_points: list[str] = field(default_factory=list)
    sysctls: dict[str, str] = field(default_factory=dict)

    @classmethod
    def take(cls) -> HostSnapshot:
        return cls(host_links(), host_nft_tables(), host_netns(), host_mount_points(), read_sysctls())

    def to_json(self) -> dict[str, object]:
        return {
            "links": self.links,
            "nft_tables": self.nft_tables,
            "netns": self.netns,
            "mount_points": self.mount_points,
            "sysctls": self.sysctls,
        }

    @classmethod
    def from_json(cls, data: dict[str, object]) -> HostSnapshot:
        return cls(**data)  # type: ignore[arg-type]


def leftovers(
    before: HostSnapshot,
    cgroup_relative: str,
    namespaces: dict[str, int],
    created_dirs: list[str],
    state_paths: list[Path],
    namespaces_pinned_until: float | None = None,
) -> list[str]:
    """Everything the node changed that is still there, one line each; empty when it left nothing."""
    found: list[str] = []
    for name, inode in namespaces.items():
        if pids := pids_in_namespace(namespace_kind(name), inode, namespaces_pinned_until):
            found.append(f"processes in the {name} namespace: {sorted(pids)}")
    for hierarchy in cgroup_hierarchies():
        if (hierarchy / cgroup_relative).exists():
            found.append(f"cgroup {hierarchy / cgroup_relative}")
    after = HostSnapshot.take()
    if new := sorted(set(after.links) - set(before.links)):
        found.append(f"new links on the machine: {new}")
    if new := sorted(set(after.nft_tables) - set(before.nft_tables)):
        found.append(f"new nft tables on the machine: {new}")
    if new := sorted(set(after.netns) - set(before.netns)):
        found.append(f"new named network namespaces: {new}")
    if new := sorted(set(after.mount_points) - set(before.mount_points)):
        found.append(f"new mounts on the machine: {new}")
    mounted_state = [m for m in after.mount_points if any(Path(m).is_relative_to(p) for p in state_paths)]
    if mounted_state:
        found.append(f"mounts under the node's directories: {mounted_state}")
    changed = {name: value for name, value in after.sysctls.items() if before.sysctls.get(name) != value}
    if changed:
        found.append(f"sysctls changed: {changed} (were {before.sysctls})")
    if still := [path for path in created_dirs if Path(path).exists()]:
        found.append(f"directories the node created: {still}")
    return found
