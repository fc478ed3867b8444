"""Snapshots on every node, end to end: two real nodes, the chart's agent on both, an S3-compatible object
store (Versity's gateway) as the cluster's store. A snapshot captured on node A is pushed before it is Ready;
a replica scheduled on node B pulls it into B's cache, verifies it and restores, and answers through the
Service as the cold replica does. With the object store stopped, B's replica starts cold within a bound, the
Events say why and B's cache holds nothing half-written; started again, the next replica restores. With
pre-staging, B holds the snapshot before its replica arrives and the restore reads nothing remote.

Which node a replica lands on is the scheduler's, steered as an operator would: by cordoning the other node.
The model files are on storage both nodes mount at the same path, as a shared model cache is on a cluster.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from control_plane import s3
from control_plane.cluster import ControlPlane
from control_plane.node import RealNode
from endpoint_flow import (
    CHART,
    ENDPOINT,
    RELEASE,
    Answer,
    agent_store,
    chart_values,
    client_pod,
    completion,
    endpoint,
    events_of,
    get,
    pod_url,
    ready_snapshot,
    ready_workers,
    service_url,
    store_on_node,
    uninstall,
    waiter,
    worker_pods,
)
from node_plugin import HostPython
from two_nodes import (
    BUCKET,
    on_either_node,
    only_schedulable,
    pulled,
    restart_object_store,
    start_object_store,
    use_object_store,
)

from warmstart.api import labels as L
from warmstart.snapshot.remote.object_keys import Keys
from warmstart.snapshot.store import SnapshotStore

pytestmark = pytest.mark.spawns

PULL_BOUND = 120.0  # the agent's pull timeout and the client's retries, with room for a loaded machine


@pytest.fixture(scope="module")
def object_store(real_node: RealNode, tmp_path_factory: pytest.TempPathFactory) -> Iterator[s3.S3Server]:
    if not s3.is_cached():
        pytest.skip(f"no S3 server built ({s3.server_path()}): run `hack/control-plane build`")
    server = start_object_store(real_node, tmp_path_factory.mktemp("s3"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def release(
    kube: ControlPlane,
    real_node: RealNode,
    second_node: RealNode,
    object_store: s3.S3Server,
    chart_image: str,
    namespace: str,
) -> Iterator[str]:
    """The chart with an agent on each node, the object store as the cluster's store; the operator on A."""
    store = store_on_node(namespace)
    values = chart_values(chart_image, real_node, namespace, store)
    use_object_store(kube, values, object_store, namespace)
    kube.helm(
        "install", RELEASE, str(CHART), "-n", namespace, "-f", "-", input=json.dumps(values), timeout=120
    )
    try:
        yield store
    finally:
        uninstall(kube, namespace)


def event_reasons(kube: ControlPlane, namespace: str, pod: dict[str, Any]) -> dict[str, str]:
    return {e["reason"]: e.get("message", "") for e in events_of(kube, namespace, pod["metadata"]["name"])}


def assert_no_half_snapshot(store: SnapshotStore) -> None:
    assert store.list() == [], [s.id for s in store.list()]
    for directory in (store.snapshots_dir, store.staging_dir):
        assert not directory.exists() or list(directory.iterdir()) == [], list(directory.iterdir())


def settled_snapshot(kube: ControlPlane, namespace: str) -> dict[str, Any] | None:
    """The endpoint's Ready InferenceSnapshot once no capture pod is left: while one runs, what the snapshot
    records can still change (once, under a loaded machine's full suite, a Ready snapshot went back to
    Capturing and was captured again)."""
    snap = ready_snapshot(kube, namespace)
    return snap if snap is not None and not worker_pods(kube, namespace, L.ROLE_CAPTURE) else None


def capture_on_a(
    kube: ControlPlane,
    namespace: str,
    nodes: tuple[RealNode, RealNode],
    chart_image: str,
    host_python: HostPython,
    models: Path,
    prestage: str = "None",
) -> tuple[str, Answer, str]:
    """The endpoint's capture on A alone; (the snapshot's id, the captured replica's answer, the Service's
    URL) once its InferenceSnapshot is Ready, which it turns only once pushed to the object store."""
    node_a, node_b = nodes
    wait = waiter(kube, namespace)
    kube.kubectl("apply", "-f", "-", input=client_pod(namespace, chart_image, node_a))
    only_schedulable(kube, node_a, node_b)
    body = on_either_node(endpoint(ENDPOINT, namespace, chart_image, node_a, host_python, None), models)
    body["spec"]["snapshot"]["prestage"] = prestage
    kube.kubectl("apply", "-f", "-", input=json.dumps(body))
    snap = wait(lambda: settled_snapshot(kube, namespace), "the InferenceSnapshot Ready, no capture pod left")
    assert snap["status"]["node"] == node_a.name, snap["status"]
    snapshot_id = snap["status"]["snapshotId"]
    url = service_url(kube, namespace, ENDPOINT)
    answer = wait(lambda: completion(kube, namespace, url), "a completion from the captured replica")
    return snapshot_id, answer, url


def replicas_on(kube: ControlPlane, namespace: str, node: RealNode, event: str) -> list[dict[str, Any]]:
    """Restore-role pods on `node` with an Event of reason `event`."""
    pods = worker_pods(kube, namespace, L.ROLE_RESTORE)
    pods = [pod for pod in pods if pod["spec"].get("nodeName") == node.name]
    return [pod for pod in pods if event in event_reasons(kube, namespace, pod)]


def ready_and_restored(kube: ControlPlane, namespace: str, node: RealNode) -> dict[str, Any] | None:
    """A Ready replica on `node` that the agent restored, None while there is none."""
    ready = {pod["metadata"]["name"]: pod for pod in ready_workers(kube, namespace, L.ROLE_RESTORE)}
    names = [pod["metadata"]["name"] for pod in replicas_on(kube, namespace, node, "Restored")]
    return next((ready[name] for name in names if name in ready), None)


@pytest.fixture
def models(tmp_path: Path) -> Path:
    """The model cache both nodes mount at the same path (the restored engine maps its files again)."""
    directory = tmp_path / "models"
    directory.mkdir()
    return directory


@pytest.fixture
def nodes(
    kube: ControlPlane, real_node: RealNode, second_node: RealNode
) -> Iterator[tuple[RealNode, RealNode]]:
    try:
        yield real_node, second_node
    finally:
        kube.kubectl("uncordon", real_node.name, second_node.name, check=False)


@pytest.mark.integration
def test_captured_on_one_node_restored_on_the_other_through_the_object_store_and_cold_while_it_is_down(
    kube: ControlPlane,
    nodes: tuple[RealNode, RealNode],
    object_store: s3.S3Server,
    chart_image: str,
    host_python: HostPython,
    namespace: str,
    release: str,
    models: Path,
) -> None:
    node_a, node_b = nodes
    wait = waiter(kube, namespace)
    snapshot_id, answer, url = capture_on_a(kube, namespace, nodes, chart_image, host_python, models)
    manifest = object_store.data_dir / BUCKET / Keys(f"{namespace}/").manifest(snapshot_id)
    assert manifest.is_file(), f"{manifest} not in the bucket once the snapshot is Ready"
    b_cache = agent_store(node_b, namespace)

    # The object store down: B's replica is refused within a bound and starts cold; B's cache stays clean.
    object_store.stop()
    only_schedulable(kube, node_b, node_a)
    kube.kubectl("scale", f"iep/{ENDPOINT}", "-n", namespace, "--replicas=2")
    refused = wait(lambda: replicas_on(kube, namespace, node_b, "RestoreRefused"),
                   "B's replica refused, the object store down", timeout=PULL_BOUND + 60)[0]  # fmt: skip
    name = refused["metadata"]["name"]
    reason = event_reasons(kube, namespace, refused)["RestoreRefused"]
    assert "object store" in reason and "starts cold" in reason, reason
    cold = wait(lambda: next((p for p in ready_workers(kube, namespace, L.ROLE_RESTORE)
                              if p["metadata"]["name"] == name), None), "B's cold replica Ready")  # fmt: skip
    assert completion(kube, namespace, pod_url(cold)) == answer
    assert_no_half_snapshot(b_cache)

    # Started again: the next replica on B pulls, verifies and restores.
    restart_object_store(object_store, node_a)
    kube.kubectl("delete", "pod", "-n", namespace, name, "--wait=false")
    restored = wait(
        lambda: ready_and_restored(kube, namespace, node_b), "a replica restored on B from the object store"
    )
    assert completion(kube, namespace, pod_url(restored)) == answer
    assert [snapshot.id for snapshot in b_cache.list()] == [snapshot_id]
    assert pulled(kube, namespace, node_b, "restore") > 0
    for _ in range(3):  # through the Service, whichever replica answers
        assert completion(kube, namespace, url) == answer


@pytest.mark.integration
def test_with_prestaging_the_other_node_holds_the_snapshot_before_its_replica_and_reads_nothing_remote(
    kube: ControlPlane,
    nodes: tuple[RealNode, RealNode],
    chart_image: str,
    host_python: HostPython,
    namespace: str,
    release: str,
    models: Path,
) -> None:
    node_a, node_b = nodes
    wait = waiter(kube, namespace)
    snapshot_id, answer, _url = capture_on_a(kube, namespace, nodes, chart_image, host_python, models,
                                             prestage="PageCache")  # fmt: skip
    b_cache = agent_store(node_b, namespace)
    wait(
        lambda: [s.id for s in b_cache.list()] == [snapshot_id],
        "B's cache holding the snapshot, no replica there",
    )
    prestaged = pulled(kube, namespace, node_b, "prestage")
    assert prestaged > 0

    only_schedulable(kube, node_b, node_a)
    kube.kubectl("scale", f"iep/{ENDPOINT}", "-n", namespace, "--replicas=2")
    restored = wait(lambda: ready_and_restored(kube, namespace, node_b), "a replica restored on B")
    assert completion(kube, namespace, pod_url(restored)) == answer
    assert pulled(kube, namespace, node_b, "restore") == 0
    assert pulled(kube, namespace, node_b, "prestage") == prestaged


def tamper_in_bucket(server: s3.S3Server, cache: SnapshotStore, namespace: str, snapshot_id: str) -> None:
    """Overwrite one byte in the middle of the snapshot's largest blob object in the bucket (same size)."""
    snapshot = cache.get(snapshot_id)
    entry = max(snapshot.files.values(), key=lambda file: file.size)
    path = server.data_dir / BUCKET / Keys(f"{namespace}/").blob(entry.digest)
    with path.open("r+b") as blob:
        blob.seek(entry.size // 2)
        byte = blob.read(1)
        blob.seek(-1, 1)
        blob.write(bytes([byte[0] ^ 0xFF]))


def condition(kube: ControlPlane, namespace: str, kind: str) -> dict[str, Any]:
    body = get(kube, "iep", namespace, ENDPOINT) or {}
    return next((c for c in body.get("status", {}).get("conditions", []) if c["type"] == kind), {})


@pytest.mark.integration
def test_a_bucket_copy_tampered_in_place_is_counted_until_invalid_and_the_recapture_restores(
    kube: ControlPlane,
    nodes: tuple[RealNode, RealNode],
    object_store: s3.S3Server,
    chart_image: str,
    host_python: HostPython,
    namespace: str,
    release: str,
    models: Path,
) -> None:
    """One blob object overwritten in place: each replica on B (no cached copy) is refused by its pull and
    starts cold, each refusal is counted, the endpoint says so, the third makes the snapshot Invalid, the
    operator captures a new one, and the next replica restores from it."""
    node_a, node_b = nodes
    wait = waiter(kube, namespace)
    snapshot_id, answer, _url = capture_on_a(kube, namespace, nodes, chart_image, host_python, models)
    first = ready_snapshot(kube, namespace)
    assert first is not None
    tamper_in_bucket(object_store, agent_store(node_a, namespace), namespace, snapshot_id)

    only_schedulable(kube, node_b, node_a)
    kube.kubectl("scale", f"iep/{ENDPOINT}", "-n", namespace, "--replicas=3")
    name = first["metadata"]["name"]

    def refused_on_b(count: int) -> list[dict[str, Any]] | None:
        found = replicas_on(kube, namespace, node_b, "RestoreFailed")
        return found if len(found) >= count else None

    def isnap_where(check: Any) -> dict[str, Any] | None:
        snap = get(kube, "isnap", namespace, name)
        return snap if snap is not None and check(snap["status"]) else None

    def degraded_by_refusals() -> dict[str, Any] | None:
        found = condition(kube, namespace, "Degraded")
        return found if found.get("reason") == "RestoreRefused" else None

    refused = wait(
        lambda: refused_on_b(2), "two replicas on B refused by their pulls", timeout=PULL_BOUND + 60
    )
    reason = event_reasons(kube, namespace, refused[0])["RestoreFailed"]
    assert "object store" in reason and "tampered" in reason, reason
    counted = wait(lambda: isnap_where(lambda st: st.get("restoreFailures", 0) >= 2), "two refusals counted")
    assert "tampered" in counted["status"]["restoreFailureMessage"]
    degraded = wait(degraded_by_refusals, "the endpoint saying its replicas were refused")
    assert degraded["status"] == "True" and "object store" in degraded["message"], degraded
    assert not agent_store(node_b, namespace).list()

    # One more refusal (a replacement on B pulls again): Invalid, a new capture, a replica restored from it.
    kube.kubectl("delete", "pod", "-n", namespace, refused[0]["metadata"]["name"], "--wait=false")
    invalid = wait(
        lambda: isnap_where(lambda st: st.get("phase") == "Invalid"), "Invalid", timeout=PULL_BOUND + 120
    )
    assert invalid["status"]["restoreFailures"] >= 3, invalid["status"]

    def new_snapshot() -> dict[str, Any] | None:
        snap = settled_snapshot(kube, namespace)
        return snap if snap is not None and snap["metadata"]["name"] != name else None

    def restored_from(snapshot: str) -> dict[str, Any] | None:
        pod = ready_and_restored(kube, namespace, node_b)
        return (
            pod if pod is not None and pod["metadata"]["labels"].get(L.SNAPSHOT_LABEL) == snapshot else None
        )

    fresh = wait(new_snapshot, "a new snapshot Ready")
    restored = wait(
        lambda: restored_from(fresh["metadata"]["name"]), "a replica on B restored from the new one"
    )
    assert completion(kube, namespace, pod_url(restored)) == answer
