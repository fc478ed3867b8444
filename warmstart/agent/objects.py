"""Reading Kubernetes objects as the plain dicts the agent gets from the API server."""

from __future__ import annotations

from typing import Any

from warmstart.api import labels as L


def meta(obj: dict[str, Any] | None) -> dict[str, Any]:
    return (obj or {}).get("metadata") or {}


def labels(obj: dict[str, Any] | None) -> dict[str, str]:
    return meta(obj).get("labels") or {}


def status(obj: dict[str, Any] | None) -> dict[str, Any]:
    return (obj or {}).get("status") or {}


def names(obj: dict[str, Any]) -> tuple[str, str]:
    return meta(obj)["namespace"], meta(obj)["name"]


def key(obj: dict[str, Any]) -> str:
    """`namespace/name`, for logs."""
    return "/".join(names(obj))


def _worker_status(pod: dict[str, Any]) -> dict[str, Any]:
    statuses = status(pod).get("containerStatuses") or []
    return next((found for found in statuses if found.get("name") == L.WORKER_CONTAINER), {})


def worker_image_id(pod: dict[str, Any]) -> str:
    """The image the container runtime runs the worker from, as the kubelet reports it ("" before it runs)."""
    return str(_worker_status(pod).get("imageID") or "")


def worker_container_id(pod: dict[str, Any]) -> str:
    """The runtime's id of the worker container (`containerd://<hex>`), "" before the kubelet reports it."""
    return str(_worker_status(pod).get("containerID") or "")


def store_snapshot_id(snap: dict[str, Any]) -> str:
    """The store id an InferenceSnapshot's status points at ("" before it is Ready)."""
    return str(status(snap).get("snapshotId") or "")
