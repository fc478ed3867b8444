"""Endpoints at rest cost the API server no write: over several resync periods, while the operator checks
every endpoint, the apiserver's audit log records no create, update, patch or delete by it; nor for an
endpoint once it is deleted."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import audit
import pytest
from control_plane import build
from control_plane.cluster import ControlPlane
from operator_process import OperatorProcess

from warmstart.api import labels as L

pytestmark = [pytest.mark.integration, pytest.mark.spawns]

CRDS = Path(__file__).resolve().parents[2] / "crds"
ENDPOINTS = 500
RESYNC_SECONDS = 10
PERIODS = 3


@pytest.fixture
def audited(tmp_path: Path) -> Iterator[ControlPlane]:
    """A control plane of its own whose apiserver keeps an audit log."""
    if not build.is_cached():
        pytest.skip("the local Kubernetes control plane is not built: run `hack/control-plane build`")
    plane = ControlPlane(state_dir=tmp_path / "kube", nodes=1, audit_log=tmp_path / "audit.log")
    plane.start()
    try:
        plane.kubectl("apply", "--server-side", "-f", str(CRDS))
        plane.kubectl("wait", "--for=condition=Established", "--timeout=60s", "-f", str(CRDS))
        yield plane
    finally:
        plane.stop()


def endpoints_manifest(namespace: str, count: int) -> str:
    spec = {
        "model": {"uri": "org/model"},
        "engine": {"kind": "vllm", "image": "registry.example/warmstart-worker:0.1"},
        "resources": {"gpus": 1},
        "replicas": 0,
        "snapshot": {"enabled": False},
    }
    items = [
        {
            "apiVersion": L.API_VERSION,
            "kind": L.ENDPOINT_KIND,
            "metadata": {"name": f"ep-{index:04d}", "namespace": namespace},
            "spec": spec,
        }
        for index in range(count)
    ]
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": items})


# kopf's record of the spec it handled: written after the handler's own writes, the last of a change's.
HANDLED = "kopf.zalando.org/last-handled-configuration"


def reconciled(kube: ControlPlane, namespace: str, handled: str = "") -> int:
    """The endpoints whose current spec the operator has reconciled and kopf recorded as handled (with
    `handled` in that record, when given)."""
    out = kube.kubectl("get", "iep", "-n", namespace, "-o", "json", timeout=120).stdout
    return sum(
        1
        for item in json.loads(out)["items"]
        if (item.get("status") or {}).get("observedGeneration") == item["metadata"]["generation"]
        and item["status"].get("children")
        and handled in (item["metadata"].get("annotations") or {}).get(HANDLED, "")
    )


def wait_handled(kube: ControlPlane, namespace: str, handled: str = "") -> None:
    kube.wait_for(lambda: reconciled(kube, namespace, handled) == 1, timeout=60, message=f"handled {handled}")


def test_endpoints_at_rest_cost_no_write_over_several_resyncs(audited: ControlPlane, tmp_path: Path) -> None:
    kube, namespace = audited, "idle"
    kube.kubectl("create", "namespace", namespace)
    env = {"WARMSTART_OPERATOR_RESYNC_SECONDS": str(RESYNC_SECONDS)}
    operator = OperatorProcess(kube.kubeconfig, tmp_path / "operator.log", env=env)
    operator.start()
    try:
        kube.kubectl("create", "-f", "-", input=endpoints_manifest(namespace, ENDPOINTS), timeout=300)
        kube.wait_for(
            lambda: reconciled(kube, namespace) == ENDPOINTS, timeout=600, interval=2, message="reconciled"
        )
        time.sleep(RESYNC_SECONDS)  # the creates' own follow-ups are over
        since = audit.now()
        time.sleep(RESYNC_SECONDS * PERIODS)
        until = audit.now()
        time.sleep(2)  # what was answered before `until` is in the log
    finally:
        operator.stop()
    requests = audit.operator_requests(kube.audit_log or Path(), since, until)
    looked_at = {r.name for r in requests if r.verb == "get" and r.resource == L.ENDPOINT_PLURAL}
    assert len(looked_at) == ENDPOINTS, f"the resync checked {len(looked_at)} of {ENDPOINTS} endpoints"
    writes = [r for r in requests if r.write]
    assert not writes, f"{len(writes)} writes at rest: {dict(audit.tally(writes))}"
    assert "Traceback" not in operator.log_path.read_text(errors="replace"), operator.log_tail(120)


@contextlib.contextmanager
def one_endpoint_reconciled(kube: ControlPlane, namespace: str, resync: int, logs: Path) -> Iterator[None]:
    """The operator running (resyncs every `resync` s) and one endpoint in `namespace` it reconciled."""
    kube.kubectl("create", "namespace", namespace)
    env = {"WARMSTART_OPERATOR_RESYNC_SECONDS": str(resync)}
    operator = OperatorProcess(kube.kubeconfig, logs / "operator.log", env=env)
    operator.start()
    try:
        kube.kubectl("create", "-f", "-", input=endpoints_manifest(namespace, 1))
        wait_handled(kube, namespace)
        yield
    finally:
        operator.stop()


def test_nothing_is_sent_for_a_deleted_endpoint(audited: ControlPlane, tmp_path: Path) -> None:
    kube, namespace, resync = audited, "deleted", 2
    with one_endpoint_reconciled(kube, namespace, resync, tmp_path):
        # The audit log stamps a write when its answer is complete, a moment after the object it stored
        # can be read: the creation's last write may otherwise be counted after this point.
        time.sleep(resync)
        since = audit.now()
        kube.kubectl("delete", "iep", "ep-0000", "-n", namespace, "--wait=true")
        # The garbage collector deletes its children meanwhile: each deletion wakes the endpoint up.
        kube.wait_for(
            lambda: not kube.kubectl("get", "deployment,service", "-n", namespace, "-o", "name").stdout,
            timeout=60,
            message="children collected",
        )
        time.sleep(resync * 3)
        until = audit.now()
        time.sleep(2)
    requests = audit.operator_requests(kube.audit_log or Path(), since, until)
    writes = [r for r in requests if r.write and r.namespace == namespace]
    assert not writes, f"{len(writes)} writes after the endpoint was deleted: {dict(audit.tally(writes))}"


CHANGES = 10


def test_each_spec_change_costs_a_bounded_number_of_writes(audited: ControlPlane, tmp_path: Path) -> None:
    """Ten spec changes of one endpoint, each waited for: per change at most one patch of the endpoint
    object (kopf's record of the spec it handled), one of its status and one of each child the change
    touches; the counts are printed."""
    kube, namespace, resync = audited, "churn", 2
    with one_endpoint_reconciled(kube, namespace, resync, tmp_path):
        time.sleep(resync * 2)
        since = audit.now()
        for change in range(1, CHANGES + 1):
            patch = {"spec": {"template": {"annotations": {"churn": str(change)}}}}
            kube.kubectl("patch", "iep", "ep-0000", "-n", namespace, "--type=merge", "-p", json.dumps(patch))
            wait_handled(kube, namespace, f'"churn":"{change}"')
        time.sleep(resync * 3)
        until = audit.now()
        time.sleep(2)
    requests = audit.operator_requests(kube.audit_log or Path(), since, until)
    writes = audit.tally([r for r in requests if r.write and r.namespace == namespace])
    print(f"\n{CHANGES} spec changes: {dict(writes)}")
    assert writes["patch inferenceendpoints"] <= CHANGES, dict(writes)
    assert writes["patch inferenceendpoints/status"] <= CHANGES, dict(writes)
    assert writes["patch deployments"] <= CHANGES, dict(writes)
    assert sum(writes.values()) <= 4 * CHANGES, dict(writes)
