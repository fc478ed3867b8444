"""Scale from zero on the real node: a request sent to an endpoint at zero replicas, held by the KEDA HTTP
add-on's interceptor until a replica is Ready, answered by a restored replica against a cold-started one.

Starts a control plane and real node of its own with KEDA and the add-on on it, installs the chart, and two
endpoints of the builtin engine on CPU (tiny model) in `autoscaling.mode: http` with `minReplicas: 0`: one
with snapshots, one without. Per round and endpoint: wait until KEDA has taken it to zero, send one
completion through the interceptor from a client pod and time it there (request sent -> whole answer), then
a second one while the replica runs. Baselines from the same run: that second request (the path's cost with a
replica up) and a bare pod of the same image created -> Ready (the kubelet's floor for any new replica);
their sum is the floor of a request at zero.

    .venv/bin/python benchmarks/scale_from_zero.py --rounds 3 --out benchmarks/results/DIR

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

from control_plane import addons  # noqa: E402
from control_plane.cluster import ControlPlane, wait_for  # noqa: E402
from control_plane.node import RealNode  # noqa: E402
from endpoint_flow import (  # noqa: E402
    COLD_ENDPOINT,
    ENDPOINT,
    HOLD_SECONDS,
    at_zero,
    autoscaled,
    client_pod,
    endpoint,
    install,
    ready_snapshot,
    routed_host,
    timed_completion,
)
from node_plugin import host_python_mounts  # noqa: E402
from pod_start import NAMESPACE, TIMEOUT, bare_start, benchmark_node, run_benchmark  # noqa: E402
from pod_timeline import PodTimeline  # noqa: E402

COOLDOWN_SECONDS = 5
KINDS = {ENDPOINT: "restore", COLD_ENDPOINT: "cold"}


def prepare(kube: ControlPlane, node: RealNode, chart_image: str) -> None:
    addons.install(kube, node.pod_placement())
    kube.kubectl("create", "namespace", NAMESPACE)
    kube.wait_default_service_account(NAMESPACE)
    install(kube, chart_image, node, NAMESPACE)
    kube.kubectl("apply", "-f", "-", input=client_pod(NAMESPACE, chart_image, node))
    python = host_python_mounts(node.state_dir / "launcher")
    for name, snapshots in ((ENDPOINT, True), (COLD_ENDPOINT, False)):
        body = autoscaled(endpoint(name, NAMESPACE, chart_image, node, python, snapshots), 0, 1)
        body["spec"]["autoscaling"]["cooldownSeconds"] = COOLDOWN_SECONDS
        kube.kubectl("apply", "-f", "-", input=json.dumps(body))
    wait_for(lambda: ready_snapshot(kube, NAMESPACE), timeout=TIMEOUT, message="the snapshot Ready")


def request_at_zero(kube: ControlPlane, name: str) -> dict[str, Any]:
    wait_for(lambda: at_zero(kube, NAMESPACE, name), timeout=TIMEOUT, interval=1.0, message=f"{name} at zero")
    url = f"http://{addons.interceptor_address()}/v1/completions"
    host = routed_host(kube, NAMESPACE, name)
    answer, seconds = timed_completion(kube, NAMESPACE, url, host, timeout=HOLD_SECONDS)
    warm_answer, warm_seconds = timed_completion(kube, NAMESPACE, url, host)
    return {"seconds": seconds, "warm_seconds": warm_seconds, "answer": answer, "warm_answer": warm_answer}


def measure(rounds: int, state_dir: Path) -> dict[str, Any]:
    with benchmark_node(state_dir, addons.built_images(), addons.missing_reason()) as (kube, node, chart):
        prepare(kube, node, chart)
        clock = PodTimeline(kube, NAMESPACE)
        clock.start()
        rows: dict[str, list[dict[str, Any]]] = {"restore": [], "cold": [], "bare": []}
        for index in range(rounds):
            for name, kind in KINDS.items():
                rows[kind].append(request_at_zero(kube, name))
            rows["bare"].append(bare_start(kube, clock, chart, node, index))
        clock.stop()
        return {"rows": rows}


def table(result: dict[str, Any]) -> str:
    rows = result["rows"]
    median = {kind: statistics.median(r["seconds"] for r in rows[kind]) for kind in rows}
    warm = statistics.median(r["warm_seconds"] for kind in KINDS.values() for r in rows[kind])
    floor = median["bare"] + warm
    answers = {r[key] for kind in KINDS.values() for r in rows[kind] for key in ("answer", "warm_answer")}
    lines = [
        f"{'request -> answer, endpoint at 0 replicas':<48} {'median s':>9}   runs (s)",
        *(
            f"{label:<48} {median[kind]:>9.2f}   " + " ".join(f"{r['seconds']:.2f}" for r in rows[kind])
            for kind, label in (("restore", "restored replica (snapshot)"), ("cold", "cold-started replica"))
        ),
        f"{'same request, replica already up (the path)':<48} {warm:>9.2f}",
        f"{'bare pod, same image, created -> Ready':<48} {median['bare']:>9.2f}   "
        + " ".join(f"{r['seconds']:.2f}" for r in rows["bare"]),
        "",
        f"restore vs cold start, request held at zero: {median['cold'] / median['restore']:.1f}x faster",
        f"floor (bare pod + the request with a replica up): {floor:.2f} s; "
        f"restored is {median['restore'] / floor:.2f}x the floor",
        f"every request answered with 200 and the same completion: {len(answers) == 1}",
    ]
    return "\n".join(lines)


def main() -> int:
    return run_benchmark(__doc__ or "", "scale-from-zero-", measure, table)


if __name__ == "__main__":
    sys.exit(main())
