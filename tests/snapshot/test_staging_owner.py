"""Whose staging GC may remove at once: an owner whose pid is gone from this pid namespace since this boot,
whatever its hostname (the agent pods of one node share the node's pids, each under its own hostname), and
never one whose pid belongs to another pid namespace (a container of the same hostname with its own pids).
Real processes in real namespaces (`unshare`, as root)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from warmstart.snapshot.store import SnapshotStore

pytestmark = [
    pytest.mark.spawns,
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare(1)"
    ),
]

# Run by a child: make a staging directory in the store (argv[1]), print its path, wait for stdin to close.
STAGE = """
import sys
from pathlib import Path
from warmstart.snapshot.staging_owner import create_staging_root
from warmstart.snapshot.store import SnapshotStore
print(create_staging_root(SnapshotStore(Path(sys.argv[1])).layout), flush=True)
sys.stdin.read()
"""
HOUR = 3600.0


def staging_in_child(
    store: SnapshotStore, unshare: tuple[str, ...], prefix: tuple[str, ...] = ()
) -> tuple[subprocess.Popen[str], Path]:
    """A child in the namespaces `unshare` makes (run through `prefix`) that made a staging directory and
    waits."""
    argv = ["unshare", *unshare, "--", *prefix, sys.executable, "-c", STAGE, str(store.root)]
    child = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    line = child.stdout.readline().strip()
    assert line, f"the child made no staging directory (exit {child.poll()})"
    return child, Path(line)


def finish(child: subprocess.Popen[str]) -> None:
    assert child.stdin is not None
    child.stdin.close()
    child.wait(timeout=30)


def test_gc_removes_at_once_the_staging_of_a_dead_owner_of_another_hostname(tmp_path: Path) -> None:
    """A killed agent's pod replaced by another on the same node: its staging goes at the next GC."""
    store = SnapshotStore(tmp_path / "store")
    store.layout.ensure()
    rename = ("sh", "-c", 'hostname another-agent-pod && exec "$@"', "sh")
    child, staging = staging_in_child(store, ("--uts",), rename)
    finish(child)

    report = store.gc(staging_older_than=HOUR)

    assert not staging.exists(), report.kept_staging
    assert [entry.split(" ")[0] for entry in report.removed_staging] == [staging.name]
    assert "is gone" in report.removed_staging[0]


def test_gc_keeps_the_staging_of_a_live_owner_in_another_pid_namespace(tmp_path: Path) -> None:
    """The owner's pid means nothing here: only its staging's age can say it was abandoned."""
    store = SnapshotStore(tmp_path / "store")
    store.layout.ensure()
    child, staging = staging_in_child(store, ("--pid", "--fork", "--mount-proc"))
    try:
        report = store.gc(staging_older_than=HOUR)
        assert staging.exists(), report.removed_staging
        assert "touched" in report.kept_staging[0], report.kept_staging
    finally:
        finish(child)
    assert "is gone" not in " ".join(store.gc(staging_older_than=HOUR).removed_staging)
