"""`warmstart serve`: the embedded default, one machine and no cluster.

The first start is a cold start plus a capture: the worker loads, warms up and quiesces, its process is
snapshotted into the store, and the same process then resumes and serves (restore in place), so the first
start costs a cold start and one dump, and the snapshot is ready for the next start. Every later start
restores from the newest valid snapshot of the same identity into a fresh sandbox. Whenever restoring is not
possible (no CRIU 4, not root, a snapshot refused or failing) it cold-starts and says why.

Each worker runs in its own sandbox (PID + mount namespace) so a restore gets the PIDs and paths its
process had when it was dumped.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from warmstart.checkpoint import hugepages
from warmstart.host import procinfo
from warmstart.serve.local_node import LocalNode, usable_criu
from warmstart.serve.worker_spec import ServeError, StartReport, WorkerSpec
from warmstart.snapshot.signing_keys import signing_keys

if TYPE_CHECKING:
    from warmstart.snapshot.signing import Signer, Verifier

COMMAND_START = "command_start"  # the phase before the start's clock (`before_the_clock`)


def print_report(report: StartReport, spec: WorkerSpec) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"warmstart serve: {spec.engine}/{spec.model} on {spec.device} at {spec.base_url}")
    for column in ("mode", "time to ready", "snapshot size", "snapshot id"):
        table.add_column(column)
    size = f"{report.snapshot_bytes / 2**20:.1f} MiB" if report.snapshot_bytes else "-"
    table.add_row(report.mode, f"{report.seconds_to_ready:.2f} s", size, report.snapshot_id or "-")
    console = Console(width=max(Console().width, 120))
    console.print(table)
    if report.reason:
        console.print(f"[yellow]{report.reason}[/yellow]")
    if report.timings:
        phases = ", ".join(f"{k} {v:.2f}s" for k, v in report.timings.items())
        console.print(f"phases: {phases}", soft_wrap=True)  # one line, for scripts that read it


def _serve(args: argparse.Namespace) -> int:
    from warmstart.checkpoint.sandbox import SandboxError
    from warmstart.host.env import default_criu_command
    from warmstart.snapshot.store import SnapshotStore
    from warmstart.snapshot.verified import records_wanted

    problem = _settings_problem(args)
    if problem:
        print(f"warmstart serve: {problem}", file=sys.stderr)
        return 2
    store_root = Path(args.store).resolve()
    spec = WorkerSpec(args.engine, args.model, args.device, args.host, args.port, list(args.worker_arg))
    with ThreadPoolExecutor(1, thread_name_prefix="warmstart-criu-check") as pool:  # beside the keys
        criu_check = pool.submit(usable_criu, args.criu or default_criu_command())
        signer, verifier = _store_and_keys(store_root, args.key)
        criu, why_not = criu_check.result()
    if criu is None:
        print(f"snapshots are off: {why_not}")
    work_dir = Path(args.work_dir).resolve() if args.work_dir else None
    store = SnapshotStore(store_root, verified_records=records_wanted())
    node = LocalNode(spec, store, signer, verifier, criu, work_dir, args.ready_timeout)
    _stop_on_signals()
    try:
        with hugepages.selected(args.transparent_hugepages):
            return _serve_until_stopped(node, spec, args.once)
    except KeyboardInterrupt:
        print("stopping", flush=True)
        return 0
    except (OSError, ServeError, SandboxError) as exc:
        print(f"warmstart serve: {exc}", file=sys.stderr)
        return 1
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)  # let the clean-up finish
        node.stop_all()


def _settings_problem(args: argparse.Namespace) -> str | None:
    """What makes these settings unusable, naming the flag, before anything starts; None when nothing. (The
    worker's own flags, --worker-arg, are the worker's to refuse: its log, which serve names, says why.)"""
    for flag, value in (("--store", args.store), ("--key", args.key), ("--work-dir", args.work_dir)):
        if value is not None and (not value.strip() or "\0" in value):
            return f"{flag}: must name a file or directory (got {value!r})"
    if args.key is not None:
        from warmstart.snapshot.signing import SigningKeyError

        try:
            signing_keys(Path(args.store), args.key)  # a key given must be usable: no silent cold starts
        except (OSError, SigningKeyError) as exc:
            return f"--key: {exc}"
    return None


def _store_and_keys(store_root: Path, key: str | None) -> tuple[Signer | None, Verifier | None]:
    """The store's directory (made where missing) and its keys; none, saying why, when either cannot be
    had: the worker then cold-starts."""
    from warmstart.snapshot.signing import SigningKeyError

    try:
        store_root.mkdir(parents=True, exist_ok=True)
        signer, verifier, note = signing_keys(store_root, key)
    except (OSError, SigningKeyError) as exc:
        print(f"snapshots are off: the store {store_root} or its signing key cannot be used: {exc}")
        return None, None
    if note:
        print(note)
    return signer, verifier


def _serve_until_stopped(node: LocalNode, spec: WorkerSpec, once: bool) -> int:
    report = node.start()
    report.timings = {COMMAND_START: before_the_clock(report), **report.timings}
    print_report(report, spec)
    if once:
        return 0
    print(f"serving on {spec.base_url} (Ctrl-C to stop)", flush=True)
    while any(sandbox.alive() for sandbox in node.sandboxes):
        time.sleep(0.2)
    print("the worker exited", file=sys.stderr)
    return 1


def before_the_clock(report: StartReport) -> float:
    """Seconds from this command's start to the start's own clock (the interpreter, imports, the keys, CRIU's
    check, the identity lookup): outside `time to ready`, but a client of a fresh `warmstart serve` waits for
    them too."""
    clock_began = time.time() - report.seconds_to_ready
    return max(0.0, clock_began - procinfo.process_start_time())


def _stop_on_signals() -> None:
    """SIGTERM stops serve like Ctrl-C does (a KeyboardInterrupt, so every clean-up path runs)."""

    def interrupt(signum: int, _frame: object) -> None:
        for each in (signal.SIGINT, signal.SIGTERM):  # a second signal must not cut the clean-up short
            signal.signal(each, signal.SIG_IGN)
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    from warmstart.api.worker_options import seconds

    parser.add_argument("--engine", default="builtin", help="engine adapter (default builtin)")
    parser.add_argument("--model", default="tiny", help="model preset or directory (default tiny)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cpu or cuda (default cpu)")
    parser.add_argument("--store", required=True, help="snapshot store directory (created if missing)")
    parser.add_argument(
        "--key",
        help="signing key file (default: an HMAC key generated once for this store in $WARMSTART_KEY_DIR, "
        "else ~/.config/warmstart/keys: never inside the store)",
    )
    parser.add_argument("--criu", help="CRIU 4 command line (default: WARMSTART_CRIU or criu)")
    parser.add_argument("--host", default="127.0.0.1", help="address the worker listens on")
    parser.add_argument("--work-dir", help="where sandboxes keep their files (default <store>/pods)")
    parser.add_argument("--ready-timeout", type=seconds, default=900.0, help="seconds to wait for a worker")
    parser.add_argument(
        "--worker-arg", action="append", default=[], help="extra argument for `warmstart worker` (repeatable)"
    )
    parser.add_argument(
        "--transparent-hugepages", choices=hugepages.MODES, default=None,
        help="select this transparent huge pages mode on the machine while running (always lets CRIU restore "
        "into 2 MiB pages; the earlier mode comes back at exit); default: leave the machine's as it is",
    )  # fmt: skip


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from warmstart.api.worker_options import port_number

    parser = subparsers.add_parser(
        "serve",
        help="serve an OpenAI-compatible endpoint; first start cold + capture, later starts restore",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_serve_arguments(parser)
    parser.add_argument("--port", type=port_number, default=8000, help="port to serve on (default 8000)")
    parser.add_argument(
        "--once", "--exit-after-ready", dest="once", action="store_true",
        help="stop the worker and exit once it served (tests, demos)",
    )  # fmt: skip
    parser.set_defaults(func=_serve)
