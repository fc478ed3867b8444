"""What each ServiceAccount of the chart may and may not do, asked of the real API server.

The chart's RBAC is rendered by helm, applied to the local control plane, and checked with
`kubectl auth can-i --as system:serviceaccount:...`: the node agent gets what its code calls and
nothing more (no Secrets, no pod exec or deletion, no writes to endpoints); the operator cannot read
Secrets either.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from warmstart.agent.kube_status import KubeStatus
from warmstart.api import labels as L

pytestmark = [pytest.mark.integration, pytest.mark.reliability, pytest.mark.spawns]

CHART = Path(__file__).resolve().parents[2] / "charts" / "warmstart"
KUBE_VERSION = "1.35.0"

AGENT_MAY = [
    ("watch", "pods"), ("list", "pods"), ("patch", "pods"), ("get", "replicasets.apps"),
    ("get", "deployments.apps"), ("get", "inferenceendpoints.warmstart.dev"),
    ("watch", "inferencesnapshots.warmstart.dev"), ("patch", "inferencesnapshots.warmstart.dev/status"),
    ("create", "events"),
]  # fmt: skip
AGENT_MAY_NOT = [
    ("get", "secrets"), ("list", "secrets"), ("get", "nodes"), ("create", "pods"), ("delete", "pods"),
    ("create", "pods/exec"), ("patch", "inferenceendpoints.warmstart.dev"),
    ("patch", "inferencesnapshots.warmstart.dev"), ("delete", "inferencesnapshots.warmstart.dev"),
    ("patch", "inferenceendpoints.warmstart.dev/status"), ("patch", "deployments.apps"),
    ("get", "configmaps"), ("create", "serviceaccounts/token"),
]  # fmt: skip
NODE_A, NODE_B = "kwok-gpu-0", "kwok-gpu-1"  # the control plane's two fake nodes
POLICY_API = "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy"
OPERATOR_MAY_NOT = [("get", "secrets"), ("list", "secrets"), ("create", "pods/exec"), ("patch", "nodes")]


def _rendered(kube: Any, release: str, namespace: str) -> list[dict[str, Any]]:
    result = kube.helm(
        "template", release, str(CHART), "--namespace", namespace, "--kube-version", KUBE_VERSION,
        "--api-versions", POLICY_API, "--show-only", "templates/agent-rbac.yaml",
        "--show-only", "templates/operator-rbac.yaml", "--show-only", "templates/agent-pod-policy.yaml",
    )  # fmt: skip
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def _service_account(objects: list[dict[str, Any]], component: str) -> str:
    for obj in objects:
        if (
            obj["kind"] == "ServiceAccount"
            and obj["metadata"]["labels"].get("app.kubernetes.io/component") == component
        ):
            return obj["metadata"]["name"]
    raise AssertionError(f"the chart renders no ServiceAccount for the {component}")


def _can(kube: Any, namespace: str, account: str, verb: str, resource: str) -> bool:
    kind, _, subresource = resource.partition("/")  # `x/y` alone would name object y of kind x
    answer = kube.kubectl(
        "auth", "can-i", verb, kind, *([f"--subresource={subresource}"] if subresource else []),
        "--namespace", namespace, "--as", f"system:serviceaccount:{namespace}:{account}", check=False,
    )  # fmt: skip
    assert answer.stdout.strip() in ("yes", "no"), answer.stdout + answer.stderr
    return answer.stdout.strip() == "yes"


@pytest.fixture(scope="module")
def crds(kube: Any) -> None:
    crd_dir = CHART.parents[1] / "crds"
    kube.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd_dir))
    kube.kubectl("wait", "--for=condition=Established", "--timeout=60s", "-f", str(crd_dir))


@pytest.fixture
def chart_rbac(kube: Any, namespace: str, crds: None) -> Any:
    release = namespace[-20:].strip("-")
    objects = _rendered(kube, release, namespace)
    manifest = yaml.safe_dump_all(objects)
    kube.kubectl("apply", "-f", "-", input=manifest)
    yield objects
    kube.kubectl("delete", "--ignore-not-found", "--wait=false", "-f", "-", input=manifest, check=False)


def test_the_agent_may_do_what_its_code_calls_and_nothing_more(kube: Any, namespace: str, chart_rbac) -> None:
    agent = _service_account(chart_rbac, "agent")
    refused = [
        (verb, resource) for verb, resource in AGENT_MAY if not _can(kube, namespace, agent, verb, resource)
    ]
    allowed = [
        (verb, resource) for verb, resource in AGENT_MAY_NOT if _can(kube, namespace, agent, verb, resource)
    ]
    assert refused == [] and allowed == []


def test_the_operator_cannot_read_secrets_or_exec(kube: Any, namespace: str, chart_rbac) -> None:
    operator = _service_account(chart_rbac, "operator")
    allowed = [(verb, res) for verb, res in OPERATOR_MAY_NOT if _can(kube, namespace, operator, verb, res)]
    assert allowed == []
    assert _can(kube, namespace, operator, "create", "inferencesnapshots.warmstart.dev")


def _pod(kube: Any, namespace: str, name: str, node: str, account: str = "default") -> Any:
    """A pod object bound to `node` (a fake node: the API server's checks are what is tested)."""
    from kubernetes import client

    body = {
        "metadata": {"name": name, "labels": {"app": name}, "annotations": {"team": "a"}},
        "spec": {"nodeName": node, "serviceAccountName": account,
                 "containers": [{"name": "worker", "image": "warmstart:test"}]},
    }  # fmt: skip
    return client.CoreV1Api(kube.api_client()).create_namespaced_pod(namespace, body)


def _as_agent(kube: Any, namespace: str, account: str, bound_to: Any | None) -> Any:
    """The core API as the agent's ServiceAccount, with a token bound to pod `bound_to` (as the kubelet
    mounts it into the agent's pod), or bound to nothing."""
    from kubernetes import client

    admin = client.CoreV1Api(kube.api_client())
    spec: dict[str, Any] = {"audiences": [], "expirationSeconds": 600}
    if bound_to is not None:
        meta = bound_to.metadata
        spec["boundObjectRef"] = {"apiVersion": "v1", "kind": "Pod", "name": meta.name, "uid": meta.uid}
    token = admin.create_namespaced_service_account_token(account, namespace, {"spec": spec}).status.token
    configuration = copy.copy(kube.api_client().configuration)
    configuration.cert_file = configuration.key_file = None
    configuration.api_key = {"authorization": f"Bearer {token}"}
    return client.CoreV1Api(client.ApiClient(configuration))


def _refused(call: Callable[[], Any]) -> str:
    from kubernetes.client.exceptions import ApiException

    try:
        call()
    except ApiException as exc:
        assert exc.status in (403, 422), exc
        return str(exc.body)
    return ""


def test_the_agent_may_only_set_its_status_annotation_on_pods_of_its_own_node(
    kube: Any, namespace: str, chart_rbac
) -> None:
    """`patch pods` is cluster-wide in RBAC; the chart's admission policy narrows it to the one annotation,
    on pods of the node the agent's token was issued for (its pod's node)."""
    from kubernetes import client

    agent = _service_account(chart_rbac, "agent")
    agent_pod = _pod(kube, namespace, "agent", NODE_A, account=agent)
    _pod(kube, namespace, "here", NODE_A), _pod(kube, namespace, "there", NODE_B)
    api, unbound = _as_agent(kube, namespace, agent, agent_pod), _as_agent(kube, namespace, agent, None)
    status = {"metadata": {"annotations": {L.STATUS_ANNOTATION: '{"restoreSeconds": 0.5}'}}}
    # The API server enforces a new policy once its informers have it: until a probe on another node's pod
    # is refused, a write going through would say nothing about the policy.
    _pod(kube, namespace, "probe", NODE_B)
    kube.wait_for(
        lambda: _refused(lambda: api.patch_namespaced_pod("probe", namespace, status)), timeout=60,
        message="the chart's admission policy in force",
    )  # fmt: skip

    agent_code = KubeStatus(api.api_client, NODE_A)
    agent_code.annotate_pod(namespace, "here", {"restoreSeconds": 0.5})
    written = api.read_namespaced_pod("here", namespace).metadata.annotations[L.STATUS_ANNOTATION]
    assert json.loads(written)["restoreSeconds"] == 0.5
    refusals = {
        "a pod of another node": _refused(lambda: api.patch_namespaced_pod("there", namespace, status)),
        "another annotation": _refused(lambda: api.patch_namespaced_pod(
            "here", namespace, {"metadata": {"annotations": {"team": "b"}}})),
        "an annotation removed": _refused(lambda: api.patch_namespaced_pod(
            "here", namespace, {"metadata": {"annotations": {"team": None}}})),
        "a label": _refused(lambda: api.patch_namespaced_pod(
            "here", namespace, {"metadata": {"labels": {"app": "other"}}})),
        "a token bound to no pod": _refused(lambda: unbound.patch_namespaced_pod("here", namespace, status)),
    }  # fmt: skip
    assert all(refusals.values()), {what: bool(why) for what, why in refusals.items()}
    assert "own node" in refusals["a pod of another node"]
    assert "warmstart.dev/status" in refusals["another annotation"]
    admin = client.CoreV1Api(kube.api_client())
    assert admin.read_namespaced_pod("here", namespace).metadata.labels == {"app": "here"}
    assert admin.read_namespaced_pod("there", namespace).metadata.annotations == {"team": "a"}
    # Nobody else is bound by the policy: the cluster's admin still may.
    admin.patch_namespaced_pod("there", namespace, {"metadata": {"labels": {"app": "x"}}})
