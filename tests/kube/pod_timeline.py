"""When each pod of a namespace reached each step of its start, seen from a watch (wall clock, so the times
line up with the agent's restore timestamps on the pod), and a replica's start split into those steps.
Used by the pod start benchmark and the GPU end-to-end test."""

from __future__ import annotations

import datetime as dt
import json
import threading
import time
from typing import Any

from control_plane.cluster import ControlPlane, wait_for

from warmstart.api import labels as L

STEPS = ("seen", "scheduled", "running", "ready")


class PodTimeline:
    """Watches one namespace's pods; `at[step][pod]` is when the watch first saw the pod at that step:
    seen (created), scheduled (bound to a node), running (its containers started) and ready (the Ready
    condition)."""

    def __init__(self, kube: ControlPlane, namespace: str) -> None:
        from kubernetes import client

        self._api = client.CoreV1Api(kube.api_client())
        self._namespace = namespace
        self.at: dict[str, dict[str, float]] = {step: {} for step in STEPS}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> PodTimeline:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def __enter__(self) -> PodTimeline:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _run(self) -> None:
        from kubernetes import watch

        while not self._stop.is_set():
            stream = watch.Watch().stream(self._api.list_namespaced_pod, self._namespace, timeout_seconds=5)
            for event in stream:
                self._record(event["object"], time.time())

    def _record(self, pod: Any, now: float) -> None:
        name = pod.metadata.name
        reached = {
            "seen": True,
            "scheduled": bool(pod.spec.node_name),
            "running": any(s.state and s.state.running for s in pod.status.container_statuses or []),
            "ready": any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or []),
        }
        for step, done in reached.items():
            if done:
                self.at[step].setdefault(name, now)

    def wait_ready(self, name: str, timeout: float) -> float:
        """When pod `name` turned Ready; waits for it."""
        wait_for(lambda: name in self.at["ready"], timeout=timeout, message=f"pod {name} Ready")
        return self.at["ready"][name]

    def start_phases(self, pod: dict[str, Any], since: float) -> dict[str, float]:
        """Seconds spent in each step of the pod's start, from `since` (the scale request, say) to Ready:
        to_pod (the operator and the ReplicaSet), scheduling, container_start, and for a restored pod
        to_agent (until the agent began its restore), the agent's restore and resume_to_ready (the engine
        resuming, the kubelet's probes); for a cold pod running_to_ready."""
        name = pod["metadata"]["name"]
        at = {step: self.at[step].get(name) for step in STEPS}
        if None in at.values():
            return {}
        phases = {
            "to_pod": at["seen"] - since,
            "scheduling": at["scheduled"] - at["seen"],
            "container_start": at["running"] - at["scheduled"],
        }
        report = json.loads((pod["metadata"].get("annotations") or {}).get(L.STATUS_ANNOTATION) or "{}")
        if "restoreStartedAt" not in report:
            return {**phases, "running_to_ready": at["ready"] - at["running"]}
        began = dt.datetime.fromisoformat(report["restoreStartedAt"]).timestamp()
        restore = float(report["restoreSeconds"])
        return {
            **phases,
            "to_agent": began - at["running"],
            "agent_restore": restore,
            "resume_to_ready": at["ready"] - began - restore,
        }
