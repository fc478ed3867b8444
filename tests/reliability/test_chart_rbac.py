"""What each ServiceAccount of the chart may and may not do, asked of the real API server.

The chart's RBAC is rendered by helm, applied to the local control plane, and checked with
`kubectl auth can-i --as system:serviceaccount:...`: the node agent gets what its code calls and
nothing more (no Secrets, no pod exec or deletion, no writes to endpoints); the operator cannot read
Secrets either.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = [pytest.mark.integration, pytest.mark.reliability]

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
OPERATOR_MAY_NOT = [("get", "secrets"), ("list", "secrets"), ("create", "pods/exec"), ("patch", "nodes")]


def _rendered(kube: Any, release: str, namespace: str) -> list[dict[str, Any]]:
    result = kube.helm(
        "template", release, str(CHART), "--namespace", namespace, "--kube-version", KUBE_VERSION,
        "--show-only", "templates/agent-rbac.yaml", "--show-only", "templates/operator-rbac.yaml",
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
