"""Operator at rest: what it asks the apiserver for while nothing changes, from the apiserver's audit log.

N InferenceEndpoints (replicas 0, no autoscaler, no snapshots: nothing of theirs changes) are made and
reconciled; then, for several resync periods, every request by the operator is counted.

    .venv/bin/python benchmarks/operator_idle.py --endpoints 500 --resync 15 --window 60

Needs `hack/control-plane build` once. Starts and stops its own control plane and operator.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "hack"), str(REPO / "tests"), str(REPO / "tests" / "operator")]

import audit  # noqa: E402
from control_plane import build, versions  # noqa: E402
from control_plane.cluster import ControlPlane  # noqa: E402
from operator_process import OperatorProcess  # noqa: E402
from operator_scale import print_rows  # noqa: E402
from test_idle_cluster import endpoints_manifest  # noqa: E402

NAMESPACE = "idle"


def reconciled(kube: ControlPlane) -> int:
    """Endpoints whose status reports their current generation."""
    out = kube.kubectl("get", "iep", "-n", NAMESPACE, "-o", "json", timeout=120).stdout
    return sum(
        1
        for item in json.loads(out)["items"]
        if (item.get("status") or {}).get("observedGeneration") == item["metadata"]["generation"]
    )


def make_endpoints(kube: ControlPlane, endpoints: int, state_dir: Path, timeout: float) -> float:
    """Create them and wait until every one is reconciled; seconds taken."""
    manifest = state_dir / "endpoints.json"
    manifest.write_text(endpoints_manifest(NAMESPACE, endpoints))
    started = time.monotonic()
    kube.kubectl("create", "-f", str(manifest), timeout=300)
    kube.wait_for(lambda: reconciled(kube) >= endpoints, timeout=timeout, interval=2, message="reconciled")
    return time.monotonic() - started


def start(state_dir: Path, resync: float) -> tuple[ControlPlane, OperatorProcess]:
    kube = ControlPlane(state_dir=state_dir / "kube", nodes=1, audit_log=state_dir / "audit.log")
    kube.start()
    kube.kubectl("apply", "--server-side", "-f", str(REPO / "crds"))
    kube.kubectl("wait", "--for=condition=Established", "--timeout=60s", "-f", str(REPO / "crds"))
    kube.kubectl("create", "namespace", NAMESPACE)
    env = {"WARMSTART_OPERATOR_RESYNC_SECONDS": f"{resync:g}"}
    return kube, OperatorProcess(kube.kubeconfig, state_dir / "operator.log", env=env)


def run(endpoints: int, resync: float, window: float, state_dir: Path) -> list[tuple[str, str]]:
    kube, operator = start(state_dir, resync)
    try:
        operator.start()
        took = make_endpoints(kube, endpoints, state_dir, timeout=900)
        time.sleep(resync + 5)  # the first resync after the creates' own reconciles
        since = audit.now()
        time.sleep(window)
        until = audit.now()
        time.sleep(2)  # requests answered just before `until` reach the log
        requests = audit.operator_requests(kube.audit_log or Path(), since, until)
    finally:
        operator.stop()
        kube.stop()
    per_minute = 60 / window / endpoints
    writes = [r for r in requests if r.write]
    rows = [
        ("endpoints at rest (replicas 0)", str(endpoints)),
        ("resync period", f"{resync:g} s"),
        ("counted window", f"{window:g} s ({window / resync:.1f} resync periods)"),
        ("create all and see them reconciled", f"{took:.0f} s"),
        ("operator requests / endpoint / minute", f"{len(requests) * per_minute:.2f}"),
        ("operator writes / endpoint / minute", f"{len(writes) * per_minute:.2f}"),
        ("operator writes in the window", str(len(writes))),
    ]
    for what, number in sorted(audit.tally(requests).items()):
        rows.append((f"  {what} / endpoint / minute", f"{number * per_minute:.2f}"))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--endpoints", type=int, default=500)
    parser.add_argument("--resync", type=float, default=15, help="the operator's resync period, seconds")
    parser.add_argument("--window", type=float, default=60, help="seconds counted")
    args = parser.parse_args()
    if args.endpoints < 1 or args.window <= 0 or args.resync <= 0:
        parser.error("--endpoints, --window and --resync must be positive")
    if not build.is_cached():
        print(
            f"the local control plane is not built in {versions.cache_root()}: run `hack/control-plane build`"
        )
        return 2
    with tempfile.TemporaryDirectory(prefix="operator-idle-") as tmp:
        rows = run(args.endpoints, args.resync, args.window, Path(tmp))
    print_rows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
