"""A staging directory's owner record: written under the store's shared lock when the directory is made,
read by GC to decide whether the directory is abandoned (its owner process gone, or untouched for long)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import uuid
from pathlib import Path

from warmstart.host import procinfo
from warmstart.host.clock import utc_now
from warmstart.host.fileio import UnsafeInput, read_json_file, write_new_file
from warmstart.snapshot.layout import DELETING_SUFFIX, MAX_OWNER_BYTES, OWNER_FILE, StoreLayout
from warmstart.snapshot.manifest import CREATED_FORMAT


def this_host() -> str:
    """Where this process's pids mean something: this boot of the machine and this pid namespace.

    A hostname says neither: the agent pods of one node (host PID namespace) each have their own, so a
    new agent could not tell that a killed one's pid is gone, and two containers of one hostname may each
    have their own pids. Without a boot id or a pid namespace to read, the hostname stands in.
    """
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        pid_namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return f"{socket.gethostname()}/unknown"
    return f"{boot_id}/{pid_namespace}"


def create_staging_root(layout: StoreLayout) -> Path:
    """A staging directory and its owner record, made under the shared lock: GC never sees it bare."""
    owner = {
        "pid": os.getpid(),
        "pid_start": procinfo.start_ticks(os.getpid()),
        "host": this_host(),
        "hostname": socket.gethostname(),  # for people: `host` is what GC compares
        "created": utc_now().strftime(CREATED_FORMAT),
    }
    with layout.lock(exclusive=False):
        root = layout.staging_dir / uuid.uuid4().hex
        root.mkdir()
        write_new_file(root / OWNER_FILE, json.dumps(owner).encode())
        (root / "files").mkdir()
    return root


def newest_mtime(path: Path) -> float:
    """The latest mtime of `path` and everything under it (a capture writing anywhere keeps it fresh)."""
    newest = path.lstat().st_mtime
    for directory, _, names in os.walk(path):
        for name in [*names, "."]:
            with contextlib.suppress(FileNotFoundError):
                newest = max(newest, os.lstat(os.path.join(directory, name)).st_mtime)
    return newest


def staging_is_stale(entry: Path, here: str, now: float, older_than: float) -> tuple[bool, str]:
    """Whether GC may remove the staging entry, and why."""
    if entry.name.endswith(DELETING_SUFFIX):
        return True, "interrupted delete"
    if not stat.S_ISDIR(entry.lstat().st_mode):
        return True, "not a directory"
    try:
        owner = read_json_file(entry / OWNER_FILE, MAX_OWNER_BYTES)
    except (OSError, UnsafeInput):
        owner = None
    if isinstance(owner, dict) and owner.get("host") == here and isinstance(owner.get("pid"), int):
        if procinfo.same_process(owner["pid"], owner.get("pid_start")):
            return False, f"owner pid {owner['pid']} is running"
        return True, f"owner pid {owner['pid']} is gone"
    age = now - newest_mtime(entry)
    if age > older_than:
        return True, f"untouched for {age:.0f}s"
    return False, f"touched {age:.0f}s ago"
