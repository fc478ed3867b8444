"""When each pod of a namespace reached each step of its start, seen from a watch (wall clock, so the times
line up with the agent's restore timestamps on the pod), and a replica's start split into those steps.
Used by the pod start benchmark and the GPU end-to-end test."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import threading
import time
from typing import Any

from control_plane.cluster import ControlPlane, wait_for

from warmstart.api import labels as L

STEPS = ("seen", "scheduled", "running", "ready")
# One line per event: name|node|the running containers' start times|the Ready condition's status.
WATCH_FORMAT = (
    "jsonpath={.metadata.name}|{.spec.nodeName}|{.status.containerStatuses[*].state.running.startedAt}|"
    '{.status.conditions[?(@.type=="Ready")].status}{"\\n"}'
)


class PodTimeline:
    """Watches one namespace's pods; `at[step][pod]` is when the watch first saw the pod at that step:
    seen (created), scheduled (bound to a node), running (its containers started) and ready (the Ready
    condition)."""

    def __init__(self, kube: ControlPlane, namespace: str) -> None:
        # kubectl's watch, not the Python client: the GPU machine's python has no `kubernetes` package.
        kubectl = str(kube.binary("kubectl"))
        self._argv = [kubectl, "get", "pods", "-n", namespace, "--watch", "-o", WATCH_FORMAT]
        self._env = kube.tool_env()
        self.at: dict[str, dict[str, float]] = {step: {} for step in STEPS}
        self._watch: subprocess.Popen[str] | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> PodTimeline:
        self._watch = subprocess.Popen(self._argv, env=self._env, stdout=subprocess.PIPE, text=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._watch is not None:
            self._watch.kill()
            self._watch.wait()

    def __enter__(self) -> PodTimeline:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _run(self) -> None:
        assert self._watch is not None and self._watch.stdout is not None
        for line in self._watch.stdout:
            name, node, running, ready = (line.rstrip("\n").split("|") + ["", "", "", ""])[:4]
            now = time.time()
            reached = {"seen": bool(name), "scheduled": bool(node), "running": bool(running.strip()),
                       "ready": ready == "True"}  # fmt: skip
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
