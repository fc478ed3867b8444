"""The first rollout (cold workers replaced by restore workers once a snapshot is Ready), against a real API
server, scheduler and Deployment controller, on a kwok node of the test's own (tainted, so that no other
test's pod lands there), with two GPUs: one for the cold worker, one for the capture pod. Where the capture
pod's GPU is free again, the cold worker serves until its replacement is Ready, and the endpoint never stops
being Ready; where another pod took it, the operator replaces the workers one at a time until the rollout
ends, then goes back to a surge."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from cluster_calls import CAPTURED, TIMEOUT, apply, endpoint, get, items, set_snapshot_status, template_role
from control_plane.cluster import fake_gpu_node
from operator_process import OperatorProcess, running_operator

from warmstart.api import labels as L
from warmstart.kube.client import Kube, KubeError
from warmstart.operator.rollout import ONE_AT_A_TIME, SURGE

pytestmark = [pytest.mark.integration, pytest.mark.spawns]

TAINT = {"key": "test.warmstart.dev/rollout", "value": "only", "effect": "NoSchedule"}
FIRST = "test-rollout-first"


@pytest.fixture(scope="module")
def operator(kube, crds, tmp_path_factory) -> Iterator[OperatorProcess]:
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    env = {"WARMSTART_OPERATOR_RESYNC_SECONDS": "2", "WARMSTART_OPERATOR_CAPTURE_BACKOFF_SECONDS": "1"}
    with running_operator(kube.kubeconfig, log, env) as process:
        yield process


@pytest.fixture
def node(kube) -> Iterator[str]:
    """A kwok node with two GPUs that only this test's pods tolerate."""
    name = "kwok-rollout"
    body = fake_gpu_node(name)
    body["spec"] = {"taints": [TAINT]}
    for resources in (body["status"]["capacity"], body["status"]["allocatable"]):
        resources["nvidia.com/gpu"] = "2"
    kube.kubectl("apply", "-f", "-", input=json.dumps(body))
    kube.kubectl("wait", "--for=condition=Ready", f"node/{name}", "--timeout=60s")
    yield name
    kube.kubectl("delete", "node", name, "--wait=false", "--ignore-not-found", check=False)


def filler(kube, namespace: str, node: str) -> None:
    """Another workload's pod asking for a GPU of `node`: pending until one is free, then placed before any
    pod of ours (its priority is higher, and it preempts nothing)."""
    priority = {
        "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": FIRST},
        "value": 1000, "preemptionPolicy": "Never",
    }  # fmt: skip
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "filler", "namespace": namespace},
        "spec": {
            "priorityClassName": FIRST,
            "tolerations": [TAINT],
            "nodeSelector": {"kubernetes.io/hostname": node},
            "containers": [
                {"name": "c", "image": "filler", "resources": {"limits": {"nvidia.com/gpu": "1"}}}
            ],
        },
    }
    kube.kubectl(
        "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [priority, pod]})
    )


class Recorder:
    """Every status the endpoint and the Deployment had, and the Deployment's strategies, as watches deliver
    them."""

    def __init__(self, kube, namespace: str, name: str) -> None:
        self.statuses: list[dict[str, Any]] = []
        self.deployments: list[dict[str, Any]] = []
        api = Kube(kube.api_client())
        for kind, into, pick in (
            (L.ENDPOINT_KIND, self.statuses, lambda o: o.get("status") or {}),
            ("Deployment", self.deployments, lambda o: o),
        ):
            _, version = api.list_with_version(kind, namespace, "", {"metadata.name": name})
            watching = threading.Thread(
                target=self._record, args=(api, kind, namespace, name, version, into, pick), daemon=True
            )
            watching.start()

    @staticmethod
    def _record(api: Kube, kind: str, namespace: str, name: str, version: str, into: list, pick) -> None:
        with contextlib.suppress(KubeError):  # the test ended: its namespace or control plane is going
            for _, body in api.watch(kind, namespace, 4 * TIMEOUT, fields={"metadata.name": name},
                                     resource_version=version):  # fmt: skip
                into.append(pick(body))

    @property
    def strategies(self) -> list[dict[str, Any]]:
        return [body["spec"]["strategy"].get("rollingUpdate") or {} for body in self.deployments]

    @property
    def available(self) -> list[int]:
        """The Deployment's available replicas, as its controller counted them at each change."""
        return [int((body.get("status") or {}).get("availableReplicas") or 0) for body in self.deployments]


def serving_cold(kube, namespace: str, name: str) -> dict[str, Any]:
    """The endpoint Ready on its cold worker, its snapshot (captured by no one yet) returned."""
    kube.wait_for(
        lambda: (get(kube, "iep", namespace, name) or {}).get("status", {}).get("readyReplicas") == 1,
        timeout=TIMEOUT,
        message="the cold worker Ready",
    )
    return kube.wait_for(
        lambda: (s := items(kube, "isnap", namespace, f"{L.ENDPOINT_LABEL}={name}")) and s[0],
        timeout=TIMEOUT,
        message="an InferenceSnapshot",
    )


def rolled_to_restore(kube, namespace: str, name: str, snapshot: str) -> None:
    """Wait until the endpoint's only worker restores from `snapshot` and serves."""

    def done() -> bool:
        status = (get(kube, "iep", namespace, name) or {}).get("status") or {}
        pods = items(
            kube, "pod", namespace, f"{L.ENDPOINT_LABEL}={name},{L.COMPONENT_LABEL}={L.WORKER_COMPONENT}"
        )
        return (
            status.get("phase") == "Ready"
            and template_role(kube, namespace, name) == (L.ROLE_RESTORE, snapshot)
            and len(pods) == 1
            and pods[0]["metadata"]["labels"].get(L.ROLE_LABEL) == L.ROLE_RESTORE
        )

    kube.wait_for(done, timeout=TIMEOUT, message="the restore worker alone, Ready")


def worker_spec(node: str) -> dict[str, Any]:
    return {
        "resources": {"gpus": 1},
        "template": {"nodeSelector": {"kubernetes.io/hostname": node}, "tolerations": [TAINT]},
    }


def test_with_room_for_one_more_worker_the_endpoint_serves_throughout_its_first_rollout(
    kube, namespace, operator, node
):
    apply(kube, endpoint("surge", namespace, **worker_spec(node)))
    snapshot = serving_cold(kube, namespace, "surge")
    recorder = Recorder(kube, namespace, "surge")
    set_snapshot_status(kube, namespace, snapshot["metadata"]["name"], CAPTURED)
    rolled_to_restore(kube, namespace, "surge", snapshot["metadata"]["name"])

    seen = [(s.get("phase"), s.get("readyReplicas")) for s in recorder.statuses]
    assert seen and all(phase == "Ready" and ready == 1 for phase, ready in seen), seen
    assert min(recorder.available) == 1, recorder.available
    assert recorder.strategies and all(s == SURGE for s in recorder.strategies), recorder.strategies


def test_without_room_the_workers_are_replaced_one_at_a_time_until_the_rollout_ends(
    kube, namespace, operator, node
):
    apply(kube, endpoint("swap", namespace, **worker_spec(node)))
    snapshot = serving_cold(kube, namespace, "swap")
    filler(kube, namespace, node)  # takes the capture pod's GPU once it is free
    recorder = Recorder(kube, namespace, "swap")
    set_snapshot_status(kube, namespace, snapshot["metadata"]["name"], CAPTURED)
    rolled_to_restore(kube, namespace, "swap", snapshot["metadata"]["name"])
    kube.wait_for(
        lambda: get(kube, "deployment", namespace, "swap")["spec"]["strategy"]["rollingUpdate"] == SURGE,
        timeout=TIMEOUT,
        message="a surge again once the rollout ended",
    )
    assert ONE_AT_A_TIME in recorder.strategies, recorder.strategies
    # The surge pod that found no room was no problem to report: it waited for the cold worker to go.
    reasons = [s.get("reason") for s in recorder.statuses if s.get("phase") == "Degraded"]
    assert "Unschedulable" not in reasons, recorder.statuses
    kube.kubectl("delete", "priorityclass", FIRST, "--ignore-not-found")
