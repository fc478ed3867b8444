"""Scale out on the workers' queue through Prometheus on the real node: a load starts, prometheus-adapter
serves `warmstart_worker_requests_waiting` to the endpoint's HPA (mode `hpa`, the flagship example's), the
HPA asks for a second replica, and that replica is restored from the snapshot, against a cold-started one.

Starts a control plane and real node of its own with prometheus-operator, a Prometheus it runs (scraping
every 5 s) and prometheus-adapter on it, installs the chart, and per round an endpoint of the builtin engine
on CPU (tiny model, one sequence at a time so that four clients queue) in `autoscaling.mode: hpa`, 1..2
replicas, first with snapshots, then without. Times from the load's start, polled every 0.25 s: the
autoscaler setting two replicas (its own reaction: scrape, adapter, HPA sync), the new replica Ready, its
first answer. Baseline from the same run: a bare pod of the same image created -> Ready (the kubelet's floor
for any new replica); the autoscaler's reaction plus that is the floor of load -> new replica Ready.

    .venv/bin/python benchmarks/scale_on_metrics.py --rounds 3 --out benchmarks/results/DIR

Needs root, `hack/control-plane build`, `hack/control-plane images` and `hack/control-plane addons`.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "hack"), str(REPO / "tests"), str(REPO / "tests" / "kube")]

from control_plane import monitoring  # noqa: E402
from control_plane.cluster import ControlPlane, wait_for  # noqa: E402
from control_plane.node import RealNode  # noqa: E402
from endpoint_flow import ENDPOINT, endpoint, get, install, ready_snapshot, start_client  # noqa: E402
from metrics_flow import MONITORED, custom_metric, scale_out_under_load, scaled_on_queue, started_as  # noqa: E402
from node_plugin import HostPython, host_python_mounts  # noqa: E402
from pod_start import NAMESPACE, TIMEOUT, bare_start, benchmark_node, run_benchmark  # noqa: E402
from pod_timeline import PodTimeline  # noqa: E402

from warmstart.api import labels as L  # noqa: E402

LOAD_SECONDS = 120
KINDS = {"restore": True, "cold": False}


def prepare(kube: ControlPlane, node: RealNode, chart_image: str) -> None:
    monitoring.install(kube, node.pod_placement())
    kube.kubectl("create", "namespace", NAMESPACE)
    kube.wait_default_service_account(NAMESPACE)
    install(kube, chart_image, node, NAMESPACE, MONITORED)
    start_client(kube, NAMESPACE, chart_image, node)


def one_scale_out(
    kube: ControlPlane, node: RealNode, chart_image: str, python: HostPython, snapshots: bool
) -> dict[str, Any]:
    """The endpoint applied afresh, scaled out under load once, then deleted."""
    body = scaled_on_queue(endpoint(ENDPOINT, NAMESPACE, chart_image, node, python, snapshots), "hpa")
    kube.kubectl("apply", "-f", "-", input=json.dumps(body))
    role = L.ROLE_RESTORE if snapshots else L.ROLE_COLD
    if snapshots:
        wait_for(lambda: ready_snapshot(kube, NAMESPACE), timeout=TIMEOUT, message="the snapshot Ready")
    wait_for(lambda: started_as(kube, NAMESPACE, 1, role), timeout=TIMEOUT, message=f"one {role} replica")
    wait_for(lambda: custom_metric(kube, NAMESPACE), timeout=TIMEOUT, message="the metric served")
    times = scale_out_under_load(kube, NAMESPACE, role, ENDPOINT, LOAD_SECONDS)
    kube.kubectl("delete", "iep", ENDPOINT, "-n", NAMESPACE, "--cascade=foreground", "--timeout=120s")
    wait_for(lambda: get(kube, "iep", NAMESPACE, ENDPOINT) is None, timeout=TIMEOUT, message="endpoint gone")
    return times.row()


def measure(rounds: int, state_dir: Path) -> dict[str, Any]:
    extra = monitoring.built_images()
    with benchmark_node(state_dir, extra, monitoring.missing_reason()) as (kube, node, chart):
        prepare(kube, node, chart)
        python = host_python_mounts(node.state_dir / "launcher")
        clock = PodTimeline(kube, NAMESPACE)
        clock.start()
        rows: dict[str, list[dict[str, Any]]] = {"restore": [], "cold": [], "bare": []}
        for index in range(rounds):
            for kind, snapshots in KINDS.items():
                rows[kind].append(one_scale_out(kube, node, chart, python, snapshots))
            rows["bare"].append(bare_start(kube, clock, chart, node, index))
        clock.stop()
        return {"rows": rows}


def table(result: dict[str, Any]) -> str:
    rows = result["rows"]

    def median(kind: str, key: str) -> float:
        return statistics.median(row[key] for row in rows[kind])

    def runs(kind: str, key: str) -> str:
        return " ".join(f"{row[key]:.1f}" for row in rows[kind])

    bare = statistics.median(row["seconds"] for row in rows["bare"])
    start = {kind: median(kind, "answered") - median(kind, "decided") for kind in KINDS}
    lines = [f"{'seconds from the load starting, median':<40} {'2 wanted':>9} {'Ready':>7} {'answered':>9}"]
    for kind, label in (("restore", "restored replica (snapshot)"), ("cold", "cold-started replica")):
        lines.append(
            f"{label:<40} {median(kind, 'decided'):>9.1f} {median(kind, 'ready'):>7.1f} "
            f"{median(kind, 'answered'):>9.1f}   answered {runs(kind, 'answered')}"
        )
    reaction = median("restore", "decided")
    floor = reaction + bare
    lines += [
        f"{'bare pod, same image, created -> Ready':<40} {bare:>17.2f}   " + runs("bare", "seconds"),
        "",
        "the autoscaler's own reaction (load -> 2 replicas wanted: scrape, adapter, HPA): restored rounds "
        f"{runs('restore', 'decided')} s, cold rounds {runs('cold', 'decided')} s",
        f"new replica, wanted -> first answer: restored {start['restore']:.1f} s, cold {start['cold']:.1f} s "
        f"({start['cold'] / start['restore']:.1f}x faster)",
        f"floor of load -> restored replica Ready (its reaction + bare pod): {floor:.1f} s; restored "
        f"{median('restore', 'ready'):.1f} s is {median('restore', 'ready') / floor:.2f}x it",
        f"queue peak per replica seen by the HPA: {max(row['peak'] for k in KINDS for row in rows[k]):.2f}",
    ]
    return "\n".join(lines)


def main() -> int:
    return run_benchmark(__doc__ or "", "scale-on-metrics-", measure, table)


if __name__ == "__main__":
    sys.exit(main())
