"""The `spawns` marker: given to every test that uses one of the fixtures below that start processes, and
kept honest: a test that starts a process (itself or through a fixture it uses) while it is not marked
`spawns` fails, naming what it started. Test modules mark the rest themselves (`pytestmark`).

What counts as starting a process is what Python itself reports: its audit events for `subprocess.Popen`,
`os.fork`, `os.forkpty`, `os.posix_spawn`, `os.system` and the `os.exec*`/`os.spawn*` calls, and
multiprocessing's `spawn` start method (which starts its interpreter without an audit event). A test that
uses a process a session fixture started before it (the control plane, say) starts nothing itself; it is
caught when it runs alone, when the fixture starts for it.
"""

from __future__ import annotations

import multiprocessing.util
import sys
from collections.abc import Generator
from typing import Any

import pytest

MARKER = "spawns"
# The fixtures of tests/ that start processes or hand the test a place to put the ones it starts: a test
# whose fixtures include one (directly or through another fixture) starts processes.
SPAWNING_FIXTURES = frozenset(
    {
        "kube",  # the control plane (kube_plugin)
        "real_node",  # containerd, kubelet, kube-proxy, CoreDNS (node_plugin)
        "s3_server_factory",  # an S3 gateway (s3_plugin)
        "criu_command",  # probes CRIU by running it
        "sandboxes",  # the sandboxes a test starts
        "small_mount",  # mount(8)
        "start_worker",  # `warmstart worker` processes (tests/worker)
        "worker",  # a `warmstart worker` process (tests/reliability)
    }
)
SPAWN_EVENTS = frozenset(
    {"subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.system", "os.exec", "os.spawn"}
)


def program_of(event: str, args: tuple[Any, ...]) -> str:
    """The command an audit event names, shortened (os.fork names none)."""
    if event == "os.fork" or not args:
        return ""
    command = args[1] if event == "subprocess.Popen" else args[0]  # Popen's first is its `executable=`
    text = " ".join(map(str, command)) if isinstance(command, list | tuple) else str(command)
    return text[:120]


class SpawnRecorder:
    """What this process started since the last `take()`: one line per process, the event and its program."""

    def __init__(self) -> None:
        self.started: list[str] = []

    def audit(self, event: str, args: tuple[Any, ...]) -> None:
        if event in SPAWN_EVENTS:
            self.started.append(f"{event} {program_of(event, args)}".strip())

    def take(self) -> list[str]:
        started, self.started = self.started, []
        return started


RECORDER = SpawnRecorder()


def pytest_configure(config: pytest.Config) -> None:
    sys.addaudithook(RECORDER.audit)  # an audit hook cannot be removed: it only records, and is checked below
    spawnv_passfds = multiprocessing.util.spawnv_passfds

    def recorded_spawnv_passfds(path: str, args: list[str], passfds: Any) -> int:
        RECORDER.started.append(f"multiprocessing spawn {path}")
        return spawnv_passfds(path, args, passfds)

    patch = pytest.MonkeyPatch()
    patch.setattr(multiprocessing.util, "spawnv_passfds", recorded_spawnv_passfds)
    config.add_cleanup(patch.undo)


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if SPAWNING_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(MARKER)


def fail_if_unmarked(item: pytest.Item, phase: str) -> None:
    started = RECORDER.take()
    if started and item.get_closest_marker(MARKER) is None:
        shown = "\n  ".join(started[:5]) + (f"\n  ... {len(started) - 5} more" if len(started) > 5 else "")
        pytest.fail(
            f"{item.nodeid} started {len(started)} process(es) in its {phase} but is not marked "
            f"`{MARKER}` (pytestmark = pytest.mark.{MARKER}):\n  {shown}",
            pytrace=False,
        )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    RECORDER.take()  # what ran between tests (collection, another test's late threads) is nobody's
    yield
    fail_if_unmarked(item, "setup")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    yield
    fail_if_unmarked(item, "call")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    yield
    if nextitem is None:  # the session's fixtures end here too (stopping a node): their processes are theirs
        RECORDER.take()
        return
    fail_if_unmarked(item, "teardown")
