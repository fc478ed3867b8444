"""Pod created -> Ready on the real node: a restored replica against a cold-started one, in one run.

Installs the chart (operator and agent DaemonSet from the project's image) on a control plane and real node
of its own, and two endpoints of the builtin engine on CPU (tiny model): one with snapshots, one without.
Then, per round, scales each from 1 to 2 replicas and times the new pod from its first sight in a watch to
its Ready condition; the restored pod's answer (its token ids) is compared with the cold one's. Baselines
from the same run: a bare pod of the same image (what the kubelet and containerd take for any pod: the floor
of a pod start) and a serial read of the snapshot's files from the page cache (the floor of moving its
bytes). Last, the agent is rolled out again without the container runtime's socket (`agent.criSocket: ""`)
and the restores repeated: the image a worker runs from then comes from the kubelet's report (the agent's
`pod_checks` phase).

    .venv/bin/python benchmarks/pod_start.py --rounds 3

Needs root, `hack/control-plane build` and `hack/control-plane images`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "hack"), str(REPO / "tests"), str(REPO / "tests" / "kube")]

from control_plane import images  # noqa: E402
from control_plane.cluster import ControlPlane, wait_for  # noqa: E402
from control_plane.node import NodeImage, RealNode  # noqa: E402
from endpoint_flow import (  # noqa: E402
    CHART,
    COLD_ENDPOINT,
    ENDPOINT,
    RELEASE,
    agent_store,
    client_pod,
    completion,
    endpoint,
    get,
    install,
    pod_url,
    ready,
    ready_snapshot,
    worker_pods,
)
from node_plugin import host_python_mounts  # noqa: E402
from pod_timeline import PodTimeline  # noqa: E402

from warmstart.api import labels as L  # noqa: E402
from warmstart.snapshot.store import SnapshotStore  # noqa: E402

NAMESPACE = "bench"
TIMEOUT = 300.0


def start_seconds(clock: PodTimeline, name: str) -> float:
    """Pod `name` first seen -> Ready."""
    return clock.wait_ready(name, TIMEOUT) - clock.at["seen"][name]


@contextlib.contextmanager
def benchmark_node(
    state_dir: Path, more_images: dict[str, Path], missing: str | None
) -> Iterator[tuple[ControlPlane, RealNode, str]]:
    """A control plane and a started real node with the chart's images and `more_images`; the chart image's
    reference. Exits naming what is not built (`missing`: what the caller lacks, None when nothing)."""
    chart = images.chart_images()[0].reference
    built = images.built_images()
    if chart not in built:
        sys.exit(f"{chart} is not built: run `hack/control-plane images`")
    if missing:
        sys.exit(missing)
    kube = ControlPlane(state_dir=state_dir / "kube", nodes=1)  # kwok: the real node runs every pod
    kube.start()
    every = {**built, **more_images}
    node = RealNode(
        plane=kube, state_dir=state_dir / "node", images=[NodeImage(r, p) for r, p in every.items()]
    )
    try:
        node.start()
        yield kube, node, chart
    finally:
        node.stop()
        kube.stop()


def bare_start(
    kube: ControlPlane, clock: PodTimeline, chart_image: str, node: RealNode, index: int
) -> dict[str, Any]:
    """One bare pod of the chart's image created -> Ready (the kubelet's floor for any pod), then deleted."""
    name = f"bare-{index}"
    kube.kubectl("apply", "-f", "-", input=json.dumps(bare_pod(name, chart_image, node)))
    row = {"pod": name, "seconds": start_seconds(clock, name)}
    kube.kubectl("delete", "pod", name, "-n", NAMESPACE, "--wait=false")
    return row


def bare_pod(name: str, chart_image: str, node: RealNode) -> dict[str, Any]:
    """The worker's image doing nothing, as a worker pod is made: no service account token (the operator
    leaves it out), Ready by a readiness probe a second apart (without one the kubelet marks a pod Ready only
    at its next relist of the runtime, up to a second later, which a worker pod does not wait for)."""
    body = json.loads(client_pod(NAMESPACE, chart_image, node))
    body["metadata"]["name"] = name
    body["spec"]["automountServiceAccountToken"] = False
    probe = {"exec": {"command": ["true"]}, "periodSeconds": 1, "failureThreshold": 1}
    body["spec"]["containers"][0]["readinessProbe"] = probe
    return body


def scale_out(kube: ControlPlane, clock: PodTimeline, name: str, role: str) -> dict[str, Any]:
    """1 -> 2 replicas; the new pod's start time, then back to 1 replica."""
    before = {p["metadata"]["name"] for p in worker_pods(kube, NAMESPACE, role, name)}

    def new_pod() -> dict[str, Any] | None:
        return next(
            (p for p in worker_pods(kube, NAMESPACE, role, name) if p["metadata"]["name"] not in before), None
        )

    kube.kubectl("scale", f"iep/{name}", "-n", NAMESPACE, "--replicas=2")
    new = wait_for(new_pod, timeout=TIMEOUT, message=f"a new {role} pod of {name}")
    pod_name = new["metadata"]["name"]
    seconds = start_seconds(clock, pod_name)
    pod = get(kube, "pod", NAMESPACE, pod_name)
    assert pod is not None and ready(pod)
    answer = completion(kube, NAMESPACE, pod_url(pod))
    phases = clock.start_phases(pod, since=clock.at["seen"][pod_name])
    report = json.loads((pod["metadata"].get("annotations") or {}).get(L.STATUS_ANNOTATION) or "{}")
    phases.update({f"agent_{name}": seconds for name, seconds in report.get("restorePhases", {}).items()})
    kube.kubectl("scale", f"iep/{name}", "-n", NAMESPACE, "--replicas=1")
    wait_for(lambda: len(worker_pods(kube, NAMESPACE, role, name)) == 1, timeout=TIMEOUT, message="scaled in")
    return {"pod": pod_name, "seconds": seconds, "answer": answer, **phases}


def serial_read(store: SnapshotStore, snapshot_id: str) -> tuple[int, float]:
    """Bytes of every blob of the snapshot and the seconds one reader takes (page cache warmed first)."""
    paths = [store.blob_path(digest) for digest in sorted(store.get(snapshot_id).manifest.digests())]
    for path in paths:
        path.read_bytes()
    started = time.monotonic()
    total = sum(len(path.read_bytes()) for path in paths)
    return total, time.monotonic() - started


def prepare(kube: ControlPlane, node: RealNode, chart_image: str) -> tuple[PodTimeline, str, SnapshotStore]:
    kube.kubectl("create", "namespace", NAMESPACE)
    kube.wait_default_service_account(NAMESPACE)
    install(kube, chart_image, node, NAMESPACE)
    clock = PodTimeline(kube, NAMESPACE).start()
    kube.kubectl("apply", "-f", "-", input=client_pod(NAMESPACE, chart_image, node))
    python = host_python_mounts(node.state_dir / "launcher")
    for name, snapshots in ((COLD_ENDPOINT, False), (ENDPOINT, True)):
        body = endpoint(name, NAMESPACE, chart_image, node, python, snapshots)
        kube.kubectl("apply", "-f", "-", input=json.dumps(body))
    snap = wait_for(lambda: ready_snapshot(kube, NAMESPACE), timeout=TIMEOUT, message="the snapshot Ready")
    for name, role in ((COLD_ENDPOINT, L.ROLE_COLD), (ENDPOINT, L.ROLE_RESTORE)):
        wait_for(lambda n=name, r=role: any(ready(p) for p in worker_pods(kube, NAMESPACE, r, n)),
                 timeout=TIMEOUT, message=f"{name} Ready")  # fmt: skip
    return clock, snap["status"]["snapshotId"], agent_store(node, NAMESPACE)


def without_runtime_socket(kube: ControlPlane) -> None:
    """The agent rolled out again with `agent.criSocket: ""`: it waits for the kubelet's report."""
    kube.helm("upgrade", RELEASE, str(CHART), "-n", NAMESPACE, "--reuse-values", "--set", "agent.criSocket=",
              timeout=120)  # fmt: skip
    agent = f"daemonset/{RELEASE}-warmstart-agent"
    kube.kubectl("rollout", "status", agent, "-n", NAMESPACE, "--timeout=180s", timeout=200)


def measure(rounds: int, state_dir: Path) -> dict[str, Any]:
    with benchmark_node(state_dir, {}, None) as (kube, node, chart):
        clock, snapshot_id, store = prepare(kube, node, chart)
        rows: dict[str, list[dict[str, Any]]] = {"bare": [], "cold": [], "restore": []}
        for index in range(rounds):
            rows["bare"].append(bare_start(kube, clock, chart, node, index))
            rows["cold"].append(scale_out(kube, clock, COLD_ENDPOINT, L.ROLE_COLD))
            rows["restore"].append(scale_out(kube, clock, ENDPOINT, L.ROLE_RESTORE))
        without_runtime_socket(kube)
        rows["restore_kubelet"] = [scale_out(kube, clock, ENDPOINT, L.ROLE_RESTORE) for _ in range(rounds)]
        clock.stop()
        size, read_s = serial_read(store, snapshot_id)
        return {
            "rows": rows,
            "snapshot": snapshot_id,
            "snapshot_bytes": size,
            "serial_read_seconds": read_s,
        }


def runs(measured: list[dict[str, Any]]) -> str:
    return " ".join(f"{r['seconds']:.2f}" for r in measured)


def table(result: dict[str, Any]) -> str:
    rows = result["rows"]
    median = {kind: statistics.median(r["seconds"] for r in runs) for kind, runs in rows.items()}
    size, read = result["snapshot_bytes"], result["serial_read_seconds"]
    floor = median["bare"] + read
    restored = rows["restore"] + rows.get("restore_kubelet", [])
    same = all(r["answer"] == rows["cold"][0]["answer"] for r in restored + rows["cold"])
    lines = [
        f"{'pod start (created -> Ready)':<40} {'median s':>9}   runs (s)",
        *(
            f"{label:<40} {median[kind]:>9.2f}   {runs(rows[kind])}"
            for kind, label in (
                ("bare", "bare pod, same image (kubelet floor)"),
                ("cold", "cold start (builtin, tiny, CPU)"),
                ("restore", "restored by the agent"),
                ("restore_kubelet", "restored, image from the kubelet"),
            )
            if kind in rows
        ),
        "",
        f"restore vs cold start: {median['cold'] / median['restore']:.1f}x faster",
        *(
            f"{label}, median phases: {median_phases(rows[kind])}"
            for kind, label in (("restore", "restored"), ("restore_kubelet", "image from the kubelet"))
            if kind in rows
        ),
        f"snapshot {result['snapshot']}: {size / 2**20:.1f} MiB; one reader from the page cache "
        f"{read:.3f} s ({size / read / 1e9:.2f} GB/s)",
        f"floor (bare pod + serial read of every snapshot byte): {floor:.2f} s; "
        f"restore is {median['restore'] / floor:.2f}x the floor",
        f"token ids identical to the cold start's: {same}",
    ]
    return "\n".join(line for line in lines if line)


def median_phases(measured: list[dict[str, Any]]) -> str:
    keys = [key for key in measured[0] if key not in ("pod", "seconds", "answer")]
    values = {
        key: statistics.median(r[key] for r in measured) for key in keys if all(key in r for r in measured)
    }
    return ", ".join(f"{key.replace('_', ' ')} {value:.2f} s" for key, value in values.items())


def run_benchmark(
    description: str,
    prefix: str,
    measure: Callable[[int, Path], dict[str, Any]],
    table: Callable[[dict[str, Any]], str],
) -> int:
    """The real-node benchmarks' command line: --rounds, --out; the table printed, raw output saved."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, help="directory for the raw result (default: print only)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix=prefix) as state:
        result = measure(args.rounds, Path(state))
    result["machine"] = f"{platform.node()} {platform.machine()}, {platform.release()}"
    result["date"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    report = table(result)
    print(report)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "result.json").write_text(json.dumps(result, indent=2))
        (args.out / "table.txt").write_text(report + "\n")
    return 0


def main() -> int:
    return run_benchmark(__doc__ or "", "pod-start-", measure, table)


if __name__ == "__main__":
    raise SystemExit(main())
