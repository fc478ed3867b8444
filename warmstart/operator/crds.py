"""The operator's own CRDs coming and going while it runs.

kopf's view of which resources exist can miss a CRD created after it started (its rescans race the API
server's discovery): a CRD whose uid differs from the one kopf started with means kopf has to be started
again to serve it. (Endpoints hold no finalizer, so a CRD deletion needs nothing from the operator.)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from warmstart.api import labels as L
from warmstart.kube.client import CRD_KIND, Kube, KubeError
from warmstart.operator.diagnosis import is_terminating

log = logging.getLogger(__name__)

ENDPOINT_CRD = f"{L.ENDPOINT_PLURAL}.{L.GROUP}"
SNAPSHOT_CRD = f"{L.SNAPSHOT_PLURAL}.{L.GROUP}"
KIND_OF_CRD = {ENDPOINT_CRD: L.ENDPOINT_KIND, SNAPSHOT_CRD: L.SNAPSHOT_KIND}
VERBS_KOPF_NEEDS = frozenset({"list", "watch", "patch"})


def established(body: Mapping[str, Any]) -> bool:
    conditions = (body.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)


def served(kube: Kube, name: str) -> bool:
    return kube.served_verbs(KIND_OF_CRD[name]) >= VERBS_KOPF_NEEDS


def served_uids(kube: Kube) -> dict[str, str]:
    """uid of each of the operator's CRDs that is established, not terminating and served by discovery."""
    uids = {}
    for name in KIND_OF_CRD:
        # Listed by name (at most one): the operator may list and watch CRDs, not get them.
        for crd in kube.list(CRD_KIND, "", {}, fields={"metadata.name": name}):
            if established(crd) and not is_terminating(crd) and served(kube, name):
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
