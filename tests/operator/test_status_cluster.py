"""Status that says why, against a real API server, scheduler, controller-manager and kwok nodes: the
scheduler's and the kubelet's reasons in the endpoint's conditions, columns and Events; node agents looked up
where the chart says they run; a spec's every problem at once; Ready while a replica serves; a snapshot
deletion that rolls the workers at most once; endpoints that need no finalizer.

Where a kubelet would report a container that cannot start, the test writes what it would (kwok's pods
always start), on the pod's status subresource."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from cluster_calls import (
    CAPTURED,
    TIMEOUT,
    apply,
    condition,
    endpoint,
    events_about,
    get,
    items,
    set_snapshot_status,
    template_role,
)
from operator_process import OperatorProcess, running_operator

from warmstart.api import labels as L

pytestmark = [pytest.mark.integration, pytest.mark.spawns]

NO_SNAPSHOTS = {"enabled": False}
AGENT_LABELS = {"app.kubernetes.io/component": "agent", "test.warmstart.dev/agent": "status-cluster"}
NOWHERE = {"nodeSelector": {"warmstart.dev/no-such-node": "true"}}
LEGACY_FINALIZER = f"{L.GROUP}/finalizer"


@pytest.fixture(scope="module")
def agent_namespace(kube) -> Iterator[str]:
    name = "status-agents"
    kube.kubectl("create", "namespace", name)
    kube.wait_default_service_account(name)
    yield name
    kube.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="module")
def operator(kube, crds, agent_namespace, tmp_path_factory) -> Iterator[OperatorProcess]:
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    env = {
        "WARMSTART_OPERATOR_RESYNC_SECONDS": "2",
        "WARMSTART_OPERATOR_CAPTURE_BACKOFF_SECONDS": "1",
        "WARMSTART_OPERATOR_AGENT_NAMESPACE": agent_namespace,
        "WARMSTART_OPERATOR_AGENT_SELECTOR": ",".join(f"{k}={v}" for k, v in AGENT_LABELS.items()),
    }
    with running_operator(kube.kubeconfig, log, env) as process:
        yield process


def reconciles(operator: OperatorProcess) -> float:
    """Reconciles the operator ran so far, whatever their result."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in operator.metrics().splitlines()
        if line.startswith("warmstart_operator_reconciles_total{")
    )


def after_resyncs(kube, operator: OperatorProcess, sweeps: int = 3) -> None:
    """Return once the operator has reconciled every endpoint it knows about `sweeps` more times (at
    least): a positive signal that resyncs ran, instead of a sleep."""
    known = sum(
        float(line.rsplit(" ", 1)[1])
        for line in operator.metrics().splitlines()
        if line.startswith("warmstart_operator_endpoints{")
    )
    target = reconciles(operator) + sweeps * max(known, 1)
    kube.wait_for(lambda: reconciles(operator) >= target, timeout=TIMEOUT, message=f"{sweeps} resyncs")


def wait_condition(kube, namespace: str, name: str, kind: str, reason: str) -> dict[str, Any]:
    return kube.wait_for(
        lambda: (b := get(kube, "iep", namespace, name)) and condition(b, kind).get("reason") == reason and b,
        timeout=TIMEOUT,
        message=f"{kind} reason {reason}",
    )


def columns(kube, namespace: str, name: str) -> dict[str, str]:
    """`kubectl get iep` as a user sees it: column -> value."""
    header, row = kube.kubectl("get", "iep", name, "-n", namespace).stdout.splitlines()
    starts = [match.start() for match in re.finditer(r"\S+", header)]
    ends = [*starts[1:], None]
    return {header[a:b].strip(): row[a:b].strip() for a, b in zip(starts, ends, strict=True)}


def test_workers_that_cannot_be_scheduled_say_why_once(kube, namespace, operator):
    apply(kube, endpoint("nowhere", namespace, snapshot=NO_SNAPSHOTS, template=NOWHERE))
    body = wait_condition(kube, namespace, "nowhere", "Ready", "Unschedulable")
    ready, degraded = condition(body, "Ready"), condition(body, "Degraded")
    assert ready["status"] == "False" and "didn't match Pod's node affinity/selector" in ready["message"]
    assert ready["message"].startswith("worker pod nowhere-")
    assert (degraded["status"], degraded["reason"]) == ("True", "Unschedulable")
    assert (body["status"]["phase"], body["status"]["reason"]) == ("Degraded", "Unschedulable")
    shown = columns(kube, namespace, "nowhere")
    assert {k: shown[k] for k in ("NAME", "PHASE", "READY", "RESTORED", "REASON")} == {
        "NAME": "nowhere",
        "PHASE": "Degraded",
        "READY": "0/1",
        "RESTORED": "0",
        "REASON": "Unschedulable",
    }
    after_resyncs(kube, operator)
    assert len(events_about(kube, namespace, "nowhere", "Unschedulable")) == 1  # news once, not per resync


def test_a_claim_that_does_not_exist_is_a_missing_volume(kube, namespace, operator):
    template = {
        "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "absent"}}],
        "volumeMounts": [{"name": "models", "mountPath": "/models"}],
    }
    apply(kube, endpoint("claimless", namespace, snapshot=NO_SNAPSHOTS, template=template))
    body = wait_condition(kube, namespace, "claimless", "Degraded", "MissingVolume")
    assert 'persistentvolumeclaim "absent" not found' in condition(body, "Degraded")["message"]
    assert condition(body, "Ready")["reason"] == "MissingVolume"
    kube.wait_for(
        lambda: events_about(kube, namespace, "claimless", "MissingVolume"), timeout=TIMEOUT, message="event"
    )


def play_kubelet(kube, namespace: str, pod: str, container: dict[str, Any]) -> None:
    """What the kubelet writes for a worker container that does not run: not Ready, and why."""
    not_ready = [{"type": kind, "status": "False"} for kind in ("Ready", "ContainersReady")]
    worker = {"name": L.WORKER_CONTAINER, "ready": False, "started": False, "image": "w", "imageID": ""}
    patch = {"status": {"conditions": not_ready, "containerStatuses": [{**worker, **container}]}}
    kube.kubectl(
        "patch",
        "pod",
        pod,
        "-n",
        namespace,
        "--subresource=status",
        "--type=strategic",
        "-p",
        json.dumps(patch),
    )


def running_worker(kube, namespace: str, name: str) -> str:
    pods = kube.wait_for(
        lambda: [
            p for p in items(kube, "pod", namespace, f"{L.ENDPOINT_LABEL}={name}") if p["status"].get("podIP")
        ],
        timeout=TIMEOUT,
        message="a worker pod kwok started",
    )
    return pods[0]["metadata"]["name"]


CRASHING = {
    "state": {
        "running": None,
        "waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting"},
    },
    "lastState": {"terminated": {"exitCode": 3, "reason": "Error", "message": "no model at /models/tiny"}},
    "restartCount": 4,
}
PULL_FAILING = {
    "state": {
        "running": None,
        "waiting": {"reason": "ImagePullBackOff", "message": 'Back-off pulling image "w"'},
    }
}
CREATING = {"state": {"running": None, "waiting": {"reason": "ContainerCreating"}}}


@pytest.mark.parametrize(
    ("container", "reason", "words"),
    [
        (CRASHING, "CrashLoopBackOff", "restarted 4 times, last exit 3 (Error): no model at /models/tiny"),
        (PULL_FAILING, "ImagePullFailed", 'ImagePullBackOff: Back-off pulling image "w"'),
        (CREATING, "MissingVolume", 'configmap "model-config" not found'),
    ],
    ids=["crash-loop", "image-pull", "mount"],
)
def test_a_worker_the_kubelet_cannot_run_says_why(kube, namespace, operator, container, reason, words):
    apply(kube, endpoint("stalled", namespace, snapshot=NO_SNAPSHOTS))
    pod = running_worker(kube, namespace, "stalled")
    wait_condition(kube, namespace, "stalled", "Ready", "ReplicasReady")
    if reason == "MissingVolume":  # the kubelet says this in an Event only
        uid = get(kube, "pod", namespace, pod)["metadata"]["uid"]
        message = 'MountVolume.SetUp failed for volume "config" : configmap "model-config" not found'
        kube.kubectl("create", "-f", "-", input=json.dumps(mount_event(namespace, pod, uid, message)))
    play_kubelet(kube, namespace, pod, container)
    body = wait_condition(kube, namespace, "stalled", "Ready", reason)
    assert (
        words in condition(body, "Ready")["message"]
        and f"worker pod {pod}" in condition(body, "Ready")["message"]
    )
    assert condition(body, "Degraded")["reason"] == reason
    assert columns(kube, namespace, "stalled")["REASON"] == reason


def mount_event(namespace: str, pod: str, uid: str, message: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{pod}.mount", "namespace": namespace},
        "involvedObject": {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": pod,
            "namespace": namespace,
            "uid": uid,
        },
        "type": "Warning",
        "reason": "FailedMount",
        "message": message,
        "source": {"component": "kubelet"},
        "lastTimestamp": "2026-01-01T00:00:00Z",
        "count": 1,
    }


def agent_pod(namespace: str, node: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"agent-{node}", "namespace": namespace, "labels": dict(AGENT_LABELS)},
        "spec": {"nodeName": node, "containers": [{"name": "agent", "image": "warmstart"}]},
    }


def test_a_capture_pod_on_a_node_without_an_agent_says_so_until_one_runs(
    kube, namespace, agent_namespace, operator
):
    apply(kube, endpoint("lonely", namespace, snapshot={"maxCaptureAttempts": 1}))
    body = wait_condition(kube, namespace, "lonely", "SnapshotReady", "NoNodeAgent")
    snapshot_ready = condition(body, "SnapshotReady")
    capture = kube.wait_for(
        lambda: items(kube, "pod", namespace, f"{L.ENDPOINT_LABEL}=lonely,{L.ROLE_LABEL}=capture"),
        timeout=TIMEOUT,
        message="the capture pod",
    )[0]
    node = capture["spec"]["nodeName"]
    assert snapshot_ready["message"].startswith(f"capture pod {capture['metadata']['name']}: ")
    assert (
        f"no Ready node agent on node {node} (namespace {agent_namespace}, selector "
        in snapshot_ready["message"]
    )
    assert condition(body, "Degraded")["reason"] == "NoNodeAgent"
    kube.wait_for(
        lambda: events_about(kube, namespace, "lonely", "NoNodeAgent"), timeout=TIMEOUT, message="event"
    )

    nodes = [
        n["metadata"]["name"] for n in json.loads(kube.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    ]
    listing = {"apiVersion": "v1", "kind": "List", "items": [agent_pod(agent_namespace, n) for n in nodes]}
    kube.kubectl("apply", "-f", "-", input=json.dumps(listing))
    try:
        body = wait_condition(kube, namespace, "lonely", "SnapshotReady", "Capturing")
        assert condition(body, "Degraded")["status"] == "False"
        assert len(events_about(kube, namespace, "lonely", "NoNodeAgent")) == 1
    finally:
        kube.kubectl("delete", "pods", "--all", "-n", agent_namespace, "--wait=false")


def refuse_new_pods(kube, namespace: str) -> str:
    """An admission policy refusing every new pod in `namespace` (as a quota or a policy engine would)."""
    policy = f"no-pods-{namespace}"[:63]
    constraints = {
        "resourceRules": [
            {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["pods"]}
        ]
    }  # fmt: skip
    listing = {
        "apiVersion": "v1",
        "kind": "List",
        "items": [
            {
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": "ValidatingAdmissionPolicy",
                "metadata": {"name": policy},
                "spec": {
                    "failurePolicy": "Fail",
                    "matchConstraints": constraints,
                    "validations": [
                        {"expression": "false", "message": "no more pods here (the test's policy)"}
                    ],
                },
            },
            {
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": "ValidatingAdmissionPolicyBinding",
                "metadata": {"name": policy},
                "spec": {
                    "policyName": policy,
                    "validationActions": ["Deny"],
                    "matchResources": {
                        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
                    },
                },
            },
        ],
    }
    kube.kubectl("apply", "-f", "-", input=json.dumps(listing))
    probe = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "probe", "namespace": namespace},
        "spec": {"containers": [{"name": "c", "image": "probe"}]},
    }

    def refused() -> bool:
        result = kube.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(probe), check=False)
        return result.returncode != 0 and "the test's policy" in result.stderr

    kube.wait_for(refused, timeout=TIMEOUT, message="the policy in force")
    return policy


def test_ready_stays_true_while_a_scale_up_cannot_start(kube, namespace, operator):
    apply(kube, endpoint("steady", namespace, snapshot=NO_SNAPSHOTS))
    first = wait_condition(kube, namespace, "steady", "Ready", "ReplicasReady")
    assert condition(first, "Ready")["status"] == "True"
    policy = refuse_new_pods(kube, namespace)
    try:
        kube.kubectl("scale", "iep/steady", "-n", namespace, "--replicas=2")
        body = wait_condition(kube, namespace, "steady", "Degraded", "FailedCreate")
    finally:
        kube.kubectl(
            "delete", "validatingadmissionpolicybinding,validatingadmissionpolicy", policy, check=False
        )
    ready = condition(body, "Ready")
    assert (ready["status"], ready["message"]) == ("True", "1/2 replicas ready")
    assert ready["lastTransitionTime"] == condition(first, "Ready")["lastTransitionTime"]
    progressing = condition(body, "Progressing")
    assert (progressing["status"], progressing["reason"]) == ("True", "ScalingUp")
    assert "the test's policy" in condition(body, "Degraded")["message"]
    assert body["status"]["ready"] == "1/2"


def test_zero_replicas_are_scaled_to_zero_not_ready(kube, namespace, operator):
    apply(kube, endpoint("idle", namespace, snapshot=NO_SNAPSHOTS, replicas=0))
    body = wait_condition(kube, namespace, "idle", "Ready", "ScaledToZero")
    assert condition(body, "Ready")["status"] == "False" and condition(body, "Degraded")["status"] == "False"
    assert (body["status"]["phase"], body["status"]["ready"]) == ("ScaledToZero", "0/0")
    assert columns(kube, namespace, "idle")["PHASE"] == "ScaledToZero"


def log_lines(operator: OperatorProcess, namespace: str, name: str) -> list[str]:
    pattern = re.compile(rf"{re.escape(namespace)}/{re.escape(name)}: generation \d+ not reconciled")
    return [
        line for line in operator.log_path.read_text(errors="replace").splitlines() if pattern.search(line)
    ]


def test_an_invalid_spec_names_every_problem_in_one_event_and_one_log_line(kube, namespace, operator):
    """The CRD's schema cannot see these: worker flags and a revision for an engine without one."""
    bad = {"kind": "builtin", "image": "w:1", "args": ["--no-such-flag"]}
    apply(
        kube,
        endpoint("typo", namespace, snapshot=NO_SNAPSHOTS, engine=bad, model={"uri": "t", "revision": "v1"}),
    )
    body = wait_condition(kube, namespace, "typo", "Degraded", "InvalidSpec")
    message = condition(body, "Degraded")["message"]
    assert message.startswith("2 problems in the spec: spec.engine.args: the worker would refuse them")
    assert "; spec.model.revision: is a Hugging Face revision" in message
    assert body["status"]["reason"] == "InvalidSpec" and condition(body, "Ready")["status"] == "False"
    after_resyncs(kube, operator)
    assert len(events_about(kube, namespace, "typo", "InvalidSpec")) == 1
    assert len(log_lines(operator, namespace, "typo")) == 1

    apply(
        kube,
        endpoint("typo", namespace, snapshot=NO_SNAPSHOTS, engine={**bad, "args": []}, model={"uri": "t"}),
    )
    wait_condition(kube, namespace, "typo", "Degraded", "AsExpected")
    apply(kube, endpoint("typo", namespace, snapshot=NO_SNAPSHOTS, engine=bad, model={"uri": "t"}))
    body = wait_condition(kube, namespace, "typo", "Degraded", "InvalidSpec")
    assert condition(body, "Degraded")["message"].startswith("1 problem in the spec: spec.engine.args")
    kube.wait_for(
        lambda: len(events_about(kube, namespace, "typo", "InvalidSpec")) == 2,
        timeout=TIMEOUT,
        message="one more event for the new generation",
    )
    after_resyncs(kube, operator)
    assert len(log_lines(operator, namespace, "typo")) == 2


def revision(kube, namespace: str, name: str) -> int:
    annotations = (get(kube, "deployment", namespace, name) or {}).get("metadata", {}).get("annotations", {})
    return int(annotations.get("deployment.kubernetes.io/revision", 0))


def test_deleting_the_snapshot_in_use_rolls_the_workers_at_most_once(kube, namespace, operator):
    apply(kube, endpoint("rolled", namespace, replicas=2))
    snap = kube.wait_for(
        lambda: (s := items(kube, "isnap", namespace, f"{L.ENDPOINT_LABEL}=rolled")) and s[0],
        timeout=TIMEOUT,
        message="an InferenceSnapshot",
    )
    name, uid = snap["metadata"]["name"], snap["metadata"]["uid"]
    set_snapshot_status(kube, namespace, name, CAPTURED)
    kube.wait_for(
        lambda: get(kube, "iep", namespace, "rolled")["status"].get("currentSnapshot") == name,
        timeout=TIMEOUT,
        message="restoring from the snapshot",
    )
    assert template_role(kube, namespace, "rolled") == ("restore", name)
    before = kube.wait_for(lambda: revision(kube, namespace, "rolled"), timeout=TIMEOUT, message="a revision")

    kube.kubectl("delete", "isnap", name, "-n", namespace, "--wait=true", "--timeout=60s")
    fresh = kube.wait_for(
        lambda: [
            s
            for s in items(kube, "isnap", namespace, f"{L.ENDPOINT_LABEL}=rolled")
            if s["metadata"]["uid"] != uid
        ],
        timeout=TIMEOUT,
        message="a new snapshot captured for the same request key",
    )[0]
    capturing = kube.wait_for(
        lambda: (
            (b := get(kube, "iep", namespace, "rolled"))
            and b["status"].get("currentSnapshot") is None
            and condition(b, "SnapshotReady")["status"] == "False"
            and b
        ),
        timeout=TIMEOUT,
        message="the endpoint without a Ready snapshot",
    )
    assert "serving replicas keep their template" in condition(capturing, "SnapshotReady")["message"]
    assert template_role(kube, namespace, "rolled") == ("restore", name)  # kept: no roll to cold
    assert revision(kube, namespace, "rolled") == before

    new = fresh["metadata"]["name"]
    set_snapshot_status(kube, namespace, new, CAPTURED)
    kube.wait_for(
        lambda: get(kube, "iep", namespace, "rolled")["status"].get("currentSnapshot") == new,
        timeout=TIMEOUT,
        message="restoring from the new snapshot",
    )
    assert template_role(kube, namespace, "rolled") == ("restore", new)
    assert revision(kube, namespace, "rolled") <= before + 1


def test_endpoints_hold_no_finalizer_and_an_old_one_is_let_go(kube, namespace, operator):
    apply(kube, endpoint("plain", namespace, snapshot=NO_SNAPSHOTS))
    body = wait_condition(kube, namespace, "plain", "Ready", "ReplicasReady")
    assert not body["metadata"].get("finalizers")
    legacy = json.loads(endpoint("legacy", namespace, snapshot=NO_SNAPSHOTS))
    legacy["metadata"]["finalizers"] = [LEGACY_FINALIZER]  # what an earlier operator put on every endpoint
    apply(kube, json.dumps(legacy))
    kube.wait_for(
        lambda: not (get(kube, "iep", namespace, "legacy") or {}).get("metadata", {}).get("finalizers"),
        timeout=TIMEOUT,
        message="the earlier version's finalizer removed",
    )


def stray_pod(namespace: str, endpoint_name: str, name: str, report: dict[str, Any]) -> dict[str, Any]:
    """A tenant's plain pod with an endpoint's worker labels and an agent's status annotation: no owner."""
    labels = {L.ENDPOINT_LABEL: endpoint_name, L.COMPONENT_LABEL: L.WORKER_COMPONENT, L.ROLE_LABEL: "restore"}
    annotation = json.dumps({**report, "at": "2026-01-01T00:00:00Z"})
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name, "namespace": namespace, "labels": labels,
            "annotations": {L.STATUS_ANNOTATION: annotation},
        },
        "spec": {"containers": [{"name": L.WORKER_CONTAINER, "image": "w"}]},
    }  # fmt: skip


def test_pods_that_only_carry_an_endpoints_labels_are_not_counted_as_its_replicas(kube, namespace, operator):
    apply(kube, endpoint("counted", namespace, snapshot=NO_SNAPSHOTS))
    wait_condition(kube, namespace, "counted", "Ready", "ReplicasReady")
    reports = [{"restoreSeconds": 1.5}, {"restoreSeconds": 2.0}, {"restoreFailed": "made up"}]
    strays = [stray_pod(namespace, "counted", f"stray-{i}", report) for i, report in enumerate(reports)]
    kube.kubectl("create", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": strays}))
    kube.wait_for(
        lambda: all(
            any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))
            for p in (get(kube, "pod", namespace, s["metadata"]["name"]) for s in strays)
        ),
        timeout=TIMEOUT,
        message="the stray pods Ready",
    )
    after_resyncs(kube, operator)
    body = get(kube, "iep", namespace, "counted")
    assert (body["status"]["restoredReplicas"], body["status"]["ready"]) == (0, "1/1")
    assert condition(body, "Degraded")["reason"] == "AsExpected", condition(body, "Degraded")
    shown = columns(kube, namespace, "counted")
    assert (shown["READY"], shown["RESTORED"]) == ("1/1", "0")
