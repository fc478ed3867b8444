"""Pod created -> Ready on a second node, the snapshot captured on the first: restored after a pull from the
object store, restored from the node's cache, and cold-started, in one run.

Starts a control plane, two real nodes and an S3 server (Versity's gateway) of its own, installs the chart
with the object store as the cluster's store, and two endpoints of the builtin engine on CPU (tiny model):
one with snapshots, captured on node A, one without. Then, with A cordoned, per round: a bare pod on B (the
floor of any pod start), the cold endpoint scaled 1 -> 2, the snapshot's endpoint scaled 1 -> 2 with B's
cache emptied first (the restore pulls every byte), and again with the cache kept (it pulls nothing). Each
new pod is timed from its first sight in a watch to its Ready condition; every answer is compared with the
cold one's. The bytes each restore pulled are the agent's own count. Floors from the same run: the bare pod
plus one reader of every snapshot byte from the page cache (the cached row), plus one GET at a time of every
blob from the S3 server (the pulled row).

    .venv/bin/python benchmarks/two_node_start.py --rounds 3

Needs root, `hack/control-plane build` and `hack/control-plane images`.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / p) for p in ("hack", "tests", "tests/kube", "benchmarks")]

from control_plane import images, network, s3  # noqa: E402
from control_plane.cluster import ControlPlane, wait_for  # noqa: E402
from control_plane.node import NodeImage, RealNode  # noqa: E402
from endpoint_flow import (  # noqa: E402
    CHART,
    COLD_ENDPOINT,
    ENDPOINT,
    RELEASE,
    agent_store,
    chart_values,
    client_pod,
    endpoint,
    ready,
    ready_snapshot,
    store_on_node,
    worker_pods,
)
from node_plugin import host_python_mounts  # noqa: E402
from pod_start import (  # noqa: E402
    NAMESPACE,
    TIMEOUT,
    bare_pod,
    run_benchmark,
    runs,
    scale_out,
    serial_read,
    start_seconds,
)
from pod_timeline import PodTimeline  # noqa: E402
from two_nodes import (  # noqa: E402
    BUCKET,
    on_either_node,
    only_schedulable,
    pulled,
    start_object_store,
    use_object_store,
)

from warmstart.api import labels as L  # noqa: E402
from warmstart.snapshot.remote import Credentials, RemoteConfig  # noqa: E402
from warmstart.snapshot.remote.object_keys import Keys  # noqa: E402
from warmstart.snapshot.remote.objects import ObjectClient  # noqa: E402
from warmstart.snapshot.store import SnapshotStore  # noqa: E402

KINDS = ("bare", "cold", "pulled", "cached")


def prepare(
    kube: ControlPlane, nodes: tuple[RealNode, RealNode], chart: str, models: Path, server: s3.S3Server
) -> str:
    """The chart and both endpoints, the snapshot captured on A; its id once both endpoints serve."""
    node_a, node_b = nodes
    kube.kubectl("create", "namespace", NAMESPACE)
    kube.wait_default_service_account(NAMESPACE)
    values = chart_values(chart, node_a, NAMESPACE, store_on_node(NAMESPACE))
    use_object_store(kube, values, server, NAMESPACE)
    kube.helm(
        "install", RELEASE, str(CHART), "-n", NAMESPACE, "-f", "-", input=json.dumps(values), timeout=120
    )
    kube.kubectl("apply", "-f", "-", input=client_pod(NAMESPACE, chart, node_a))
    only_schedulable(kube, node_a, node_b)
    python = host_python_mounts(node_a.state_dir / "launcher")
    for name in (COLD_ENDPOINT, ENDPOINT):
        body = on_either_node(endpoint(name, NAMESPACE, chart, node_a, python, None), models)
        if name == COLD_ENDPOINT:
            body["spec"]["snapshot"] = {"enabled": False}
        kube.kubectl("apply", "-f", "-", input=json.dumps(body))
    snap = wait_for(lambda: ready_snapshot(kube, NAMESPACE), timeout=TIMEOUT, message="the snapshot Ready")
    for name, role in ((COLD_ENDPOINT, L.ROLE_COLD), (ENDPOINT, L.ROLE_RESTORE)):
        wait_for(lambda n=name, r=role: any(ready(p) for p in worker_pods(kube, NAMESPACE, r, n)),
                 timeout=TIMEOUT, message=f"{name} Ready")  # fmt: skip
    only_schedulable(kube, node_b, node_a)
    return snap["status"]["snapshotId"]


def empty_cache(store: SnapshotStore, snapshot_id: str) -> None:
    """B's cache as a node's that never held the snapshot (its blobs collected at once)."""
    if store.is_published(snapshot_id):
        store.delete(snapshot_id)
    store.gc(blob_grace=0)


def restore_on_b(kube: ControlPlane, clock: PodTimeline, node_b: RealNode) -> dict[str, Any]:
    before = pulled(kube, NAMESPACE, node_b, "restore")
    row = scale_out(kube, clock, ENDPOINT, L.ROLE_RESTORE)
    row["pulled_bytes"] = pulled(kube, NAMESPACE, node_b, "restore") - before
    return row


def serial_get(server: s3.S3Server, store: SnapshotStore, snapshot_id: str, root: Path) -> tuple[int, float]:
    """Bytes of every blob of the snapshot and the seconds one GET at a time takes to move them from the S3
    server (a second gateway on loopback over the same directory, the first being in the nodes' network):
    the floor of a pull, which also checks every digest."""
    keys = Keys(f"{NAMESPACE}/")
    sizes = {entry.digest: entry.size for entry in store.get(snapshot_id).manifest.files.values()}
    reader = s3.start_s3_server(server.data_dir, credentials=(server.access_key_id, server.secret_access_key),
                                log=root / "versitygw-loopback.log")  # fmt: skip
    try:
        credentials = Credentials(reader.access_key_id, reader.secret_access_key)
        client = ObjectClient(
            RemoteConfig(bucket=BUCKET, endpoint=reader.endpoint, concurrency=1, credentials=credentials)
        )
        started = time.monotonic()
        total = sum(
            client.read_into(keys.blob(digest), lambda _view: None, size) for digest, size in sizes.items()
        )
        return total, time.monotonic() - started
    finally:
        reader.stop()


def measure(rounds: int, state_dir: Path) -> dict[str, Any]:
    chart = images.chart_images()[0].reference
    built = images.built_images()
    if chart not in built:
        sys.exit(f"{chart} is not built: run `hack/control-plane images`")
    chart_only = [NodeImage(reference, path) for reference, path in built.items()]
    kube = ControlPlane(state_dir=state_dir / "kube", nodes=1)  # kwok: the real nodes run every pod
    kube.start()
    node_a = RealNode(plane=kube, state_dir=state_dir / "node-a", images=chart_only)
    node_b = RealNode(plane=kube, state_dir=state_dir / "node-b", images=chart_only,
                      name=network.SECOND_NODE_NAME, first=node_a)  # fmt: skip
    server = None
    try:
        node_a.start()
        node_b.start()
        server = start_object_store(node_a, state_dir / "s3")
        models = state_dir / "models"
        models.mkdir()
        clock = PodTimeline(kube, NAMESPACE)
        clock.start()
        snapshot_id = prepare(kube, (node_a, node_b), chart, models, server)
        b_cache = agent_store(node_b, NAMESPACE)
        rows: dict[str, list[dict[str, Any]]] = {kind: [] for kind in KINDS}
        for index in range(rounds):
            name = f"bare-{index}"
            kube.kubectl("apply", "-f", "-", input=json.dumps(bare_pod(name, chart, node_b)))
            rows["bare"].append({"pod": name, "seconds": start_seconds(clock, name)})
            kube.kubectl("delete", "pod", name, "-n", NAMESPACE, "--wait=false")
            rows["cold"].append(scale_out(kube, clock, COLD_ENDPOINT, L.ROLE_COLD))
            empty_cache(b_cache, snapshot_id)
            rows["pulled"].append(restore_on_b(kube, clock, node_b))
            rows["cached"].append(restore_on_b(kube, clock, node_b))
        clock.stop()
        size, read_s = serial_read(b_cache, snapshot_id)
        get_bytes, get_s = serial_get(server, b_cache, snapshot_id, state_dir)
        return {
            "rows": rows,
            "snapshot": snapshot_id,
            "snapshot_bytes": size,
            "serial_read_seconds": read_s,
            "serial_get_bytes": get_bytes,
            "serial_get_seconds": get_s,
        }
    finally:
        if server is not None:
            server.stop()
        node_b.stop()
        node_a.stop()
        kube.stop()


def table(result: dict[str, Any]) -> str:
    rows = result["rows"]
    median = {kind: statistics.median(r["seconds"] for r in measured) for kind, measured in rows.items()}
    size, read = result["snapshot_bytes"], result["serial_read_seconds"]
    get_bytes, get_s = result["serial_get_bytes"], result["serial_get_seconds"]
    answers = [r["answer"] for kind in ("cold", "pulled", "cached") for r in rows[kind]]
    same = len(set(answers)) == 1 and bool(answers[0].strip())
    pulled_bytes = [int(r["pulled_bytes"]) for r in rows["pulled"]]
    cached_bytes = [int(r["pulled_bytes"]) for r in rows["cached"]]
    lines = [
        f"{'pod start on node B (created -> Ready)':<52} {'median s':>9}   runs (s)",
        *(
            f"{label:<52} {median[kind]:>9.2f}   {runs(rows[kind])}"
            for kind, label in (
                ("bare", "bare pod, same image (kubelet floor)"),
                ("cold", "cold start (builtin, tiny, CPU)"),
                ("pulled", "restored, pulled from the object store first"),
                ("cached", "restored from B's cache"),
            )
        ),
        "",
        f"bytes pulled per restore: after emptying the cache {pulled_bytes}; from the cache {cached_bytes}",
        f"snapshot {result['snapshot']}: {size / 2**20:.1f} MiB; one reader from the page cache {read:.3f} s",
        f"floor of the cached restore (bare pod + that read): {median['bare'] + read:.2f} s; "
        f"it is {median['cached'] / (median['bare'] + read):.2f}x the floor",
        f"one GET at a time from the S3 server: {get_bytes / 2**20:.1f} MiB in {get_s:.3f} s; "
        f"floor of the pulled restore (cached floor + that): {median['bare'] + read + get_s:.2f} s; it is "
        f"{median['pulled'] / (median['bare'] + read + get_s):.2f}x the floor",
        f"cached restore vs cold start: {median['cold'] / median['cached']:.1f}x faster; "
        f"the pull adds {median['pulled'] - median['cached']:.2f} s",
        f"answers identical to the cold start's (and not empty): {same}",
    ]
    return "\n".join(lines)


def main() -> int:
    return run_benchmark(__doc__ or "", "two-node-start-", measure, table)


if __name__ == "__main__":
    raise SystemExit(main())
