"""The operator's children as its watches last saw them, so that a check of an endpoint at rest reads them
from memory instead of asking the API server for each.

kopf already watches every Deployment, Service and HPA the operator manages (to wake their endpoint up on a
change); those events, and the operator's own reads and writes of them, fill this. A copy seen within
`max_age` seconds is answered from here; an older one, or one never seen, is read from the API server. The
bound is there because a watch broken long enough to be listed again reports no deletion it missed: no
stale copy outlives that by more than `max_age`.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from typing import Any

from warmstart.kube.client import Kube

Ref = tuple[str, str, str]  # (kind, namespace, name)
WATCHED = frozenset({"Deployment", "Service", "HorizontalPodAutoscaler"})  # see handlers.on_child_event


class SeenChildren:
    def __init__(self, max_age: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_age = max_age
        self._clock = clock
        self._seen: dict[Ref, tuple[float, dict[str, Any]]] = {}
        self._lock = threading.Lock()

    def saw(self, body: dict[str, Any]) -> None:
        """A copy of a watched kind as the API server holds it now."""
        if body.get("kind") not in WATCHED:
            return
        meta = body["metadata"]
        ref = (body["kind"], meta.get("namespace", ""), meta["name"])
        with self._lock:
            self._seen[ref] = (self._clock(), copy.deepcopy(body))

    def gone(self, kind: str, namespace: str, name: str) -> None:
        with self._lock:
            self._seen.pop((kind, namespace, name), None)

    def fresh(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """A copy seen within `max_age`; None: ask the API server."""
        with self._lock:
            seen = self._seen.get((kind, namespace, name))
        if seen is None or self._clock() - seen[0] > self.max_age:
            return None
        return copy.deepcopy(seen[1])


class SeenKube(Kube):
    """A Kube whose reads of a watched child answer from SeenChildren, and whose reads and writes of one
    keep it up to date."""

    def __init__(self, kube: Kube, seen: SeenChildren) -> None:
        self.__dict__.update(vars(kube))
        self.seen = seen

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        if kind in WATCHED and (copy_ := self.seen.fresh(kind, namespace, name)) is not None:
            return copy_
        body = super().get(kind, namespace, name)
        if body is not None:
            self.seen.saw({"kind": kind, **body})
        return body

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        body = super().apply(obj)
        self.seen.saw({"kind": obj.get("kind", ""), **body})
        return body
