"""The product end to end on the real node: `helm install` of the chart (the project's image), an
InferenceEndpoint of the builtin engine on CPU, a capture pod the agent DaemonSet checkpoints, and replicas
the agent restores into real pods, answering through the Service exactly as a cold pod does.

Nothing plays a part here: the operator and the agent run in their pods from the chart, the workers are
containers the kubelet starts, and every status is written by its owner. The workers run the chart's image
with this test run's Python environment mounted in (`template.volumes`), as a user mounts a model cache:
an image with torch would take a CI run minutes to build.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from control_plane.cluster import ControlPlane, wait_for
from control_plane.node import RealNode
from endpoint_flow import (
    COLD_ENDPOINT,
    ENDPOINT,
    RELEASE,
    START_TIMEOUT,
    agent_store,
    all_events,
    apply_endpoint,
    client_pod,
    completion,
    endpoint,
    events_of,
    get,
    install,
    items,
    pod_url,
    ready,
    ready_snapshot,
    ready_workers,
    service_url,
    tamper,
    uninstall,
    waiter,
    worker_pods,
)
from node_plugin import HostPython

from warmstart.agent import objects
from warmstart.agent.cri import ContainerRuntime
from warmstart.api import labels as L
from warmstart.api.snapshot import MAX_RESTORE_FAILURES
from warmstart.checkpoint import hugepages
from warmstart.snapshot import residency
from warmstart.snapshot.signing import load_verifier

pytestmark = pytest.mark.spawns

THP_MODE = hugepages.current_mode() if hugepages.THP_ENABLED.exists() else ""  # "": the chart's default


@pytest.fixture
def release(kube: ControlPlane, real_node: RealNode, chart_image: str, namespace: str) -> Iterator[str]:
    """The chart installed into the test's namespace; returns the agent's store directory on the node. The
    agent selects the node's transparent huge pages mode, the one it has: the machine stays as it is, and
    the agent must still be able to write it."""
    store = install(kube, chart_image, real_node, namespace, agent={"transparentHugepages": THP_MODE})
    try:
        yield store
    finally:
        uninstall(kube, namespace)


@pytest.mark.integration
def test_helm_install_capture_and_restore_replicas_on_the_real_node(
    kube: ControlPlane,
    real_node: RealNode,
    chart_image: str,
    host_python: HostPython,
    namespace: str,
    release: str,
) -> None:
    kube.kubectl("apply", "-f", "-", input=client_pod(namespace, chart_image, real_node))
    for name, snapshots in ((COLD_ENDPOINT, False), (ENDPOINT, True)):
        body = endpoint(name, namespace, chart_image, real_node, host_python, snapshots)
        kube.kubectl("apply", "-f", "-", input=json.dumps(body))

    wait = waiter(kube, namespace)

    # The reference: the same model cold-started by an endpoint without snapshots, through its Service.
    wait(lambda: any(ready(p) for p in worker_pods(kube, namespace, L.ROLE_COLD, COLD_ENDPOINT)),
         "the cold endpoint's replica Ready")  # fmt: skip
    cold_url = service_url(kube, namespace, COLD_ENDPOINT)
    cold_answer = wait(lambda: completion(kube, namespace, cold_url), "a completion from the cold replica")

    # The capture pod is checkpointed by the agent; the snapshot records the runtime identity it measured.
    snap = wait(lambda: ready_snapshot(kube, namespace), "the InferenceSnapshot Ready")
    identity = snap["status"]["identity"]
    assert identity["image"].startswith("sha256:") or "@sha256:" in identity["image"], identity
    assert identity["engine"] == "builtin" and identity["model_digest"], identity
    # A capture that went as planned says nothing alarming: no probe of its pod failed while it was dumped.
    warnings = json.loads(kube.kubectl("get", "events", "-n", namespace, "--field-selector", "type=Warning",
                                       "-o", "json").stdout)["items"]  # fmt: skip
    capture_pod = f"{snap['metadata']['name']}-capture-"
    unhealthy = [e["message"] for e in warnings if e["involvedObject"]["name"].startswith(capture_pod)
                 and e["reason"] == "Unhealthy"]  # fmt: skip
    assert not unhealthy, unhealthy

    kube.kubectl("scale", f"iep/{ENDPOINT}", "-n", namespace, "--replicas=2")
    restored = wait(
        lambda: (pods := ready_workers(kube, namespace, L.ROLE_RESTORE)) and len(pods) == 2 and pods,
        "two restore replicas Ready",
    )  # fmt: skip
    runtime = ContainerRuntime(real_node.containerd_socket)  # the agent asks it (chart: agent.criSocket)
    for pod in restored:
        # The runtime's word on the image is the kubelet's, which the snapshot recorded at capture.
        uid, reported = pod["metadata"]["uid"], objects.worker_image_id(pod)
        assert runtime.container_image(uid, L.WORKER_CONTAINER) == reported == identity["image"], reported
        assert runtime.container_image(uid, "no-such-container") == ""
        events = events_of(kube, namespace, pod["metadata"]["name"])
        reasons = {event["reason"] for event in events}
        assert "Restored" in reasons, (pod["metadata"]["name"], reasons)
        assert "RestoreRefused" not in reasons and "RestoreFailed" not in reasons, reasons
        # The Event names what `kubectl get isnap` shows: the InferenceSnapshot, and its store id (-o wide).
        said = next(event["message"] for event in events if event["reason"] == "Restored")
        assert snap["metadata"]["name"] in said and snap["status"]["snapshotId"] in said, said
        assert completion(kube, namespace, pod_url(pod)) == cold_answer
        # No snapshot store in a worker: neither other engines' snapshots nor a key.
        kube.kubectl(
            "exec", "-n", namespace, pod["metadata"]["name"], "--", "test", "!", "-e", L.STORE_MOUNT_PATH
        )
    agent_logs = kube.kubectl("logs", "-n", namespace, "-l", "app.kubernetes.io/component=agent", "--tail=-1")
    assert "workers' images: from the container runtime at" in agent_logs.stdout, agent_logs.stdout
    if THP_MODE:
        assert f"transparent huge pages on this node: {THP_MODE}" in agent_logs.stdout, agent_logs.stdout
    for fallback in ("no container runtime socket", "no image from the container runtime"):
        assert fallback not in agent_logs.stdout, agent_logs.stdout  # the agent asked the runtime itself
    wide = kube.kubectl("get", "isnap", snap["metadata"]["name"], "-n", namespace, "-o", "wide").stdout
    assert snap["status"]["snapshotId"] in wide, wide
    assert not worker_pods(kube, namespace, L.ROLE_COLD), "the cold replica was replaced"
    url = service_url(kube, namespace, ENDPOINT)
    assert wait(lambda: completion(kube, namespace, url), "a completion through the Service") == cold_answer
    for _ in range(3):  # through the Service, whichever replica answers
        assert completion(kube, namespace, url) == cold_answer


@pytest.mark.integration
def test_a_tampered_snapshot_is_refused_the_replicas_start_cold_and_it_goes_invalid(
    kube: ControlPlane,
    real_node: RealNode,
    chart_image: str,
    host_python: HostPython,
    namespace: str,
    release: str,
) -> None:
    wait = waiter(kube, namespace)
    kube.kubectl("apply", "-f", "-", input=client_pod(namespace, chart_image, real_node))
    apply_endpoint(kube, namespace, chart_image, real_node, host_python)
    snap = wait(lambda: ready_snapshot(kube, namespace), "the InferenceSnapshot Ready")
    good = wait(lambda: ready_workers(kube, namespace, L.ROLE_RESTORE), "a restored replica")
    reference = completion(kube, namespace, pod_url(good[0]))

    store = agent_store(real_node, namespace)
    tamper(store, snap["status"]["snapshotId"])
    kube.kubectl("scale", f"iep/{ENDPOINT}", "-n", namespace, f"--replicas={1 + MAX_RESTORE_FAILURES}")
    name = snap["metadata"]["name"]
    invalid = wait(
        lambda: (s := get(kube, "isnap", namespace, name)) and s["status"].get("phase") == "Invalid" and s,
        "the tampered snapshot Invalid",
    )
    assert "sha256" in json.dumps(invalid["status"]).lower(), invalid["status"]
    assert "Invalid" in {event["reason"] for event in events_of(kube, namespace, name)}
    failed = [e for e in all_events(kube, namespace) if e["reason"] == "RestoreFailed"]
    assert len(failed) >= MAX_RESTORE_FAILURES and all("sha256" in e["message"] for e in failed), failed

    # The endpoint heals: a new capture, and every replica restored from it, with the same answers.
    def healed() -> list[dict[str, Any]] | None:
        snap_now = (get(kube, "iep", namespace, ENDPOINT) or {}).get("status", {}).get("currentSnapshot")
        pods = ready_workers(kube, namespace, L.ROLE_RESTORE)
        labelled = [p for p in pods if p["metadata"]["labels"].get(L.SNAPSHOT_LABEL) == snap_now]
        return (
            labelled if snap_now not in (None, name) and len(labelled) == 1 + MAX_RESTORE_FAILURES else None
        )

    for pod in wait(healed, "every replica restored from a new snapshot"):
        assert all(s["restartCount"] == 0 for s in pod["status"]["containerStatuses"]), "no crash loop"
        assert completion(kube, namespace, pod_url(pod)) == reference


REPORT = L.STATUS_ANNOTATION


def overwrite_model(node: RealNode, namespace: str) -> Path:
    """Change the model's weights in place, keeping the file's size and header: its last bytes reversed in
    4-byte units (still valid numbers), where the restore pods' cheap fingerprint of it reads."""
    models = node.shadow("/var/lib/warmstart") / namespace / "models"
    path = max(models.rglob("*.safetensors"), key=lambda p: p.stat().st_size)
    path.chmod(path.stat().st_mode | 0o200)
    with path.open("r+b") as weights:
        weights.seek(-256, 2)
        tail = weights.read(256)
        changed = b"".join(tail[i : i + 4] for i in range(len(tail) - 4, -1, -4))
        assert changed != tail, "the model's last bytes read the same reversed"
        weights.seek(-256, 2)
        weights.write(changed)
    return path


@pytest.mark.integration
def test_a_model_changed_in_place_is_refused_then_captured_again_and_restored_from_the_new_snapshot(
    kube: ControlPlane,
    real_node: RealNode,
    chart_image: str,
    host_python: HostPython,
    namespace: str,
    release: str,
) -> None:
    """The model file under a Ready snapshot is overwritten (same size): the next replica is refused and
    starts cold, nothing is counted against the snapshot, the operator retires it (Stale) and captures what
    the pods hold now, and the replicas restore from the new snapshot; SnapshotReady says so at each step."""
    wait = waiter(kube, namespace)
    apply_endpoint(kube, namespace, chart_image, real_node, host_python)
    snap = wait(lambda: ready_snapshot(kube, namespace), "the InferenceSnapshot Ready")
    old = snap["metadata"]["name"]
    wait(lambda: ready_workers(kube, namespace, L.ROLE_RESTORE), "a restored replica")
    seen: list[tuple[str, str, str]] = []  # SnapshotReady's (status, reason, message), each change

    def snapshot_ready() -> dict[str, Any]:
        status = (get(kube, "iep", namespace, ENDPOINT) or {}).get("status") or {}
        found = next((c for c in status.get("conditions") or [] if c["type"] == "SnapshotReady"), {})
        now = (found.get("status", ""), found.get("reason", ""), found.get("message", ""))
        if not seen or seen[-1] != now:
            seen.append(now)
        return status

    wait(lambda: snapshot_ready().get("currentSnapshot") == old, "the endpoint restoring from the snapshot")
    path = overwrite_model(real_node, namespace)
    kube.kubectl("scale", f"iep/{ENDPOINT}", "-n", namespace, "--replicas=2")

    def refused_pods() -> list[dict[str, Any]]:
        snapshot_ready()
        pods = worker_pods(kube, namespace, L.ROLE_RESTORE)
        return [p for p in pods if "changed content" in p["metadata"].get("annotations", {}).get(REPORT, "")]

    refused = wait(refused_pods, "the new replica refused")[0]
    report = json.loads(refused["metadata"]["annotations"][REPORT])
    assert f"{path.name} changed content since the snapshot" in report["restoreFailed"], report
    assert report["refused"] == "ModelChanged" and len(report["factsDigest"]) == 64, report
    messages = [e["message"] for e in events_of(kube, namespace, refused["metadata"]["name"])
                if e["reason"] == "RestoreRefused"]  # fmt: skip
    assert messages and "the worker starts cold" in messages[0], messages

    def retired() -> dict[str, Any] | None:
        snapshot_ready()
        found = get(kube, "isnap", namespace, old) or {}
        return found if found.get("status", {}).get("phase") == "Stale" else None

    stale = wait(retired, "the snapshot Stale")
    assert stale["status"]["staleReason"] == "ModelChanged", stale["status"]
    assert not stale["status"].get("restoreFailures"), "the pod's change is not the snapshot's failure"

    def restored_from_a_new_snapshot() -> list[dict[str, Any]] | None:
        current = snapshot_ready().get("currentSnapshot")
        pods = [p for p in ready_workers(kube, namespace, L.ROLE_RESTORE)
                if p["metadata"]["labels"].get(L.SNAPSHOT_LABEL) == current]  # fmt: skip
        return pods if current not in (None, old) and len(pods) == 2 else None

    for pod in wait(restored_from_a_new_snapshot, "both replicas restored from a new snapshot"):
        reasons = {e["reason"] for e in events_of(kube, namespace, pod["metadata"]["name"])}
        assert "Restored" in reasons and "RestoreRefused" not in reasons, reasons
    new = snapshot_ready()["currentSnapshot"]

    # What SnapshotReady said: restoring from the old snapshot, the change and the capture, the new one.
    steps = [(status, reason) for status, reason, _ in seen]
    first = steps.index(("True", "SnapshotReady"))
    changed = steps.index(("False", "ModelChanged"), first)
    assert ("True", "SnapshotReady") in steps[changed:], seen
    assert old in seen[first][2] and f"capturing {new}" in seen[changed][2], seen
    assert f"{path.name} changed content" in seen[changed][2], seen
    assert seen[-1][:2] == ("True", "SnapshotReady") and new in seen[-1][2], seen
    endpoint_events = [e for e in events_of(kube, namespace, ENDPOINT) if e["reason"] == "ModelChanged"]
    assert len(endpoint_events) == 1 and old in endpoint_events[0]["message"], endpoint_events
    snapshots = items(kube, "isnap", namespace, f"{L.ENDPOINT_LABEL}={ENDPOINT}")
    assert sorted(s["metadata"]["name"] for s in snapshots) == sorted([old, new]), "one capture per change"


@pytest.mark.integration
def test_a_restore_pod_in_another_namespace_is_refused_and_starts_cold(
    kube: ControlPlane,
    real_node: RealNode,
    chart_image: str,
    host_python: HostPython,
    namespace: str,
    release: str,
) -> None:
    """A tenant of another namespace copies the endpoint, its InferenceSnapshot with the Ready status (as one
    allowed to write statuses there could) and a restore pod owned by that endpoint (the operator does not
    watch that namespace): the agent restores nothing captured elsewhere, and says so."""
    wait = waiter(kube, namespace)
    apply_endpoint(kube, namespace, chart_image, real_node, host_python)
    snap = wait(lambda: ready_snapshot(kube, namespace), "the InferenceSnapshot Ready")

    def restore_template() -> dict[str, Any] | None:
        # The operator turns the Deployment to restores after it sees the snapshot Ready, a moment later.
        template = get(kube, "deployment", namespace, ENDPOINT)["spec"]["template"]
        return template if template["metadata"]["labels"][L.ROLE_LABEL] == L.ROLE_RESTORE else None

    template = wait(restore_template, "the Deployment's pods turned to restores")

    other = f"{namespace[:50]}-other"
    kube.kubectl("create", "namespace", other)
    try:
        kube.wait_default_service_account(other)
        name = snap["metadata"]["name"]
        copy = {"apiVersion": L.API_VERSION, "kind": L.SNAPSHOT_KIND,
                "metadata": {"name": name, "namespace": other}, "spec": snap["spec"]}  # fmt: skip
        kube.kubectl("apply", "-f", "-", input=json.dumps(copy))
        status = json.dumps({"status": snap["status"]})
        kube.kubectl("patch", "isnap", name, "-n", other, "--subresource=status",
                     "--type=merge", "-p", status)  # fmt: skip
        spec = template["spec"]
        source = get(kube, "iep", namespace, ENDPOINT)
        copied_endpoint = {"apiVersion": L.API_VERSION, "kind": L.ENDPOINT_KIND, "spec": source["spec"],
                           "metadata": {"name": ENDPOINT, "namespace": other}}  # fmt: skip
        kube.kubectl("apply", "-f", "-", input=json.dumps(copied_endpoint))
        owner = get(kube, "iep", other, ENDPOINT)
        reference = {"apiVersion": L.API_VERSION, "kind": L.ENDPOINT_KIND, "name": ENDPOINT,
                     "uid": owner["metadata"]["uid"]}  # fmt: skip
        metadata = {"name": "intruder", "namespace": other, "labels": template["metadata"]["labels"],
                    "ownerReferences": [reference]}  # fmt: skip
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}
        kube.kubectl("apply", "-f", "-", input=json.dumps(pod))
        started = waiter(kube, other)(lambda: (p := get(kube, "pod", other, "intruder")) and ready(p) and p,
                                      "the copied pod Ready after a cold start")  # fmt: skip
        events = events_of(kube, other, "intruder")
        refused = [e["message"] for e in events if e["reason"] == "RestoreRefused"]
        assert refused and "another namespace" in refused[0], [e["message"] for e in events]
        assert "Restored" not in {e["reason"] for e in events}
        assert all(s["restartCount"] == 0 for s in started["status"]["containerStatuses"])
    finally:
        kube.kubectl("delete", "namespace", other, "--wait=false", check=False)


def signing_key(kube: ControlPlane, namespace: str) -> bytes:
    """The chart's signing key, from its Secret (the only place it is kept)."""
    secret = get(kube, "secret", namespace, f"{RELEASE}-warmstart-signing-key")
    assert secret is not None, "the chart makes the signing key Secret"
    return base64.b64decode(secret["data"]["key"])


def signing_key_file(kube: ControlPlane, namespace: str, directory: Path) -> Path:
    path = directory / "signing.key"
    path.write_bytes(signing_key(kube, namespace))
    path.chmod(0o600)
    return path


def agent_log_says(kube: ControlPlane, namespace: str, text: str) -> bool:
    logs = kube.kubectl("logs", "-n", namespace, "-l", "app.kubernetes.io/component=agent", "--tail=200",
                        check=False)  # fmt: skip
    return text in logs.stdout


@pytest.mark.integration
def test_the_agent_killed_during_a_capture_leaves_no_half_snapshot_and_the_capture_is_retried(
    kube: ControlPlane,
    real_node: RealNode,
    chart_image: str,
    host_python: HostPython,
    namespace: str,
    release: str,
    tmp_path: Path,
) -> None:
    """The agent pod is force-deleted as soon as it starts checkpointing: whatever it had done by then
    (dump, staging, publishing), the store shows only whole, verified snapshots, the attempt ends and the
    DaemonSet's next agent pod captures the endpoint."""
    wait = waiter(kube, namespace)
    apply_endpoint(kube, namespace, chart_image, real_node, host_python)
    wait_for(lambda: agent_log_says(kube, namespace, "capturing pid"), timeout=START_TIMEOUT, interval=0.2,
             message="the agent starting a capture")  # fmt: skip
    kube.kubectl("delete", "pod", "-n", namespace, "-l", "app.kubernetes.io/component=agent",
                 "--grace-period=0", "--force")  # fmt: skip

    snap = wait(lambda: ready_snapshot(kube, namespace), "the InferenceSnapshot Ready")
    store = agent_store(real_node, namespace)
    verifier = load_verifier(signing_key_file(kube, namespace, tmp_path))
    published = [s.id for s in store.list()]
    assert snap["status"]["snapshotId"] in published
    for snapshot_id in published:
        store.verify(snapshot_id, verifier)  # raises on anything partial or altered
    wait(lambda: ready_workers(kube, namespace, L.ROLE_RESTORE), "a restored replica")


@pytest.mark.integration
def test_a_link_the_tenant_puts_where_the_engine_log_was_brings_nothing_of_its_target_into_the_store(
    kube: ControlPlane,
    real_node: RealNode,
    chart_image: str,
    host_python: HostPython,
    namespace: str,
    release: str,
    tmp_path: Path,
) -> None:
    """While the capture pod's engine starts, the tenant replaces the log the engine writes to (and keeps
    open) with a link to the agent's signing key, a file only root may read, seen only by the agent: the
    agent reads the engine's open files through their descriptors, never their paths, so not one byte of
    the key reaches a snapshot."""
    wait = waiter(kube, namespace)
    apply_endpoint(kube, namespace, chart_image, real_node, host_python)
    capture = wait(
        lambda: next(iter(items(kube, "pod", namespace, f"{L.ROLE_LABEL}={L.ROLE_CAPTURE}")), None),
        "the capture pod",
    )
    log = (real_node.shadow("/var/lib/kubelet") / "pods" / capture["metadata"]["uid"] / "volumes"
           / "kubernetes.io~empty-dir" / "control" / "logs" / "engine.log")  # fmt: skip
    wait_for(log.exists, timeout=START_TIMEOUT, interval=0.02, message="the engine's log")
    log.unlink()
    log.symlink_to("/etc/warmstart/signing/key")
    snapshots = items(kube, "isnap", namespace, f"{L.ENDPOINT_LABEL}={ENDPOINT}")
    assert not any(s.get("status", {}).get("captureState") for s in snapshots), "planted before the capture"

    snap = wait(lambda: ready_snapshot(kube, namespace), "the InferenceSnapshot Ready")
    key = signing_key(kube, namespace)
    store = agent_store(real_node, namespace)
    snapshot = store.get(snap["status"]["snapshotId"])
    assert not any(path.endswith("engine.log") for path in snapshot.files), "a deleted log is left out"
    for digest in snapshot.manifest.digests():
        assert key not in store.blob_path(digest).read_bytes()
    wait(lambda: ready_workers(kube, namespace, L.ROLE_RESTORE), "a restored replica")


@pytest.mark.integration
def test_prestage_keeps_the_snapshot_and_the_model_in_the_nodes_page_cache(
    kube: ControlPlane,
    real_node: RealNode,
    chart_image: str,
    host_python: HostPython,
    namespace: str,
    release: str,
) -> None:
    """`snapshot.prestage: PageCache`: the agent stages the snapshot's blobs, the operator's unprivileged
    stager pod the model files; dropped from the page cache, both are read back in by their next passes."""
    wait = waiter(kube, namespace)

    def prestaged(spec: dict[str, Any]) -> None:
        spec["snapshot"]["prestage"] = "PageCache"

    apply_endpoint(kube, namespace, chart_image, real_node, host_python, prestaged)
    snap = wait(lambda: ready_snapshot(kube, namespace), "the InferenceSnapshot Ready")
    selector = f"{L.ENDPOINT_LABEL}={ENDPOINT},{L.COMPONENT_LABEL}={L.PRESTAGE_COMPONENT}"
    wait(lambda: [p for p in items(kube, "pod", namespace, selector) if ready(p)], "the model stager running")

    store = agent_store(real_node, namespace)
    blobs = residency.blob_paths(store, [store.get(snap["status"]["snapshotId"])])
    models = real_node.shadow("/var/lib/warmstart") / namespace / "models"
    weights = [path for path in models.rglob("*.safetensors") if path.is_file()]
    assert blobs and weights, (blobs, weights)

    def all_resident() -> bool:
        return all(residency.resident_bytes(path) == path.stat().st_size for path in blobs + weights)

    wait(all_resident, "the snapshot and the model in the page cache")
    for path in blobs + weights:
        residency.evict(path)
    assert not all_resident()
    wait(all_resident, "the snapshot and the model staged again")


@pytest.mark.integration
def test_a_tensor_parallel_endpoint_is_captured_and_restored_with_all_its_ranks(
    kube: ControlPlane,
    real_node: RealNode,
    chart_image: str,
    host_python: HostPython,
    namespace: str,
    release: str,
) -> None:
    """`engine.tensorParallelSize: 2` (gloo on CPU): the agent checkpoints the worker's engine with its second
    rank as one tree, and restores both into a new pod, which answers as the captured replica does."""
    wait = waiter(kube, namespace)
    kube.kubectl("apply", "-f", "-", input=client_pod(namespace, chart_image, real_node))

    def two_ranks(spec: dict[str, Any]) -> None:
        spec["engine"]["tensorParallelSize"] = 2

    apply_endpoint(kube, namespace, chart_image, real_node, host_python, two_ranks)
    snap = wait(lambda: ready_snapshot(kube, namespace), "the InferenceSnapshot Ready")
    assert snap["status"]["identity"]["parallelism"] == 2, snap["status"]["identity"]
    url = service_url(kube, namespace, ENDPOINT)
    reference = wait(lambda: completion(kube, namespace, url), "a completion from the captured replica")

    kube.kubectl("scale", f"iep/{ENDPOINT}", "-n", namespace, "--replicas=2")
    restored = wait(lambda: ready_workers(kube, namespace, L.ROLE_RESTORE), "a restore replica Ready")
    pod = restored[0]
    reasons = {event["reason"] for event in events_of(kube, namespace, pod["metadata"]["name"])}
    assert "Restored" in reasons and "RestoreFailed" not in reasons, reasons
    ranks = kube.kubectl(
        "exec", "-n", namespace, pod["metadata"]["name"], "--", "sh", "-c",
        "grep -l 'warmstart.engines.builtin.paralle[l]' /proc/[0-9]*/cmdline | wc -l",
    ).stdout.strip()  # fmt: skip
    assert ranks == "1", f"the restored pod runs {ranks} rank-1 processes"
    assert completion(kube, namespace, pod_url(pod)) == reference
