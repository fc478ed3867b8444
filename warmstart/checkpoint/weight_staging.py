"""Start a weight stager next to a restore, for snapshots whose engine left its weights out of the image.

The engine's staging plan travels in the signed snapshot (`meta.worker.weight_staging`, written by the engine
process at capture). When the stored manifest has one, the restoring side binds a socket in the sandbox's
control directory (so it exists before the engine resumes) and starts `warmstart.gpu.weight_stager` with it, a
pipe for the plan and the sandbox's root directory as inherited descriptors, as the user the sandbox runs as,
before the snapshot is verified: the stager's Python and CUDA start meanwhile. It gets the plan through the
pipe once the manifest's signature and identity check out (the plan's authority is the signature), and copies
while the blobs are hashed and CRIU runs; a snapshot that fails any check, or whose signed manifest has no
plan, has its stager stopped. The resume payload names the socket; the restored engine maps the staged weights
instead of reading them itself (see the stager's docstring).

The plan is the engine's word, so the stager reads only inside the sandbox's root, with the sandbox's user's
rights, and only onto a GPU the sandbox was given (`NVIDIA_VISIBLE_DEVICES` / `CUDA_VISIBLE_DEVICES` of its
first process, when they name GPUs by UUID). A stager still running `STAGER_DEADLINE_SECONDS` after its
start is killed; one whose restore failed is stopped. A stager that cannot start costs the restore nothing:
the engine refills its weights itself.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

from warmstart.api.control_dir import ControlDir
from warmstart.gpu.weight_stager.channel import listen
from warmstart.gpu.weight_stager.plan import StagingPlan
from warmstart.gpu.weight_stager.stage import COPY_PATHS, MAX_STAGING_THREADS, STAGING_THREADS
from warmstart.host.env import env_flag, env_int, env_str
from warmstart.host.fileio import write_all
from warmstart.snapshot.store import Snapshot, SnapshotStore

log = logging.getLogger(__name__)

STAGER_DEADLINE_SECONDS = 300.0
PLAN_PIPE_BYTES = 1 << 20  # the default most a user may ask for (fs.pipe-max-size); an 8B model's is ~50 KB
STAGER_ENV = "WARMSTART_WEIGHT_STAGER"  # "0": no stager, the engine refills its weights itself (to measure)
STAGER_COPY_ENV = "WARMSTART_STAGER_COPY"  # "mapped": DMA from the page cache, not through pinned buffers
STAGER_THREADS_ENV = "WARMSTART_STAGER_THREADS"  # copying threads (the stager's default when unset)


def staging_plan(snapshot: Snapshot) -> StagingPlan | None:
    """The engine's plan, when the snapshot has one and runs on CUDA; None otherwise (or when unreadable)."""
    planned = snapshot.record.worker.weight_staging
    if not planned or not snapshot.record.uses_cuda:
        return None
    try:
        return StagingPlan.from_dict(planned)
    except (ValueError, KeyError, TypeError) as exc:
        log.warning(
            "snapshot %s: unusable weight staging plan (%s); the engine refills itself", snapshot.id, exc
        )
        return None


def spawn_stager_early(
    store: SnapshotStore, snapshot_id: str, sandbox_init_pid: int, control: ControlDir
) -> StagerProcess | None:
    """A stager started before the snapshot is verified, when its stored manifest has a plan: Python,
    cuda-python and the CUDA driver start while the blobs are hashed. The unverified manifest only decides
    whether to start one; the stager waits for `give_plan` to hand it the plan of the signed manifest."""
    try:
        unverified = store.get(snapshot_id)
    except Exception:  # unreadable: the verification that follows says why
        return None
    if allowed_plan(unverified, sandbox_init_pid) is None:
        return None
    try:
        return StagerProcess.start(sandbox_init_pid, control)
    except Exception as exc:  # a stager is an optimisation: the restore goes on without one
        log.warning("no weight stager (%s); the engine refills its weights itself", exc)
        return None


def give_plan(
    stager: StagerProcess | None, snapshot: Snapshot, sandbox_init_pid: int
) -> StagerProcess | None:
    """Hand the signed snapshot's plan to `stager`: the stager, or None (stopped) when there is no plan
    it may follow or it could not take it."""
    if stager is None:
        return None
    plan = allowed_plan(snapshot, sandbox_init_pid)
    try:
        if plan is not None:
            stager.send_plan(plan)
            return stager
    except OSError as exc:
        log.warning(
            "the weight stager did not take its plan (%s); the engine refills its weights itself", exc
        )
    stager.stop()
    return None


def allowed_plan(snapshot: Snapshot, sandbox_init_pid: int) -> StagingPlan | None:
    """The snapshot's plan when a stager may follow it for this sandbox (switched on, a GPU it was given)."""
    plan = staging_plan(snapshot)
    if plan is None or not env_flag(STAGER_ENV):
        return None
    allowed = sandbox_gpus(sandbox_init_pid)
    if allowed is not None and plan.device_uuid not in allowed:
        log.warning(
            "weight staging plan names GPU %r, not one of this sandbox's %s", plan.device_uuid, allowed
        )
        return None
    return plan


def sandbox_gpus(pid: int) -> set[str] | None:
    """The GPU UUIDs process `pid` was given, or None when its environment does not name them."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    environment = dict(item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    for name in ("NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
        value = environment.get(name.encode(), b"").decode(errors="replace")
        uuids = {item.strip() for item in value.split(",") if item.strip().startswith("GPU-")}
        if uuids:
            return uuids
    return None


class StagerProcess:
    """A running stager: `send_plan()` once the snapshot's signature checks out, `payload()` for the resume
    signal, `stop()` when the restore failed."""

    def __init__(
        self, process: subprocess.Popen[bytes], control_dir_fd: int, socket_name: str, plan_pipe: int
    ) -> None:
        self.process = process
        self.socket_name = socket_name
        self._control_dir_fd = control_dir_fd
        self._plan_pipe: int | None = plan_pipe
        self._reaped = threading.Event()
        threading.Thread(target=self._reap, name="weight-stager-reaper", daemon=True).start()

    @classmethod
    def start(cls, sandbox_init_pid: int, control: ControlDir) -> StagerProcess:
        """The stager, started as the sandbox's user with its root; it waits for `send_plan`."""
        socket_name = f"weight-stager-{uuid.uuid4().hex[:12]}.sock"  # never one an older stager may remove
        control_dir_fd = os.open(control.path, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        plan_read, plan_write = os.pipe()
        with contextlib.suppress(OSError):  # a larger plan waits for the stager to read it
            fcntl.fcntl(plan_write, fcntl.F_SETPIPE_SZ, PLAN_PIPE_BYTES)
        try:
            with contextlib.ExitStack() as opened:  # closed here once started: the stager has its own copies
                opened.callback(os.close, plan_read)
                copy, threads = _copy_and_threads()
                listener = opened.enter_context(listen(f"/proc/self/fd/{control_dir_fd}/{socket_name}"))
                root_fd = os.open(f"/proc/{sandbox_init_pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
                opened.callback(os.close, root_fd)
                process = subprocess.Popen(
                    [sys.executable, "-m", "warmstart.gpu.weight_stager", "--plan-fd", str(plan_read),
                     "--listen-fd", str(listener.fileno()), "--root-fd", str(root_fd), "--copy", copy,
                     "--threads", str(threads)],
                    stdin=subprocess.DEVNULL,
                    pass_fds=(plan_read, listener.fileno(), root_fd),
                    **_as_owner_of(sandbox_init_pid),
                )  # fmt: skip
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(socket_name, dir_fd=control_dir_fd)
            os.close(control_dir_fd)
            os.close(plan_write)
            raise
        return cls(process, control_dir_fd, socket_name, plan_write)

    def send_plan(self, plan: StagingPlan) -> None:
        """Write the plan for the stager to follow, once: OSError when it is gone."""
        if self._plan_pipe is None:
            raise OSError("the weight stager has its plan already")
        pipe, self._plan_pipe = self._plan_pipe, None
        try:
            write_all(pipe, plan.to_json().encode())
        finally:
            os.close(pipe)

    def payload(self) -> dict[str, Any]:
        return {"weight_stager_socket": self.socket_name}

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()
        self._reaped.wait(timeout=10)
        if self._plan_pipe is not None:
            os.close(self._plan_pipe)
            self._plan_pipe = None

    def _reap(self) -> None:
        try:
            code = self.process.wait(timeout=STAGER_DEADLINE_SECONDS)
        except subprocess.TimeoutExpired:
            log.warning("the weight stager ran past %.0f s; killing it", STAGER_DEADLINE_SECONDS)
            self.process.kill()
            code = self.process.wait()
        if code:
            log.warning("the weight stager exited with %d (the engine refilled its weights itself)", code)
        with contextlib.suppress(OSError):
            os.unlink(self.socket_name, dir_fd=self._control_dir_fd)
        os.close(self._control_dir_fd)
        self._reaped.set()


def _copy_and_threads() -> tuple[str, int]:
    copy = env_str(STAGER_COPY_ENV, COPY_PATHS[0])
    if copy not in COPY_PATHS:
        raise ValueError(f"{STAGER_COPY_ENV}={copy!r} is not one of {', '.join(COPY_PATHS)}")
    threads = env_int(STAGER_THREADS_ENV, STAGING_THREADS)
    if not 1 <= threads <= MAX_STAGING_THREADS:
        raise ValueError(f"{STAGER_THREADS_ENV}={threads} is not from 1 to {MAX_STAGING_THREADS}")
    return copy, threads


def _as_owner_of(pid: int) -> dict[str, Any]:
    """Popen options running the child as the user and group of process `pid` (nothing for root)."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    status = dict(line.split(":", 1) for line in lines if ":" in line)
    uid, gid = int(status["Uid"].split()[0]), int(status["Gid"].split()[0])
    return {} if uid == 0 else {"user": uid, "group": gid, "extra_groups": []}
