"""Test data: InferenceEndpoint and InferenceSnapshot bodies as the API server would return them."""

from __future__ import annotations

import copy
from typing import Any

from warmstart.api import labels as L

UID = "0b3c8f0e-1111-4222-8333-444455556666"


def endpoint_spec(**overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"uri": "Qwen/Qwen3-0.6B", "revision": "main"},
        "engine": {
            "kind": "vllm",
            "image": "registry.example/warmstart-worker:0.1",
            "args": ["--enforce-eager"],
        },
        "resources": {"gpus": 1},
        "snapshot": {"enabled": True},
    }
    spec.update(copy.deepcopy(overrides))
    return spec


def endpoint_body(name: str = "qwen", namespace: str = "ml", **spec_overrides: Any) -> dict[str, Any]:
    return {
        "apiVersion": L.API_VERSION,
        "kind": L.ENDPOINT_KIND,
        "metadata": {"name": name, "namespace": namespace, "uid": UID, "generation": 1},
        "spec": endpoint_spec(**spec_overrides),
    }


def snapshot_object(
    name: str, request_hash: str, phase: str | None, created: str, **status: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": L.API_VERSION,
        "kind": L.SNAPSHOT_KIND,
        "metadata": {"name": name, "namespace": "ml", "uid": f"uid-{name}", "creationTimestamp": created},
        "spec": {"endpoint": "qwen", "requestKeyHash": request_hash, "requestKey": {}},
        "status": {**agent_reported(phase, status), **status},
    }
    return body


def agent_reported(phase: str | None, status: dict[str, Any]) -> dict[str, Any]:
    """What the node agent reports for a snapshot the operator should see in `phase`."""
    attempt = int(status.get("attempts") or 1)
    message = status.get("message", "")
    return {
        None: {},
        "Pending": {},
        "Capturing": {"captureAttempt": attempt, "captureState": "Capturing"},
        "Ready": {"captureAttempt": attempt, "captureState": "Captured", "snapshotId": f"id-of-{attempt}"},
        "Failed": {"captureAttempt": attempt, "captureState": "Failed", "captureMessage": message},
        "Invalid": {
            "captureAttempt": attempt,
            "captureState": "Captured",
            "snapshotId": "id",
            "restoreFailures": 3,
        },
    }[phase]
