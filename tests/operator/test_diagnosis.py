"""Why pods do not progress, read from pod status as the scheduler and the kubelet write it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from warmstart.api import labels as L
from warmstart.host.command_settings import SettingsError, load
from warmstart.operator.diagnosis import (
    AgentLookup,
    causes,
    deployment_causes,
    deployment_pods,
    facts_changes,
    parse_selector,
    pod_cause,
    restore_causes,
)
from warmstart.operator.settings import OperatorSettings

NO_GPU = (
    "0/3 nodes are available: 3 Insufficient nvidia.com/gpu. preemption: 0/3 nodes are available: "
    "3 No preemption victims found for incoming pod."
)
NO_CLAIM = 'persistentvolumeclaim "models" not found. preemption: 0/2 nodes are available: 2 Preemption ...'
LOOKUP = AgentLookup("warmstart", {"app.kubernetes.io/component": "agent"})


def pod(
    name: str = "w-1",
    role: str = L.ROLE_COLD,
    node: str = "",
    ready: bool = False,
    scheduled: dict[str, Any] | None = None,
    containers: list[dict[str, Any]] | None = None,
    terminating: bool = False,
) -> dict[str, Any]:
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    if scheduled is not None:
        conditions.append({"type": "PodScheduled", **scheduled})
    meta: dict[str, Any] = {"name": name, "uid": f"uid-{name}", "labels": {L.ROLE_LABEL: role}}
    if terminating:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "metadata": meta,
        "spec": {"nodeName": node} if node else {},
        "status": {"conditions": conditions, "containerStatuses": containers or []},
    }


def waiting(reason: str, message: str = "", **extra: Any) -> dict[str, Any]:
    state = {"reason": reason, **({"message": message} if message else {})}
    return {"name": "worker", "ready": False, "state": {"waiting": state}, **extra}


UNSCHEDULABLE = {"status": "False", "reason": "Unschedulable", "message": NO_GPU}


def test_unschedulable_carries_the_schedulers_message():
    assert pod_cause(pod(scheduled=UNSCHEDULABLE)) == ("Unschedulable", NO_GPU)


def test_a_missing_claim_is_a_missing_volume():
    found = pod_cause(pod(scheduled={"status": "False", "reason": "Unschedulable", "message": NO_CLAIM}))
    assert found == ("MissingVolume", NO_CLAIM)


@pytest.mark.parametrize(
    ("kubelet_reason", "message", "cause"),
    [
        ("ErrImagePull", 'failed to pull image "w:404": not found', "ImagePullFailed"),
        ("ImagePullBackOff", 'Back-off pulling image "w:404"', "ImagePullFailed"),
        (
            "ErrImageNeverPull",
            'Container image "w:1" is not present with pull policy of Never',
            "ImagePullFailed",
        ),
        ("CreateContainerConfigError", 'secret "hf-token" not found', "ContainerConfigError"),
        ("RunContainerError", "exec: warmstart: not found", "ContainerCreateFailed"),
    ],
)
def test_waiting_containers_name_the_kubelets_reason_and_message(kubelet_reason, message, cause):
    scheduled = {"status": "True"}
    found = pod_cause(pod(node="n1", scheduled=scheduled, containers=[waiting(kubelet_reason, message)]))
    assert found == (cause, f"container worker: {kubelet_reason}: {message}")


def test_a_crash_loop_names_the_restarts_and_the_last_exit():
    last = {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}
    crashing = waiting("CrashLoopBackOff", "back-off 40s restarting", restartCount=4, lastState=last)
    found = pod_cause(pod(node="n1", containers=[crashing]))
    assert found == (
        "CrashLoopBackOff",
        "container worker: CrashLoopBackOff: back-off 40s restarting "
        "(restarted 4 times, last exit 137 (OOMKilled))",
    )


def test_container_creating_is_a_cause_only_with_the_kubelets_mount_failure():
    creating = pod(node="n1", containers=[waiting("ContainerCreating")])
    assert pod_cause(creating) is None  # starting normally, as far as anyone can tell
    failure = 'MountVolume.SetUp failed for volume "cache" : configmap "models" not found'
    assert pod_cause(creating, failure) == ("MissingVolume", f"container worker is not created: {failure}")


def test_starting_running_and_terminating_pods_have_no_cause():
    assert pod_cause(pod()) is None  # not looked at by the scheduler yet
    assert (
        pod_cause(pod(node="n1", ready=True, containers=[{"name": "worker", "state": {"running": {}}}]))
        is None
    )
    assert pod_cause(pod(scheduled=UNSCHEDULABLE, terminating=True)) is None


def test_pods_with_the_same_cause_are_grouped_in_order():
    pods = [
        pod("w-1", scheduled=UNSCHEDULABLE),
        pod("w-2", node="n1", containers=[waiting("ImagePullBackOff", "Back-off")]),
        pod("w-3", scheduled=UNSCHEDULABLE),
        pod("w-4", node="n1", ready=True),
    ]
    found = causes(pods, "worker", {}, None, None)
    assert [(c.reason, c.pods) for c in found] == [
        ("Unschedulable", ("w-1", "w-3")),
        ("ImagePullFailed", ("w-2",)),
    ]
    assert found[0].message == f"2 worker pods (w-1, w-3): {NO_GPU}"
    assert found[1].message == "worker pod w-2: container worker: ImagePullBackOff: Back-off"


def test_many_pods_are_counted_and_a_few_named():
    pods = [pod(f"w-{i}", scheduled=UNSCHEDULABLE) for i in range(5)]
    (found,) = causes(pods, "worker", {}, None, None)
    assert found.message.startswith("5 worker pods (w-0, w-1, w-2 and 2 more): 0/3 nodes")


def test_capture_and_restore_pods_need_a_ready_agent_on_their_node():
    pods = [
        pod("cap", role=L.ROLE_CAPTURE, node="n1"),
        pod("r-1", role=L.ROLE_RESTORE, node="n2", ready=True),
        pod("r-2", role=L.ROLE_RESTORE, node="n3"),
        pod("cold", role=L.ROLE_COLD, node="n1"),  # a cold pod needs no agent
        pod("r-3", role=L.ROLE_RESTORE, scheduled=UNSCHEDULABLE),  # no node yet: the scheduler's cause
    ]
    found = causes(pods, "worker", {}, {"n3"}, LOOKUP)
    assert [(c.reason, c.pods) for c in found] == [
        ("NoNodeAgent", ("cap",)),
        ("NoNodeAgent", ("r-1",)),
        ("Unschedulable", ("r-3",)),
    ]
    assert (
        "no Ready node agent on node n1 (namespace warmstart, selector app.kubernetes.io/component=agent)"
        in (found[0].message)
    )
    assert "nothing will capture it" in found[0].message and "cold-starts" in found[1].message
    assert causes(pods[:3], "worker", {}, None, None) == []  # no lookup: not checked


def test_agent_lookup_comes_from_both_settings_or_none(monkeypatch):
    monkeypatch.setenv("WARMSTART_OPERATOR_AGENT_NAMESPACE", "warmstart")
    monkeypatch.setenv("WARMSTART_OPERATOR_AGENT_SELECTOR",
                       "app.kubernetes.io/name=warmstart, app.kubernetes.io/component=agent")  # fmt: skip
    assert load(OperatorSettings).agents == AgentLookup(
        "warmstart", {"app.kubernetes.io/name": "warmstart", "app.kubernetes.io/component": "agent"}
    )
    monkeypatch.delenv("WARMSTART_OPERATOR_AGENT_SELECTOR")
    with pytest.raises(SettingsError, match="set together"):
        load(OperatorSettings)
    monkeypatch.delenv("WARMSTART_OPERATOR_AGENT_NAMESPACE")
    assert load(OperatorSettings).agents is None


@pytest.mark.parametrize("text", ["app", "a!=b", "=b", "a==b"])
def test_only_equality_selectors_are_taken(text):
    with pytest.raises(ValueError, match="key=value"):
        parse_selector(text, "SETTING")


def test_pods_a_deployment_cannot_create_are_its_replica_failure():
    quota = 'pods "llm-7d9-x" is forbidden: exceeded quota: pods, requested: pods=1, used: pods=1, limited: 1'
    deployment = {
        "metadata": {"name": "llm"},
        "status": {
            "conditions": [
                {"type": "Available", "status": "True"},
                {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate", "message": quota},
            ]
        },
    }
    (found,) = deployment_causes(deployment)
    assert (found.reason, found.message) == ("FailedCreate", f"Deployment llm cannot create pods: {quota}")
    deployment["status"]["conditions"][1]["status"] = "False"
    assert deployment_causes(deployment) == [] and deployment_causes(None) == []


def made_by(body: dict[str, Any], replica_set: str | None, template_hash: str | None, **ref: Any) -> dict:
    """`body` with the pod-template-hash label and a controller reference to ReplicaSet `replica_set`."""
    meta = body["metadata"]
    if template_hash is not None:
        meta["labels"]["pod-template-hash"] = template_hash
    if replica_set is not None:
        owner = {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": replica_set, "uid": "rs-uid"}
        meta["ownerReferences"] = [{**owner, "controller": True, **ref}]
    return body


def test_only_the_pods_the_endpoints_replica_sets_control_are_its_workers():
    mine = [made_by(pod("tiny-7f9-a"), "tiny-7f9", "7f9"), made_by(pod("tiny-5c4-b"), "tiny-5c4", "5c4")]
    strays = [
        pod("plain"),  # the endpoint's labels and nothing else
        made_by(pod("copied-label"), None, "7f9"),
        made_by(pod("other-deployment"), "tinier-7f9", "7f9"),
        made_by(pod("hash-not-its-own"), "tiny-7f9", "5c4"),
        made_by(pod("not-controller"), "tiny-7f9", "7f9", controller=False),
        made_by(pod("not-a-replica-set"), "tiny-7f9", "7f9", kind="StatefulSet"),
        made_by(pod("no-uid"), "tiny-7f9", "7f9", uid=""),
    ]
    assert deployment_pods([*strays, *mine], "tiny") == mine


def restore_report(body: dict[str, Any], report: dict[str, Any]) -> dict[str, Any]:
    body["metadata"]["annotations"] = {L.STATUS_ANNOTATION: json.dumps(report)}
    return body


def test_restore_pods_the_agent_did_not_restore_are_a_cause_grouped_by_its_reason():
    tampered = "pulling snapshot s1 from the object store failed: blob sha256:ab do not match (tampered)"
    pods = [
        restore_report(pod("w-1", L.ROLE_RESTORE, ready=True), {"restoreFailed": tampered}),
        restore_report(pod("w-2", L.ROLE_RESTORE), {"restoreFailed": tampered}),
        restore_report(pod("w-3", L.ROLE_RESTORE), {"restoreFailed": "another image"}),
        restore_report(pod("w-4", L.ROLE_RESTORE, ready=True), {"restoreSeconds": 1.5}),
        restore_report(pod("w-5", L.ROLE_RESTORE, terminating=True), {"restoreFailed": tampered}),
        restore_report(pod("w-6", L.ROLE_COLD), {"restoreFailed": tampered}),
        pod("w-7", L.ROLE_RESTORE),
    ]
    found = restore_causes(pods)
    assert [(c.reason, c.pods) for c in found] == [
        ("RestoreRefused", ("w-1", "w-2")),
        ("RestoreRefused", ("w-3",)),
    ]
    assert found[0].message == f"2 worker pods (w-1, w-2): not restored, started cold: {tampered}"


def test_restore_pods_refused_because_their_model_or_engine_changed_are_read_newest_first():
    changed = "the pod differs from the snapshot's capture: model /m: model.safetensors changed content"

    def refused(name: str, at: str, **report: Any) -> dict[str, Any]:
        body = pod(name, L.ROLE_RESTORE, terminating=name.endswith("gone"))
        body["metadata"]["labels"][L.SNAPSHOT_LABEL] = "s1"
        return restore_report(body, {"restoreFailed": changed, "at": at, **report})

    pods = [
        refused("w-1", "2026-01-01T00:00:01Z", refused="ModelChanged", factsDigest="d1"),
        refused("w-2", "2026-01-01T00:00:02Z", refused="EngineChanged", factsDigest="d2"),
        refused("w-gone", "2026-01-01T00:00:03Z", refused="ModelChanged", factsDigest="d3"),
        refused("w-3", "2026-01-01T00:00:04Z"),  # another refusal (an image, a GPU): nothing to capture for
        refused("w-4", "2026-01-01T00:00:05Z", refused="NoSuchReason", factsDigest="d4"),
        refused("w-5", "2026-01-01T00:00:06Z", refused="ModelChanged"),  # no digest: not typed
    ]
    found = facts_changes(pods)
    assert [(c.snapshot, c.reason, c.facts_digest) for c in found] == [
        ("s1", "EngineChanged", "d2"),
        ("s1", "ModelChanged", "d1"),
    ]
    assert found[1].message == f"restore pod w-1 refused: {changed}"
