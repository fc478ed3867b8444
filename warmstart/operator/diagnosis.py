"""Why an endpoint's pods do not serve, or its capture pod is not captured: causes read from what the
scheduler and the kubelet report on the pods (and the node agents' pods), as `kubectl describe` shows them.

Pure functions: pods in, causes out. Each cause has a CamelCase reason (a condition reason) and the
message the cluster gave, so that the endpoint's status says what the pods say.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from warmstart.api import labels as L
from warmstart.api.snapshot import FACTS_DIGEST_KEY, REFUSED_KEY, FactsChanged

UNSCHEDULABLE = "Unschedulable"
MISSING_VOLUME = "MissingVolume"
CONFIG_ERROR = "ContainerConfigError"
CREATE_FAILED = "ContainerCreateFailed"
IMAGE_PULL_FAILED = "ImagePullFailed"
CRASH_LOOP = "CrashLoopBackOff"
NO_NODE_AGENT = "NoNodeAgent"
FAILED_CREATE = "FailedCreate"
RESTORE_REFUSED = "RestoreRefused"
REASONS = frozenset(
    {
        UNSCHEDULABLE, MISSING_VOLUME, CONFIG_ERROR, CREATE_FAILED, IMAGE_PULL_FAILED, CRASH_LOOP,
        NO_NODE_AGENT, FAILED_CREATE, RESTORE_REFUSED,
    }
)  # fmt: skip
POD_TEMPLATE_HASH = "pod-template-hash"  # the Deployment controller's label on its ReplicaSets' pods

# The kubelet's waiting reasons -> the cause they report.
WAITING_CAUSES = {
    "ErrImagePull": IMAGE_PULL_FAILED,
    "ImagePullBackOff": IMAGE_PULL_FAILED,
    "ErrImageNeverPull": IMAGE_PULL_FAILED,
    "InvalidImageName": IMAGE_PULL_FAILED,
    "CreateContainerConfigError": CONFIG_ERROR,
    "CreateContainerError": CREATE_FAILED,
    "RunContainerError": CREATE_FAILED,
    "CrashLoopBackOff": CRASH_LOOP,
}
CONTAINER_CREATING = "ContainerCreating"
# The scheduler's words for a claim that does not exist or is not bound.
CLAIM_PROBLEM = re.compile(
    r'persistentvolumeclaim "[^"]+" not found|unbound immediate PersistentVolumeClaims'
)
MOUNT_EVENT_REASONS = ("FailedMount", "FailedAttachVolume")
MAX_NAMED_PODS = 3
PodT = TypeVar("PodT", bound=Mapping[str, Any])


@dataclass(frozen=True)
class Cause:
    """Why one or more pods of the same kind (worker or capture) cannot progress."""

    reason: str
    detail: str
    kind: str  # "worker" or "capture"
    pods: tuple[str, ...]  # none: the detail names what it is about

    @property
    def message(self) -> str:
        if not self.pods:
            return self.detail
        if len(self.pods) == 1:
            return f"{self.kind} pod {self.pods[0]}: {self.detail}"
        named = ", ".join(self.pods[:MAX_NAMED_PODS])
        more = f" and {len(self.pods) - MAX_NAMED_PODS} more" if len(self.pods) > MAX_NAMED_PODS else ""
        return f"{len(self.pods)} {self.kind} pods ({named}{more}): {self.detail}"


@dataclass(frozen=True)
class AgentLookup:
    """Where the node agents' pods are: the chart names their namespace and label selector; without them
    the operator does not check that a node has an agent."""

    namespace: str
    selector: dict[str, str]

    def describe(self) -> str:
        return f"namespace {self.namespace}, selector {L.label_selector(self.selector)}"


def parse_selector(text: str, setting: str) -> dict[str, str]:
    """`k1=v1,k2=v2` (equality terms only, the form a Deployment's matchLabels has) -> a dict."""
    selector = {}
    for term in text.split(","):
        key, equals, value = term.strip().partition("=")
        if not equals or not key.strip() or value.startswith("=") or "!" in key:
            raise ValueError(f"{setting}={text!r}: each term must be key=value")
        selector[key.strip()] = value.strip()
    return selector


def deployment_pods(pods: Iterable[PodT], deployment: str) -> list[PodT]:
    """The pods Deployment `deployment` made, among pods that carry its labels: each is controlled by one
    of its ReplicaSets, which the Deployment controller names `<deployment>-<pod-template-hash>`, the hash
    also being the pod's label. Labels alone are anyone's (a tenant's plain pod may carry the endpoint's
    and an agent's status annotation), an owner reference is not: one naming an owner that does not exist
    gets the pod deleted by the garbage collector, and one naming the real ReplicaSet is what makes a
    pod the ReplicaSet's own. No API call: the owner references are on the pods."""
    return [pod for pod in pods if _made_by(pod, deployment)]


def _made_by(pod: Mapping[str, Any], deployment: str) -> bool:
    meta = pod.get("metadata") or {}
    template_hash = (meta.get("labels") or {}).get(POD_TEMPLATE_HASH)
    if not template_hash:
        return False
    controller = next((ref for ref in meta.get("ownerReferences") or [] if ref.get("controller")), {})
    return (
        controller.get("kind") == "ReplicaSet"
        and str(controller.get("apiVersion", "")).startswith("apps/")
        and controller.get("name") == f"{deployment}-{template_hash}"
        and bool(controller.get("uid"))
    )


def agent_report(pod: Mapping[str, Any]) -> dict[str, Any]:
    """What the node agent reported on the pod (its `warmstart.dev/status` annotation, JSON such as
    {"restoreSeconds": 2.1, "at": "...Z"}); empty when it is missing or not a JSON object."""
    raw = ((pod.get("metadata") or {}).get("annotations") or {}).get(L.STATUS_ANNOTATION)
    try:
        report = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return report if isinstance(report, dict) else {}


def restore_causes(pods: Iterable[Mapping[str, Any]]) -> list[Cause]:
    """Restore pods the node agent did not restore (it refused, or the restore failed: the pod's
    `warmstart.dev/status` says why) and that started cold instead, grouped by what the agent said."""
    grouped: dict[str, list[str]] = {}
    for pod in pods:
        role = ((pod.get("metadata") or {}).get("labels") or {}).get(L.ROLE_LABEL)
        why = agent_report(pod).get("restoreFailed")
        if role == L.ROLE_RESTORE and why and not is_terminating(pod):
            grouped.setdefault(str(why), []).append(_name(pod))
    return [
        Cause(RESTORE_REFUSED, f"not restored, started cold: {why}", "worker", tuple(names))
        for why, names in grouped.items()
    ]


@dataclass(frozen=True)
class PodsChanged:
    """A restore pod the node agent refused because its model or engine changed since its snapshot's
    capture."""

    snapshot: str  # the snapshot it was refused
    reason: str  # a FactsChanged
    facts_digest: str  # of the facts the pod showed
    message: str


def facts_changes(pods: Iterable[Mapping[str, Any]]) -> list[PodsChanged]:
    """The restore pods refused their snapshot because what it was taken of changed (the agent's typed
    `refused` report, see `FactsChanged`), newest report first."""
    found: list[tuple[str, PodsChanged]] = []
    for pod in pods:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        report = agent_report(pod)
        reason, digest = report.get(REFUSED_KEY), report.get(FACTS_DIGEST_KEY)
        if labels.get(L.ROLE_LABEL) != L.ROLE_RESTORE or is_terminating(pod):
            continue
        if reason not in set(FactsChanged) or not isinstance(digest, str) or not digest:
            continue
        why = f"restore pod {_name(pod)} refused: {report.get('restoreFailed') or reason}"
        found.append(
            (str(report.get("at") or ""), PodsChanged(labels.get(L.SNAPSHOT_LABEL, ""), reason, digest, why))
        )
    return [change for _, change in sorted(found, key=lambda item: item[0], reverse=True)]


def _conditions(pod: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return {c.get("type", ""): c for c in (pod.get("status") or {}).get("conditions") or []}


def _name(pod: Mapping[str, Any]) -> str:
    return str((pod.get("metadata") or {}).get("name", ""))


def is_ready(pod: Mapping[str, Any]) -> bool:
    return _conditions(pod).get("Ready", {}).get("status") == "True"


def is_terminating(pod: Mapping[str, Any]) -> bool:
    return bool((pod.get("metadata") or {}).get("deletionTimestamp"))


def node_of(pod: Mapping[str, Any]) -> str:
    return str((pod.get("spec") or {}).get("nodeName") or "")


def _container_statuses(pod: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    status = pod.get("status") or {}
    return [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]


def scheduling_cause(pod: Mapping[str, Any]) -> tuple[str, str] | None:
    """(reason, the scheduler's message) for a pod the scheduler cannot place."""
    scheduled = _conditions(pod).get("PodScheduled", {})
    if scheduled.get("status") != "False":
        return None
    message = str(scheduled.get("message") or scheduled.get("reason") or "not scheduled")
    return (MISSING_VOLUME if CLAIM_PROBLEM.search(message) else UNSCHEDULABLE), message


def _last_exit(container: Mapping[str, Any]) -> str:
    terminated = (container.get("lastState") or {}).get("terminated") or {}
    if not terminated:
        return ""
    words = f"last exit {terminated.get('exitCode')}"
    if terminated.get("reason"):
        words += f" ({terminated['reason']})"
    if terminated.get("message"):
        words += f": {str(terminated['message']).strip()[:300]}"
    return words


def container_cause(container: Mapping[str, Any], mount_failure: str) -> tuple[str, str] | None:
    """(reason, message) for a container the kubelet cannot start or keep running."""
    waiting = (container.get("state") or {}).get("waiting") or {}
    kubelet_reason = str(waiting.get("reason") or "")
    name = container.get("name", "")
    if kubelet_reason == CONTAINER_CREATING and mount_failure:
        return MISSING_VOLUME, f"container {name} is not created: {mount_failure}"
    cause = WAITING_CAUSES.get(kubelet_reason)
    if cause is None:
        return None
    detail = f"container {name}: {kubelet_reason}"
    if waiting.get("message"):
        detail += f": {waiting['message']}"
    if cause == CRASH_LOOP:
        detail += f" (restarted {container.get('restartCount', 0)} times"
        last = _last_exit(container)
        detail += f", {last})" if last else ")"
    return cause, detail


def pod_cause(pod: Mapping[str, Any], mount_failure: str = "") -> tuple[str, str] | None:
    """What keeps one pod from running, from its scheduling and its containers; None when nothing does
    (it runs, or it is starting normally). `mount_failure` is the kubelet's FailedMount message for it."""
    if is_terminating(pod):
        return None
    causes = itertools.chain(
        [scheduling_cause(pod)], (container_cause(c, mount_failure) for c in _container_statuses(pod))
    )
    return next((cause for cause in causes if cause is not None), None)


def creating_pods(pods: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Pods whose containers wait in ContainerCreating: the kubelet says why only in Events (FailedMount)."""
    return [
        pod
        for pod in pods
        if not is_terminating(pod)
        and any(
            ((c.get("state") or {}).get("waiting") or {}).get("reason") == CONTAINER_CREATING
            for c in _container_statuses(pod)
        )
    ]


def ready_agent_nodes(agent_pods: Iterable[Mapping[str, Any]]) -> set[str]:
    return {node_of(pod) for pod in agent_pods if is_ready(pod) and not is_terminating(pod) and node_of(pod)}


def needs_agent(pod: Mapping[str, Any]) -> bool:
    role = ((pod.get("metadata") or {}).get("labels") or {}).get(L.ROLE_LABEL)
    return role in (L.ROLE_CAPTURE, L.ROLE_RESTORE) and bool(node_of(pod)) and not is_terminating(pod)


def agent_cause(pod: Mapping[str, Any], agent_nodes: set[str], lookup: AgentLookup) -> tuple[str, str] | None:
    """A capture or restore pod on a node where no node agent is Ready: nothing captures or restores it."""
    if not needs_agent(pod) or node_of(pod) in agent_nodes:
        return None
    role = ((pod.get("metadata") or {}).get("labels") or {}).get(L.ROLE_LABEL)
    effect = "nothing will capture it" if role == L.ROLE_CAPTURE else "it cold-starts instead of restoring"
    return (
        NO_NODE_AGENT,
        f"no Ready node agent on node {node_of(pod)} ({lookup.describe()}): {effect}; "
        "check where the agent DaemonSet runs (its node selector and tolerations)",
    )


def causes(
    pods: Iterable[Mapping[str, Any]],
    kind: str,
    mount_failures: Mapping[str, str],
    agent_nodes: set[str] | None,
    lookup: AgentLookup | None,
) -> list[Cause]:
    """The causes of `kind` pods (worker or capture), pods with the same reason and message grouped, in
    the order first seen. `agent_nodes` None: the agents are not checked. `mount_failures`: pod name ->
    the kubelet's mount failure."""
    grouped: dict[tuple[str, str], list[str]] = {}
    for pod in pods:
        if is_ready(pod) and not needs_agent(pod):
            continue
        found = pod_cause(pod, mount_failures.get(_name(pod), ""))
        if found is None and agent_nodes is not None and lookup is not None:
            found = agent_cause(pod, agent_nodes, lookup)
        if found is not None:
            grouped.setdefault(found, []).append(_name(pod))
    return [Cause(reason, detail, kind, tuple(names)) for (reason, detail), names in grouped.items()]


def deployment_causes(deployment: Mapping[str, Any] | None) -> list[Cause]:
    """The Deployment's ReplicaFailure: pods it cannot even create (a quota, an admission policy)."""
    meta = (deployment or {}).get("metadata") or {}
    for cond in ((deployment or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
            why = cond.get("message") or cond.get("reason")
            detail = f"Deployment {meta.get('name')} cannot create pods: {why}"
            return [Cause(FAILED_CREATE, detail, "worker", ())]
    return []
