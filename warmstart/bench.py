"""`warmstart bench restore`: cold start vs restore of the same engine and model, measured in one run.

For each of N repetitions: a cold start, a restore with the page cache hot and (as root) one with the page
cache dropped first. Each is timed to ready (HTTP) and to the first token of a one-token completion. The
restore is compared with its floor, measured in the same run: the snapshot's bytes over the bandwidth read
back from the store (hot and dropped) plus CRIU's fixed cost (restoring a trivial process).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from warmstart.checkpoint.layout import CRIU_DIR
from warmstart.serve.cli import add_worker_arguments
from warmstart.serve.local_node import LocalNode
from warmstart.serve.worker_spec import ServeError, StartReport, WorkerSpec

if TYPE_CHECKING:
    from warmstart.checkpoint.criu import Criu
    from warmstart.checkpoint.sandbox import Sandbox
    from warmstart.snapshot.store import Snapshot, SnapshotStore

READ_CHUNK = 8 << 20


@dataclass
class Series:
    """One kind of start, repeated."""

    name: str
    ready: list[float] = field(default_factory=list)
    first_token: list[float] = field(default_factory=list)
    phases: dict[str, list[float]] = field(default_factory=dict)

    def median(self, values: list[float]) -> float:
        return statistics.median(values) if values else float("nan")


@dataclass
class Floor:
    name: str
    seconds: float
    detail: str


def drop_page_cache() -> bool:
    """Write back and drop the page cache; False when not permitted (not root)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def first_token_seconds(spec: WorkerSpec, started: float) -> float:
    """Seconds from `started` until a one-token greedy completion came back."""
    body = json.dumps({"model": spec.model, "prompt": "warm", "max_tokens": 1, "temperature": 0}).encode()
    request = urllib.request.Request(
        spec.base_url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        response.read()
    return time.monotonic() - started


def read_bandwidth(paths: list[Path]) -> tuple[int, float]:
    """Bytes and seconds to read `paths` sequentially in large chunks."""
    total, started = 0, time.monotonic()
    for path in paths:
        with open(path, "rb", buffering=0) as handle:
            while chunk := handle.read(READ_CHUNK):
                total += len(chunk)
    return total, time.monotonic() - started


def criu_fixed_cost(criu: Criu, work: Path) -> float:
    """Seconds for CRIU to restore a trivial process (a sleeping `sleep`) into a fresh sandbox."""
    from warmstart.checkpoint.sandbox import Sandbox, waiting_init_command

    script = "setsid sleep 600 </dev/null >/dev/null 2>&1 & wait"
    source = Sandbox.start(work / "trivial-source", ["/bin/sh", "-c", script])
    try:
        pid = _wait_for_child_pid(source)
        # leave it running: its exit would end the namespace, and CRIU with it, before CRIU is done
        criu.in_namespaces_of(source.init_pid).dump(
            pid, work / "trivial-images", logs_dir=work / "trivial-logs", leave_running=True
        )
    finally:
        source.stop(grace=1)
    target = Sandbox.start(work / "trivial-target", waiting_init_command(), reserve_pids=True)
    try:
        started = time.monotonic()
        criu.in_namespaces_of(target.init_pid).restore(
            work / "trivial-images", logs_dir=work / "trivial-logs"
        )
        return time.monotonic() - started
    finally:
        target.stop(grace=1)


def _wait_for_child_pid(sandbox: Sandbox) -> int:
    from warmstart.checkpoint.sandbox import namespace_pids

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for pid in sandbox.host_pids():
            if pid != sandbox.init_pid and Path(f"/proc/{pid}/comm").read_text().strip() == "sleep":
                return namespace_pids(pid)[-1]
        time.sleep(0.01)
    raise ServeError("the trivial process for CRIU's fixed cost did not start")


def snapshot_blob_paths(store: SnapshotStore, snapshot: Snapshot) -> list[Path]:
    return [
        store.blob_path(entry.digest)
        for name, entry in snapshot.files.items()
        if name.startswith(f"{CRIU_DIR}/")
    ]


def timed_start(
    node: LocalNode, start: Callable[[], StartReport], mode: str
) -> tuple[float, float, dict[str, float]]:
    """Run `start()` (it returns once the worker serves); seconds to ready and to the first token."""
    began = time.monotonic()
    try:
        report = start()
        ready = time.monotonic() - began
        if report.mode != mode:
            raise ServeError(f"expected a {mode} start, got {report.mode}: {report.reason}")
        token = first_token_seconds(node.spec, began)
    finally:
        node.stop_all()
    return ready, token, report.timings


def run_bench(args: argparse.Namespace) -> int:
    from warmstart.config import default_criu_command
    from warmstart.serve.local_node import usable_criu
    from warmstart.snapshot.keys import signing_keys
    from warmstart.snapshot.store import SnapshotStore

    if args.repeat < 1:
        print(f"--repeat must be at least 1, got {args.repeat}", file=sys.stderr)
        return 2
    criu, why_not = usable_criu(args.criu or default_criu_command())
    if criu is None:
        print(f"warmstart bench restore needs CRIU 4 as root: {why_not}", file=sys.stderr)
        return 2
    store_root = Path(args.store).resolve()
    store_root.mkdir(parents=True, exist_ok=True)
    signer, verifier, note = signing_keys(store_root, args.key)
    if note:
        print(note)
    spec = WorkerSpec(args.engine, args.model, args.device, args.host, args.port, list(args.worker_arg))
    work = Path(tempfile.mkdtemp(prefix="bench-", dir=store_root))
    store = SnapshotStore(store_root)
    node = LocalNode(spec, store, signer, verifier, criu, work / "pods", args.ready_timeout)
    try:
        return _bench(args, node, store, criu, work)
    except ServeError as exc:
        print(f"warmstart bench restore: {exc}", file=sys.stderr)
        return 1
    finally:
        node.stop_all()
        shutil.rmtree(work, ignore_errors=True)


def _bench(args: argparse.Namespace, node: LocalNode, store: SnapshotStore, criu: Criu, work: Path) -> int:
    can_drop = os.geteuid() == 0 and args.drop_caches
    cold, hot, dropped = (
        Series("cold start"),
        Series("restore, page cache hot"),
        Series("restore, cache dropped"),
    )
    capture = node.start_cold_and_capture()
    node.stop_all()
    if not capture.snapshot_id:
        print(f"capture failed, nothing to restore: {capture.reason}", file=sys.stderr)
        return 1
    identity, unknown = node.identities.lookup(node.spec)
    if identity is None:
        print(f"the capture recorded no identity to restore against: {unknown}", file=sys.stderr)
        return 1
    snapshot = store.get(capture.snapshot_id)
    for _ in range(args.repeat):
        _record(cold, *timed_start(node, lambda: node.start_cold("benchmark"), "cold"))
        _record(hot, *timed_start(node, lambda: node.start_restored(snapshot.id, identity), "restore"))
        if can_drop:
            drop_page_cache()
            _record(
                dropped, *timed_start(node, lambda: node.start_restored(snapshot.id, identity), "restore")
            )
    floors = _floors(store, snapshot, criu, work, can_drop)
    _print_tables([cold, hot] + ([dropped] if can_drop else []), floors, snapshot, capture.timings, args)
    return 0


def _record(series: Series, ready: float, token: float, phases: dict[str, float]) -> None:
    series.ready.append(ready)
    series.first_token.append(token)
    for name, seconds in phases.items():
        series.phases.setdefault(name, []).append(seconds)


def _floors(store: SnapshotStore, snapshot: Snapshot, criu: Criu, work: Path, can_drop: bool) -> list[Floor]:
    fixed = criu_fixed_cost(criu, work)
    paths = snapshot_blob_paths(store, snapshot)
    floors = []
    read_bandwidth(paths)  # warm the page cache
    size, seconds = read_bandwidth(paths)
    floors.append(_floor("floor, page cache hot", size, seconds, fixed))
    if can_drop:
        drop_page_cache()
        size, seconds = read_bandwidth(paths)
        floors.append(_floor("floor, cache dropped", size, seconds, fixed))
    return floors


def _floor(name: str, size: int, seconds: float, fixed: float) -> Floor:
    bandwidth = size / seconds if seconds > 0 else float("inf")
    detail = f"{size / 2**20:.0f} MiB at {bandwidth / 2**30:.2f} GiB/s + CRIU fixed {fixed:.2f}s"
    return Floor(name, size / bandwidth + fixed, detail)


def _rows(series: list[Series], floors: list[Floor]) -> list[list[str]]:
    cold = series[0].median(series[0].ready)
    rows = []
    for item in series:
        ready = item.median(item.ready)
        spread = f"{min(item.ready):.2f}-{max(item.ready):.2f} s"
        token = f"{item.median(item.first_token):.2f} s"
        rows.append([item.name, f"{ready:.2f} s", spread, token, f"{cold / ready:.1f}x"])
    for floor in floors:
        rows.append([floor.name, f"{floor.seconds:.2f} s", floor.detail, "-", f"{cold / floor.seconds:.1f}x"])
    return rows


HEADERS = ["start", "to ready (median)", "spread (min-max)", "first token (median)", "vs cold"]


def _print_tables(
    series: list[Series],
    floors: list[Floor],
    snapshot: Snapshot,
    timings: dict[str, float],
    args: argparse.Namespace,
) -> None:
    from rich.console import Console
    from rich.table import Table

    title = (
        f"warmstart bench restore: {args.engine}/{args.model} on {args.device}, {args.repeat} repetitions, "
        f"snapshot {snapshot.size / 2**20:.0f} MiB"
    )
    table = Table(title=title)
    for header in HEADERS:
        table.add_column(header)
    rows = _rows(series, floors)
    for row in rows:
        table.add_row(*row)
    console = Console(width=max(Console().width, 140))
    console.print(table)
    notes = ["capture phases: " + ", ".join(f"{k} {v:.2f}s" for k, v in timings.items())]
    for item in series:
        if item.phases:
            medians = ", ".join(f"{k} {statistics.median(v):.2f}s" for k, v in item.phases.items())
            notes.append(f"{item.name} phases (median): {medians}")
    for note in notes:
        console.print(note)
    if args.markdown:
        lines = [f"**{title}**", "", "| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        lines += [""] + [f"- {note}" for note in notes] + [""]
        Path(args.markdown).write_text("\n".join(lines))


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from warmstart.worker_flags import port_number

    bench = subparsers.add_parser("bench", help="benchmarks")
    kinds = bench.add_subparsers(dest="bench_kind", metavar="KIND", required=True)
    parser = kinds.add_parser(
        "restore", help="cold start vs restore of the same worker", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    add_worker_arguments(parser)
    parser.add_argument("--port", type=port_number, default=8010, help="port the benchmarked workers use")
    parser.add_argument("--repeat", type=int, default=3, help="repetitions of each start (default 3)")
    parser.add_argument(
        "--no-drop-caches", dest="drop_caches", action="store_false",
        help="skip the page-cache-dropped restores (they need root)",
    )  # fmt: skip
    parser.add_argument("--markdown", help="also write the table as Markdown to this file")
    parser.set_defaults(func=run_bench)
