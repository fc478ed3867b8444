"""Two real nodes and an S3-compatible object store as the cluster's snapshot store, as a user runs them: the
S3 server (Versity's gateway) inside the apiserver's network namespace where both nodes reach it, its
credentials in a Secret, the chart's `agent.objectStore` values, an agent on each node, an endpoint that may
run on either node, which one steered by cordoning the other, and the agents' metrics of the bytes they moved.
Used by the two-node end-to-end tests and the two-node benchmark."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from control_plane import cluster_stores, s3
from control_plane.cluster import ControlPlane
from control_plane.node import RealNode
from endpoint_flow import items

BUCKET = cluster_stores.BUCKET
CREDENTIALS_SECRET = cluster_stores.CREDENTIALS_SECRET
BOTH_NODES = cluster_stores.ON_BOTH_NODES  # either real node: the real nodes' label, both nodes' taints


def start_object_store(node: RealNode, root: Path) -> s3.S3Server:
    """The S3 server beside both nodes (`hack/control-plane up --object-store` starts the same)."""
    return s3.start_beside_nodes(node, root / "data", [BUCKET], log=root / "versitygw.log")


def restart_object_store(server: s3.S3Server, node: RealNode) -> None:
    server.start(ready=lambda: s3.listening(node.api_holder, server.port))


def use_object_store(kube: ControlPlane, values: dict[str, Any], server: s3.S3Server, namespace: str) -> None:
    """The chart's values for the object store (its credentials in a Secret of the release's namespace), and
    the agent on both nodes."""
    kube.kubectl("apply", "-f", "-", input=json.dumps(cluster_stores.credentials_secret(namespace, server)))
    values["agent"].update(BOTH_NODES)
    values["agent"]["objectStore"] = {
        "bucket": BUCKET,
        "endpoint": server.endpoint,
        "prefix": f"{namespace}/",
        "credentialsSecret": CREDENTIALS_SECRET,
    }


def on_either_node(body: dict[str, Any], models: Path) -> dict[str, Any]:
    """The endpoint on either real node, with snapshots, its model files on storage both nodes mount at the
    same path (as a shared model cache is on a cluster: the restored engine maps the files again)."""
    spec = body["spec"]
    spec["snapshot"] = {"enabled": True}
    spec["template"].update(BOTH_NODES)
    for volume in spec["template"]["volumes"]:
        if volume["name"] == "models":
            volume["hostPath"] = {"path": str(models), "type": "Directory"}
    return body


def only_schedulable(kube: ControlPlane, node: RealNode, other: RealNode) -> None:
    kube.kubectl("uncordon", node.name)
    kube.kubectl("cordon", other.name)


def agent_metric(
    kube: ControlPlane, namespace: str, node: RealNode, name: str, labels: dict[str, str]
) -> float:
    """One sample of the agent's metrics on `node`, read inside its pod (0 when absent)."""
    agents = items(kube, "pod", namespace, "app.kubernetes.io/component=agent")
    pod = next(p for p in agents if p["spec"].get("nodeName") == node.name)
    port = next(p["containerPort"] for p in pod["spec"]["containers"][0]["ports"] if p["name"] == "metrics")
    script = (
        f"import urllib.request as u; print(u.urlopen('http://127.0.0.1:{port}/metrics').read().decode())"
    )
    exec_in = ("exec", "-n", namespace, pod["metadata"]["name"], "--")
    text = kube.kubectl(*exec_in, "python3", "-c", script).stdout
    wanted = name + "{" + ",".join(f'{key}="{value}"' for key, value in sorted(labels.items())) + "}"
    for line in text.splitlines():
        sample, _, value = line.rpartition(" ")
        if sample == wanted:
            return float(value)
    return 0.0


def pulled(kube: ControlPlane, namespace: str, node: RealNode, reason: str) -> float:
    """Bytes the node's agent pulled from the object store for `reason` (restore or prestage)."""
    labels = {"direction": "pull", "reason": reason}
    return agent_metric(kube, namespace, node, "warmstart_agent_object_store_bytes_total", labels)
