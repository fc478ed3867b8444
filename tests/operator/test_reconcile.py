"""The reconcile's pure decisions: which template the workers run, which causes are news."""

from __future__ import annotations

import datetime as dt
import re
from typing import Any

import pytest
from builders import endpoint_body, endpoint_spec, snapshot_object

from warmstart.api import labels as L
from warmstart.api.endpoint import EndpointStatus
from warmstart.kube.client import KubeError
from warmstart.operator import children
from warmstart.operator.diagnosis import Cause
from warmstart.operator.placement import NODE_LOCAL, OBJECT_STORE, SHARED_VOLUME
from warmstart.operator.reconcile import (
    ChildApplyFailed,
    MissingAPI,
    apply_optional_children,
    cause_events,
    current_capture_pods,
    sync_snapshots,
    worker_node,
    worker_template,
)
from warmstart.operator.request_key import request_key, request_key_hash
from warmstart.operator.snapshots import SnapshotPlan, plan_snapshots
from warmstart.operator.spec import parse_spec
from warmstart.operator.status import Workload, endpoint_status

HASH = "ab" * 32
OTHER_HASH = "cd" * 32
SPEC = parse_spec(endpoint_spec())
OWNER = children.Owner.from_body(endpoint_body())
T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def deployment(role: str, snapshot: str, request_hash: str = HASH, node: str = "") -> dict[str, Any]:
    return children.deployment(OWNER, SPEC, role, snapshot, request_hash, node)


def test_a_ready_snapshot_is_restored_from():
    plan = SnapshotPlan(role=L.ROLE_RESTORE, ready="new")
    assert worker_template(SPEC, plan, deployment(L.ROLE_RESTORE, "old"), HASH) == (L.ROLE_RESTORE, "new")


def test_while_no_snapshot_is_ready_the_restore_template_of_the_same_key_is_kept():
    capturing = SnapshotPlan(role=L.ROLE_COLD, active="again", capture_attempt=1)
    kept = worker_template(SPEC, capturing, deployment(L.ROLE_RESTORE, "deleted"), HASH)
    assert kept == (L.ROLE_RESTORE, "deleted")
    # The pod template is the same object as before: the Deployment controller rolls nothing.
    before = deployment(L.ROLE_RESTORE, "deleted")["spec"]["template"]
    assert children.deployment(OWNER, SPEC, *kept, HASH)["spec"]["template"] == before


def test_a_template_of_another_key_a_cold_one_or_disabled_snapshots_go_cold():
    capturing = SnapshotPlan(role=L.ROLE_COLD, active="again", capture_attempt=1)
    cold = (L.ROLE_COLD, "")
    assert worker_template(SPEC, capturing, deployment(L.ROLE_RESTORE, "old", OTHER_HASH), HASH) == cold
    assert worker_template(SPEC, capturing, deployment(L.ROLE_COLD, ""), HASH) == cold
    assert worker_template(SPEC, capturing, None, HASH) == cold
    disabled = parse_spec(endpoint_spec(snapshot={"enabled": False}))
    assert (
        worker_template(disabled, SnapshotPlan(role=L.ROLE_COLD), deployment(L.ROLE_RESTORE, "old"), HASH)
        == cold
    )


def test_restores_prefer_the_ready_snapshots_node_only_with_a_node_local_store():
    plan = SnapshotPlan(role=L.ROLE_RESTORE, ready="new", ready_node="gpu-2")
    restore = (L.ROLE_RESTORE, "new")
    assert worker_node(restore, plan, deployment(L.ROLE_COLD, ""), NODE_LOCAL) == "gpu-2"
    assert worker_node(restore, plan, None, SHARED_VOLUME) == ""
    assert worker_node(restore, plan, None, OBJECT_STORE) == ""
    assert worker_node((L.ROLE_COLD, ""), SnapshotPlan(role=L.ROLE_COLD), None, NODE_LOCAL) == ""


def test_a_kept_restore_template_keeps_its_node_so_nothing_rolls():
    capturing = SnapshotPlan(role=L.ROLE_COLD, active="again", capture_attempt=1)
    before = deployment(L.ROLE_RESTORE, "deleted", node="gpu-2")
    kept = worker_template(SPEC, capturing, before, HASH)
    node = worker_node(kept, capturing, before, NODE_LOCAL)
    assert node == "gpu-2"
    assert (
        children.deployment(OWNER, SPEC, *kept, HASH, node)["spec"]["template"] == before["spec"]["template"]
    )
    assert worker_node(kept, capturing, before, OBJECT_STORE) == ""  # the store changed kind since


def test_only_the_current_attempts_capture_pod_is_diagnosed():
    pods = [{"metadata": {"name": children.capture_pod_name("s", n)}} for n in (1, 2)]
    assert current_capture_pods(SnapshotPlan(role=L.ROLE_COLD, active="s", capture_attempt=2), pods) == [
        pods[1]
    ]
    assert current_capture_pods(SnapshotPlan(role=L.ROLE_RESTORE, ready="s"), pods) == []


class StatusNamingKube:
    """A Kube of one InferenceSnapshot and its capture pods that records, as each capture pod is created,
    which pod the snapshot's status names (what a node agent handling that pod reads then)."""

    def __init__(self, snapshot: dict[str, Any], pods: list[str]) -> None:
        self.snapshot = snapshot
        self.pods = {name: {"metadata": {"name": name}} for name in pods}
        self.named_at_create: dict[str, str | None] = {}

    def create(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        assert obj["kind"] == "Pod", obj["kind"]
        name = obj["metadata"]["name"]
        self.named_at_create[name] = self.snapshot["status"].get("capturePod")
        self.pods[name] = obj
        return obj

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        assert (kind, name) == (L.SNAPSHOT_KIND, self.snapshot["metadata"]["name"])
        return self.snapshot

    def list(self, kind: str, namespace: str, selector: Any) -> list[dict[str, Any]]:
        assert kind == "Pod"
        return list(self.pods.values())

    def delete(self, kind: str, namespace: str, name: str) -> bool:
        return self.pods.pop(name, None) is not None

    def patch_status(self, kind: str, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        assert (kind, name) == (L.SNAPSHOT_KIND, self.snapshot["metadata"]["name"])
        self.snapshot["status"].update(status)
        return self.snapshot


def test_a_retried_capture_pod_is_named_in_the_snapshots_status_before_it_exists():
    """The node agent handles a capture pod once, as soon as it sees it bound, and passes over one that the
    snapshot's `capturePod` does not name (an earlier attempt's): were the retry's pod created before the
    status named it, an agent quick enough would read the previous attempt's name and never capture it."""
    key = request_key(SPEC)
    request_hash = request_key_hash(key)
    name = f"{OWNER.name}-{request_hash[:10]}"
    failed = snapshot_object(
        name, request_hash, "Failed", "2026-01-01T00:00:00Z", attempts=1, message="No space left on device",
        retryAfter="2026-01-01T00:00:05Z", capturePod=children.capture_pod_name(name, 1),
    )  # fmt: skip
    plan = plan_snapshots(OWNER, SPEC, request_hash, key, [failed], T0 + dt.timedelta(minutes=1))
    assert plan.capture_attempt == 2, plan
    kube = StatusNamingKube(failed, [children.capture_pod_name(name, 1)])

    sync_snapshots(kube, OWNER, SPEC, plan, request_hash)  # type: ignore[arg-type]

    retried = children.capture_pod_name(name, 2)
    assert set(kube.pods) == {retried}
    assert kube.named_at_create == {retried: retried}
    assert failed["status"]["attempts"] == 2 and failed["status"]["capturePod"] == retried


def status_with(previous: EndpointStatus, **causes: Any) -> EndpointStatus:
    return endpoint_status(
        generation=1,
        snapshots_enabled=True,
        plan=SnapshotPlan(
            role=L.ROLE_COLD, active="s", active_phase="Pending", attempts=1, capture_attempt=1
        ),
        work=Workload(desired=1, replicas=1),
        selector="a=b",
        request_hash=HASH,
        pods=[],
        previous=previous,
        now=T0,
        **causes,
    )


NONE = EndpointStatus()  # a fresh endpoint's


def cause(reason: str, kind: str, detail: str) -> Cause:
    return Cause(reason, detail, kind, (f"{kind}-pod",))


def test_a_cause_is_an_event_once_and_again_only_when_it_changes():
    unschedulable = cause(
        "Unschedulable", "worker", "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."
    )
    first = status_with(NONE, worker_causes=[unschedulable])
    assert cause_events(NONE, first) == [
        ("Warning", "Unschedulable", f"worker pod worker-pod: {unschedulable.detail}")
    ]
    # The same reason with another message (the scheduler counts nodes again): not news.
    reworded = cause("Unschedulable", "worker", "0/4 nodes are available: 4 Insufficient nvidia.com/gpu.")
    assert cause_events(first, status_with(first, worker_causes=[reworded])) == []
    pulled = cause("ImagePullFailed", "worker", "container worker: ErrImagePull: not found")
    assert [e[1] for e in cause_events(first, status_with(first, worker_causes=[pulled]))] == [
        "ImagePullFailed"
    ]
    cleared = status_with(first)
    assert cause_events(first, cleared) == []


def test_a_capture_cause_beside_a_worker_cause_is_its_own_event():
    worker = cause("Unschedulable", "worker", "0/3 nodes are available")
    capture = cause("NoNodeAgent", "capture", "no Ready node agent on node n1")
    events = cause_events(NONE, status_with(NONE, worker_causes=[worker], capture_causes=[capture]))
    assert [(kind, reason) for kind, reason, _ in events] == [
        ("Warning", "NoNodeAgent"),
        ("Warning", "Unschedulable"),
    ]


def test_the_same_cause_in_two_conditions_is_one_event():
    capture = cause("NoNodeAgent", "capture", "no Ready node agent on node n1")
    events = cause_events(NONE, status_with(NONE, capture_causes=[capture]))
    assert [reason for _, reason, _ in events] == ["NoNodeAgent"]


class RefusingKube:
    """Serves no kind but Deployment and Service: applying any other is a 404."""

    def get(self, kind: str, namespace: str, name: str) -> None:
        return None

    def delete(self, kind: str, namespace: str, name: str) -> None:
        pass

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        raise KubeError(404, f"the server could not find the requested resource ({obj['kind']})")


METRIC = {"name": "m", "target": "1"}
NOT_SERVED = "is not served by this cluster: install"


@pytest.mark.parametrize(
    ("autoscaling", "missing"),
    [
        ({"mode": "keda", "metric": METRIC}, f"keda.sh/v1alpha1 ScaledObject {NOT_SERVED} KEDA or use"),
        ({"mode": "http"}, f"http.keda.sh/v1alpha1 HTTPScaledObject {NOT_SERVED} the KEDA HTTP add-on"),
        ({"mode": "hpa", "metric": METRIC}, None),  # autoscaling/v2 is always served: the server refused it
    ],
)
def test_a_kind_the_cluster_does_not_serve_names_what_to_install(autoscaling, missing):
    spec = parse_spec(endpoint_spec(autoscaling=autoscaling))
    refused = ChildApplyFailed if missing is None else MissingAPI
    with pytest.raises(refused, match=re.escape(missing or "HTTP 404")):
        apply_optional_children(RefusingKube(), OWNER, spec, [])
