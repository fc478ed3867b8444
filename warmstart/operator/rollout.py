"""How the worker Deployment replaces its pods when its template changes (cold to restore, a new snapshot).

By default with a surge: the new pod starts beside the one it replaces, which serves until the new one is
Ready, so an endpoint of one replica serves throughout (right after a capture the cluster has room: the
capture pod's GPU is free again). Where the scheduler finds no room for the surge pod, the old pods must go
first: the Deployment then replaces one at a time until the rollout ends (complete, or past the Deployment's
progress deadline). The state is the Deployment's own: its strategy, its progress and its pods' templates.

Only a lack of resources makes room by removing an old pod; a surge pod that can go nowhere for another
reason (a selector no node matches) leaves the old pods serving, and says why.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from warmstart.operator.diagnosis import POD_TEMPLATE_HASH, UNSCHEDULABLE, scheduling_cause

SURGE = {"maxSurge": 1, "maxUnavailable": 0}
ONE_AT_A_TIME = {"maxSurge": 0, "maxUnavailable": 1}
# The scheduler's words for resources no node has free (`0/2 nodes are available: 2 Insufficient cpu.`).
NO_ROOM = "Insufficient "
# The Deployment controller's Progressing reasons once a rollout is over.
ENDED = ("NewReplicaSetAvailable", "ProgressDeadlineExceeded")


def rolling_out(workers: Iterable[Mapping[str, Any]]) -> bool:
    """The Deployment's pods are of more than one template: a rollout is under way."""
    hashes = {((pod.get("metadata") or {}).get("labels") or {}).get(POD_TEMPLATE_HASH) for pod in workers}
    return len(hashes - {None}) > 1


def waits_for_room(pod: Mapping[str, Any]) -> bool:
    """The scheduler placed the pod nowhere because no node has the resources it asks for free."""
    cause = scheduling_cause(pod)
    return cause is not None and cause[0] == UNSCHEDULABLE and NO_ROOM in cause[1]


def rollout_ended(deployment: Mapping[str, Any] | None) -> bool:
    """The Deployment controller says its rollout is over: complete, or past its progress deadline (what
    bounds a fall back to one at a time that can never complete)."""
    status = (deployment or {}).get("status") or {}
    if status.get("observedGeneration", 0) < ((deployment or {}).get("metadata") or {}).get("generation", 0):
        return False
    progressing = next((c for c in status.get("conditions") or [] if c.get("type") == "Progressing"), {})
    return progressing.get("reason") in ENDED


def _replacing_one_at_a_time(deployment: Mapping[str, Any] | None) -> bool:
    current = (((deployment or {}).get("spec") or {}).get("strategy") or {}).get("rollingUpdate")
    return current == ONE_AT_A_TIME and not rollout_ended(deployment)


def rolling_update(deployment: Mapping[str, Any] | None, workers: list[Mapping[str, Any]]) -> dict[str, int]:
    """The strategy the Deployment should have now: one at a time from when a rollout found no room for a
    surge pod until that rollout ends (kept, so that it does not stall half way), else a surge."""
    if _replacing_one_at_a_time(deployment):
        return ONE_AT_A_TIME
    if rolling_out(workers) and any(waits_for_room(pod) for pod in workers):
        return ONE_AT_A_TIME
    return SURGE


def waiting_for_room(deployment: Mapping[str, Any] | None, workers: list[Mapping[str, Any]]) -> set[str]:
    """Names of pods that wait for the pods they replace to go: no problem to report while they do."""
    if not (rolling_out(workers) or _replacing_one_at_a_time(deployment)):
        return set()
    return {str(pod["metadata"]["name"]) for pod in workers if waits_for_room(pod)}
