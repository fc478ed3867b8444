"""The local control plane serves real Kubernetes API semantics: CRDs, custom objects, watches, and the
third-party schemas (KEDA, prometheus-operator) our objects must satisfy."""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path

import pytest
from control_plane import network

pytestmark = [pytest.mark.integration, pytest.mark.spawns]

REPO = Path(__file__).resolve().parents[2]

PLACEHOLDER_GROUP = "placeholder.warmstart.dev"
PLACEHOLDER_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": f"gadgets.{PLACEHOLDER_GROUP}"},
    "spec": {
        "group": PLACEHOLDER_GROUP,
        "scope": "Namespaced",
        "names": {"plural": "gadgets", "singular": "gadget", "kind": "Gadget", "listKind": "GadgetList"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "required": ["size"],
                                "properties": {"size": {"type": "integer", "minimum": 1}},
                            }
                        },
                    }
                },
            }
        ],
    },
}


def crd_established(kube, name: str) -> bool:
    crd = json.loads(kube.kubectl("get", "crd", name, "-o", "json").stdout)
    return any(c["type"] == "Established" and c["status"] == "True" for c in crd["status"]["conditions"])


@pytest.fixture(scope="module")
def placeholder_crd(kube) -> str:
    kube.kubectl("apply", "-f", "-", input=json.dumps(PLACEHOLDER_CRD))
    name = PLACEHOLDER_CRD["metadata"]["name"]
    kube.wait_for(lambda: crd_established(kube, name), timeout=30, message=f"CRD {name} Established")
    return name


def gadget(name: str, size: int) -> dict:
    return {
        "apiVersion": f"{PLACEHOLDER_GROUP}/v1",
        "kind": "Gadget",
        "metadata": {"name": name},
        "spec": {"size": size},
    }


def test_fake_gpu_nodes_are_ready(kube):
    nodes = json.loads(kube.kubectl("get", "nodes", "-l", "type=kwok", "-o", "json").stdout)["items"]
    assert len(nodes) == kube.nodes
    for node in nodes:
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"
        ready = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
        assert ready and ready[0]["status"] == "True"


def test_custom_object_create_read_and_watch(kube, namespace, placeholder_crd):
    from kubernetes import client, watch

    api = client.CustomObjectsApi(kube.api_client())
    coordinates = {"group": PLACEHOLDER_GROUP, "version": "v1", "namespace": namespace, "plural": "gadgets"}
    api.create_namespaced_custom_object(body=gadget("first", 1), **coordinates)
    read = api.get_namespaced_custom_object(name="first", **coordinates)
    assert read["spec"] == {"size": 1}

    events: list[tuple[str, int]] = []
    stream = watch.Watch()
    for event in stream.stream(api.list_namespaced_custom_object, timeout_seconds=30, **coordinates):
        events.append((event["type"], event["object"]["spec"]["size"]))
        if event["type"] == "ADDED":
            api.patch_namespaced_custom_object(name="first", body={"spec": {"size": 2}}, **coordinates)
        elif event["type"] == "MODIFIED":
            stream.stop()
    assert events == [("ADDED", 1), ("MODIFIED", 2)]


def test_custom_object_schema_rejects_bad_value(kube, namespace, placeholder_crd):
    result = kube.kubectl(
        "apply", "-n", namespace, "-f", "-", input=json.dumps(gadget("bad", 0)), check=False
    )
    assert result.returncode != 0
    assert "spec.size" in result.stderr


def project_crd_files() -> list[Path]:
    return sorted((REPO / "crds").glob("*.yaml"))


@pytest.mark.skipif(not project_crd_files(), reason="crds/ has no CRD manifests yet")
def test_project_crds_install_and_establish(kube):
    for path in project_crd_files():
        kube.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(path))
    names = kube.kubectl("get", "-f", str(REPO / "crds"), "-o", "name").stdout.split()
    assert names, "crds/ applied but kubectl lists no CRD from it"
    for name in names:
        crd = name.split("/", 1)[1]
        kube.wait_for(
            lambda crd=crd: crd_established(kube, crd), timeout=30, message=f"CRD {crd} Established"
        )


THIRD_PARTY_CRDS = (
    "scaledobjects.keda.sh",
    "triggerauthentications.keda.sh",
    "httpscaledobjects.http.keda.sh",
    "servicemonitors.monitoring.coreos.com",
    "podmonitors.monitoring.coreos.com",
)


@pytest.mark.parametrize("name", THIRD_PARTY_CRDS)
def test_third_party_crd_is_installed(kube, name):
    assert crd_established(kube, name)


def scaled_object(spec_changes: dict) -> dict:
    spec = {
        "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "worker"},
        "minReplicaCount": 0,
        "maxReplicaCount": 4,
        "triggers": [
            {
                "type": "prometheus",
                "metadata": {
                    "serverAddress": "http://prometheus.monitoring:9090",
                    "query": "sum(rate(requests_total[1m]))",
                    "threshold": "10",
                },
            }
        ],
    }
    spec.update(spec_changes)
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": "so"},
        "spec": spec,
    }


def test_keda_schema_accepts_a_valid_scaled_object(kube, namespace):
    kube.kubectl(
        "create", "-n", namespace, "--validate=strict", "-f", "-", input=json.dumps(scaled_object({}))
    )
    stored = json.loads(kube.kubectl("get", "scaledobject", "so", "-n", namespace, "-o", "json").stdout)
    assert stored["spec"]["maxReplicaCount"] == 4


def test_keda_schema_rejects_a_wrong_type(kube, namespace):
    body = json.dumps(scaled_object({"maxReplicaCount": "four"}))
    result = kube.kubectl("create", "-n", namespace, "-f", "-", input=body, check=False)
    assert result.returncode != 0
    assert "spec.maxReplicaCount" in result.stderr


def test_keda_schema_rejects_an_unknown_field(kube, namespace):
    body = json.dumps(scaled_object({"maxReplicas": 4}))
    result = kube.kubectl("create", "-n", namespace, "--validate=strict", "-f", "-", input=body, check=False)
    assert result.returncode != 0
    assert "maxReplicas" in result.stderr


def test_the_service_range_holds_thousands_of_services(kube, namespace):
    """Stress tests create hundreds of endpoints, each with a Service: a /24 would stop them at 253."""
    address = free_service_address(kube)
    assert address not in ipaddress.ip_network("10.0.0.0/24")
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "far", "namespace": namespace},
        "spec": {"clusterIP": str(address), "ports": [{"port": 80}]},
    }
    kube.kubectl("apply", "-f", "-", input=json.dumps(service))
    created = json.loads(kube.kubectl("get", "service", "far", "-n", namespace, "-o", "json").stdout)
    assert created["spec"]["clusterIP"] == str(address)


def free_service_address(kube) -> ipaddress.IPv4Address:
    """The highest address of the range no Service holds: earlier tests' Services take random addresses
    from the range's upper part, so a fixed one may already be taken."""
    services = json.loads(kube.kubectl("get", "services", "--all-namespaces", "-o", "json").stdout)["items"]
    taken = {ip for service in services for ip in service["spec"].get("clusterIPs", [])}
    hosts = reversed(list(network.SERVICE_SUBNET.hosts()))
    return next(address for address in hosts if str(address) not in taken)
