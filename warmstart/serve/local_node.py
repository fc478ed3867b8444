"""Starting workers on this machine: cold, cold + capture, or restored from the store."""

from __future__ import annotations

import functools
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from warmstart.api.capture_record import CaptureRecord
from warmstart.host.fileio import UnsafeInput
from warmstart.serve.identity_cache import IdentityCache
from warmstart.serve.readiness import import_http_client_meanwhile
from warmstart.serve.worker_spec import CONTROL_SUBDIR, ServeError, StartReport, WorkerExited, WorkerSpec
from warmstart.serve.workers import PlainWorker, wait_http_ready

if TYPE_CHECKING:
    from warmstart.api.control_dir import ControlDir
    from warmstart.api.identity import SnapshotIdentity
    from warmstart.checkpoint.criu import Criu
    from warmstart.checkpoint.sandbox import Sandbox
    from warmstart.snapshot.signing import Signer, Verifier
    from warmstart.snapshot.store import SnapshotStore


class LocalNode:
    """Whatever the store holds, a start ends serving: an oddity in the store's tree (a file or a link where
    a directory goes, junk, a full disk) is a refusal with its reason and a cold start, never an exit.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        store: SnapshotStore,
        signer: Signer | None,
        verifier: Verifier | None,
        criu: Criu | None,
        work_dir: Path | None = None,
        ready_timeout: float = 900.0,
    ) -> None:
        """Without CRIU or keys, snapshots are off (the caller said why). `work_dir` None: `<store>/pods`,
        or a fresh temporary directory when that is not a usable directory."""
        self.spec = spec
        self.store = store
        self.signer = signer
        self.verifier = verifier
        self.criu = criu
        self.work_dir = work_dir or store.root / "pods"
        self.ready_timeout = ready_timeout
        self.sandboxes: list[Sandbox | PlainWorker] = []
        self.notes: list[str] = []  # said with the next start's report
        self._default_work_dir = None if work_dir else self.work_dir
        self._work_dir_checked = False
        self._temporary_work_dir: Path | None = None
        self._started = 0

    @functools.cached_property
    def identities(self) -> IdentityCache:
        assert self.signer is not None and self.verifier is not None, "snapshots are off"
        return IdentityCache(self.store.root, self.signer, self.verifier)

    def _new_sandbox_dir(self, role: str) -> Path:
        """A fresh, real directory for one sandbox (anything planted under its name is removed first)."""
        work_dir = self._checked_work_dir()
        self._started += 1
        work_dir.mkdir(parents=True, exist_ok=True)
        if work_dir.is_symlink():
            raise ServeError(f"the work directory {work_dir} is a symbolic link; refusing to use it")
        path = work_dir / f"{role}-{self._started}-{os.getpid()}"
        for stale in (path, _images_dir(path)):
            _remove_without_following(stale)
        os.mkdir(path, 0o755)  # fails rather than follow anything that appeared meanwhile
        os.mkdir(path / CONTROL_SUBDIR, 0o755)
        os.mkdir(path / CONTROL_SUBDIR / "logs", 0o755)
        return path

    def _checked_work_dir(self) -> Path:
        """The work directory, made where missing and pruned of dead runs, once; the default one inside the
        store is replaced by a fresh temporary directory (with a note) when it is not a real directory."""
        if self._work_dir_checked:
            return self.work_dir
        try:
            self.work_dir.mkdir(parents=True, exist_ok=True)
            if self.work_dir.is_symlink() or not self.work_dir.is_dir():
                raise ServeError(f"the work directory {self.work_dir} is a symbolic link or no directory")
            prune_work_dir(self.work_dir)
        except (OSError, ServeError) as exc:
            if self._default_work_dir is None:
                raise ServeError(f"{exc}; refusing to use it") from exc
            self.work_dir = self._temporary_work_dir = Path(tempfile.mkdtemp(prefix="warmstart-pods-"))
            self.notes.append(f"{exc}: this run's sandboxes are in {self.work_dir} (removed at exit)")
        self._work_dir_checked = True
        return self.work_dir

    def _start_worker_sandbox(self, mode: str, reserve_pids: bool = False) -> Sandbox:
        from warmstart.checkpoint.sandbox import MOUNTPOINT, Sandbox

        host_dir = self._new_sandbox_dir(mode)
        command = self.spec.command(mode, MOUNTPOINT / CONTROL_SUBDIR)
        sandbox = Sandbox.start(host_dir, command, reserve_pids=reserve_pids)
        self.sandboxes.append(sandbox)
        return sandbox

    def start_cold(self, reason: str) -> StartReport:
        started = time.monotonic()
        if os.geteuid() == 0:
            worker: Sandbox | PlainWorker = self._start_worker_sandbox("cold")
        else:  # no namespaces without root; nothing will be checkpointed anyway
            worker = PlainWorker(self._new_sandbox_dir("cold"), self.spec)
            self.sandboxes.append(worker)
        wait_http_ready(self.spec, started + self.ready_timeout, worker)
        return StartReport("cold", time.monotonic() - started, reason=reason)

    def start_cold_and_capture(self) -> StartReport:
        from warmstart.api.control_dir import ControlDir
        from warmstart.checkpoint.capture import CaptureError, CaptureOptions, capture

        assert self.criu is not None and self.signer is not None
        started = time.monotonic()
        sandbox = self._start_worker_sandbox("capture")
        options = CaptureOptions(
            record=CaptureRecord(identity_cache_key=self.identities.key(self.spec)),
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
            return self._serving_cold(sandbox, started, f"capture failed: {exc}")
        snapshot, note = result.snapshot, ""
        try:
            self.identities.record(self.spec, snapshot.identity, snapshot.record.worker.model_dir)
        except (OSError, UnsafeInput) as exc:  # the next start recovers it
            note = f"the identity record could not be written ({exc})"
        wait_http_ready(self.spec, started + self.ready_timeout, sandbox)
        return StartReport(
            "cold+capture", time.monotonic() - started, snapshot.id, snapshot.size, note, result.timings
        )

    def start_restored(self, snapshot_id: str, identity: SnapshotIdentity) -> StartReport:
        from warmstart.api.control_dir import ControlDir
        from warmstart.checkpoint.restore import RestoreFailed, RestoreRefused, restore

        assert self.criu is not None and self.verifier is not None
        started, began_at = time.monotonic(), time.time()
        import_http_client_meanwhile()  # for the readiness probes, while the restore mostly waits
        # PID 1 is the worker supervisor in restore mode: it adopts the restored engine, or cold-starts one
        # itself when the restore fails.
        sandbox = self._start_worker_sandbox("restore", reserve_pids=True)
        control = ControlDir(sandbox.host_dir / CONTROL_SUBDIR)
        try:
            result = restore(
                store=self.store, verifier=self.verifier, snapshot_id=snapshot_id, expected_identity=identity,
                sandbox=sandbox, control=control, criu=self.criu, work_dir=_images_dir(sandbox.host_dir),
                resume_payload=self._resume_payload(restore_started_at=began_at),
            )  # fmt: skip
        except (RestoreRefused, RestoreFailed) as exc:
            if not _worker_goes_cold(control):
                # neither restore-failed nor the claim could be written (a full disk): the supervisor would
                # wait for its restore timeout, so a fresh worker cold-starts instead
                self._discard(sandbox)
                return self.start_cold(f"{exc}; a fresh worker cold-started")
            return self._serving_cold(sandbox, started, f"{exc}; the worker cold-started")
        wait_http_ready(self.spec, started + self.ready_timeout, sandbox)
        return StartReport(
            "restore", time.monotonic() - started, snapshot_id, result.snapshot.size, timings=result.timings
        )

    def _serving_cold(self, sandbox: Sandbox, started: float, reason: str) -> StartReport:
        """The report once a worker whose capture or restore failed serves cold; when it died instead (it
        could not even signal, on a full disk), a fresh worker cold-starts."""
        try:
            wait_http_ready(self.spec, started + self.ready_timeout, sandbox)
        except WorkerExited as exc:
            self._discard(sandbox)
            return self.start_cold(f"{reason}; {exc}; a fresh worker cold-started")
        return StartReport("cold", time.monotonic() - started, reason=reason)

    def _resume_payload(self, **extra: Any) -> dict[str, Any]:
        return {"port": self.spec.port, "host": self.spec.host, **extra}

    def start(self) -> StartReport:
        """Restore when a valid snapshot exists, else cold start (and capture when CRIU is usable)."""
        report = _noted(self._start(), *self.notes)
        self.notes.clear()
        return report

    def _start(self) -> StartReport:
        from warmstart.snapshot.manifest import SnapshotError

        if self.criu is None:
            return self.start_cold("CRIU 4 is not usable here (see above); snapshots are off")
        if self.signer is None or self.verifier is None:
            return self.start_cold("no signing key (see above); snapshots are off")
        started = len(self.sandboxes)
        try:
            return self._start_from_store()
        except (SnapshotError, UnsafeInput, OSError) as exc:  # an oddity of the store not refused earlier
            for worker in self.sandboxes[started:]:
                self._discard(worker)
            return self.start_cold(f"the snapshot store cannot be used ({exc}); snapshots are skipped")

    def _start_from_store(self) -> StartReport:
        from warmstart.checkpoint.restore import FailureCounter

        identity, unknown = self.identities.lookup(self.spec)
        recovered = ""
        if identity is None:
            identity, recovered = self.identities.recover(self.spec, self.store)
        if identity is None:
            return _noted(self.start_cold_and_capture(), unknown)
        failures = FailureCounter(self.store.root)
        skipped: list[str] = []
        for snapshot in self.store.list(identity.digest(), verifier=self.verifier):
            if failures.invalid(snapshot.id):
                skipped.append(f"{snapshot.id} failed {failures.count(snapshot.id)} times")
                continue
            return _noted(self.start_restored(snapshot.id, identity), recovered)
        invalid = "snapshots marked invalid: " + "; ".join(skipped) if skipped else ""
        return _noted(self.start_cold_and_capture(), invalid)

    def _discard(self, worker: Sandbox | PlainWorker) -> None:
        self.sandboxes.remove(worker)
        worker.stop()
        shutil.rmtree(_images_dir(worker.host_dir), ignore_errors=True)

    def stop_all(self) -> None:
        """Stop every sandbox; drop the restored image links (the logs stay until the next run, unless they
        are in a temporary work directory, which goes)."""
        while self.sandboxes:
            self._discard(self.sandboxes[-1])
        if self._temporary_work_dir is not None:
            shutil.rmtree(self._temporary_work_dir, ignore_errors=True)
            self.work_dir, self._temporary_work_dir = self._default_work_dir or self.work_dir, None
            self._work_dir_checked = False


def _worker_goes_cold(control: ControlDir) -> bool:
    """Whether the restore sandbox's supervisor cold-starts the engine itself: it was answered
    restore-failed, or it claimed the pod for a cold start (anything unreadable there counts as such)."""
    from warmstart.api.control_dir import CLAIM_COLD, RESTORE_CLAIM, RESTORE_FAILED, SignalError

    try:
        claim = control.read(RESTORE_CLAIM)
        return control.read(RESTORE_FAILED) is not None or (
            claim is not None and claim.payload.get("holder") == CLAIM_COLD
        )
    except (SignalError, OSError):
        return True


def _noted(report: StartReport, *notes: str) -> StartReport:
    """`report`, its reason after the (non-empty) `notes`."""
    report.reason = "; ".join(filter(None, (*notes, report.reason)))
    return report


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
