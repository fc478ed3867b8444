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
ENDPOINT = "endpoint"  # the pod's endpoint ready in its Service's EndpointSlice (what kube-proxy follows)
# One line per event: name|node|the running containers' start times|the Ready condition's status.
WATCH_FORMAT = (
    "jsonpath={.metadata.name}|{.spec.nodeName}|{.status.containerStatuses[*].state.running.startedAt}|"
    '{.status.conditions[?(@.type=="Ready")].status}{"\\n"}'
)
# One line per EndpointSlice event: its endpoints' pods, then their readiness, in the same order (no range:
# kubectl's jsonpath fails a range over a slice with no endpoints).
SLICE_FORMAT = 'jsonpath={.endpoints[*].targetRef.name}|{.endpoints[*].conditions.ready}{"\\n"}'


class PodTimeline:
    """Watches one namespace's pods and EndpointSlices; `at[step][pod]` is when a watch first saw the pod at
    that step: seen (created), scheduled (bound to a node), running (its containers started), ready (the
    Ready condition) and endpoint (ready in an EndpointSlice)."""

    def __init__(self, kube: ControlPlane, namespace: str) -> None:
        # kubectl's watch, not the Python client: the GPU machine's python has no `kubernetes` package.
        watch = [str(kube.binary("kubectl")), "get", "-n", namespace, "--watch", "-o"]
        self._argvs = {
            self._pod_line: [*watch, WATCH_FORMAT, "pods"],
            self._slice_line: [*watch, SLICE_FORMAT, "endpointslices"],
        }
        self._env = kube.tool_env()
        self.at: dict[str, dict[str, float]] = {step: {} for step in (*STEPS, ENDPOINT)}
        self._watches: list[subprocess.Popen[str]] = []
        self._threads: list[threading.Thread] = []

    def start(self) -> PodTimeline:
        for handle, argv in self._argvs.items():
            watch = subprocess.Popen(argv, env=self._env, stdout=subprocess.PIPE, text=True)
            self._watches.append(watch)
            self._threads.append(threading.Thread(target=self._run, args=(watch, handle), daemon=True))
            self._threads[-1].start()
        return self

    def stop(self) -> None:
        for watch in self._watches:
            watch.kill()
            watch.wait()

    def __enter__(self) -> PodTimeline:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @staticmethod
    def _run(watch: subprocess.Popen[str], handle: Any) -> None:
        assert watch.stdout is not None
        for line in watch.stdout:
            handle(line.rstrip("\n"), time.time())

    def _pod_line(self, line: str, now: float) -> None:
        name, node, running, ready = (line.split("|") + ["", "", "", ""])[:4]
        reached = {"seen": bool(name), "scheduled": bool(node), "running": bool(running.strip()),
                   "ready": ready == "True"}  # fmt: skip
        for step, done in reached.items():
            if done:
                self.at[step].setdefault(name, now)

    def _slice_line(self, line: str, now: float) -> None:
        names, _, readiness = line.partition("|")
        for name, ready in zip(names.split(), readiness.split(), strict=False):
            if ready == "true":
                self.at[ENDPOINT].setdefault(name, now)

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
