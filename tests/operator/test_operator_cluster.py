"""The operator against a real API server, controller-manager, scheduler and kwok nodes."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from cluster_calls import (
    STORE_ID,
    TIMEOUT,
    apply,
    condition,
    endpoint,
    get,
    items,
    set_snapshot_status,
    template_role,
)
from operator_process import OperatorProcess

from warmstart.api import labels as L
from warmstart.operator.placement import preferred_node

pytestmark = [pytest.mark.integration, pytest.mark.spawns]

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def operator(kube, crds, tmp_path_factory) -> Iterator[OperatorProcess]:
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    process = OperatorProcess(
        kube.kubeconfig,
        log,
        env={"WARMSTART_OPERATOR_RESYNC_SECONDS": "5", "WARMSTART_OPERATOR_CAPTURE_BACKOFF_SECONDS": "1"},
    )
    process.start()
    yield process
    process.stop()
    assert "Traceback" not in log.read_text(errors="replace"), process.log_tail(120)


def restore_pods(kube, namespace: str) -> list[dict]:
    """The restore-role pods not being deleted."""
    pods = items(kube, "pod", namespace, f"{L.ROLE_LABEL}=restore")
    return [p for p in pods if p["metadata"].get("deletionTimestamp") is None]


NO_SNAPSHOTS = {"enabled": False}
HPA = {
    "mode": "hpa",
    "minReplicas": 1,
    "maxReplicas": 5,
    "metric": {"name": "vllm:num_requests_waiting", "target": "4"},
}


def test_create_makes_owned_children_and_goes_ready(kube, namespace, operator):
    apply(kube, endpoint("web", namespace, snapshot=NO_SNAPSHOTS, autoscaling=HPA))
    iep = kube.wait_for(lambda: get(kube, "iep", namespace, "web"), message="endpoint")
    uid = iep["metadata"]["uid"]
    for kind in ("deployment", "service", "hpa"):
        child = kube.wait_for(
            lambda kind=kind: get(kube, kind, namespace, "web"), timeout=TIMEOUT, message=f"{kind} web"
        )
        (ref,) = child["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["uid"], ref["controller"]) == (L.ENDPOINT_KIND, uid, True)
    hpa = get(kube, "hpa", namespace, "web")
    assert hpa["spec"]["scaleTargetRef"]["kind"] == L.ENDPOINT_KIND

    ready = kube.wait_for(
        lambda: (
            (b := get(kube, "iep", namespace, "web")) and condition(b, "Ready").get("status") == "True" and b
        ),
        timeout=TIMEOUT,
        message="endpoint Ready (kwok makes the pods ready)",
    )
    status = ready["status"]
    assert status["phase"] == "Ready" and status["readyReplicas"] == 1
    assert status["selector"] == "app.kubernetes.io/component=worker,warmstart.dev/endpoint=web"
    assert status["observedGeneration"] == ready["metadata"]["generation"]
    assert condition(ready, "SnapshotReady")["reason"] == "SnapshotsDisabled"
    # kwok starts the container and makes the pod Ready at the same moment: a cold start of 0 s.
    timed = kube.wait_for(
        lambda: (s := get(kube, "iep", namespace, "web")["status"]) and "lastColdStartSeconds" in s and s,
        timeout=TIMEOUT,
        message="status.lastColdStartSeconds from the Ready cold pod",
    )
    assert timed["lastColdStartSeconds"] == 0
    events = kube.kubectl(
        "get",
        "events",
        "-n",
        namespace,
        "--field-selector",
        "involvedObject.kind=InferenceEndpoint",
        "-o",
        "json",
    ).stdout
    assert "PhaseChanged" in {e["reason"] for e in json.loads(events)["items"]}


def test_kubectl_scale_reaches_the_deployment(kube, namespace, operator):
    apply(kube, endpoint("scaled", namespace, snapshot=NO_SNAPSHOTS))
    kube.wait_for(lambda: get(kube, "deployment", namespace, "scaled"), timeout=TIMEOUT, message="deployment")
    kube.kubectl("scale", "iep/scaled", "-n", namespace, "--replicas=3")
    kube.wait_for(
        lambda: get(kube, "deployment", namespace, "scaled")["spec"]["replicas"] == 3,
        timeout=TIMEOUT,
        message="Deployment replicas 3",
    )
    kube.wait_for(
        lambda: get(kube, "iep", namespace, "scaled")["status"].get("readyReplicas") == 3,
        timeout=TIMEOUT,
        message="3 ready replicas in the endpoint status",
    )
    scale = json.loads(
        kube.kubectl(
            "get",
            "--raw",
            f"/apis/warmstart.dev/v1alpha1/namespaces/{namespace}/inferenceendpoints/scaled/scale",
        ).stdout
    )
    assert scale["spec"]["replicas"] == 3 and scale["status"]["replicas"] == 3
    assert scale["status"]["selector"].endswith("warmstart.dev/endpoint=scaled")


KEDA_ZERO = {
    "mode": "keda",
    "minReplicas": 0,
    "maxReplicas": 4,
    # At zero no worker reports its queue: the way back is a metric of what is in front of the workers.
    "metric": {"name": "requests", "target": "2", "query": "sum(rate(gateway_requests_total[1m]))"},
}


def test_keda_scaled_object_then_switch_to_hpa(kube, namespace, operator):
    apply(kube, endpoint("burst", namespace, snapshot=NO_SNAPSHOTS, autoscaling=KEDA_ZERO, replicas=0))
    scaled = kube.wait_for(
        lambda: get(kube, "scaledobject", namespace, "burst"),
        timeout=TIMEOUT,
        message="ScaledObject (accepted by KEDA's CRD schema)",
    )
    assert scaled["spec"]["minReplicaCount"] == 0
    assert scaled["spec"]["triggers"][0]["metadata"]["query"] == KEDA_ZERO["metric"]["query"]
    kube.wait_for(
        lambda: get(kube, "iep", namespace, "burst")["status"].get("phase") == "ScaledToZero",
        timeout=TIMEOUT,
        message="phase ScaledToZero",
    )
    apply(kube, endpoint("burst", namespace, snapshot=NO_SNAPSHOTS, autoscaling=HPA, replicas=1))
    kube.wait_for(lambda: get(kube, "hpa", namespace, "burst"), timeout=TIMEOUT, message="HPA")
    kube.wait_for(
        lambda: get(kube, "scaledobject", namespace, "burst") is None,
        timeout=TIMEOUT,
        message="ScaledObject removed",
    )


def go_duration_seconds(text: str) -> float:
    """Seconds of a Go duration string ("120s", "2m0s", "1h30m")."""
    units = {"h": 3600, "m": 60, "s": 1}
    parts = re.findall(r"(\d+(?:\.\d+)?)([hms])", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"not a Go duration: {text!r}"
    return sum(float(number) * units[unit] for number, unit in parts)


def test_http_scaled_object_then_switch_to_keda(kube, namespace, operator):
    http = {"mode": "http", "minReplicas": 0, "maxReplicas": 2, "http": {"pathPrefixes": ["/v1/"]}}
    apply(kube, endpoint("held", namespace, snapshot=NO_SNAPSHOTS, autoscaling=http, replicas=0))
    httpso = kube.wait_for(
        lambda: get(kube, "httpscaledobject", namespace, "held"),
        timeout=TIMEOUT,
        message="HTTPScaledObject (accepted by the HTTP add-on's CRD schema)",
    )
    assert httpso["metadata"]["ownerReferences"][0]["kind"] == L.ENDPOINT_KIND
    assert httpso["spec"]["hosts"] == [f"held.{namespace}"] and httpso["spec"]["pathPrefixes"] == ["/v1/"]
    assert httpso["spec"]["scaleTargetRef"] == {
        "apiVersion": L.API_VERSION,
        "kind": L.ENDPOINT_KIND,
        "name": "held",
        "service": "held",
        "port": 80,
    }
    assert httpso["spec"]["replicas"] == {"min": 0, "max": 2}
    # As written (120s) or as the HTTP add-on's controller writes the same duration back (2m0s).
    timeouts = {key: go_duration_seconds(value) for key, value in httpso["spec"]["timeouts"].items()}
    assert timeouts == {"conditionWait": 120, "responseHeader": 600}
    assert get(kube, "service", namespace, "held")["spec"]["ports"][0]["port"] == 80
    kube.wait_for(
        lambda: get(kube, "iep", namespace, "held")["status"].get("phase") == "ScaledToZero",
        timeout=TIMEOUT,
        message="phase ScaledToZero",
    )
    assert "HTTPScaledObject" in get(kube, "iep", namespace, "held")["status"]["children"]
    keda = {**KEDA_ZERO, "maxReplicas": 2}
    apply(kube, endpoint("held", namespace, snapshot=NO_SNAPSHOTS, autoscaling=keda, replicas=0))
    kube.wait_for(
        lambda: get(kube, "scaledobject", namespace, "held"), timeout=TIMEOUT, message="ScaledObject"
    )
    kube.wait_for(
        lambda: get(kube, "httpscaledobject", namespace, "held") is None,
        timeout=TIMEOUT,
        message="HTTPScaledObject removed",
    )


def test_snapshot_lifecycle_capture_restore_and_identity_change(kube, namespace, operator):
    apply(kube, endpoint("llm", namespace, replicas=2))
    snap = kube.wait_for(
        lambda: (s := items(kube, "isnap", namespace, f"{L.ENDPOINT_LABEL}=llm")) and s[0],
        timeout=TIMEOUT,
        message="an InferenceSnapshot",
    )
    name = snap["metadata"]["name"]
    assert snap["spec"]["requestKeyHash"].startswith(snap["metadata"]["labels"][L.REQUEST_KEY_LABEL])
    kube.wait_for(
        lambda: (get(kube, "isnap", namespace, name) or {}).get("status", {}).get("phase") == "Pending",
        timeout=TIMEOUT,
        message="snapshot Pending",
    )
    capture = kube.wait_for(
        lambda: get(kube, "pod", namespace, f"{name}-capture-1"), timeout=TIMEOUT, message="capture pod"
    )
    assert capture["metadata"]["labels"][L.ROLE_LABEL] == "capture"
    assert capture["metadata"]["ownerReferences"][0]["name"] == name
    assert template_role(kube, namespace, "llm") == ("cold", "")

    assert capture["spec"]["activeDeadlineSeconds"] == 3600 and capture["spec"]["restartPolicy"] == "Never"
    captured = {"captureAttempt": 1, "captureState": "Captured", "snapshotId": STORE_ID, "sizeBytes": 1 << 30}
    set_snapshot_status(kube, namespace, name, {**captured, "node": "kwok-gpu-0"})
    kube.wait_for(
        lambda: template_role(kube, namespace, "llm") == ("restore", name),
        timeout=TIMEOUT,
        message="Deployment switched to restore",
    )
    kube.wait_for(
        lambda: len(restore_pods(kube, namespace)) >= 2, timeout=TIMEOUT, message="2 restore-role pods"
    )
    # The operator runs with the default node-local store: only kwok-gpu-0's store holds the snapshot.
    template = get(kube, "deployment", namespace, "llm")["spec"]["template"]
    assert preferred_node(template["spec"]) == "kwok-gpu-0"
    placed = kube.wait_for(
        lambda: (
            (pods := restore_pods(kube, namespace)) and all(p["spec"].get("nodeName") for p in pods) and pods
        ),
        timeout=TIMEOUT,
        message="the restore pods scheduled",
    )
    assert {p["spec"]["nodeName"] for p in placed} == {"kwok-gpu-0"}
    kube.wait_for(
        lambda: get(kube, "pod", namespace, f"{name}-capture-1") is None,
        timeout=TIMEOUT,
        message="capture pod removed once the snapshot is Ready",
    )
    iep = kube.wait_for(
        lambda: (
            (b := get(kube, "iep", namespace, "llm")) and condition(b, "Ready").get("status") == "True" and b
        ),
        timeout=TIMEOUT,
        message="endpoint Ready on restored replicas",
    )
    assert iep["status"]["currentSnapshot"] == name and iep["status"]["workerRole"] == "restore"
    assert condition(iep, "SnapshotReady")["status"] == "True"

    new_engine = {"kind": "vllm", "image": "registry.example/warmstart-worker:0.2"}
    apply(kube, endpoint("llm", namespace, replicas=2, engine=new_engine))
    fresh = kube.wait_for(
        lambda: [
            s
            for s in items(kube, "isnap", namespace, f"{L.ENDPOINT_LABEL}=llm")
            if s["metadata"]["name"] != name
        ],
        timeout=TIMEOUT,
        message="a second snapshot for the new identity",
    )
    assert fresh[0]["spec"]["requestKeyHash"] != snap["spec"]["requestKeyHash"]
    kube.wait_for(
        lambda: get(kube, "pod", namespace, f"{fresh[0]['metadata']['name']}-capture-1"),
        timeout=TIMEOUT,
        message="a new capture pod",
    )
    assert template_role(kube, namespace, "llm") == ("cold", "")
    assert get(kube, "isnap", namespace, name) is not None  # retention 2 keeps the previous one


def test_failed_capture_is_retried_then_invalid_is_replaced(kube, namespace, operator):
    apply(
        kube,
        endpoint("flaky", namespace, snapshot={"maxCaptureAttempts": 2}),
    )
    snap = kube.wait_for(
        lambda: (s := items(kube, "isnap", namespace, f"{L.ENDPOINT_LABEL}=flaky")) and s[0],
        timeout=TIMEOUT,
        message="an InferenceSnapshot",
    )
    name = snap["metadata"]["name"]
    kube.wait_for(
        lambda: get(kube, "pod", namespace, f"{name}-capture-1"), timeout=TIMEOUT, message="capture 1"
    )
    set_snapshot_status(
        kube, namespace, name, {"captureAttempt": 1, "captureState": "Failed", "captureMessage": "criu: boom"}
    )
    retried = kube.wait_for(
        lambda: (s := get(kube, "isnap", namespace, name))["status"].get("attempts") == 2 and s,
        timeout=TIMEOUT,
        message="attempt 2 (backoff 1 s)",
    )
    assert retried["status"]["phase"] == "Pending"
    kube.wait_for(
        lambda: get(kube, "pod", namespace, f"{name}-capture-2"), timeout=TIMEOUT, message="capture 2"
    )
    again = {"captureAttempt": 2, "captureState": "Failed", "captureMessage": "criu: boom again"}
    set_snapshot_status(kube, namespace, name, again)
    degraded = kube.wait_for(
        lambda: (
            (b := get(kube, "iep", namespace, "flaky"))
            and condition(b, "Degraded").get("status") == "True"
            and b
        ),
        timeout=TIMEOUT,
        message="Degraded after maxCaptureAttempts",
    )
    assert "boom again" in condition(degraded, "SnapshotReady")["message"]
    assert template_role(kube, namespace, "flaky") == ("cold", "")

    captured = {"captureAttempt": 2, "captureState": "Captured", "snapshotId": STORE_ID}
    set_snapshot_status(kube, namespace, name, {**captured, "restoreFailures": 3})
    kube.wait_for(
        lambda: get(kube, "isnap", namespace, f"{name}-1"),
        timeout=TIMEOUT,
        message="a fresh snapshot replaces the Invalid one",
    )


def test_a_capture_pod_not_done_in_time_fails_the_attempt_and_is_replaced(kube, namespace, operator):
    """Its pod never got scheduled (no node matches), so no kubelet ever enforces its activeDeadlineSeconds:
    the operator fails the attempt once captureTimeoutSeconds passed, says why, and retries with a new pod."""
    snapshot = {"captureTimeoutSeconds": 30}
    nowhere = {"nodeSelector": {"warmstart.dev/no-such-node": "true"}}
    apply(kube, endpoint("stuck", namespace, snapshot=snapshot, template=nowhere))
    snap = kube.wait_for(
        lambda: (s := items(kube, "isnap", namespace, f"{L.ENDPOINT_LABEL}=stuck")) and s[0],
        timeout=TIMEOUT,
        message="an InferenceSnapshot",
    )
    name = snap["metadata"]["name"]
    first = kube.wait_for(
        lambda: get(kube, "pod", namespace, f"{name}-capture-1"), timeout=TIMEOUT, message="1"
    )
    assert first["spec"]["activeDeadlineSeconds"] == 30
    kube.wait_for(
        lambda: get(kube, "pod", namespace, f"{name}-capture-2"), timeout=TIMEOUT + 30, message="capture 2"
    )
    events = kube.kubectl("get", "events", "-n", namespace, "-o", "json").stdout
    assert "not done within 30s" in events and "didn't match Pod's node affinity/selector" in events


def test_child_deleted_or_edited_by_hand_comes_back(kube, namespace, operator):
    apply(kube, endpoint("sturdy", namespace, snapshot=NO_SNAPSHOTS, replicas=2))
    service = kube.wait_for(
        lambda: get(kube, "service", namespace, "sturdy"), timeout=TIMEOUT, message="service"
    )
    kube.wait_for(lambda: get(kube, "deployment", namespace, "sturdy"), timeout=TIMEOUT, message="deployment")
    kube.kubectl("delete", "service", "sturdy", "-n", namespace)
    kube.kubectl("scale", "deployment/sturdy", "-n", namespace, "--replicas=7")
    back = kube.wait_for(
        lambda: (
            (s := get(kube, "service", namespace, "sturdy"))
            and s["metadata"]["uid"] != service["metadata"]["uid"]
            and s
        ),
        timeout=TIMEOUT,
        message="service recreated",
    )
    assert back["spec"]["selector"][L.ENDPOINT_LABEL] == "sturdy"
    kube.wait_for(
        lambda: get(kube, "deployment", namespace, "sturdy")["spec"]["replicas"] == 2,
        timeout=TIMEOUT,
        message="hand-edited replicas put back",
    )


def test_deleting_the_endpoint_collects_everything(kube, namespace, operator):
    apply(kube, endpoint("gone", namespace, autoscaling=HPA))
    snap = kube.wait_for(
        lambda: items(kube, "isnap", namespace, f"{L.ENDPOINT_LABEL}=gone"),
        timeout=TIMEOUT,
        message="snapshot",
    )
    for kind in ("deployment", "service", "hpa"):
        kube.wait_for(lambda kind=kind: get(kube, kind, namespace, "gone"), timeout=TIMEOUT, message=kind)
    iep = kube.wait_for(
        lambda: (b := get(kube, "iep", namespace, "gone")) and b.get("status", {}).get("phase") and b,
        timeout=TIMEOUT,
        message="a status",
    )
    assert not iep["metadata"].get("finalizers")  # nothing the operator must be around for
    kube.kubectl("delete", "iep", "gone", "-n", namespace, "--wait=true", "--timeout=60s")
    for kind in ("deployment", "service", "hpa"):
        kube.wait_for(
            lambda kind=kind: get(kube, kind, namespace, "gone") is None,
            timeout=TIMEOUT,
            message=f"{kind} garbage-collected",
        )
    kube.wait_for(
        lambda: get(kube, "isnap", namespace, snap[0]["metadata"]["name"]) is None,
        timeout=TIMEOUT,
        message="snapshot collected by the garbage collector (its owner reference)",
    )
    kube.wait_for(
        lambda: not items(kube, "pod", namespace, f"{L.ENDPOINT_LABEL}=gone"),
        timeout=TIMEOUT,
        message="worker and capture pods gone",
    )


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ({"replicas": -1}, "spec.replicas"),
        ({"engine": {"kind": "tgi", "image": "x"}}, "spec.engine.kind"),
        (
            {
                "autoscaling": {
                    "mode": "hpa",
                    "minReplicas": 5,
                    "maxReplicas": 2,
                    "metric": {"name": "m", "target": "1"},
                }
            },
            "spec.autoscaling.minReplicas",
        ),
        (
            {"autoscaling": {"mode": "hpa", "minReplicas": 0, "metric": {"name": "m", "target": "1"}}},
            "spec.autoscaling.minReplicas",
        ),
        ({"autoscaling": {"mode": "hpa"}}, "spec.autoscaling.metric"),
        ({"autoscaling": {"mode": "none", "minReplicas": 0}}, "spec.autoscaling.minReplicas"),
        (
            {"autoscaling": {"mode": "http", "metric": {"name": "m", "target": "1"}}},
            "spec.autoscaling.metric",
        ),
        ({"autoscaling": {**HPA, "http": {}}}, "spec.autoscaling.http"),
        (
            {"autoscaling": {"mode": "http", "http": {"targetConcurrency": 0}}},
            "spec.autoscaling.http.targetConcurrency",
        ),
        ({"autoscaling": {"mode": "http", "http": {"hosts": ["a b"]}}}, "spec.autoscaling.http.hosts[0]"),
        (
            {"autoscaling": {"mode": "http", "http": {"pathPrefixes": ["v1"]}}},
            "spec.autoscaling.http.pathPrefixes[0]",
        ),
        (
            {"autoscaling": {"mode": "http", "http": {"coldStartTimeoutSeconds": 0}}},
            "spec.autoscaling.http.coldStartTimeoutSeconds",
        ),
        (
            {"autoscaling": {"mode": "http", "http": {"responseTimeoutSeconds": "10m"}}},
            "spec.autoscaling.http.responseTimeoutSeconds",
        ),
        ({"snapshot": {"prestage": "Always"}}, "spec.snapshot.prestage"),
        ({"model": None}, "spec.model"),
        ({"resources": {"gpus": 1, "gpuProduct": "NVIDIA H200"}}, "spec.resources.gpuProduct"),
        (
            {"engine": {"kind": "vllm", "image": "w:1", "tensorParallelSize": 2}, "resources": {"gpus": 1}},
            "spec.engine.tensorParallelSize",
        ),
        ({"template": {"volumes": [{"name": "shm", "emptyDir": {}}]}}, "spec.template.volumes"),
        (
            {"template": {"volumes": [{"name": "c"}], "volumeMounts": [{"name": "o", "mountPath": "/c"}]}},
            "spec.template.volumeMounts",
        ),
        (
            {
                "template": {
                    "volumes": [{"name": "cache"}],
                    "volumeMounts": [{"name": "cache", "mountPath": "/run/warmstart/control"}],
                }
            },
            "spec.template.volumeMounts",
        ),
    ],
)
def test_invalid_specs_are_rejected_naming_the_field(kube, namespace, crds, spec, expected):
    body = json.loads(endpoint("bad", namespace, **spec))
    body["spec"] = {k: v for k, v in body["spec"].items() if v is not None}
    result = kube.kubectl("apply", "-f", "-", input=json.dumps(body), check=False)
    assert result.returncode != 0
    assert expected in result.stderr, result.stderr


def test_a_stale_snapshot_storage_is_refused_by_strict_validation_and_pruned_otherwise(kube, namespace, crds):
    """snapshot.storage left the CRD (storage is the chart's choice): kubectl's strict field validation names
    it, and a client that does not validate has it pruned, so no stored endpoint keeps it."""
    stale = endpoint("stale", namespace, snapshot={"retention": 3, "storage": {"claimName": "s"}})
    strict = kube.kubectl("apply", "-f", "-", input=stale, check=False)
    assert strict.returncode != 0 and 'unknown field "spec.snapshot.storage"' in strict.stderr, strict.stderr
    kube.kubectl("apply", "--validate=false", "-f", "-", input=stale)
    stored = get(kube, "iep", namespace, "stale")["spec"]["snapshot"]
    assert "storage" not in stored and stored["retention"] == 3


def test_operator_metrics_and_liveness(kube, namespace, operator):
    apply(kube, endpoint("counted", namespace, snapshot=NO_SNAPSHOTS))
    kube.wait_for(
        lambda: get(kube, "iep", namespace, "counted")["status"].get("phase") == "Ready",
        timeout=TIMEOUT,
        message="endpoint Ready",
    )
    assert operator.alive()
    text = operator.metrics()
    assert "warmstart_operator_reconciles_total{" in text
    assert "warmstart_operator_reconcile_seconds_bucket{" in text
    assert 'warmstart_operator_endpoints{phase="Ready"}' in text


OBJECT_STORE = ("--set", "agent.objectStore.bucket=b", "--set", "agent.objectStore.credentialsSecret=keys")


@pytest.mark.parametrize("store", [(), ("--set", "agent.store.claimName=snapshots"), OBJECT_STORE])
def test_chart_renders_to_objects_the_api_server_accepts(kube, namespace, crds, store):
    server = json.loads(kube.kubectl("version", "-o", "json").stdout)["serverVersion"]["gitVersion"]
    rendered = kube.helm(
        "template",
        "ws",
        str(REPO / "charts" / "warmstart"),
        "--namespace",
        namespace,
        "--kube-version",
        server,
        "--set",
        "metrics.serviceMonitor.enabled=true",
        *store,
    ).stdout
    kinds = {doc["kind"] for doc in yaml.safe_load_all(rendered) if doc}
    assert {
        "Deployment",
        "DaemonSet",
        "ClusterRole",
        "ClusterRoleBinding",
        "ServiceAccount",
        "ServiceMonitor",
    } <= kinds
    result = kube.kubectl(
        "apply", "--dry-run=server", "-n", namespace, "-f", "-", input=rendered, check=False
    )
    assert result.returncode == 0, result.stderr
