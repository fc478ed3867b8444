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
import contextlib
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from warmstart.fileio import write_atomic
from warmstart.snapshot.keys import signing_keys

if TYPE_CHECKING:
    from warmstart.checkpoint.criu import Criu
    from warmstart.checkpoint.sandbox import Sandbox
    from warmstart.identity import SnapshotIdentity
    from warmstart.snapshot.signing import Signer, Verifier
    from warmstart.snapshot.store import SnapshotStore

log = logging.getLogger(__name__)

CONTROL_SUBDIR = "control"  # a sandbox's control directory, relative to its private directory
READY_PATH = "/ready"  # 200 once the worker serves


class ServeError(RuntimeError):
    """The worker could not be brought up at all (not even by a cold start)."""


@dataclass
class WorkerSpec:
    """What to run: the same engine, model and device for cold starts, captures and restores."""

    engine: str = "builtin"
    model: str = "tiny"
    device: str = "cpu"
    host: str = "127.0.0.1"
    port: int = 8000
    extra_args: list[str] = field(default_factory=list)

    def command(self, mode: str, control_dir: Path) -> list[str]:
        return [
            sys.executable, "-m", "warmstart", "worker", "--engine", self.engine, "--model", self.model,
            "--device", self.device, "--mode", mode, "--host", self.host, "--port", str(self.port),
            "--control-dir", str(control_dir), *self.extra_args,
        ]  # fmt: skip

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass
class StartReport:
    """How a worker came up; what the table prints."""

    mode: str  # "restore", "cold+capture", "cold"
    seconds_to_ready: float
    snapshot_id: str = ""
    snapshot_bytes: int = 0
    reason: str = ""
    timings: dict[str, float] = field(default_factory=dict)


class IdentityCache:
    """This machine's worker identities, learnt from cold starts, so a restore need not load the engine.

    A worker's identity is only known once its engine has loaded (model digest, resolved engine arguments),
    which is the cost a restore avoids. So each capture records the identity its worker reported, keyed by
    everything that identity derives from and that is cheap to read here: engine, model, device, worker
    arguments, Python/torch/warmstart versions and warmstart's own source files, NVIDIA driver and GPU
    model, the image name; and the model files' sizes and mtimes. Any change there is a miss, and a miss is
    a cold start that records afresh. Entries are signed with the store's key, like manifests.
    """

    def __init__(self, store_root: Path, signer: Signer, verifier: Verifier) -> None:
        self.directory = store_root / "identities"
        self.signer = signer
        self.verifier = verifier

    @staticmethod
    def key(spec: WorkerSpec) -> str:
        facts = {
            "engine": spec.engine, "model": spec.model, "device": spec.device, "args": spec.extra_args,
            "python": sys.version, "torch": _distribution_version("torch"),
            "warmstart": _distribution_version("warmstart"), "nvidia": _nvidia_facts(),
            "image": os.environ.get("WARMSTART_IMAGE", ""), "cache": os.environ.get("WARMSTART_CACHE", ""),
            "code": _code_fingerprint(),
        }  # fmt: skip
        return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()

    def record(self, spec: WorkerSpec, identity: SnapshotIdentity, model_dir: str) -> None:
        entry = {"identity": identity.to_dict(), "model_dir": model_dir, "files": _fingerprint(model_dir)}
        data = json.dumps(entry, sort_keys=True).encode()
        from warmstart.snapshot.signing import signature_document

        self.directory.mkdir(parents=True, exist_ok=True)
        target = self.directory / f"{self.key(spec)}.json"
        write_atomic(target, data)
        write_atomic(target.with_suffix(".sig"), signature_document(self.signer, data))

    def lookup(self, spec: WorkerSpec) -> tuple[SnapshotIdentity | None, str]:
        """The identity a worker of `spec` has here, or None with the reason."""
        from warmstart.identity import SnapshotIdentity
        from warmstart.snapshot.signing import SignatureInvalid, verify_document

        target = self.directory / f"{self.key(spec)}.json"
        try:
            data = target.read_bytes()
            verify_document(self.verifier, data, target.with_suffix(".sig").read_bytes())
        except FileNotFoundError:
            return None, "no earlier start of this engine, model, device and software here"
        except SignatureInvalid as exc:
            return None, f"the recorded identity {target} is not trusted: {exc}"
        entry = json.loads(data)
        if _fingerprint(entry["model_dir"]) != entry["files"]:
            return None, f"the model files in {entry['model_dir']} changed since the last capture"
        return SnapshotIdentity.from_dict(entry["identity"]), ""


def _code_fingerprint() -> str:
    """Sizes and mtimes of warmstart's own modules: an edited checkout is another worker image."""
    package = Path(__file__).resolve().parent
    entries = []
    for path in package.rglob("*.py"):
        info = path.stat()
        entries.append((str(path.relative_to(package)), info.st_size, info.st_mtime_ns))
    return hashlib.sha256(json.dumps(sorted(entries)).encode()).hexdigest()


def _distribution_version(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return ""


def _nvidia_facts() -> str:
    """Driver version and GPU models from /proc (empty without an NVIDIA driver)."""
    parts = []
    with contextlib.suppress(OSError):
        parts.append(Path("/proc/driver/nvidia/version").read_text().splitlines()[0])
    with contextlib.suppress(OSError):
        for info in sorted(Path("/proc/driver/nvidia/gpus").glob("*/information")):
            parts += [line for line in info.read_text().splitlines() if line.startswith("Model:")]
    return "\n".join(parts)


def _fingerprint(model_dir: str) -> dict[str, list[int]]:
    """Name -> [size, mtime_ns] of every file in the model directory (not recursive)."""
    found: dict[str, list[int]] = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir(model_dir):
            if entry.is_file() and not entry.name.startswith("."):
                info = entry.stat()
                found[entry.name] = [info.st_size, info.st_mtime_ns]
    return found


def wait_http_ready(spec: WorkerSpec, deadline: float, worker: Sandbox | PlainWorker) -> None:
    """Poll the worker until it answers HTTP; fails naming its logs when it dies first or takes too long."""
    logs = f"see {worker.host_dir / 'init.log'} and {worker.host_dir / CONTROL_SUBDIR / 'logs'}/"
    while True:
        try:
            with urllib.request.urlopen(spec.base_url + READY_PATH, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if not worker.alive():
            raise ServeError(f"the worker exited before it served; {logs}")
        if time.monotonic() >= deadline:
            raise ServeError(f"the worker did not answer on {spec.base_url} within --ready-timeout; {logs}")
        time.sleep(0.02)


class PlainWorker:
    """A cold worker as a plain child process, for machines where sandboxes cannot be made (not root)."""

    def __init__(self, host_dir: Path, process: subprocess.Popen[bytes]) -> None:
        self.host_dir = host_dir
        self.process = process

    @classmethod
    def start(cls, host_dir: Path, spec: WorkerSpec) -> PlainWorker:
        with open(host_dir / "init.log", "ab") as log_file:
            process = subprocess.Popen(
                spec.command("cold", host_dir / CONTROL_SUBDIR), stdin=subprocess.DEVNULL, stdout=log_file,
                stderr=log_file, start_new_session=True,
            )  # fmt: skip
        return cls(host_dir, process)

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, grace: float = 5.0) -> None:
        if not self.alive():
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


class LocalNode:
    """Starts workers on this machine: cold, cold + capture, or restored from the store."""

    def __init__(
        self,
        spec: WorkerSpec,
        store: SnapshotStore,
        signer: Signer,
        verifier: Verifier,
        criu: Criu | None,
        work_dir: Path,
        ready_timeout: float = 900.0,
    ) -> None:
        self.spec = spec
        self.store = store
        self.signer = signer
        self.verifier = verifier
        self.criu = criu
        self.work_dir = work_dir
        self.ready_timeout = ready_timeout
        self.sandboxes: list[Sandbox | PlainWorker] = []
        self.identities = IdentityCache(store.root, signer, verifier)
        self._started = 0

    def _new_sandbox_dir(self, role: str) -> Path:
        if self._started == 0:
            prune_work_dir(self.work_dir)
        self._started += 1
        self.work_dir.mkdir(parents=True, exist_ok=True)
        path = self.work_dir / f"{role}-{self._started}-{os.getpid()}"
        shutil.rmtree(path, ignore_errors=True)
        (path / CONTROL_SUBDIR / "logs").mkdir(parents=True)
        return path

    def _start_worker_sandbox(self, mode: str) -> Sandbox:
        from warmstart.checkpoint.sandbox import MOUNTPOINT, Sandbox

        host_dir = self._new_sandbox_dir(mode)
        command = self.spec.command(mode, MOUNTPOINT / CONTROL_SUBDIR)
        sandbox = Sandbox.start(host_dir, command)
        self.sandboxes.append(sandbox)
        return sandbox

    def start_cold(self, reason: str) -> StartReport:
        started = time.monotonic()
        if os.geteuid() == 0:
            worker: Sandbox | PlainWorker = self._start_worker_sandbox("cold")
        else:  # no namespaces without root; nothing will be checkpointed anyway
            worker = PlainWorker.start(self._new_sandbox_dir("cold"), self.spec)
            self.sandboxes.append(worker)
        wait_http_ready(self.spec, started + self.ready_timeout, worker)
        return StartReport("cold", time.monotonic() - started, reason=reason)

    def start_cold_and_capture(self) -> StartReport:
        from warmstart.checkpoint.capture import CaptureError, CaptureOptions, capture
        from warmstart.protocol import ControlDir

        assert self.criu is not None
        started = time.monotonic()
        sandbox = self._start_worker_sandbox("capture")
        options = CaptureOptions(
            keep_serving=True,
            resume_payload=self._resume_payload(),
            ready_timeout=self.ready_timeout,
        )
        control = ControlDir(sandbox.host_dir / CONTROL_SUBDIR)
        try:
            result = capture(
                store=self.store, signer=self.signer, sandbox=sandbox, control=control, criu=self.criu,
                options=options,
            )  # fmt: skip
        except CaptureError as exc:  # the source was resumed: it serves as a plain cold start
            wait_http_ready(self.spec, started + self.ready_timeout, sandbox)
            return StartReport("cold", time.monotonic() - started, reason=f"capture failed: {exc}")
        snapshot = result.snapshot
        self.identities.record(
            self.spec, snapshot.identity, str(snapshot.meta["worker"].get("model_dir", ""))
        )
        wait_http_ready(self.spec, started + self.ready_timeout, sandbox)
        return StartReport(
            "cold+capture", time.monotonic() - started, snapshot.id, snapshot.size, timings=result.timings
        )

    def start_restored(self, snapshot_id: str, identity: SnapshotIdentity) -> StartReport:
        from warmstart.checkpoint.restore import RestoreFailed, RestoreRefused, restore
        from warmstart.checkpoint.sandbox import MOUNTPOINT, Sandbox
        from warmstart.protocol import ControlDir

        assert self.criu is not None
        started, began_at = time.monotonic(), time.time()
        host_dir = self._new_sandbox_dir("restore")
        # PID 1 is the worker supervisor in restore mode: it adopts the restored engine, or cold-starts one
        # itself when the restore fails.
        command = self.spec.command("restore", MOUNTPOINT / CONTROL_SUBDIR)
        sandbox = Sandbox.start(host_dir, command, reserve_pids=True)
        self.sandboxes.append(sandbox)
        try:
            result = restore(
                store=self.store, verifier=self.verifier, snapshot_id=snapshot_id, expected_identity=identity,
                sandbox=sandbox, control=ControlDir(host_dir / CONTROL_SUBDIR), criu=self.criu,
                work_dir=_images_dir(host_dir),
                resume_payload=self._resume_payload(restore_started_at=began_at),
            )  # fmt: skip
        except (RestoreRefused, RestoreFailed) as exc:
            # restore-failed was sent: the sandbox's supervisor cold-starts the engine itself.
            wait_http_ready(self.spec, started + self.ready_timeout, sandbox)
            return StartReport("cold", time.monotonic() - started, reason=f"{exc}; the worker cold-started")
        wait_http_ready(self.spec, started + self.ready_timeout, sandbox)
        return StartReport(
            "restore", time.monotonic() - started, snapshot_id, result.snapshot.size, timings=result.timings
        )

    def _resume_payload(self, **extra: Any) -> dict[str, Any]:
        return {"port": self.spec.port, "host": self.spec.host, **extra}

    def start(self) -> StartReport:
        """Restore when a valid snapshot exists, else cold start (and capture when CRIU is usable)."""
        from warmstart.checkpoint.restore import FailureCounter

        if self.criu is None:
            return self.start_cold("CRIU 4 is not usable here (see above); snapshots are off")
        identity, unknown = self.identities.lookup(self.spec)
        if identity is None:
            report = self.start_cold_and_capture()
            report.reason = "; ".join(filter(None, [unknown, report.reason]))
            return report
        failures = FailureCounter(self.store.root)
        skipped: list[str] = []
        for snapshot in self.store.list(identity.digest()):
            if failures.invalid(snapshot.id):
                skipped.append(f"{snapshot.id} failed {failures.count(snapshot.id)} times")
                continue
            return self.start_restored(snapshot.id, identity)
        report = self.start_cold_and_capture()
        if skipped:
            report.reason = "; ".join(
                filter(None, ["snapshots marked invalid: " + "; ".join(skipped), report.reason])
            )
        return report

    def stop_all(self) -> None:
        """Stop every sandbox; drop the restored image links (the logs stay until the next run)."""
        while self.sandboxes:
            sandbox = self.sandboxes.pop()
            sandbox.stop()
            shutil.rmtree(_images_dir(sandbox.host_dir), ignore_errors=True)


def _images_dir(sandbox_dir: Path) -> Path:
    return sandbox_dir.with_name(sandbox_dir.name + "-images")


def prune_work_dir(work_dir: Path) -> None:
    """Remove sandbox directories left by earlier runs whose serve process is gone."""
    if not work_dir.is_dir():
        return
    for entry in work_dir.iterdir():
        owner = entry.name.removesuffix("-images").rsplit("-", 1)[-1]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            shutil.rmtree(entry, ignore_errors=True)


def usable_criu(command: str) -> tuple[Criu | None, str]:
    """A working CRIU 4 as root, or None with the reason."""
    from warmstart.checkpoint.criu import Criu, CriuError

    if os.geteuid() != 0:
        return None, "not root: CRIU and sandboxes need root"
    criu = Criu(command)
    try:
        criu.version()
    except CriuError as exc:
        return None, str(exc)
    return criu, ""


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
        console.print("phases: " + ", ".join(f"{k} {v:.2f}s" for k, v in report.timings.items()))


def _serve(args: argparse.Namespace) -> int:
    from warmstart.config import default_criu_command
    from warmstart.snapshot.store import SnapshotStore

    store_root = Path(args.store).resolve()
    store_root.mkdir(parents=True, exist_ok=True)
    spec = WorkerSpec(args.engine, args.model, args.device, args.host, args.port, list(args.worker_arg))
    signer, verifier, note = signing_keys(store_root, args.key)
    if note:
        print(note)
    criu, why_not = usable_criu(args.criu or default_criu_command())
    if criu is None:
        print(f"snapshots are off: {why_not}")
    work_dir = Path(args.work_dir) if args.work_dir else store_root / "pods"
    node = LocalNode(spec, SnapshotStore(store_root), signer, verifier, criu, work_dir, args.ready_timeout)
    _stop_on_signals()
    try:
        report = node.start()
        print_report(report, spec)
        if args.once:
            return 0
        print(f"serving on {spec.base_url} (Ctrl-C to stop)", flush=True)
        while any(sandbox.alive() for sandbox in node.sandboxes):
            time.sleep(0.2)
        print("the worker exited", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("stopping", flush=True)
        return 0
    except ServeError as exc:
        print(f"warmstart serve: {exc}", file=sys.stderr)
        return 1
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)  # let the clean-up finish
        node.stop_all()


def _stop_on_signals() -> None:
    """SIGTERM stops serve like Ctrl-C does (a KeyboardInterrupt, so every clean-up path runs)."""

    def interrupt(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", default="builtin", help="engine adapter (default builtin)")
    parser.add_argument("--model", default="tiny", help="model preset or directory (default tiny)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cpu or cuda (default cpu)")
    parser.add_argument("--store", required=True, help="snapshot store directory (created if missing)")
    parser.add_argument("--key", help="signing key file (default: <store>/keys/hmac.key, generated once)")
    parser.add_argument("--criu", help="CRIU 4 command line (default: WARMSTART_CRIU or criu)")
    parser.add_argument("--host", default="127.0.0.1", help="address the worker listens on")
    parser.add_argument("--work-dir", help="where sandboxes keep their files (default <store>/pods)")
    parser.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for a worker")
    parser.add_argument(
        "--worker-arg", action="append", default=[], help="extra argument for `warmstart worker` (repeatable)"
    )


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from warmstart.worker_flags import port_number

    parser = subparsers.add_parser(
        "serve",
        help="serve an OpenAI-compatible endpoint; first start cold + capture, later starts restore",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_worker_arguments(parser)
    parser.add_argument("--port", type=port_number, default=8000, help="port to serve on (default 8000)")
    parser.add_argument(
        "--once", "--exit-after-ready", dest="once", action="store_true",
        help="stop the worker and exit once it served (tests, demos)",
    )  # fmt: skip
    parser.set_defaults(func=_serve)
