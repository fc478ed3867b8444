"""The node agent end to end: a real kube-apiserver (kwok node named like the agent's node), real CRIU, real
workers (builtin engine on CPU) in PID + mount namespaces standing in for the pods' containers.

The test plays the kubelet and the container runtime: it creates pod objects (kwok marks them Running), then
starts each "container" as a sandbox running `warmstart worker` with WARMSTART_POD_UID=<pod uid> and its
control directory bound from where the kubelet keeps the pod's emptyDir (kubelet root = a tmp dir).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import sys
import threading
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from s3_plugin import BUCKET
from support import agent_settings, answers, find_sandbox_pods, free_port, recording_criu_command

from warmstart.agent.agent import Agent
from warmstart.agent.kube_status import KubeStatus
from warmstart.agent.pods import control_dir_on_host
from warmstart.api import labels as L
from warmstart.api.control_dir import READY_FOR_SNAPSHOT, RESTORE_FAILED, ControlDir
from warmstart.api.identity import SnapshotIdentity
from warmstart.api.snapshot import MAX_RESTORE_FAILURES, Phase, SnapshotStatus, derive_phase
from warmstart.checkpoint.restore import FailureCounter
from warmstart.checkpoint.sandbox import Sandbox
from warmstart.operator.children import Owner
from warmstart.operator.request_key import request_key, request_key_hash
from warmstart.operator.snapshots import plan_snapshots
from warmstart.operator.spec import parse_spec
from warmstart.snapshot import generate_hmac_key, load_signer, load_verifier
from warmstart.snapshot.layout import MANIFEST_FILE
from warmstart.snapshot.remote import Credentials, RemoteConfig
from warmstart.snapshot.remote.object_keys import Keys
from warmstart.snapshot.residency import blob_paths, evict, resident_bytes
from warmstart.snapshot.signing_keys import signing_keys
from warmstart.snapshot.store import Snapshot, SnapshotStore

pytestmark = [pytest.mark.integration, pytest.mark.spawns]

NODE = "kwok-gpu-0"
ENDPOINT = "tiny"
ENDPOINT_SPEC = {
    "model": {"uri": "tiny"}, "engine": {"kind": "builtin", "image": "warmstart:test"},
    "resources": {"gpus": 0}, "snapshot": {"enabled": True},
}  # fmt: skip
REQUEST_KEY = request_key(parse_spec(ENDPOINT_SPEC))
TEST_IMAGE_ID = "sha256:" + "7" * 64


def _serving(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


class Cluster:
    """The API calls this test makes, on the real apiserver."""

    def __init__(self, kube: Any) -> None:
        from kubernetes import client

        self.kube = kube
        self.api = kube.api_client()
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)

    def endpoint(self, namespace: str, spec: dict[str, Any] = ENDPOINT_SPEC) -> dict[str, Any]:
        body = {
            "apiVersion": L.API_VERSION, "kind": L.ENDPOINT_KIND,
            "metadata": {"name": ENDPOINT, "namespace": namespace}, "spec": spec,
        }  # fmt: skip
        return self.custom.create_namespaced_custom_object(
            L.GROUP, L.VERSION, namespace, L.ENDPOINT_PLURAL, body
        )

    def snapshot(self, namespace: str, name: str, key: dict[str, Any] = REQUEST_KEY) -> dict:
        """An InferenceSnapshot as the operator makes it, for the request `key`."""
        body = {
            "apiVersion": L.API_VERSION, "kind": L.SNAPSHOT_KIND,
            "metadata": {"name": name, "namespace": namespace, "labels": {L.ENDPOINT_LABEL: ENDPOINT}},
            "spec": {"endpoint": ENDPOINT, "requestKeyHash": request_key_hash(key), "requestKey": key},
        }  # fmt: skip
        return self.custom.create_namespaced_custom_object(
            L.GROUP, L.VERSION, namespace, L.SNAPSHOT_PLURAL, body
        )

    def report_captured(self, namespace: str, name: str, snapshot_id: str) -> None:
        """What the agent writes once it captured `snapshot_id` for this InferenceSnapshot."""
        status = {"captureAttempt": 1, "captureState": "Captured", "snapshotId": snapshot_id}
        self.custom.patch_namespaced_custom_object_status(
            L.GROUP, L.VERSION, namespace, L.SNAPSHOT_PLURAL, name, {"status": status}
        )

    def phase(self, namespace: str, name: str) -> Phase:
        """The phase the operator derives from what the agent reported (no operator runs in these tests)."""
        return derive_phase(SnapshotStatus.of(self.get_snapshot(namespace, name)))[0]

    def get_snapshot(self, namespace: str, name: str) -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object(
            L.GROUP, L.VERSION, namespace, L.SNAPSHOT_PLURAL, name
        )

    def pod(self, namespace: str, name: str, role: str, snapshot: str, port: int, owner: dict | None) -> dict:
        metadata: dict[str, Any] = {
            "name": name, "namespace": namespace,
            "labels": {
                L.ENDPOINT_LABEL: ENDPOINT, L.ROLE_LABEL: role, L.SNAPSHOT_LABEL: snapshot,
                L.REQUEST_KEY_LABEL: L.request_key_label(request_key_hash(REQUEST_KEY)),
            },
        }  # fmt: skip
        if owner is not None:
            metadata["ownerReferences"] = [_reference(owner)]
        container = {"name": "worker", "image": "warmstart:test", "ports": [{"containerPort": port}]}
        body = {
            "apiVersion": "v1", "kind": "Pod", "metadata": metadata,
            "spec": {"nodeName": NODE, "containers": [container]},
        }  # fmt: skip
        created = self.api.sanitize_for_serialization(self.core.create_namespaced_pod(namespace, body))
        self.report_running(created)
        return created

    def report_running(self, pod: dict[str, Any]) -> None:
        """What the kubelet reports once the container runs: the image digest the runtime resolved (after
        kwok, which plays this node's kubelet, reported the pod Running without one)."""
        meta = pod["metadata"]
        self.kube.wait_for(
            lambda: self.core.read_namespaced_pod(meta["name"], meta["namespace"]).status.phase == "Running",
            timeout=60, message=f"pod {meta['name']} Running",
        )  # fmt: skip
        status = {"containerStatuses": [{
            "name": "worker", "image": "warmstart:test", "imageID": TEST_IMAGE_ID, "ready": False,
            "restartCount": 0, "state": {"running": {}},
        }]}  # fmt: skip
        self.core.patch_namespaced_pod_status(meta["name"], meta["namespace"], {"status": status})

    def set_owner(self, pod: dict[str, Any], owner: dict[str, Any]) -> None:
        meta = pod["metadata"]
        patch = {"metadata": {"ownerReferences": [_reference(owner)]}}
        self.core.patch_namespaced_pod(meta["name"], meta["namespace"], patch)

    def events(self, namespace: str, name: str) -> list[tuple[str, str]]:
        found = self.core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}")
        return [(event.reason, event.message) for event in found.items]

    def annotation(self, namespace: str, name: str) -> dict[str, Any]:
        pod = self.core.read_namespaced_pod(name, namespace)
        return json.loads((pod.metadata.annotations or {}).get(L.STATUS_ANNOTATION, "{}"))


def _reference(owner: dict[str, Any]) -> dict[str, Any]:
    meta = owner["metadata"]
    return {
        "apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": meta["name"], "uid": meta["uid"]
    }  # fmt: skip


@pytest.fixture(scope="module")
def crds(kube: Any) -> None:
    repo = Path(__file__).resolve().parents[2]
    kube.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(repo / "crds"))
    kube.kubectl("wait", "--for=condition=Established", "--timeout=60s", "-f", str(repo / "crds"))


@pytest.fixture
def cluster(kube: Any, crds: None) -> Cluster:
    return Cluster(kube)


@pytest.fixture
def make_agent(kube: Any, tmp_path: Path) -> Iterator[Callable[[str], Agent]]:
    """Agents of one node sharing one store and kubelet root (a second one plays the restarted agent)."""
    store = tmp_path / "store"
    store.mkdir()
    signer, verifier, _ = signing_keys(store, None)
    started: list[Agent] = []

    def make(criu_command: str) -> Agent:
        config = agent_settings(node=NODE, store=store, criu=criu_command, kubelet_root=tmp_path / "kubelet",
                                resync=2)  # fmt: skip
        started.append(Agent(config, KubeStatus(kube.api_client(), NODE), signer, verifier))
        find_sandbox_pods(started[-1])
        return started[-1]

    yield make
    for node_agent in started:
        node_agent.stopping.set()
    for node_agent in started:
        node_agent.wait_idle(60)


@pytest.fixture
def criu_calls(tmp_path: Path, criu_command: str) -> tuple[str, Callable[[], list[str]]]:
    """The real CRIU behind a wrapper that records each invocation's subcommand."""
    return recording_criu_command(tmp_path, criu_command)


def _start_agent(node_agent: Agent) -> threading.Thread:
    thread = threading.Thread(target=node_agent.run, name="agent", daemon=True)
    thread.start()
    return thread


def _container(pod: dict[str, Any], kubelet_root: Path, mode: str, port: int) -> Sandbox:
    """What the kubelet and the runtime would do: the emptyDir, then the worker with its pod uid."""
    uid = pod["metadata"]["uid"]
    control = control_dir_on_host(kubelet_root, uid)
    command = [
        sys.executable, "-m", "warmstart", "worker", "--mode", mode, "--engine", "builtin", "--model", "tiny",
        "--device", "cpu", "--host", "127.0.0.1", "--port", str(port), "--control-dir", L.CONTROL_DIR_PATH,
    ]  # fmt: skip
    env = {**os.environ, L.POD_UID_ENV: uid, "WARMSTART_RESTORE_TIMEOUT": "300"}
    return Sandbox.start(control, command, env=env, mountpoint=Path(L.CONTROL_DIR_PATH))


def test_agent_captures_restores_and_refuses(
    kube: Any,
    namespace: str,
    cluster: Cluster,
    make_agent: Callable[[str], Agent],
    criu_command: str,
    criu_calls: tuple[str, Callable[[], list[str]]],
    sandboxes: list[Sandbox],
) -> None:
    agent = make_agent(criu_command)
    kubelet_root = agent.config.kubelet_root
    port = free_port()
    endpoint = cluster.endpoint(namespace)

    # A capture pod: its worker warms up and says ready-for-snapshot; the snapshot object names its identity.
    capture_pod = cluster.pod(namespace, "tiny-capture-1", L.ROLE_CAPTURE, "tiny-snap", port, owner=None)
    sandboxes.append(_container(capture_pod, kubelet_root, "capture", port))
    control = ControlDir(control_dir_on_host(kubelet_root, capture_pod["metadata"]["uid"]))
    ready = kube.wait_for(lambda: control.read(READY_FOR_SNAPSHOT), timeout=180, message="ready-for-snapshot")
    snap = cluster.snapshot(namespace, "tiny-snap")
    cluster.set_owner(capture_pod, snap)
    # A pod of no InferenceEndpoint on this node: the agent must leave it alone.
    stranger = cluster.pod(namespace, "stranger", L.ROLE_RESTORE, "tiny-snap", port, owner=None)
    stranger_control = control_dir_on_host(kubelet_root, stranger["metadata"]["uid"])
    stranger_control.mkdir(parents=True)

    _start_agent(agent)
    status = kube.wait_for(
        lambda: cluster.phase(namespace, "tiny-snap") == Phase.READY
        and cluster.get_snapshot(namespace, "tiny-snap")["status"],
        timeout=240, message="InferenceSnapshot Ready",
    )  # fmt: skip
    store = SnapshotStore(agent.config.store)
    snapshot_id = status["snapshotId"]
    manifest = (store.snapshots_dir / snapshot_id / MANIFEST_FILE).read_bytes()
    assert status["manifestDigest"] == "sha256:" + hashlib.sha256(manifest).hexdigest()
    assert status["sizeBytes"] == store.get(snapshot_id).size > 0
    assert status["node"] == NODE and status["storagePath"] == f"snapshots/{snapshot_id}"
    assert status["timings"]["criu_dump"] > 0
    recorded = store.get(snapshot_id).identity  # the worker's measurement, the image from the runtime
    assert status["identity"] == recorded.to_dict() and status["identityHash"] == recorded.digest()
    assert (
        recorded.image == TEST_IMAGE_ID and recorded.model_digest == ready.payload["identity"]["model_digest"]
    )
    verified = store.verify(
        snapshot_id, agent.node.verifier, expected_identity=store.get(snapshot_id).identity
    )
    assert verified.record.namespace == namespace
    kube.wait_for(lambda: not sandboxes[0].alive(), timeout=60, message="capture worker exits when done")

    # A restore pod of the endpoint: restored, it answers like a cold worker of the same model would.
    restore_pod = cluster.pod(namespace, "tiny-restore-1", L.ROLE_RESTORE, "tiny-snap", port, owner=endpoint)
    sandboxes.append(_container(restore_pod, kubelet_root, "restore", port))
    kube.wait_for(lambda: _serving(port), timeout=120, message="restored worker serving")
    restored_answers = answers(f"http://127.0.0.1:{port}")
    restored_status = kube.wait_for(lambda: cluster.annotation(namespace, "tiny-restore-1"), timeout=30)
    assert restored_status["restoreSeconds"] > 0
    print(f"capture phases {status['timings']}, {status['sizeBytes']} bytes; restore {restored_status}")
    assert "Restored" in [reason for reason, _ in cluster.events(namespace, "tiny-restore-1")]
    assert agent.metrics.value("warmstart_agent_restores_total", {"result": "succeeded"}) == 1
    assert not (stranger_control / RESTORE_FAILED).exists() and not any(stranger_control.iterdir())
    sandboxes[-1].stop(grace=3)

    # The agent restarts: the new one neither captures the Ready snapshot again nor restores the pod again.
    agent.stopping.set()
    assert agent.wait_idle(30)
    agent = make_agent(criu_calls[0])
    _start_agent(agent)
    handled = {capture_pod["metadata"]["uid"], restore_pod["metadata"]["uid"], stranger["metadata"]["uid"]}
    kube.wait_for(lambda: handled <= agent.settled_pods(), timeout=30, message="restarted agent caught up")
    assert criu_calls[1]() == [], "the restarted agent ran CRIU for work already done"
    assert cluster.get_snapshot(namespace, "tiny-snap")["status"]["snapshotId"] == snapshot_id

    # Another namespace whose InferenceSnapshot points at this snapshot's store id: refused, nothing restored.
    other = f"{namespace}-b"
    kube.kubectl("create", "namespace", other)
    try:
        _refused_in_other_namespace(kube, cluster, other, status, port, kubelet_root)
    finally:
        kube.kubectl("delete", "namespace", other, "--wait=false", check=False)

    # A tampered store: verification fails, restore-failed, the worker cold-starts and answers the same.
    _tamper_largest_blob(store, snapshot_id)
    second = cluster.pod(namespace, "tiny-restore-2", L.ROLE_RESTORE, "tiny-snap", port, owner=endpoint)
    sandboxes.append(_container(second, kubelet_root, "restore", port))
    second_control = ControlDir(control_dir_on_host(kubelet_root, second["metadata"]["uid"]))
    failed = kube.wait_for(lambda: second_control.read(RESTORE_FAILED), timeout=120, message="restore-failed")
    assert "digest" in failed.payload["reason"] or "refused" in failed.payload["reason"]
    kube.wait_for(lambda: _serving(port), timeout=180, message="cold-started worker serving")
    assert answers(f"http://127.0.0.1:{port}") == restored_answers
    assert "RestoreFailed" in [reason for reason, _ in cluster.events(namespace, "tiny-restore-2")]
    kube.wait_for(
        lambda: cluster.get_snapshot(namespace, "tiny-snap")["status"].get("restoreFailures") == 1,
        timeout=30, message="restoreFailures recorded",
    )  # fmt: skip

    # Two more failures make three: the InferenceSnapshot turns Invalid (each worker is stopped before it
    # finishes its cold start, which the first failure already showed). Same port as the capture's: a worker
    # serving elsewhere differs from the snapshot and is refused before verification, which counts nothing.
    sandboxes[-1].stop(grace=3)
    for index in (3, 4):
        name = f"tiny-restore-{index}"
        failing = cluster.pod(namespace, name, L.ROLE_RESTORE, "tiny-snap", port, endpoint)
        sandboxes.append(_container(failing, kubelet_root, "restore", port))
        answer = control_dir_on_host(kubelet_root, failing["metadata"]["uid"]) / RESTORE_FAILED
        kube.wait_for(answer.exists, timeout=120, message=f"restore-failed in {name}")
        sandboxes[-1].stop(grace=1)
    invalid = kube.wait_for(
        lambda: cluster.phase(namespace, "tiny-snap") == Phase.INVALID
        and cluster.get_snapshot(namespace, "tiny-snap")["status"],
        timeout=30, message="InferenceSnapshot Invalid",
    )  # fmt: skip
    assert invalid["restoreFailures"] == 3 and "corrupted" in invalid["restoreFailureMessage"]
    assert "Invalid" in [reason for reason, _ in cluster.events(namespace, "tiny-snap")]
    assert criu_calls[1]() == [], "CRIU ran on a snapshot that failed verification"

    # Its deletion (the operator's retention, its endpoint's, a person's): the agent removes the store files.
    cluster.custom.delete_namespaced_custom_object(
        L.GROUP, L.VERSION, namespace, L.SNAPSHOT_PLURAL, "tiny-snap"
    )
    gone = store.snapshots_dir / snapshot_id
    kube.wait_for(lambda: not gone.exists(), timeout=30, message="store cleanup")


def _refused_in_other_namespace(
    kube: Any,
    cluster: Cluster,
    other: str,
    ready_status: dict[str, Any],
    port: int,
    kubelet_root: Path,
) -> None:
    kube.wait_default_service_account(other)
    endpoint = cluster.endpoint(other)
    cluster.snapshot(other, "tiny-snap")
    copied = {
        key: ready_status[key]
        for key in ("captureAttempt", "captureState", "snapshotId", "storagePath", "identity", "identityHash")
    }
    cluster.custom.patch_namespaced_custom_object_status(
        L.GROUP, L.VERSION, other, L.SNAPSHOT_PLURAL, "tiny-snap", {"status": copied}
    )
    pod = cluster.pod(other, "tiny-restore-1", L.ROLE_RESTORE, "tiny-snap", port, owner=endpoint)
    control = control_dir_on_host(kubelet_root, pod["metadata"]["uid"])
    control.mkdir(parents=True)  # the kubelet's emptyDir; no container needed for a refusal
    failed = kube.wait_for(lambda: ControlDir(control).read(RESTORE_FAILED), timeout=60, message="refusal")
    assert "never restored into another namespace" in failed.payload["reason"]
    assert "RestoreRefused" in [reason for reason, _ in cluster.events(other, "tiny-restore-1")]


def _tamper_largest_blob(store: SnapshotStore, snapshot_id: str) -> None:
    entry = max(store.get(snapshot_id).files.values(), key=lambda file: file.size)
    blob = store.blob_path(entry.digest)
    blob.chmod(0o644)
    with open(blob, "r+b") as handle:
        handle.seek(entry.size // 2)
        byte = handle.read(1)
        handle.seek(entry.size // 2)
        handle.write(bytes([byte[0] ^ 0xFF]))


def test_failed_capture_marks_the_snapshot_failed_and_the_worker_serves(
    kube: Any,
    namespace: str,
    cluster: Cluster,
    make_agent: Callable[[str], Agent],
    criu_command: str,
    sandboxes: list[Sandbox],
) -> None:
    """The InferenceSnapshot asks for another engine than the worker runs: no snapshot, the worker carries
    on serving, the InferenceSnapshot goes Failed with the reason and an Event says so."""
    agent = make_agent(criu_command)
    port = free_port()
    pod = cluster.pod(namespace, "tiny-capture-1", L.ROLE_CAPTURE, "tiny-snap", port, owner=None)
    sandboxes.append(_container(pod, agent.config.kubelet_root, "capture", port))
    control = ControlDir(control_dir_on_host(agent.config.kubelet_root, pod["metadata"]["uid"]))
    ready = kube.wait_for(lambda: control.read(READY_FOR_SNAPSHOT), timeout=180, message="ready-for-snapshot")
    assert ready.payload["identity"]["engine"] == "builtin"
    snap = cluster.snapshot(namespace, "tiny-snap", {**REQUEST_KEY, "engine": {"kind": "vllm"}})
    cluster.set_owner(pod, snap)

    _start_agent(agent)
    status = kube.wait_for(
        lambda: cluster.phase(namespace, "tiny-snap") == Phase.FAILED
        and cluster.get_snapshot(namespace, "tiny-snap")["status"],
        timeout=60, message="InferenceSnapshot Failed",
    )  # fmt: skip
    assert status["captureState"] == "Failed" and "another engine" in status["captureMessage"]
    assert "CaptureFailed" in [reason for reason, _ in cluster.events(namespace, "tiny-snap")]
    assert SnapshotStore(agent.config.store).list() == []
    kube.wait_for(lambda: _serving(port), timeout=60, message="the source serving after the failed capture")
    assert sandboxes[0].alive()


def test_agent_command_serves_grpc_and_metrics_and_stops_on_sigterm(
    kube: Any, cluster: Cluster, tmp_path: Path
) -> None:
    """`warmstart agent` as the DaemonSet runs it (environment fallbacks), on loopback."""
    import signal
    import subprocess

    import grpc

    from warmstart.agent.proto import agent_pb2, agent_pb2_grpc

    socket_path, metrics_port = tmp_path / "run" / "agent.sock", free_port()
    env = {
        **os.environ, "WARMSTART_NODE_NAME": NODE, "WARMSTART_STORE": str(tmp_path / "store"),
        "WARMSTART_KUBELET_ROOT": str(tmp_path / "kubelet"), "WARMSTART_AGENT_GRPC_SOCKET": str(socket_path),
        "WARMSTART_AGENT_METRICS_PORT_NUMBER": str(metrics_port),
        "WARMSTART_AGENT_LISTEN_ADDRESS": "127.0.0.1",
        "KUBECONFIG": str(kube.kubeconfig),
    }  # fmt: skip
    with open(tmp_path / "agent.log", "wb") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "warmstart", "agent", "--resync", "2"], env=env, stdout=log_file,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        kube.wait_for(socket_path.exists, timeout=60, message="the agent's gRPC socket")
        with grpc.insecure_channel(f"unix:{socket_path}") as channel:
            agent = agent_pb2_grpc.AgentStub(channel)
            status = kube.wait_for(
                lambda: agent.Status(agent_pb2.StatusRequest(), timeout=5), timeout=60,
                message="the agent's gRPC Status",
            )  # fmt: skip
            assert status.node == NODE  # its in_flight may hold other tests' pods
            assert list(agent.ListSnapshots(agent_pb2.ListSnapshotsRequest(), timeout=5).snapshots) == []
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read()
        assert b"warmstart_agent_captures_total" in metrics
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0, (tmp_path / "agent.log").read_text()[-2000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_vanished_published_snapshot_fails_the_capture_once(
    namespace: str, cluster: Cluster, make_agent: Callable[[str], Agent], criu_command: str
) -> None:
    """snapshot-complete names a store snapshot that is gone (deleted, or a store swapped under a restarted
    agent): the InferenceSnapshot goes Failed with the reason instead of the agent raising on every resync."""
    from warmstart.api.control_dir import SNAPSHOT_COMPLETE

    agent = make_agent(criu_command)
    snap = cluster.snapshot(namespace, "tiny-snap")
    pod = cluster.pod(namespace, "tiny-capture-1", L.ROLE_CAPTURE, "tiny-snap", free_port(), owner=snap)
    control = ControlDir(control_dir_on_host(agent.config.kubelet_root, pod["metadata"]["uid"]))
    control.send(SNAPSHOT_COMPLETE, {"snapshot": "deadbeef0000-20260101000000-000000"})

    agent.capture.handle(pod)

    status = cluster.get_snapshot(namespace, "tiny-snap")["status"]
    assert cluster.phase(namespace, "tiny-snap") == Phase.FAILED
    assert "cannot be read" in status["captureMessage"], status["captureMessage"]


def test_restore_failures_on_two_nodes_add_up_to_one_count(
    kube: Any, namespace: str, cluster: Cluster, tmp_path: Path
) -> None:
    """Restores of one snapshot failing at the same moment on two nodes, each node with its own store, add
    up to one count over the cluster (each agent once wrote its own node's count, the last one winning):
    the snapshot turns Invalid from the failures of all nodes together. A success starts the count again."""
    snap = cluster.snapshot(namespace, "tiny-snap")
    pod = cluster.pod(namespace, "tiny-restore-1", L.ROLE_RESTORE, "tiny-snap", free_port(), owner=None)
    agents = []
    for node in ("node-a", "node-b"):
        store = tmp_path / node
        store.mkdir()
        signer, verifier, _ = signing_keys(store, None)
        config = agent_settings(node=node, store=store, criu=tmp_path / "no-criu")
        agents.append(Agent(config, KubeStatus(kube.api_client(), node), signer, verifier))
    snapshot_id, per_node = "deadbeef0000-20260101000000-000000", 3

    def fail_once(agent: Agent) -> None:  # what a failed restore does on that node
        failures = FailureCounter(agent.node.store.root)
        failures.record(snapshot_id, "digest mismatch")
        agent.restore._failed(pod, snap, "digest mismatch")

    with ThreadPoolExecutor(len(agents) * per_node) as pool:
        list(pool.map(fail_once, [agent for agent in agents for _ in range(per_node)]))

    status = cluster.get_snapshot(namespace, "tiny-snap")["status"]
    assert status["restoreFailures"] == len(agents) * per_node, status
    assert cluster.phase(namespace, "tiny-snap") == Phase.INVALID
    assert all(FailureCounter(agent.node.store.root).count(snapshot_id) == per_node for agent in agents)

    agents[0].node.kube.clear_restore_failures(cluster.get_snapshot(namespace, "tiny-snap"))
    assert cluster.get_snapshot(namespace, "tiny-snap")["status"]["restoreFailures"] == 0


def test_a_snapshot_watch_goes_on_from_where_the_last_one_ended(
    kube: Any, namespace: str, cluster: Cluster
) -> None:
    """The agent's watch of deleted InferenceSnapshots ends every resync period; the next one starts from
    the last resourceVersion seen: it is not sent every snapshot in the cluster again, and misses no
    deletion."""
    status = KubeStatus(kube.api_client(), NODE)
    cluster.snapshot(namespace, "before")
    start = status.snapshots_version()
    for name in ("kept", "gone"):
        cluster.snapshot(namespace, name)

    def ours(events: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, str]]:
        return [(change, snap["metadata"]["name"]) for change, snap in events
                if snap["metadata"]["namespace"] == namespace]  # fmt: skip

    first = list(status.watch_snapshots(start, 1))
    assert ours(first) == [("ADDED", "kept"), ("ADDED", "gone")]
    cluster.custom.delete_namespaced_custom_object(L.GROUP, L.VERSION, namespace, L.SNAPSHOT_PLURAL, "gone")
    next_one = list(status.watch_snapshots(first[-1][1]["metadata"]["resourceVersion"], 1))
    assert ours(next_one) == [("DELETED", "gone")]


def test_the_agent_lists_snapshots_once_and_each_later_watch_goes_on_from_the_last(
    kube: Any, namespace: str, cluster: Cluster, tmp_path: Path
) -> None:
    """The agent's own loop: with watches of one second, several come and go, and only the first needed a
    list (a subclass of the real client, talking to the real apiserver, counts the calls)."""

    class Counting(KubeStatus):
        lists = watches = 0

        def snapshots_version(self) -> str:
            self.lists += 1
            return super().snapshots_version()

        def watch_snapshots(self, resource_version: str, seconds: int) -> Any:
            self.watches += 1
            return super().watch_snapshots(resource_version, seconds)

    status = Counting(kube.api_client(), NODE)
    signer, verifier, _ = signing_keys(tmp_path, None)
    agent = Agent(agent_settings(node=NODE, store=tmp_path, criu=tmp_path / "no-criu", resync=1), status,
                  signer, verifier)  # fmt: skip
    watching = threading.Thread(target=agent.cleanup.watch_deleted, daemon=True)
    watching.start()
    try:
        cluster.snapshot(namespace, "churn")  # an event to go on from
        kube.wait_for(lambda: status.watches >= 4, timeout=30, message="four watches")
    finally:
        agent.stopping.set()
        watching.join(timeout=10)
    assert status.lists == 1


def test_a_restore_the_previous_agent_left_unanswered_ends_in_a_cold_start(
    kube: Any,
    namespace: str,
    cluster: Cluster,
    make_agent: Callable[[str], Agent],
    criu_command: str,
    sandboxes: list[Sandbox],
) -> None:
    """An agent died holding a pod's restore claim: the next one answers restore-failed (the worker would
    otherwise wait for an answer that never comes), records why, and the worker serves cold."""
    import subprocess

    from warmstart.api.control_dir import CLAIM_RESTORE, RESTORE_CLAIM

    agent = make_agent(criu_command)
    endpoint = cluster.endpoint(namespace)
    cluster.snapshot(namespace, "tiny-snap")
    port = free_port()
    pod = cluster.pod(namespace, "tiny-restore-1", L.ROLE_RESTORE, "tiny-snap", port, owner=endpoint)
    control = ControlDir(control_dir_on_host(agent.config.kubelet_root, pod["metadata"]["uid"]))
    sandboxes.append(_container(pod, agent.config.kubelet_root, "restore", port))
    kube.wait_for(control.path.is_dir, timeout=60, message="the pod's control directory")
    dead_agent = subprocess.Popen(["true"])
    dead_agent.wait()
    assert control.claim(CLAIM_RESTORE, snapshot="whatever").ours
    claim_file = control.path / RESTORE_CLAIM
    record = json.loads(claim_file.read_text())
    claim_file.unlink()
    claim_file.write_text(json.dumps({**record, "pid": dead_agent.pid}))

    _start_agent(agent)
    failed = kube.wait_for(lambda: control.read(RESTORE_FAILED), timeout=120, message="restore-failed")
    assert "stopped during" in failed.payload["reason"]
    assert "RestoreInterrupted" in [reason for reason, _ in cluster.events(namespace, "tiny-restore-1")]
    kube.wait_for(lambda: _serving(port), timeout=180, message="the worker serving cold")


def _publish(agent: Agent, namespace: str, files: dict[str, bytes]) -> Snapshot:
    """A signed snapshot in the agent's store, as a capture in `namespace` publishes it."""
    identity = SnapshotIdentity(model_digest="sha256:" + "ab" * 32, engine="builtin", engine_version="1")
    meta = {"namespace": namespace, "inferenceSnapshot": "tiny-snap", "node": NODE}
    with agent.node.store.stage(identity, meta=meta) as staging:
        for relative, content in files.items():
            (staging.dir / relative).parent.mkdir(parents=True, exist_ok=True)
            (staging.dir / relative).write_bytes(content)
        return staging.publish(agent.node.signer)


@pytest.mark.parametrize("policy", ["PageCache", "None"])
def test_prestage_keeps_the_snapshots_of_endpoints_that_ask_in_the_page_cache(
    namespace: str, cluster: Cluster, make_agent: Callable[[str], Agent], tmp_path: Path, policy: str
) -> None:
    """A Ready InferenceSnapshot whose snapshot is in the store, its blobs dropped from the page cache: one
    pass reads them back when the endpoint asks for PageCache (the gauge says how much is resident), and
    reads nothing when it asks for None."""
    agent = make_agent(str(tmp_path / "no-criu"))
    mib = 1 << 20
    spec = {**ENDPOINT_SPEC, "snapshot": {**ENDPOINT_SPEC["snapshot"], "prestage": policy}}
    cluster.endpoint(namespace, spec)
    stored = _publish(
        agent, namespace, {"criu/pages-1.img": os.urandom(6 * mib + 5), "weights/model": os.urandom(3 * mib)}
    )
    cluster.snapshot(namespace, "tiny-snap")
    cluster.report_captured(namespace, "tiny-snap", stored.id)
    assert cluster.phase(namespace, "tiny-snap") == Phase.READY
    store = agent.node.store
    blobs = blob_paths(store, [stored])
    for blob in blobs:
        evict(blob)
    resident = lambda: sum(resident_bytes(blob) for blob in blobs)  # noqa: E731
    before = resident()
    assert before < stored.size // 4, "the blobs did not leave the page cache"

    read = agent.prestage.stage_once()

    series = {"namespace": namespace, "snapshot": "tiny-snap"}
    gauge = agent.metrics.registry.get_sample_value("warmstart_agent_prestaged_bytes", series)
    read_total = agent.metrics.value("warmstart_agent_prestage_read_bytes_total")
    assert agent.metrics.value("warmstart_agent_prestage_seconds_count") == 1
    if policy == "None":
        assert read == 0 and read_total == 0 and gauge is None
        assert resident() < stored.size // 4, "a snapshot nobody asked for was staged"
        return
    assert resident() == stored.size and gauge == stored.size
    assert stored.size - before <= read == read_total <= stored.size
    assert agent.prestage.stage_once() == 0, "resident blobs were read again"
    # The endpoint stops asking: the snapshot's series goes.
    cluster.custom.patch_namespaced_custom_object(
        L.GROUP, L.VERSION, namespace, L.ENDPOINT_PLURAL, ENDPOINT,
        {"spec": {"snapshot": {"prestage": "None"}}},
    )  # fmt: skip
    agent.prestage.stage_once()
    assert agent.metrics.registry.get_sample_value("warmstart_agent_prestaged_bytes", series) is None


def _bucket_agents(kube: Any, tmp_path: Path, server: Any, criu_command: str) -> tuple[Agent, Agent]:
    """Two agents whose stores are caches of one bucket, as on nodes A and B (both on this machine's kubelet
    root, driven one pod at a time: neither runs its loop)."""
    key = generate_hmac_key(tmp_path / "signing-key")
    remote = RemoteConfig(
        bucket=BUCKET, endpoint=server.endpoint, prefix="cluster/",
        credentials=Credentials(server.access_key_id, server.secret_access_key), concurrency=4,
    )  # fmt: skip
    agents = []
    for name in ("a", "b"):
        config = agent_settings(node=NODE, store=tmp_path / f"store-{name}", criu=criu_command,
                                kubelet_root=tmp_path / "kubelet", pull_timeout=60)  # fmt: skip
        kube_status = KubeStatus(kube.api_client(), NODE)
        agents.append(Agent(config, kube_status, load_signer(key), load_verifier(key), remote=remote))
        find_sandbox_pods(agents[-1])
    return agents[0], agents[1]


def _overwrite_in_place(server: Any, snapshot: Snapshot) -> None:
    """The largest blob's object in the bucket overwritten with as many other bytes (same size)."""
    entry = max(snapshot.files.values(), key=lambda file: file.size)
    blob = server.data_dir / BUCKET / Keys("cluster/").blob(entry.digest)
    content = bytearray(blob.read_bytes())
    content[len(content) // 2] ^= 0xFF
    blob.write_bytes(bytes(content))


def test_refused_pulls_of_a_tampered_bucket_copy_count_until_invalid_and_a_new_capture_restores(
    kube: Any,
    namespace: str,
    cluster: Cluster,
    criu_command: str,
    sandboxes: list[Sandbox],
    s3_server: Any,
    tmp_path: Path,
) -> None:
    """The bucket's copy of a Ready snapshot overwritten in place: each restore on a node without a cached
    copy is refused by the pull and counted against the snapshot like a failed verification; the third
    turns it Invalid, the operator's plan captures a new one, and the next replica restores from that."""
    node_a, node_b = _bucket_agents(kube, tmp_path, s3_server, criu_command)
    kubelet_root, port = node_a.config.kubelet_root, free_port()
    endpoint = cluster.endpoint(namespace)
    stored = _publish(
        node_a, namespace, {"criu/pages-1.img": os.urandom(3 << 20), "criu/core-1.img": b"c" * 64}
    )
    assert node_a.node.cluster_store is not None and node_b.node.cluster_store is not None
    node_a.node.cluster_store.publish(stored.id)
    cluster.snapshot(namespace, "tiny-snap")
    cluster.report_captured(namespace, "tiny-snap", stored.id)
    _overwrite_in_place(s3_server, stored)

    for attempt in range(1, MAX_RESTORE_FAILURES + 1):
        name = f"tiny-refused-{attempt}"
        pod = cluster.pod(namespace, name, L.ROLE_RESTORE, "tiny-snap", port, owner=endpoint)
        control = control_dir_on_host(kubelet_root, pod["metadata"]["uid"])
        control.mkdir(parents=True)  # the kubelet's emptyDir; the refusal needs no container
        node_b.restore.handle(pod)
        status = cluster.get_snapshot(namespace, "tiny-snap")["status"]
        assert status.get("restoreFailures") == attempt, status
        failed = ControlDir(control).read(RESTORE_FAILED)
        assert failed is not None and "object store" in failed.payload["reason"], failed
        assert "tampered" in failed.payload["reason"] and failed.payload["failures"] == attempt
        assert "RestoreFailed" in [reason for reason, _ in cluster.events(namespace, name)]
        assert "restoreFailed" in cluster.annotation(namespace, name)
        assert node_b.node.store.list() == []  # nothing of a refused pull reaches B's cache
    assert cluster.phase(namespace, "tiny-snap") == Phase.INVALID
    assert "Invalid" in [reason for reason, _ in cluster.events(namespace, "tiny-snap")]

    # The operator's plan for the endpoint: the Invalid snapshot is never used again, a new one is captured.
    snapshots = cluster.custom.list_namespaced_custom_object(
        L.GROUP, L.VERSION, namespace, L.SNAPSHOT_PLURAL
    )["items"]  # fmt: skip
    request_hash = request_key_hash(REQUEST_KEY)
    plan = plan_snapshots(Owner.from_body(endpoint), parse_spec(ENDPOINT_SPEC), request_hash, REQUEST_KEY,
                          snapshots, dt.datetime.now(dt.UTC))  # fmt: skip
    assert plan.create is not None and plan.capture_attempt == 1 and plan.ready == ""
    fresh = cluster.custom.create_namespaced_custom_object(
        L.GROUP, L.VERSION, namespace, L.SNAPSHOT_PLURAL, plan.create
    )
    new = fresh["metadata"]["name"]
    assert new != "tiny-snap"
    capture_pod = cluster.pod(namespace, f"{new}-capture-1", L.ROLE_CAPTURE, new, port, owner=fresh)
    sandboxes.append(_container(capture_pod, kubelet_root, "capture", port))
    node_a.capture.handle(capture_pod)
    ready = cluster.get_snapshot(namespace, new)["status"]
    assert cluster.phase(namespace, new) == Phase.READY, ready
    manifest = s3_server.data_dir / BUCKET / Keys("cluster/").manifest(ready["snapshotId"])
    assert manifest.is_file(), "a Ready snapshot not in the bucket"
    kube.wait_for(lambda: not sandboxes[-1].alive(), timeout=60, message="capture worker exits when done")

    # The next replica, on B whose cache holds nothing of it, pulls the new snapshot and is restored from it.
    restore_pod = cluster.pod(namespace, "tiny-restored", L.ROLE_RESTORE, new, port, owner=endpoint)
    sandboxes.append(_container(restore_pod, kubelet_root, "restore", port))
    node_b.restore.handle(restore_pod)
    kube.wait_for(lambda: _serving(port), timeout=120, message="the replica restored on B serving")
    report = cluster.annotation(namespace, "tiny-restored")
    assert report.get("restoreSeconds", 0) > 0 and "restoreFailed" not in report, report
    assert [snapshot.id for snapshot in node_b.node.store.list()] == [ready["snapshotId"]]
    assert not cluster.get_snapshot(namespace, new)["status"].get("restoreFailures")
