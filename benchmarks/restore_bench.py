#!/usr/bin/env python3
"""Cold start vs restore of the same engine and model on this machine, measured in one run.

    sudo python3 benchmarks/restore_bench.py --store /tmp/bench-store --criu "$PWD/hack/criu" --repeat 3


For each of N repetitions: a cold start, a restore with the page cache hot and (as root) one with the page
cache dropped first (and, with --cold-dropped, a cold start with the page cache dropped; with --prestage,
restores after the page cache was dropped and then the snapshot pre-staged into it as the node agent does,
and the snapshot and the weight files both). Each is timed to
ready (HTTP) and to the first token of a one-token completion, and every restore's greedy outputs are
compared with those of the engine that was captured. The restore is compared with its floor, measured in
the same run, counting every byte a restore moves: the CRIU image and the weight files it reads (at the
bandwidth of parallel reads, page cache hot and dropped), the bytes it puts on the GPU (the weights and
the device memory the CUDA checkpoint holds, at the measured pinned host-to-GPU bandwidth), plus CRIU's
fixed cost (restoring a trivial process).
"""

from __future__ import annotations

import argparse
import json
import logging
import mmap
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from warmstart.checkpoint import hugepages
from warmstart.checkpoint.layout import CRIU_DIR
from warmstart.serve.cli import add_serve_arguments
from warmstart.serve.local_node import LocalNode
from warmstart.serve.worker_spec import ServeError, StartReport, WorkerSpec

if TYPE_CHECKING:
    from warmstart.checkpoint.criu import Criu
    from warmstart.checkpoint.sandbox import Sandbox
    from warmstart.snapshot.store import Snapshot, SnapshotStore

READ_CHUNK = 16 << 20
READ_THREADS = 8
DROPPED_READ_THREADS = (READ_THREADS, 4 * READ_THREADS)  # the floor takes the faster
OUTPUT_PROMPTS = ("The quick brown fox", "Checkpoint and restore make inference workers start", "def fib(n):")
OUTPUT_TOKENS = 16
ENGINE_LOG = Path("logs") / "engine.log"  # in a sandbox's control directory
# What the restored engine logs about its own side of a restore (seconds), as phases
ENGINE_PHASES = {
    "engine_reacquire": re.compile(r"reacquired in ([0-9.]+) s"),
    "engine_stager_wait": re.compile(r"waited for staged weights ([0-9.]+) s"),
    "stager_fill": re.compile(r"weight stager \(it filled them in ([0-9.]+) s"),
}


@dataclass
class Series:
    """One kind of start, repeated."""

    name: str
    ready: list[float] = field(default_factory=list)
    first_token: list[float] = field(default_factory=list)
    phases: dict[str, list[float]] = field(default_factory=dict)
    outputs_identical: list[bool] = field(default_factory=list)
    cache: str = "hot"

    def median(self, values: list[float]) -> float:
        return statistics.median(values) if values else float("nan")


@dataclass
class Floor:
    cache: str
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


def _complete(spec: WorkerSpec, prompt: str, max_tokens: int) -> list[str]:
    body = json.dumps({"model": spec.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    request = urllib.request.Request(
        spec.base_url + "/v1/completions", data=body.encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        reply = json.loads(response.read())
    return [choice.get("text", "") for choice in reply.get("choices", [])]


def first_token_seconds(spec: WorkerSpec, started: float) -> float:
    """Seconds from `started` until a one-token greedy completion came back."""
    _complete(spec, "warm", 1)
    return time.monotonic() - started


def greedy_outputs(spec: WorkerSpec) -> list[list[str]]:
    """Greedy completions of a few prompts, one request at a time (the batch cannot change the numerics)."""
    return [_complete(spec, prompt, OUTPUT_TOKENS) for prompt in OUTPUT_PROMPTS]


def read_bandwidth(
    paths: list[Path], threads: int = READ_THREADS, *, fresh_memory: bool = False
) -> tuple[int, float]:
    """Bytes and seconds to read `paths` with `threads` parallel readers.

    Reads go in large chunks into buffers used again and again; with `fresh_memory`, each reader fills one
    anonymous mapping never touched before with its contiguous share of each file, as CRIU's restorer fills
    a restored process's memory (with one reader): every page is faulted in while it is filled, and none
    comes back warm from a mapping just unmapped.
    """
    share = (lambda size: _page_up(-(-size // threads))) if fresh_memory else (lambda size: READ_CHUNK)
    pieces = [
        (path, offset, min(share(size), size - offset))
        for path in paths
        if (size := path.stat().st_size)
        for offset in range(0, size, share(size))
    ]

    def read(piece: tuple[Path, int, int]) -> int:
        path, offset, length = piece
        fd = os.open(path, os.O_RDONLY)
        try:
            if not fresh_memory:
                return len(os.pread(fd, length, offset))
            fresh = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            with fresh, memoryview(fresh) as view:
                done = 0
                while done < length and (got := os.preadv(fd, [view[done:]], offset + done)):
                    done += got  # one read returns at most about 2 GiB
                return done
        finally:
            os.close(fd)

    started = time.monotonic()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(read, pieces))
    return total, time.monotonic() - started


def _page_up(size: int) -> int:
    return -(-size // mmap.PAGESIZE) * mmap.PAGESIZE


def pinned_to_gpu_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float | None:
    """Bytes per second of pinned host -> GPU copies (torch), or None without torch or a GPU."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    device.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    started = time.monotonic()
    for _ in range(repeats):
        device.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return nbytes * repeats / (time.monotonic() - started)


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
    from warmstart.host.procinfo import read_stat

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for pid in sandbox.host_pids():  # the shell's passing children may be gone by the time they are read
            if pid != sandbox.init_pid and (stat := read_stat(pid)) is not None and stat.comm == "sleep":
                return namespace_pids(pid)[-1]
        time.sleep(0.01)
    raise ServeError("the trivial process for CRIU's fixed cost did not start")


def snapshot_blob_paths(store: SnapshotStore, snapshot: Snapshot) -> list[Path]:
    return [
        store.blob_path(entry.digest)
        for name, entry in snapshot.files.items()
        if name.startswith(f"{CRIU_DIR}/")
    ]


def weight_files_and_bytes(snapshot: Snapshot) -> tuple[list[Path], int]:
    """The weight files a restore reads (its staging plan's) and the bytes it puts on the GPU from them."""
    plan = snapshot.record.worker.weight_staging or {}
    copies = plan.get("copies") or []
    files = sorted({Path(copy[0]) for copy in copies})
    return [path for path in files if path.is_file()], sum(int(copy[3]) for copy in copies)


def checkpointed_gpu_bytes(snapshot: Snapshot) -> int:
    """Device memory the CUDA checkpoint held, 0 if unknown: the builtin engine's GPU use when it was
    released, vLLM's process's own device memory once asleep (and trimmed, where it was)."""
    engine = snapshot.record.worker.engine
    if builtin := (engine.get("at_release") or {}).get("gpu_used_bytes"):
        return int(builtin)
    vllm = engine.get("memory_at_release") or {}
    held = vllm.get("after_trim") or vllm.get("asleep") or {}
    return int(sum(held.get("gpu_processes_gib") or []) * 2**30)


@dataclass
class Start:
    ready: float
    token: float
    phases: dict[str, float]
    outputs: list[list[str]] | None = None


def timed_start(
    node: LocalNode,
    start: Callable[[], StartReport],
    mode: str,
    check_outputs: bool = False,
    logs: str | None = None,
) -> Start:
    """Run `start()` (it returns once the worker serves); seconds to ready and to the first token.

    With `logs`, the sandboxes' logs (CRIU's restore log, the engine's) are copied under that directory.
    """
    began = time.monotonic()
    try:
        report = start()
        ready = time.monotonic() - began
        if report.mode != mode:
            raise ServeError(f"expected a {mode} start, got {report.mode}: {report.reason}")
        token = first_token_seconds(node.spec, began)
        phases = dict(report.timings)
        if mode == "restore":
            phases.update(_engine_phases(node))
            phases["restore_to_ready"] = ready
            phases["ready_to_first_token"] = token - ready
            phases["next_one_token_request"] = first_token_seconds(node.spec, time.monotonic())
        outputs = greedy_outputs(node.spec) if check_outputs else None
        if logs:
            _copy_logs(node, Path(logs))
    finally:
        node.stop_all()
    return Start(ready, token, phases, outputs)


def _copy_logs(node: LocalNode, destination: Path) -> None:
    """The last sandbox's log files, flattened into `destination` (an earlier copy is replaced)."""
    destination.mkdir(parents=True, exist_ok=True)
    for sandbox in node.sandboxes[-1:]:
        images = sandbox.host_dir.with_name(sandbox.host_dir.name + "-images")  # the restorer's own logs
        for root in (sandbox.host_dir, images):
            for path in sorted(root.rglob("*.log")):
                if path.is_file() and not path.is_symlink():
                    name = "-".join((root.name.rsplit("-", 2)[-1], *path.relative_to(root).parts))
                    shutil.copyfile(path, destination / name)


def _engine_phases(node: LocalNode) -> dict[str, float]:
    """What the restored engine logged about its side of the restore (its log in the sandbox)."""
    from warmstart.serve.worker_spec import CONTROL_SUBDIR

    found: dict[str, float] = {}
    for sandbox in node.sandboxes:
        try:
            text = (sandbox.host_dir / CONTROL_SUBDIR / ENGINE_LOG).read_text(errors="replace")
        except OSError:
            continue
        for name, pattern in ENGINE_PHASES.items():
            matches = pattern.findall(text)
            if matches:
                found[name] = float(matches[-1])
    return found


def run_bench(args: argparse.Namespace) -> int:
    from warmstart.host.env import default_criu_command
    from warmstart.serve.local_node import usable_criu
    from warmstart.snapshot.signing_keys import signing_keys
    from warmstart.snapshot.store import SnapshotStore

    if args.repeat < 1:
        print(f"--repeat must be at least 1, got {args.repeat}", file=sys.stderr)
        return 2
    criu, why_not = usable_criu(args.criu or default_criu_command())
    if criu is None:
        print(f"the restore benchmark needs CRIU 4 as root: {why_not}", file=sys.stderr)
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
        with hugepages.selected(args.transparent_hugepages):
            return _bench(args, node, store, criu, work)
    except (OSError, ServeError) as exc:
        print(f"restore_bench: {exc}", file=sys.stderr)
        return 1
    finally:
        node.stop_all()
        shutil.rmtree(work, ignore_errors=True)


def _bench(args: argparse.Namespace, node: LocalNode, store: SnapshotStore, criu: Criu, work: Path) -> int:
    can_drop = os.geteuid() == 0 and args.drop_caches
    cold, cold_dropped = Series("cold start"), Series("cold start", cache="dropped")
    restores = {
        lazy: (Series(name, cache="hot"), Series(name, cache="dropped"))
        for lazy, name in ((False, "restore"), (True, "restore, lazy pages"))
        if args.lazy_pages in ("both", "on" if lazy else "off")
    }
    prestaged = [Series("restore", cache=f"dropped, {what} pre-staged") for what in PRESTAGED]
    capture = node.start_cold_and_capture()
    reference = greedy_outputs(node.spec)  # the captured engine, serving on after its capture
    node.stop_all()
    if not capture.snapshot_id:
        print(f"capture failed, nothing to restore: {capture.reason}", file=sys.stderr)
        return 1
    identity, unknown = node.identities.lookup(node.spec)
    if identity is None:
        print(f"the capture recorded no identity to restore against: {unknown}", file=sys.stderr)
        return 1
    snapshot = store.get(capture.snapshot_id)

    def restore() -> StartReport:
        return node.start_restored(snapshot.id, identity)

    for _ in range(args.repeat):
        if args.cold:
            _record(cold, timed_start(node, lambda: node.start_cold("benchmark"), "cold"), reference)
        for lazy, (hot, dropped) in restores.items():
            _lazy_pages(lazy)
            _record(hot, timed_start(node, restore, "restore", check_outputs=True, logs=args.logs), reference)
            if can_drop:
                drop_page_cache()
                _record(dropped, timed_start(node, restore, "restore", check_outputs=True), reference)
        _lazy_pages(False)
        if can_drop and args.prestage:
            for series, with_weights in zip(prestaged, (False, True), strict=True):
                drop_page_cache()
                staged = prestage(store, snapshot, with_weights)
                _record(series, timed_start(node, restore, "restore", check_outputs=True), reference)
                series.phases.setdefault("prestage_read", []).append(staged)
        if can_drop and args.cold_dropped:
            drop_page_cache()
            _record(cold_dropped, timed_start(node, lambda: node.start_cold("benchmark"), "cold"), reference)
    floors = restore_floors(store, snapshot, criu, work, can_drop)
    measured = [cold, cold_dropped] + [series for pair in restores.values() for series in pair] + prestaged
    _print_tables([s for s in measured if s.ready], floors, snapshot, capture.timings, args)
    identical = all(all(s.outputs_identical) for pair in restores.values() for s in pair)
    if not identical:
        print("outputs after a restore differ from the captured engine's", file=sys.stderr)
    return 0 if identical else 1


PRESTAGED = ("snapshot", "snapshot and weights")


def prestage(store: SnapshotStore, snapshot: Snapshot, with_weights: bool) -> float:
    """Read the snapshot's blobs into the page cache as the node agent's pre-staging does (and, for the
    upper bound, the weight files, which the agent never reads: they are the pod's); the seconds it took."""
    from warmstart.snapshot import residency

    started = time.monotonic()
    blobs = residency.blob_paths(store, [snapshot])
    residency.stage(blobs, sum(path.stat().st_size for path in blobs), root=store.blobs_dir)
    if with_weights:
        weights, _ = weight_files_and_bytes(snapshot)
        residency.stage(weights, sum(path.stat().st_size for path in weights))
    return time.monotonic() - started


def _lazy_pages(on: bool) -> None:
    """Whether the next restores load memory lazily (read by `checkpoint.restore` at each restore)."""
    from warmstart.checkpoint.restore import LAZY_PAGES_ENV

    if on:
        os.environ[LAZY_PAGES_ENV] = "1"
    else:
        os.environ.pop(LAZY_PAGES_ENV, None)


def _record(series: Series, start: Start, reference: list[list[str]]) -> None:
    series.ready.append(start.ready)
    series.first_token.append(start.token)
    for name, seconds in start.phases.items():
        series.phases.setdefault(name, []).append(seconds)
    if start.outputs is not None:
        series.outputs_identical.append(start.outputs == reference)


def restore_floors(
    store: SnapshotStore, snapshot: Snapshot, criu: Criu, work: Path, can_drop: bool
) -> list[Floor]:
    """Every byte a restore moves: image and weight files read, weights and checkpointed device memory to
    the GPU."""
    fixed = criu_fixed_cost(criu, work)
    weights, weight_bytes = weight_files_and_bytes(snapshot)
    paths = snapshot_blob_paths(store, snapshot) + weights
    to_gpu = weight_bytes + checkpointed_gpu_bytes(snapshot)
    h2d = pinned_to_gpu_bandwidth() if to_gpu else None
    read_bandwidth(paths)  # warm the page cache
    floors = [_floor("hot", *read_bandwidth(paths), READ_THREADS, to_gpu, h2d, fixed)]
    floors[0].detail += "; " + _fresh_memory_note(snapshot_blob_paths(store, snapshot))
    if can_drop:
        floors.append(_floor("dropped", *_fastest_cold_read(paths), to_gpu, h2d, fixed))
    return floors


def _fastest_cold_read(paths: list[Path]) -> tuple[int, float, int]:
    """Bytes, seconds and readers of the fastest read from storage (a restore keeps more reads in flight
    than 8 readers: the stager's threads, CRIU, the verifier's; some disks serve more at once)."""
    reads = []
    for threads in DROPPED_READ_THREADS:
        drop_page_cache()
        reads.append((*read_bandwidth(paths, threads), threads))
    return min(reads, key=lambda read: read[1])


def _floor(
    cache: str, size: int, seconds: float, threads: int, to_gpu: int, h2d: float | None, fixed: float
) -> Floor:
    read_s = seconds
    gpu_s = to_gpu / h2d if h2d else 0.0
    gpu_note = f" + {to_gpu / 2**30:.2f} GiB to the GPU at {h2d / 2**30:.1f} GiB/s" if h2d else ""
    detail = (
        f"{size / 2**30:.2f} GiB read at {size / seconds / 2**30:.2f} GiB/s ({threads} readers)"
        f"{gpu_note} + CRIU fixed {fixed:.2f} s"
    )
    return Floor(cache, read_s + gpu_s + fixed, detail)


def _fresh_memory_note(image: list[Path]) -> str:
    """What filling fresh memory costs here: CRIU writes the image into pages the process never had."""
    (size, one), (_, many) = (
        read_bandwidth(image, threads, fresh_memory=True) for threads in (1, READ_THREADS)
    )
    return (
        f"the image read into fresh memory (as CRIU restores it): {size / 2**30:.2f} GiB at "
        f"{size / one / 2**30:.2f} GiB/s with one thread (CRIU's), {size / many / 2**30:.2f} GiB/s with "
        f"{READ_THREADS}"
    )


HEADERS = [
    "start", "page cache", "to ready (median)", "to first token (median)", "min-max (first token)", "n",
    "floor", "vs floor", "vs cold, same cache", "outputs identical",
]  # fmt: skip


def _rows(series: list[Series], floors: list[Floor]) -> list[list[str]]:
    colds = {item.cache: item.median(item.first_token) for item in series if item.name == "cold start"}
    by_cache = {floor.cache: floor for floor in floors}
    rows = []
    for item in series:
        token = item.median(item.first_token)
        floor = by_cache.get(item.cache) if item.name.startswith("restore") else None
        cold = colds.get(item.cache)
        rows.append([
            item.name, item.cache, f"{item.median(item.ready):.2f} s", f"{token:.2f} s",
            f"{min(item.first_token):.2f}-{max(item.first_token):.2f} s", str(len(item.first_token)),
            f"{floor.seconds:.2f} s" if floor else "", f"{token / floor.seconds:.2f}x" if floor else "",
            f"{cold / token:.1f}x" if cold else "",
            ("yes" if all(item.outputs_identical) else "NO") if item.outputs_identical else "",
        ])  # fmt: skip
    return rows


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
        f"restore benchmark: {args.engine}/{args.model} on {args.device}, {args.repeat} repetitions, "
        f"snapshot {snapshot.size / 2**20:.0f} MiB, transparent huge pages {hugepages.current_mode()}"
    )
    table = Table(title=title)
    for header in HEADERS:
        table.add_column(header)
    rows = _rows(series, floors)
    for row in rows:
        table.add_row(*row)
    console = Console(width=max(Console().width, 160))
    console.print(table)
    notes = ["capture phases: " + ", ".join(f"{k} {v:.2f}s" for k, v in timings.items())]
    notes += [f"floor, page cache {floor.cache}: {floor.seconds:.2f} s = {floor.detail}" for floor in floors]
    engine = snapshot.record.worker.engine
    if engine.get("at_release"):
        notes.append(f"engine at release: {json.dumps(engine['at_release'])}")
    for item in series:
        if item.phases:
            medians = ", ".join(f"{k} {statistics.median(v):.3f}s" for k, v in item.phases.items())
            notes.append(f"{item.name}, page cache {item.cache}, phases (median): {medians}")
    for note in notes:
        console.print(note, markup=False)  # notes hold names like [heap]
    if args.json:
        raw = {
            "series": [vars(item) for item in series], "floors": [vars(floor) for floor in floors],
            "capture": timings, "snapshot_bytes": snapshot.size, "engine": engine,
        }  # fmt: skip
        Path(args.json).write_text(json.dumps(raw, indent=1))
    if args.markdown:
        lines = [f"**{title}**", "", "| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        lines += [""] + [f"- {note}" for note in notes] + [""]
        Path(args.markdown).write_text("\n".join(lines))


def argument_parser() -> argparse.ArgumentParser:
    from warmstart.api.worker_options import port_number

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_serve_arguments(parser)
    parser.add_argument("--port", type=port_number, default=8010, help="port the benchmarked workers use")
    parser.add_argument("--repeat", type=int, default=3, help="repetitions of each start (default 3)")
    parser.add_argument(
        "--no-drop-caches", dest="drop_caches", action="store_false",
        help="skip the page-cache-dropped restores (they need root)",
    )  # fmt: skip
    parser.add_argument(
        "--no-cold", dest="cold", action="store_false",
        help="skip the cold starts (comparing restores alone, e.g. one lever on and off)",
    )  # fmt: skip
    parser.add_argument(
        "--cold-dropped", action="store_true", help="also time cold starts with the page cache dropped (root)"
    )
    parser.add_argument(
        "--lazy-pages", choices=("off", "on", "both"), default="off",
        help="restore memory lazily (CRIU lazy pages, userfaultfd): off (default), on, or both in turn",
    )  # fmt: skip
    parser.add_argument(
        "--prestage", action="store_true",
        help="also restore with the page cache dropped, then the snapshot (and then its weights) pre-staged",
    )  # fmt: skip
    parser.add_argument("--logs", help="copy the sandbox logs (CRIU's, the engine's) of hot restores here")
    parser.add_argument("--markdown", help="also write the table as Markdown to this file")
    parser.add_argument("--json", help="also write every measurement as JSON to this file")
    return parser


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(run_bench(argument_parser().parse_args()))
