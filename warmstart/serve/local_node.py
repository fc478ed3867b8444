"""Starting workers on this machine: cold, cold + capture, or restored from the store."""

from __future__ import annotations

import os
import shutil
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from warmstart.fileio import UnsafeInput
from warmstart.serve.identity_cache import CACHE_KEY_META, IdentityCache
from warmstart.serve.worker_spec import CONTROL_SUBDIR, ServeError, StartReport, WorkerSpec
from warmstart.serve.workers import PlainWorker, wait_http_ready

if TYPE_CHECKING:
    from warmstart.checkpoint.criu import Criu
    from warmstart.checkpoint.sandbox import Sandbox
    from warmstart.identity import SnapshotIdentity
    from warmstart.snapshot.signing import Signer, Verifier
    from warmstart.snapshot.store import Snapshot, SnapshotStore


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
        """A fresh, real directory for one sandbox (anything planted under its name is removed first)."""
        if self._started == 0:
            prune_work_dir(self.work_dir)
        self._started += 1
        self.work_dir.mkdir(parents=True, exist_ok=True)
        if self.work_dir.is_symlink():
            raise ServeError(f"the work directory {self.work_dir} is a symbolic link; refusing to use it")
        path = self.work_dir / f"{role}-{self._started}-{os.getpid()}"
        for stale in (path, _images_dir(path)):
            _remove_without_following(stale)
        os.mkdir(path, 0o755)  # fails rather than follow anything that appeared meanwhile
        os.mkdir(path / CONTROL_SUBDIR, 0o755)
        os.mkdir(path / CONTROL_SUBDIR / "logs", 0o755)
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
            meta={CACHE_KEY_META: self.identities.key(self.spec)},
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
        note = self._record_identity(snapshot)
        wait_http_ready(self.spec, started + self.ready_timeout, sandbox)
        return StartReport(
            "cold+capture", time.monotonic() - started, snapshot.id, snapshot.size, note, result.timings
        )

    def _record_identity(self, snapshot: Snapshot) -> str:
        """Record the captured identity; a note when it cannot be (the next start recovers it)."""
        try:
            self.identities.record(
                self.spec, snapshot.identity, str(snapshot.meta["worker"].get("model_dir", ""))
            )
        except (OSError, UnsafeInput) as exc:
            return f"the identity record could not be written ({exc})"
        return ""

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
        from warmstart.snapshot.manifest import SnapshotError

        if self.criu is None:
            return self.start_cold("CRIU 4 is not usable here (see above); snapshots are off")
        identity, unknown = self.identities.lookup(self.spec)
        recovered = ""
        if identity is None:
            identity, recovered = self.identities.recover(self.spec, self.store)
        if identity is None:
            report = self.start_cold_and_capture()
            report.reason = "; ".join(filter(None, [unknown, report.reason]))
            return report
        try:
            candidates = self.store.list(identity.digest())
        except SnapshotError as exc:
            return self.start_cold(f"the snapshot store cannot be used: {exc}")
        failures = FailureCounter(self.store.root)
        skipped: list[str] = []
        for snapshot in candidates:
            if failures.invalid(snapshot.id):
                skipped.append(f"{snapshot.id} failed {failures.count(snapshot.id)} times")
                continue
            report = self.start_restored(snapshot.id, identity)
            report.reason = "; ".join(filter(None, [recovered, report.reason]))
            return report
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


def _remove_without_following(path: Path) -> None:
    """Remove a directory tree, or unlink anything else (a symbolic link itself, never its target)."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path)
    else:
        path.unlink()


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
