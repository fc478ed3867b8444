"""What the reconcile reads to say why an endpoint does not progress: its pods, the kubelet's mount
failures for pods stuck before their containers start, and where the node agents run."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from warmstart.kube.client import Kube
from warmstart.operator import children
from warmstart.operator.diagnosis import (
    MOUNT_EVENT_REASONS,
    AgentLookup,
    Cause,
    causes,
    creating_pods,
    deployment_pods,
    needs_agent,
    ready_agent_nodes,
    restore_causes,
)


def mount_failures(kube: Kube, namespace: str, pods: list[Mapping[str, Any]]) -> dict[str, str]:
    """Pod name -> the newest FailedMount (or FailedAttachVolume) message the kubelet posted for it, for
    the pods given. One list per reason, and none when no pod is given."""
    if not pods:
        return {}
    uids = {str(pod["metadata"].get("uid")): pod["metadata"]["name"] for pod in pods}
    newest: dict[str, tuple[str, str]] = {}
    for reason in MOUNT_EVENT_REASONS:
        for event in kube.list("Event", namespace, {}, fields={"reason": reason}):
            involved = event.get("involvedObject") or {}
            name = uids.get(str(involved.get("uid")))
            stamp = str(event.get("lastTimestamp") or event.get("eventTime") or "")
            if name is not None and stamp >= newest.get(name, ("", ""))[0]:
                newest[name] = (stamp, str(event.get("message") or reason))
    return {name: message for name, (_, message) in newest.items()}


def agent_nodes(kube: Kube, lookup: AgentLookup | None, pods: list[Mapping[str, Any]]) -> set[str] | None:
    """Nodes with a Ready node agent; None when the agents are not looked up (no lookup configured, or no
    pod here needs an agent)."""
    if lookup is None or not any(needs_agent(pod) for pod in pods):
        return None
    return ready_agent_nodes(kube.list("Pod", lookup.namespace, lookup.selector))


def worker_pods(kube: Kube, endpoint: children.Owner) -> list[dict[str, Any]]:
    """The endpoint's worker pods: those its Deployment made; other pods carrying its labels are not its
    replicas (`deployment_pods`)."""
    labelled = kube.list("Pod", endpoint.namespace, children.worker_selector(endpoint.name))
    return deployment_pods(labelled, endpoint.name)


def observe_pods(
    kube: Kube,
    endpoint: children.Owner,
    workers: list[dict[str, Any]],
    capture_pods: list[dict[str, Any]],
    agents: AgentLookup | None,
) -> tuple[list[Cause], list[Cause]]:
    """Why the endpoint's `workers` (`worker_pods`) or `capture_pods` (the current attempt's) do not
    progress, or started cold where they were to be restored: (worker causes, capture causes)."""
    everything = [*workers, *capture_pods]
    mounts = mount_failures(kube, endpoint.namespace, creating_pods(everything))
    nodes = agent_nodes(kube, agents, everything)
    worker_causes = [*causes(workers, "worker", mounts, nodes, agents), *restore_causes(workers)]
    return worker_causes, causes(capture_pods, "capture", mounts, nodes, agents)
