"""Events (core/v1) on the objects the operator and the node agent act on, as `kubectl describe` shows
them. Best effort: a failure to record one is logged, never raised."""

from __future__ import annotations

import logging
import uuid
from typing import Any

from warmstart.host.clock import format_time
from warmstart.kube.client import Kube, KubeError

log = logging.getLogger(__name__)

MAX_MESSAGE = 1024


def record_event(
    kube: Kube,
    involved: dict[str, Any],
    kind: str,
    event_type: str,
    reason: str,
    message: str,
    component: str,
    host: str = "",
) -> None:
    """An Event of `event_type` (Normal or Warning) on `involved`, an object of `kind`, reported by
    `component` (running on node `host`, if on one)."""
    meta = involved["metadata"]
    now = format_time()
    event = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:12]}", "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": involved.get("apiVersion", "v1"),
            "kind": kind,
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta.get("uid"),
        },
        "type": event_type,
        "reason": reason,
        "message": message[:MAX_MESSAGE],
        "source": {"component": component, **({"host": host} if host else {})},
        "reportingComponent": component,
        "reportingInstance": host or component,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
    try:
        kube.create(event)
    except KubeError as exc:
        log.warning("%s/%s: event %s not recorded: %s", meta["namespace"], meta["name"], reason, exc)
