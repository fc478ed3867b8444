"""`warmstart serve` on a store whose own tree was tampered with: whatever stands where a directory, a state
file, a manifest or a blob should be (a file, a directory, a link out of the store, a FIFO, other modes,
other sizes), and a full filesystem, serve ends serving (a restore, a cold start or a capture) and says why,
never an exit or a traceback, and nothing outside the store is touched. Real serve processes, real CRIU.

The store is captured once by a real serve; each example is a copy (files hard-linked, and copied before a
mutation changes one) mutated by hypothesis, then served with `--once` and collected by `snapshot gc`."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import free_port
from test_store_hostile import tree_state

from warmstart.snapshot.signing import generate_hmac_key

pytestmark = [pytest.mark.reliability, pytest.mark.integration, pytest.mark.spawns]

EXAMPLES = 30
SERVE_SECONDS = 600  # one serve in a child process, a generous bound on a loaded 2-core machine
MODES = ("restore", "cold+capture", "cold")
TRIED: Counter[str] = Counter()  # mutations tried, by target and kind
ENDED: Counter[str] = Counter()  # how serve came up

# Where serve reads or writes in its store (`*`: every entry of that directory).
TARGETS = (
    "identities", "identities/*", "restore-failures", "restore-failures/*", "snapshots", "snapshots/*",
    "snapshots/*/manifest.json", "snapshots/*/manifest.sig", "blobs", "blobs/sha256", "blobs/sha256/*",
    "staging", "pods", ".lock",
)  # fmt: skip
KINDS = (
    "file", "empty directory", "link to a directory outside", "link to a file outside", "dangling link",
    "fifo", "mode 000", "mode 777", "missing", "truncated", "grown to 64 MiB", "zeroed",
)  # fmt: skip


@dataclass(frozen=True)
class Captured:
    store: Path
    key: Path
    criu: str


def serve_once(store: Path, key: Path, criu: str) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable, "-m", "warmstart", "serve", "--store", str(store), "--key", str(key), "--criu", criu,
        "--port", str(free_port()), "--once",
    ]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=SERVE_SECONDS)


def mode_of(result: subprocess.CompletedProcess[str]) -> str:
    """The mode in serve's table (`│ restore │ ...`), '' when it printed none."""
    for line in result.stdout.splitlines():
        cells = [cell.strip() for cell in line.split("│")]
        if len(cells) > 2 and cells[1] in MODES:
            return cells[1]
    return ""


@pytest.fixture(scope="module")
def captured(tmp_path_factory: pytest.TempPathFactory, criu_command: str) -> Captured:
    """A store holding one snapshot of the tiny worker and its identity record, made by a real serve."""
    root = tmp_path_factory.mktemp("captured")
    key = generate_hmac_key(root / "key")
    result = serve_once(root / "store", key, criu_command)
    assert result.returncode == 0 and mode_of(result) == "cold+capture", result.stdout + result.stderr
    again = serve_once(root / "store", key, criu_command)
    assert mode_of(again) == "restore", again.stdout + again.stderr  # the copies restore unless mutated
    return Captured(root / "store", key, criu_command)


@pytest.fixture(scope="module", autouse=True)
def report_counts(pytestconfig: pytest.Config) -> Iterator[None]:
    yield
    reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")
    capture = pytestconfig.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and TRIED:
        with capture.global_and_fixture_disabled():
            modes = ", ".join(f"{mode} {count}" for mode, count in sorted(ENDED.items()))
            reporter.write_line(
                f"serve on a tampered store: {sum(TRIED.values())} mutations in {sum(ENDED.values())} "
                f"starts, every start served ({modes})"
            )
            reporter.write_line("  mutations: " + ", ".join(f"{k} {n}" for k, n in sorted(TRIED.items())))


def linked_copy(source: Path, target: Path) -> None:
    """A copy of the store whose files are hard links (cheap); `own` breaks a link before a change."""
    shutil.copytree(source, target, symlinks=True, copy_function=os.link)


def own(path: Path) -> None:
    """Give a hard-linked file its own inode, so changing it leaves the captured store as it was."""
    info = path.lstat()
    if stat.S_ISREG(info.st_mode) and info.st_nlink > 1:
        copy = path.with_name(path.name + ".own")
        shutil.copy2(path, copy)
        os.replace(copy, path)


def remove(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path)


def mutate(path: Path, kind: str, outside: Path) -> None:
    """Put `kind` where `path` is (files only change content; on a directory that means emptying it)."""
    is_file = path.is_file() and not path.is_symlink()
    if kind in ("truncated", "grown to 64 MiB", "zeroed") and not is_file:
        kind = "empty directory" if path.is_dir() else "file"
    if kind in ("mode 000", "mode 777"):
        if path.exists() and not path.is_symlink():
            own(path)
            path.chmod(0o000 if kind == "mode 000" else 0o777)
        return
    if kind in ("truncated", "grown to 64 MiB", "zeroed"):
        own(path)
        size = path.stat().st_size
        with open(path, "r+b") as handle:
            if kind == "truncated":
                handle.truncate(size // 2)
            elif kind == "grown to 64 MiB":
                handle.truncate(64 << 20)  # sparse
            else:
                handle.write(b"\0" * size)
        return
    if path.exists() or path.is_symlink():
        remove(path)
    if kind == "file":
        path.write_bytes(b'{"junk": true}\n')
    elif kind == "empty directory":
        path.mkdir()
    elif kind == "link to a directory outside":
        path.symlink_to(outside)
    elif kind == "link to a file outside":
        path.symlink_to(outside / "precious")
    elif kind == "dangling link":
        path.symlink_to(outside / "nothing-here")
    elif kind == "fifo":
        os.mkfifo(path)


def resolve(store: Path, target: str, pick: int) -> Path | None:
    """The path `target` names in `store` (`*`: the pick-th entry of that directory), None when none."""
    head, star, tail = target.partition("*")
    if not star:
        return store / target
    directory = store / head.rstrip("/")
    if directory.is_symlink() or not directory.is_dir():
        return None
    entries = sorted(directory.iterdir())
    if not entries:
        return None
    chosen = entries[pick % len(entries)]
    return chosen / tail.lstrip("/") if tail else chosen


mutations = st.lists(
    st.tuples(st.sampled_from(TARGETS), st.sampled_from(KINDS), st.integers(0, 20)), min_size=1, max_size=6
)


@settings(
    max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)  # fmt: skip
@given(changes=mutations)
def test_serve_ends_serving_whatever_its_store_tree_holds(
    captured: Captured, tmp_path_factory: pytest.TempPathFactory, changes: list[tuple[str, str, int]]
) -> None:
    work = tmp_path_factory.mktemp("tampered")
    store, outside = work / "store", work / "outside"
    outside.mkdir()
    (outside / "precious").write_bytes(b"not the store's")
    linked_copy(captured.store, store)
    for target, kind, pick in changes:
        path = resolve(store, target, pick)
        if path is not None and (path.parent.is_dir() and not path.parent.is_symlink()):
            mutate(path, kind, outside)
            TRIED[f"{target} {kind}"] += 1
    before = tree_state(outside)
    result = serve_once(store, captured.key, captured.criu)
    tried = f"after {changes}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert result.returncode == 0 and mode_of(result) in MODES, tried
    assert "Traceback" not in result.stderr, tried
    ENDED[mode_of(result)] += 1
    collected = subprocess.run(
        [sys.executable, "-m", "warmstart", "snapshot", "gc", "--store", str(store), "--json"],
        capture_output=True, text=True, timeout=SERVE_SECONDS,
    )  # fmt: skip
    assert collected.returncode in (0, 1) and "Traceback" not in collected.stderr, collected.stderr
    assert tree_state(outside) == before
    shutil.rmtree(work, ignore_errors=True)


def fill(directory: Path) -> None:
    """Write into `directory` until its filesystem is full. Unbuffered: a buffered file keeps the tail of a
    write cut short and fails again on close."""
    with open(directory / "filler", "wb", buffering=0) as handle:
        try:
            while True:
                handle.write(b"\0" * (1 << 20))
                handle.flush()
        except OSError as exc:
            assert exc.errno == 28, exc  # ENOSPC


@pytest.mark.parametrize("records", ["kept", "lost"], ids=["restore", "capture"])
def test_serve_ends_serving_on_a_full_filesystem(
    captured: Captured, tmp_path: Path, small_mount, records: str
) -> None:
    """The store's filesystem is full when serve starts: a restore (or, with no identity record, a
    capture) cannot write its signals, and a fresh worker cold-starts instead of one waiting for ever."""
    size = sum(p.lstat().st_size for p in captured.store.rglob("*")) + (16 << 20)
    mount = small_mount(f"{size >> 20}m")
    shutil.copytree(captured.store, mount / "store", symlinks=True)
    if records == "lost":
        shutil.rmtree(mount / "store" / "identities")
        shutil.rmtree(mount / "store" / "snapshots")
    fill(mount)
    result = serve_once(mount / "store", captured.key, captured.criu)
    assert result.returncode == 0 and mode_of(result) == "cold", result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    ENDED["cold (full filesystem)"] += 1
