"""Operator at scale: N InferenceEndpoints on the local control plane (kwok nodes make pods Ready).

Measures the time from applying N endpoints to every one reporting Ready (all children made, pods scheduled
and Ready, status written back), per-endpoint time-to-Ready percentiles, and the operator's memory (RSS).

    .venv/bin/python benchmarks/operator_scale.py --endpoints 200

Needs `hack/control-plane build` once. Starts and stops its own control plane and operator.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import re
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "hack"), str(REPO / "tests"), str(REPO / "tests" / "operator")]

from control_plane import build, versions  # noqa: E402
from control_plane.cluster import ControlPlane  # noqa: E402
from operator_process import OperatorProcess  # noqa: E402

from warmstart.kube.client import Kube  # noqa: E402

GPUS_PER_NODE = 8


def endpoint_manifest(index: int, namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "warmstart.dev/v1alpha1",
        "kind": "InferenceEndpoint",
        "metadata": {"name": f"ep-{index:04d}", "namespace": namespace},
        "spec": {
            "model": {"uri": f"org/model-{index % 7}"},
            "engine": {"kind": "vllm", "image": "registry.example/warmstart-worker:0.1"},
            "resources": {"gpus": 1},
            "snapshot": {"enabled": False},
            "autoscaling": {
                "mode": "hpa",
                "minReplicas": 1,
                "maxReplicas": 4,
                "metric": {"name": "vllm:num_requests_waiting", "target": "4"},
            },
        },
    }


def ready_times(kube: ControlPlane, namespace: str) -> dict[str, float]:
    """Endpoint name -> seconds from creation to its Ready condition turning True (API timestamps)."""
    out = kube.kubectl("get", "iep", "-n", namespace, "-o", "json", timeout=120).stdout
    found = {}
    for item in json.loads(out)["items"]:
        created = dt.datetime.fromisoformat(item["metadata"]["creationTimestamp"].replace("Z", "+00:00"))
        for cond in (item.get("status") or {}).get("conditions") or []:
            if cond["type"] == "Ready" and cond["status"] == "True" and cond.get("reason") == "ReplicasReady":
                turned = dt.datetime.fromisoformat(cond["lastTransitionTime"].replace("Z", "+00:00"))
                found[item["metadata"]["name"]] = (turned - created).total_seconds()
    return found


def count(kube: ControlPlane, kind: str, namespace: str) -> int:
    out = kube.kubectl("get", kind, "-n", namespace, "-o", "name", timeout=120).stdout
    return len(out.split())


class RssSampler(threading.Thread):
    def __init__(self, operator: OperatorProcess) -> None:
        super().__init__(daemon=True)
        self.operator, self.peak, self.stop_flag = operator, 0, threading.Event()

    def run(self) -> None:
        while not self.stop_flag.wait(0.5):
            try:
                self.peak = max(self.peak, self.operator.rss_bytes())
            except OSError:
                return


def metric_sum(text: str, name: str) -> float:
    return sum(
        float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    )


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def run(endpoints: int, timeout: float, state_dir: Path) -> list[tuple[str, str]]:
    nodes = math.ceil(endpoints / GPUS_PER_NODE) + 1
    kube = ControlPlane(state_dir=state_dir / "kube", nodes=nodes)
    kube.start()
    operator = OperatorProcess(kube.kubeconfig, state_dir / "operator.log")
    sampler = RssSampler(operator)
    try:
        kube.kubectl("apply", "--server-side", "-f", str(REPO / "crds"))
        kube.kubectl("wait", "--for=condition=Established", "--timeout=60s", "-f", str(REPO / "crds"))
        namespace = "scale"
        kube.kubectl("create", "namespace", namespace)
        kube.wait_default_service_account(namespace)
        operator.start()
        time.sleep(2)
        rss_idle = operator.rss_bytes()
        cpu_before = operator.cpu_seconds()
        sampler.start()
        api = Kube(kube.api_client())
        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(api.create, (endpoint_manifest(i, namespace) for i in range(endpoints))))
        applied = time.monotonic() - started
        children_done = all_ready = None
        while time.monotonic() - started < timeout:
            if (
                children_done is None
                and count(kube, "deployment", namespace) >= endpoints
                and count(kube, "hpa", namespace) >= endpoints
            ):
                children_done = time.monotonic() - started
            if children_done is not None and len(ready_times(kube, namespace)) >= endpoints:
                all_ready = time.monotonic() - started
                break
            time.sleep(1)
        per_endpoint = list(ready_times(kube, namespace).values())
        text = operator.metrics()
        sampler.stop_flag.set()
        sampler.join()
        rss_after = operator.rss_bytes()
        cpu_used = operator.cpu_seconds() - cpu_before
    finally:
        sampler.stop_flag.set()
        operator.stop()
        kube.stop()
    reconciles = metric_sum(text, "warmstart_operator_reconciles_total")
    latency = metric_sum(text, "warmstart_operator_reconcile_seconds_sum") / max(1.0, reconciles)
    mib = 1024 * 1024

    def seconds(value: float | None) -> str:
        return f"{value:.1f} s" if value is not None else f"not within {timeout:.0f} s"

    return [
        ("endpoints (1 GPU worker each, HPA)", str(endpoints)),
        ("kwok nodes (8 GPUs each)", str(nodes)),
        ("create all endpoints (8 parallel clients)", seconds(applied)),
        ("all Deployments + HPAs exist", seconds(children_done)),
        ("all endpoints Ready (from the first create)", seconds(all_ready)),
        (
            "per-endpoint time to Ready p50 / p95 / max",
            " / ".join(f"{percentile(per_endpoint, q):.0f} s" for q in (0.5, 0.95, 1.0))
            if per_endpoint
            else "-",
        ),
        ("endpoints Ready", f"{len(per_endpoint)}/{endpoints}"),
        ("reconciles (all handlers)", f"{reconciles:.0f}"),
        ("mean reconcile latency", f"{latency * 1000:.0f} ms"),
        ("operator CPU time during the run", f"{cpu_used:.1f} s"),
        (
            "operator RSS idle / peak / after",
            f"{rss_idle / mib:.0f} / {sampler.peak / mib:.0f} / {rss_after / mib:.0f} MiB",
        ),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--endpoints", type=int, default=200)
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    if args.endpoints < 1:
        parser.error("--endpoints must be at least 1")
    if not build.is_cached():
        print(
            f"the local control plane is not built in {versions.cache_root()}: run `hack/control-plane build`"
        )
        return 2
    with tempfile.TemporaryDirectory(prefix="operator-scale-") as tmp:
        rows = run(args.endpoints, args.timeout, Path(tmp))
    print_rows(rows)
    return 0


def print_rows(rows: list[tuple[str, str]]) -> None:
    """The measures as one Markdown table."""
    width = max(len(name) for name, _ in rows)
    print(f"\n| {'measure'.ljust(width)} | value |\n|{'-' * (width + 2)}|-------|")
    for name, value in rows:
        print(f"| {name.ljust(width)} | {value} |")


if __name__ == "__main__":
    sys.exit(main())
