"""sync_snapshots against a real API server: what it writes when its view of the snapshots is stale."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from builders import endpoint_spec

from warmstart.api import labels as L
from warmstart.kube.client import Kube
from warmstart.operator.children import Owner
from warmstart.operator.reconcile import sync_snapshots
from warmstart.operator.request_key import request_key, request_key_hash
from warmstart.operator.snapshots import plan_snapshots
from warmstart.operator.spec import parse_spec

pytestmark = [pytest.mark.integration, pytest.mark.spawns, pytest.mark.any_cluster]


def _create_endpoint(api: Kube, namespace: str, name: str) -> dict[str, Any]:
    body = {
        "apiVersion": L.API_VERSION,
        "kind": L.ENDPOINT_KIND,
        "metadata": {"name": name, "namespace": namespace},
        "spec": endpoint_spec(),
    }
    created = api.create(body)
    assert created is not None
    return created


def test_a_snapshot_that_already_exists_keeps_its_status_and_gets_no_capture_pod(kube, namespace, crds):
    api = Kube(kube.api_client())
    body = _create_endpoint(api, namespace, "qwen")
    owner, spec = Owner.from_body(body), parse_spec(body["spec"])
    key = request_key(spec)
    # Planned from a list that did not see the snapshot yet (another reconcile created and captured it since).
    plan = plan_snapshots(owner, spec, request_key_hash(key), key, [], dt.datetime.now(dt.UTC))
    assert plan.create is not None
    name = plan.create["metadata"]["name"]
    assert api.create(plan.create) is not None
    ready = {"phase": "Ready", "attempts": 1, "snapshotId": "s-1", "reason": "Captured"}
    api.patch_status(L.SNAPSHOT_KIND, namespace, name, ready)

    sync_snapshots(api, owner, spec, plan, request_key_hash(key))

    status = (api.get(L.SNAPSHOT_KIND, namespace, name) or {}).get("status") or {}
    assert {key: status.get(key) for key in ready} == ready
    capture = {L.ENDPOINT_LABEL: owner.name, L.COMPONENT_LABEL: L.CAPTURE_COMPONENT}
    assert api.list("Pod", namespace, capture) == []
    assert not [event for event in plan.events if event[1] == "CaptureStarted"]  # it created nothing
