"""A ReadWriteMany volume that every real node mounts: the chart's `agent.store.claimName` store.

A hostPath PersistentVolume on one directory of the machine, pre-bound to its claim (the PersistentVolume
names the claim, the claim names the volume; kube-controller-manager's binder marks both Bound). The real
nodes run on one machine and see the same host filesystem, so their pods share the directory as pods of
several machines share an NFS export. The semantics are a local filesystem's: NFS itself (its caching, its
locks over the network) is not exercised, since these machines' kernels have no NFS client.

    create_shared_volume(kube, namespace, Path("/srv/store"))   # the claim `CLAIM_NAME` in `namespace`
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .cluster import ControlPlane, wait_for

CLAIM_NAME = "warmstart-store"
DEFAULT_SIZE = "10Gi"
BIND_TIMEOUT_SECONDS = 60.0


def volume_name(namespace: str) -> str:
    """The PersistentVolume's name (cluster-wide): one per namespace's claim."""
    return f"{CLAIM_NAME}-{namespace}"


def manifests(namespace: str, path: Path, size: str = DEFAULT_SIZE) -> list[dict[str, Any]]:
    """The PersistentVolume on `path` and its claim `CLAIM_NAME` in `namespace`, bound to each other."""
    volume = volume_name(namespace)
    common = {"accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeMode": "Filesystem"}
    return [
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": volume},
            "spec": {
                **common,
                "capacity": {"storage": size},
                "persistentVolumeReclaimPolicy": "Retain",
                "hostPath": {"path": str(path), "type": "Directory"},
                "claimRef": {
                    "apiVersion": "v1",
                    "kind": "PersistentVolumeClaim",
                    "namespace": namespace,
                    "name": CLAIM_NAME,
                },  # fmt: skip
            },
        },
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": CLAIM_NAME, "namespace": namespace},
            "spec": {**common, "volumeName": volume, "resources": {"requests": {"storage": size}}},
        },
    ]


def create_shared_volume(kube: ControlPlane, namespace: str, path: Path, size: str = DEFAULT_SIZE) -> str:
    """Create `path` (when missing), the volume on it and its claim in `namespace`; returns the claim's
    name once it is Bound."""
    path.mkdir(parents=True, exist_ok=True)
    body = {"apiVersion": "v1", "kind": "List", "items": manifests(namespace, path, size)}
    kube.kubectl("apply", "-f", "-", input=json.dumps(body))
    wait_for(lambda: _phase(kube, namespace) == "Bound", timeout=BIND_TIMEOUT_SECONDS, interval=1.0,
             message=f"the claim {namespace}/{CLAIM_NAME} Bound")  # fmt: skip
    return CLAIM_NAME


def delete_shared_volume(kube: ControlPlane, namespace: str) -> None:
    """Remove the claim and its volume (the directory and what it holds stay: the policy is Retain)."""
    kube.kubectl("delete", "pvc", CLAIM_NAME, "-n", namespace, "--ignore-not-found", "--wait=false")
    kube.kubectl("delete", "pv", volume_name(namespace), "--ignore-not-found", "--wait=false")


def _phase(kube: ControlPlane, namespace: str) -> str:
    result = kube.kubectl("get", "pvc", CLAIM_NAME, "-n", namespace, "-o", "jsonpath={.status.phase}",
                          check=False)  # fmt: skip
    return result.stdout.strip() if result.returncode == 0 else ""
