"""The shared-volume cases on two real nodes: the chart's `agent.store.claimName` store, one ReadWriteMany
volume that both nodes' agents mount as the one snapshot store, run by two real agents.

The volume is a hostPath PersistentVolume on a size-capped filesystem (an ext4 image on one loop device,
mounted in both nodes' mount namespaces and on the machine, so the three see one filesystem): both real nodes
run on this machine, so their agents share the volume as agents of several machines share an NFS export. Its
semantics are a local filesystem's; NFS itself (attribute caching, locks over the network) is not exercised,
since the kernel here has no NFS client.

One setup serves the module's cases, in order: captures of one identity on both nodes at once; a restore on
node B while node A's agent collects garbage on the store; A's agent killed mid-publish while B restores; the
volume full during a capture. Throughout, nothing corrupt is restored (every restored replica answers with
the cold replica's token ids, and every listed snapshot verifies), every replica ends Ready, nothing is left
half-written, and no lock on the store is held by a dead agent.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from control_plane import shared_volume
from control_plane.cluster import ControlPlane, wait_for
from control_plane.node import RealNode
from endpoint_flow import (
    CHART,
    RELEASE,
    START_TIMEOUT,
    Answer,
    agent_cgroups,
    chart_values,
    client_pod,
    completion,
    diagnostics,
    endpoint,
    events_of,
    items,
    kill_agent,
    pod_url,
    ready,
    ready_snapshot,
    store_on_node,
    uninstall,
    waiter,
    worker_pods,
)
from node_plugin import HostPython
from two_nodes import BOTH_NODES, on_either_node, only_schedulable

from warmstart.api import labels as L
from warmstart.api.snapshot import CaptureState
from warmstart.host.clock import parse_time
from warmstart.snapshot.layout import LOCK_FILE
from warmstart.snapshot.store import SnapshotStore

pytestmark = [pytest.mark.spawns, pytest.mark.integration]

VOLUME_BYTES = 6 << 30  # the image is sparse: the machine's disk holds only what the store writes
LEFT_FREE = 4 << 20  # what the filler leaves of the full volume: less than any capture writes
AGENT_STORE = "/var/lib/warmstart/store"  # the chart's mount of the store inside the agent
AGENT_KEY = "/etc/warmstart/signing/key"
JUNK_BLOBS = 20


@dataclass
class SharedStore:
    """The module's one setup: its namespace, the volume as the machine sees it, the two nodes."""

    kube: ControlPlane
    namespace: str
    mount: Path  # the volume's filesystem, mounted on the machine too
    nodes: tuple[RealNode, RealNode]
    wait: Any
    answer: Answer | None = None  # a cold replica's greedy answer: what every restored replica must say
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def store(self) -> SnapshotStore:
        return SnapshotStore(self.mount / "store")


# -- the size-capped filesystem in three mount namespaces -------------------------------------------------


def run(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True, timeout=60).stdout.strip()


def mount_namespace(node: RealNode | None) -> list[str]:
    """The command prefix that runs in the node's mount namespace (the machine's for None)."""
    if node is None:
        return []
    assert node.record is not None
    return ["nsenter", f"--target={node.record.holder_pid}", "--mount", "--"]


@contextlib.contextmanager
def capped_filesystem(root: Path, nodes: tuple[RealNode, RealNode]) -> Iterator[Path]:
    """An ext4 filesystem of VOLUME_BYTES on one loop device, mounted at the same path on the machine and
    in each node's mount namespace (one device: one filesystem, whichever mount writes)."""
    missing = [tool for tool in ("losetup", "mkfs.ext4", "nsenter", "mount") if shutil.which(tool) is None]
    if missing or not Path("/dev/loop-control").exists():
        pytest.skip(f"no loop devices or tools to make a size-capped volume ({', '.join(missing) or 'loop'})")
    image, mount = root / "volume.img", root / "volume"
    mount.mkdir()
    with image.open("wb") as file:
        file.truncate(VOLUME_BYTES)
    run("mkfs.ext4", "-q", "-m", "0", str(image))
    device = run("losetup", "--find", "--show", str(image))
    mounted: list[list[str]] = []
    try:
        for where in (None, *nodes):
            prefix = mount_namespace(where)
            run(*prefix, "mount", device, str(mount))
            mounted.append(prefix)
        yield mount
    finally:
        for prefix in reversed(mounted):
            with contextlib.suppress(subprocess.CalledProcessError):
                run(*prefix, "umount", "-l", str(mount))
        subprocess.run(["losetup", "-d", device], check=False, capture_output=True)
        image.unlink(missing_ok=True)


# -- the module's setup -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shared(
    kube: ControlPlane,
    real_node: RealNode,
    second_node: RealNode,
    chart_image: str,
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[SharedStore]:
    """The release with an agent on each node, both on the claim; the client pod on A."""
    nodes = (real_node, second_node)
    started = time.monotonic()
    namespace = f"shared-volume-{uuid.uuid4().hex[:6]}"
    kube.kubectl("create", "namespace", namespace)
    kube.wait_default_service_account(namespace)
    try:
        with capped_filesystem(tmp_path_factory.mktemp("shared"), nodes) as mount:
            claim = shared_volume.create_shared_volume(kube, namespace, mount / "store")
            values = chart_values(chart_image, real_node, namespace, store_on_node(namespace))
            values["agent"].update(BOTH_NODES)
            values["agent"]["store"] = {"claimName": claim}
            kube.helm("install", RELEASE, str(CHART), "-n", namespace, "-f", "-", input=json.dumps(values),
                      timeout=120)  # fmt: skip
            kube.kubectl("apply", "-f", "-", input=client_pod(namespace, chart_image, real_node))
            state = SharedStore(kube, namespace, mount, nodes, waiter(kube, namespace))
            try:
                yield state
            finally:
                uninstall(kube, namespace)
                kube.kubectl("delete", "namespace", namespace, "--wait=true", "--timeout=120s", check=False,
                             timeout=150)  # fmt: skip
                shared_volume.delete_shared_volume(kube, namespace)
                report(request, state, time.monotonic() - started)
    finally:
        kube.kubectl("uncordon", real_node.name, second_node.name, check=False)
        kube.kubectl("delete", "namespace", namespace, "--wait=false", "--ignore-not-found", check=False)


class _Summary:
    """A line for the run's terminal summary (registered as a plugin while the run goes on)."""

    def __init__(self, line: str) -> None:
        self.line = line

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        terminalreporter.write_line(self.line)


def report(request: pytest.FixtureRequest, state: SharedStore, seconds: float) -> None:
    counts = ", ".join(f"{key} {value}" for key, value in state.counts.items())
    line = f"The shared-volume cases on two real nodes: {counts or 'none ran'} ({seconds:.0f}s)"
    request.config.pluginmanager.register(_Summary(line))


# -- what the cases look at -------------------------------------------------------------------------------


def apply_either(
    shared: SharedStore, name: str, chart_image: str, host_python: HostPython, models: Path
) -> None:
    """An endpoint of the tiny model, one replica, that may run on either node (the schedulable one takes
    it)."""
    body = endpoint(name, shared.namespace, chart_image, shared.nodes[0], host_python, None)
    shared.kube.kubectl("apply", "-f", "-", input=json.dumps(on_either_node(body, models)))


def pods_of(shared: SharedStore, name: str, role: str | None = None) -> list[dict[str, Any]]:
    roles = [role] if role else [L.ROLE_CAPTURE, L.ROLE_COLD, L.ROLE_RESTORE]
    return [pod for each in roles for pod in worker_pods(shared.kube, shared.namespace, each, name)]


def scheduled_on(shared: SharedStore, name: str, node: RealNode) -> bool:
    """Whether the endpoint's capture pod and its replicas are all bound to `node`."""
    pods = pods_of(shared, name)
    roles = {pod["metadata"]["labels"][L.ROLE_LABEL] for pod in pods}
    return L.ROLE_CAPTURE in roles and all(pod["spec"].get("nodeName") == node.name for pod in pods)


def settled(shared: SharedStore, name: str) -> dict[str, Any] | None:
    """The endpoint's Ready InferenceSnapshot once no capture pod of it is left."""
    snap = ready_snapshot(shared.kube, shared.namespace, name)
    return snap if snap is not None and not pods_of(shared, name, L.ROLE_CAPTURE) else None


def restored_on(
    shared: SharedStore, name: str, node: RealNode, before: frozenset[str] = frozenset()
) -> dict[str, Any] | None:
    """A Ready replica of the endpoint on `node` that its agent restored (none of the pods named in
    `before`), None while there is none."""
    for pod in pods_of(shared, name, L.ROLE_RESTORE):
        if pod["spec"].get("nodeName") != node.name or not ready(pod) or pod["metadata"]["name"] in before:
            continue
        if any(
            e["reason"] == "Restored"
            for e in events_of(shared.kube, shared.namespace, pod["metadata"]["name"])
        ):
            return pod
    return None


def names_of(shared: SharedStore, name: str) -> frozenset[str]:
    return frozenset(pod["metadata"]["name"] for pod in pods_of(shared, name))


def all_ready(shared: SharedStore) -> bool:
    """Every worker pod of every endpoint Ready, and each endpoint at its replica count."""
    listed = shared.kube.kubectl("get", "iep", "-n", shared.namespace, "-o", "json").stdout
    for body in json.loads(listed)["items"]:
        name, wanted = body["metadata"]["name"], body["spec"]["replicas"]
        serving = [
            p for p in pods_of(shared, name) if p["metadata"]["labels"][L.ROLE_LABEL] != L.ROLE_CAPTURE
        ]
        if len(serving) != wanted or not all(ready(pod) for pod in serving):
            return False
    return True


def _restored_anywhere(shared: SharedStore, name: str) -> dict[str, Any] | None:
    return next(filter(None, (restored_on(shared, name, node) for node in shared.nodes)), None)


def poll(shared: SharedStore, predicate: Any, message: str) -> Any:
    """`shared.wait` polling every 10 ms, for what happens on the store in less than a second."""
    try:
        return wait_for(predicate, timeout=START_TIMEOUT, interval=0.01, message=message)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\n{diagnostics(shared.kube, shared.namespace)}") from None


def answer_of(shared: SharedStore, pod: dict[str, Any]) -> Answer:
    return shared.wait(lambda: completion(shared.kube, shared.namespace, pod_url(pod)), "an answer")


def agent_pod(shared: SharedStore, node: RealNode) -> dict[str, Any]:
    agents = items(shared.kube, "pod", shared.namespace, "app.kubernetes.io/component=agent")
    return next(p for p in agents if p["spec"].get("nodeName") == node.name)


def in_agent(shared: SharedStore, node: RealNode, *argv: str) -> Any:
    """Run `warmstart ...` inside the node's agent container (its store, its key)."""
    name = agent_pod(shared, node)["metadata"]["name"]
    exec_in = ("exec", "-n", shared.namespace, name, "--", "warmstart")
    return shared.kube.kubectl(*exec_in, *argv, timeout=120)


def gc_in_agent(shared: SharedStore, node: RealNode, *flags: str) -> dict[str, Any]:
    """`warmstart snapshot gc` in the node's agent: the store's own GC, under the store's lock."""
    result = in_agent(shared, node, "snapshot", "gc", "--json", "--key", AGENT_KEY, *flags)
    return json.loads(result.stdout)


def staging(shared: SharedStore) -> list[Path]:
    directory = shared.store.staging_dir
    return sorted(directory.iterdir()) if directory.exists() else []


def store_ids(shared: SharedStore) -> set[str]:
    return {snapshot.id for snapshot in shared.store.list()}


def snapshot_ids_in_cluster(shared: SharedStore) -> set[str]:
    snaps = items(shared.kube, "isnap", shared.namespace, L.ENDPOINT_LABEL)
    return {s["status"]["snapshotId"] for s in snaps if (s.get("status") or {}).get("snapshotId")}


def lock_holders(store: SnapshotStore) -> list[tuple[int, bool]]:
    """(pid, granted) of every flock on the store's lock file, from the kernel's table (its lines name a
    file as `major:minor:inode`, the device's numbers in hex)."""
    info = (store.root / LOCK_FILE).stat()
    wanted = (os.major(info.st_dev), os.minor(info.st_dev), info.st_ino)
    holders = []
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        blocked = fields[1] == "->"
        fields = fields[1:] if blocked else fields
        major, minor, inode = fields[5].split(":")
        if fields[1] == "FLOCK" and (int(major, 16), int(minor, 16), int(inode)) == wanted:
            holders.append((int(fields[4]), not blocked))
    return holders


def assert_nothing_half_written(shared: SharedStore) -> None:
    """No staging left, every listed snapshot is one an InferenceSnapshot names, and each verifies (its
    signature and every blob's digest) inside an agent."""
    assert staging(shared) == [], staging(shared)
    listed = store_ids(shared)
    assert listed == snapshot_ids_in_cluster(shared), (listed, snapshot_ids_in_cluster(shared))
    for snapshot_id in sorted(listed):
        in_agent(shared, shared.nodes[1], "snapshot", "verify", snapshot_id, "--key", AGENT_KEY)
    shared.counts["snapshots verified"] = shared.counts.get("snapshots verified", 0) + len(listed)


def assert_no_dead_lock_holder(shared: SharedStore) -> None:
    for pid, _ in lock_holders(shared.store):
        assert Path(f"/proc/{pid}").exists(), f"the store's lock is held by pid {pid}, which is gone"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model cache both nodes mount at the same path (the restored engine maps its files again)."""
    return tmp_path_factory.mktemp("models")


# -- the cases --------------------------------------------------------------------------------------------


def test_captures_of_one_identity_on_both_nodes_at_once_publish_two_whole_snapshots(
    shared: SharedStore, chart_image: str, host_python: HostPython, models: Path
) -> None:
    """Two endpoints of the same model, engine and image, one captured on each node at the same time into
    the one store: two snapshots of one identity, each whole, their blobs stored once where identical."""
    node_a, node_b = shared.nodes
    wait = shared.wait
    names = ("tiny", "tiny-b")
    # The store's lock held (as a GC holds it) until both agents capture and wait for it to make their
    # staging: released, the two dump, hash and publish at the same time.
    with _exclusive_lock(shared.store):
        only_schedulable(shared.kube, node_a, node_b)
        apply_either(shared, "tiny", chart_image, host_python, models)
        wait(lambda: scheduled_on(shared, "tiny", node_a), "tiny's capture pod and replica bound to A")
        only_schedulable(shared.kube, node_b, node_a)
        apply_either(shared, "tiny-b", chart_image, host_python, models)
        wait(lambda: scheduled_on(shared, "tiny-b", node_b), "tiny-b's capture pod and replica bound to B")
        shared.kube.kubectl("uncordon", node_a.name)
        wait(lambda: all(_capturing(shared, name) for name in names) and _waiting(shared.store) >= 2,
             "both agents capturing, waiting for the store's lock")  # fmt: skip

    first = wait(lambda: settled(shared, "tiny"), "tiny's snapshot Ready")
    second = wait(lambda: settled(shared, "tiny-b"), "tiny-b's snapshot Ready")
    assert (first["status"]["node"], second["status"]["node"]) == (node_a.name, node_b.name)
    assert first["status"]["identityHash"] == second["status"]["identityHash"]
    ids = {first["status"]["snapshotId"], second["status"]["snapshotId"]}
    assert len(ids) == 2 and ids <= store_ids(shared), (ids, store_ids(shared))
    overlap = _overlap(first["status"], second["status"])
    assert overlap > 0, (first["status"], second["status"])
    shared.counts["concurrent captures"] = 2
    shared.counts["capture overlap ms"] = int(overlap * 1000)

    # Once Ready, each endpoint's replicas are restored, the scheduler free to put them on either node.
    restored = {
        name: wait(lambda n=name: _restored_anywhere(shared, n), f"{name} restored") for name in names
    }
    answers = {name: answer_of(shared, pod) for name, pod in restored.items()}
    assert answers["tiny"] == answers["tiny-b"], answers
    shared.answer = answers["tiny"]  # checked against a cold replica's answer by the last case
    shared.counts["replicas restored"] = 2
    wait(lambda: all_ready(shared), "every replica Ready")
    assert_nothing_half_written(shared)


def _capturing(shared: SharedStore, name: str) -> bool:
    snaps = items(shared.kube, "isnap", shared.namespace, f"{L.ENDPOINT_LABEL}={name}")
    return any((snap.get("status") or {}).get("captureState") == CaptureState.CAPTURING for snap in snaps)


def _waiting(store: SnapshotStore) -> int:
    """How many processes wait for the store's lock."""
    return sum(1 for _, granted in lock_holders(store) if not granted)


def _overlap(first: dict[str, Any], second: dict[str, Any]) -> float:
    """Seconds during which both captures ran (their agents' start and completion times)."""
    start = max(parse_time(first["startedAt"]), parse_time(second["startedAt"]))
    end = min(parse_time(first["completedAt"]), parse_time(second["completedAt"]))
    return max(0.0, (end - start).total_seconds())


def test_a_restore_on_b_while_a_collects_garbage_on_the_store(shared: SharedStore) -> None:
    """B restores A's capture from the shared volume while A's agent runs the store's GC again and again,
    removing unreferenced blobs planted beside the snapshot's (grace 0): the restore reads whole blobs."""
    node_a, node_b = shared.nodes
    blobs = shared.store.layout.blobs_dir
    junk = [blobs / secrets.token_hex(32) for _ in range(JUNK_BLOBS)]
    for path in junk:
        path.write_bytes(os.urandom(1 << 20))
    before = names_of(shared, "tiny")
    only_schedulable(shared.kube, node_b, node_a)
    shared.kube.kubectl("scale", "iep/tiny", "-n", shared.namespace, "--replicas=2")
    runs, removed = 0, 0
    while (restored := restored_on(shared, "tiny", node_b, before)) is None:
        report_ = gc_in_agent(shared, node_a, "--blob-grace", "0")
        assert report_["errors"] == [], report_["errors"]
        runs, removed = runs + 1, removed + len(report_["removed_blobs"])
        assert runs < 200, "no replica restored on B"
    assert runs >= 1 and removed == JUNK_BLOBS, (runs, removed)
    assert not any(path.exists() for path in junk)
    assert answer_of(shared, restored) == shared.answer
    shared.counts["gc runs during B's restore"] = runs
    shared.wait(lambda: all_ready(shared), "every replica Ready")
    assert_nothing_half_written(shared)


def test_a_agent_killed_mid_publish_while_b_restores(
    shared: SharedStore, chart_image: str, host_python: HostPython, models: Path
) -> None:
    """A capture on A reaches its publish (hashed, its `snapshot/` made) and waits for the store's lock,
    held exclusively here as another node's GC would; A's agent is SIGKILLed there while B restores, and
    its pod force-deleted. B's replica restores, the next agent on A removes the dead publish's staging as
    it starts (its GC, before any cleanup interval), nothing of it is listed, no lock is held by the dead
    agent, B's GC returns, and the endpoint's next capture publishes."""
    node_a, node_b = shared.nodes
    wait, store = shared.wait, shared.store
    only_schedulable(shared.kube, node_a, node_b)
    cgroups = agent_cgroups(shared.kube, shared.namespace, node_a)
    apply_either(shared, "tiny-c", chart_image, host_python, models)
    wait(lambda: scheduled_on(shared, "tiny-c", node_a), "tiny-c's capture pod bound to A")
    # Polled finely: the lock must be held before the capture, seconds long here, reaches its publish.
    dumping = poll(shared, lambda: next(iter(staging(shared)), None), "A's capture making its staging")
    before = names_of(shared, "tiny-b")
    with _exclusive_lock(store):
        only_schedulable(shared.kube, node_b, node_a)
        shared.kube.kubectl("scale", "iep/tiny-b", "-n", shared.namespace, "--replicas=2")
        wait(lambda: (dumping / "snapshot").is_dir() or not dumping.exists(), "A's publish waiting")
        assert (dumping / "snapshot").is_dir(), f"{dumping.name} was published before the lock was held"
        assert any(not granted for _, granted in lock_holders(store)), lock_holders(store)
        kill_agent(cgroups)
    assert (dumping / "snapshot").is_dir()  # the dead publish left it half-written
    assert_no_dead_lock_holder(shared)

    # The dead agent's pod force-deleted too: the next agent on A is another pod (another hostname).
    killed = agent_pod(shared, node_a)["metadata"]["name"]
    shared.kube.kubectl("delete", "pod", "-n", shared.namespace, killed, "--force", "--grace-period=0")

    restored = wait(lambda: restored_on(shared, "tiny-b", node_b, before), "tiny-b restored on B")
    assert answer_of(shared, restored) == shared.answer
    wait(lambda: _replaced_and_ready(shared, node_a, killed), "A's next agent running")
    wait(lambda: not dumping.exists(), "the dead publish's staging removed by A's next agent as it starts")
    assert gc_in_agent(shared, node_a)["errors"] == []
    assert gc_in_agent(shared, node_b)["errors"] == []
    assert_no_dead_lock_holder(shared)

    snap = wait(lambda: settled(shared, "tiny-c"), "tiny-c's next capture Ready")
    assert snap["status"]["snapshotId"] in store_ids(shared)
    shared.kube.kubectl("uncordon", node_a.name)
    wait(lambda: all_ready(shared), "every replica Ready")
    assert_nothing_half_written(shared)
    shared.counts["agents killed mid-publish"] = 1


def _replaced_and_ready(shared: SharedStore, node: RealNode, killed: str) -> bool:
    with contextlib.suppress(StopIteration):
        pod = agent_pod(shared, node)
        return pod["metadata"]["name"] != killed and ready(pod) and "deletionTimestamp" not in pod["metadata"]
    return False


def _exclusive_lock(store: SnapshotStore) -> contextlib.AbstractContextManager[None]:
    """The store's lock held exclusively from the machine, as the store's GC holds it."""
    return store.layout.lock(exclusive=True)


def test_the_volume_full_during_a_capture_fails_it_truthfully_and_the_next_one_publishes(
    shared: SharedStore, chart_image: str, host_python: HostPython, models: Path
) -> None:
    """The volume filled (a file takes all but LEFT_FREE bytes) while an endpoint captures: the capture fails
    saying the disk is full, leaves nothing, the replica serves cold; with the space back, the retried
    capture publishes."""
    wait = shared.wait
    filler = shared.mount / "filler"
    free = os.statvfs(shared.mount)
    with filler.open("wb") as file:
        os.posix_fallocate(file.fileno(), 0, free.f_bavail * free.f_frsize - LEFT_FREE)
    try:
        apply_either(shared, "tiny-d", chart_image, host_python, models)
        failed = wait(lambda: _capture_failure(shared, "tiny-d"), "tiny-d's capture failed")
        assert "No space left on device" in failed, failed
        wait(lambda: staging(shared) == [], "the failed capture's staging gone")
        assert ready_snapshot(shared.kube, shared.namespace, "tiny-d") is None
        cold = wait(lambda: next((p for p in pods_of(shared, "tiny-d", L.ROLE_COLD) if ready(p)), None),
                    "tiny-d's cold replica Ready")  # fmt: skip
        assert answer_of(shared, cold) == shared.answer
    finally:
        filler.unlink(missing_ok=True)
    shared.counts["captures on a full volume"] = 1
    snap = wait(lambda: settled(shared, "tiny-d"), "tiny-d's snapshot Ready once space is back")
    assert snap["status"]["snapshotId"] in store_ids(shared)
    wait(lambda: all_ready(shared), "every replica Ready")
    assert_nothing_half_written(shared)
    assert_no_dead_lock_holder(shared)


def _capture_failure(shared: SharedStore, name: str) -> str | None:
    """The message of the first CaptureFailed Event of the endpoint's snapshots, None before one."""
    for snap in items(shared.kube, "isnap", shared.namespace, f"{L.ENDPOINT_LABEL}={name}"):
        for event in events_of(shared.kube, shared.namespace, snap["metadata"]["name"]):
            if event["reason"] == "CaptureFailed":
                return str(event.get("message", ""))
    return None
