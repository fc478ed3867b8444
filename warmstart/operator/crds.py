"""The operator's own CRDs coming and going while it runs.

kopf stops serving a resource whose CRD is terminating (discovery no longer lists `patch` for it), so it
never removes its finalizer from the endpoints the API server is deleting, and the CRD deletion would wait
forever: the operator lets go of them itself. And kopf's view of which resources exist can miss a CRD
created after it started (its rescans race the API server's discovery): a CRD whose uid differs from the
one kopf started with means kopf has to be started again to serve it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from warmstart.api import labels as L
from warmstart.operator.kube import CRD_KIND, Kube, KubeError
from warmstart.operator.reconcile import finalize

log = logging.getLogger(__name__)

ENDPOINT_CRD = f"{L.ENDPOINT_PLURAL}.{L.GROUP}"
SNAPSHOT_CRD = f"{L.SNAPSHOT_PLURAL}.{L.GROUP}"
KIND_OF_CRD = {ENDPOINT_CRD: L.ENDPOINT_KIND, SNAPSHOT_CRD: L.SNAPSHOT_KIND}
VERBS_KOPF_NEEDS = frozenset({"list", "watch", "patch"})


def established(body: Mapping[str, Any]) -> bool:
    conditions = (body.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)


def terminating(body: Mapping[str, Any]) -> bool:
    return bool((body.get("metadata") or {}).get("deletionTimestamp"))


def read_crd(kube: Kube, name: str) -> dict[str, Any] | None:
    """The CRD by name, through a list (the operator may list and watch CRDs, not get them)."""
    found = kube.list(CRD_KIND, "", {}, fields={"metadata.name": name})
    return found[0] if found else None


def served(kube: Kube, name: str) -> bool:
    return kube.served_verbs(KIND_OF_CRD[name]) >= VERBS_KOPF_NEEDS


def served_uids(kube: Kube) -> dict[str, str]:
    """uid of each of the operator's CRDs that is established, not terminating and served by discovery."""
    uids = {}
    for name in KIND_OF_CRD:
        crd = read_crd(kube, name)
        if crd is not None and established(crd) and not terminating(crd) and served(kube, name):
            uids[name] = crd["metadata"]["uid"]
    return uids


def wait_until_served(kube: Kube, name: str, timeout: float = 60.0, interval: float = 0.5) -> bool:
    """True once discovery lists the CRD's resource with the verbs kopf needs; False after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if served(kube, name):
                return True
        except KubeError as exc:
            log.warning("CRD %s: discovery not readable: %s", name, exc)
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def remove_finalizer(kube: Kube, body: Mapping[str, Any], finalizer: str) -> bool:
    """Drop `finalizer` from the endpoint; the resourceVersion makes a concurrent change a 409, not a loss.
    False when the object is already gone."""
    meta = body["metadata"]
    remaining = [f for f in meta.get("finalizers") or [] if f != finalizer]
    patch = {"metadata": {"finalizers": remaining, "resourceVersion": meta["resourceVersion"]}}
    try:
        kube.patch(L.ENDPOINT_KIND, meta["namespace"], meta["name"], patch)
    except KubeError as exc:
        if exc.status == 404:
            return False
        raise
    return True


def release_endpoints(kube: Kube, finalizer: str, lock_of: Callable[[tuple[str, str]], Any]) -> int:
    """Clean up after and let go of every endpoint holding `finalizer`; returns how many were released.

    The snapshots are marked and deleted as on an ordinary deletion when that works; when it does not, the
    endpoint is let go anyway: the snapshots' owner references still collect them, and the agent's store
    collection removes files whose InferenceSnapshot is gone.
    """
    released = 0
    for body in kube.list(L.ENDPOINT_KIND, "", {}):
        meta = body["metadata"]
        if finalizer not in (meta.get("finalizers") or []):
            continue
        key = (meta["namespace"], meta["name"])
        with lock_of(key):
            try:
                finalize(kube, body)
            except KubeError as exc:
                log.warning("%s/%s: snapshots not marked before its CRD goes: %s", *key, exc)
            if remove_finalizer(kube, body, finalizer):
                released += 1
                log.info("%s/%s: released (its CRD is being deleted)", *key)
    return released


def release_while_terminating(
    kube: Kube, finalizer: str, lock_of: Callable[[tuple[str, str]], Any], max_delay: float = 30.0
) -> int:
    """Release endpoints until the endpoint CRD is gone (or no longer terminating); retries with backoff."""
    released, delay = 0, 1.0
    while True:
        try:
            crd = read_crd(kube, ENDPOINT_CRD)
            if crd is None or not terminating(crd):
                return released
            released += release_endpoints(kube, finalizer, lock_of)
        except KubeError as exc:
            log.warning("CRD %s: releasing endpoints failed, retry in %.0f s: %s", ENDPOINT_CRD, delay, exc)
        time.sleep(delay)
        delay = min(max_delay, delay * 2)
