"""kubectl calls the operator's cluster tests share: read objects, apply endpoints, play the node agent."""

from __future__ import annotations

import json
import subprocess
from typing import Any

from builders import endpoint_spec

from warmstart.api import labels as L

TIMEOUT = 60


def get(kube, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
    result = kube.kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def items(kube, kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
    out = kube.kubectl("get", kind, "-n", namespace, "-l", selector, "-o", "json").stdout
    return json.loads(out)["items"]


def endpoint(name: str, namespace: str, **spec: Any) -> str:
    body = {
        "apiVersion": L.API_VERSION,
        "kind": L.ENDPOINT_KIND,
        "metadata": {"name": name, "namespace": namespace},
        "spec": endpoint_spec(**spec),
    }
    return json.dumps(body)


def apply(kube, manifest: str) -> subprocess.CompletedProcess[str]:
    return kube.kubectl("apply", "-f", "-", input=manifest)


def condition(body: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    for cond in ((body or {}).get("status") or {}).get("conditions") or []:
        if cond["type"] == kind:
            return cond
    return {}


def template_role(kube, namespace: str, name: str) -> tuple[str, str]:
    dep = get(kube, "deployment", namespace, name) or {}
    labels = dep.get("spec", {}).get("template", {}).get("metadata", {}).get("labels", {})
    return labels.get(L.ROLE_LABEL, ""), labels.get(L.SNAPSHOT_LABEL, "")


STORE_ID = "0123456789ab-20260101000000-abcdef"
CAPTURED = {"captureAttempt": 1, "captureState": "Captured", "snapshotId": STORE_ID, "sizeBytes": 1 << 30}


def set_snapshot_status(kube, namespace: str, name: str, status: dict[str, Any]) -> None:
    """What the node agent does: report the capture's outcome on the status subresource."""
    kube.kubectl(
        "patch",
        "isnap",
        name,
        "-n",
        namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": status}),
    )


def events_about(kube, namespace: str, name: str, reason: str = "") -> list[dict[str, Any]]:
    """Events on the endpoint `name`, of `reason` if given."""
    out = kube.kubectl(
        "get",
        "events",
        "-n",
        namespace,
        "--field-selector",
        f"involvedObject.kind={L.ENDPOINT_KIND},involvedObject.name={name}",
        "-o",
        "json",
    ).stdout
    return [e for e in json.loads(out)["items"] if not reason or e["reason"] == reason]
